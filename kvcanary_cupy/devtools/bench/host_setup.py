"""The set-up that ``benchmarks/host_profile.py`` and ``benchmarks/free_host_profile.py`` share.

Both time the host path of the front door with the backend's work taken out: one workload's
arrays put in place by a ``move`` function (NumPy as they are, CPU torch, or CuPy arrays on the
fake device of ``devtools/fake_cupy.py``), the free functions on long-lived plans and log, the
NumPy backend's kernels stubbed to no-ops, and a loop that times a call and then profiles it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import numpy as np

import kvcanary_cupy as kc
from .workloads import WORKLOADS, build

#: The NumPy backend's entry points the profiles stub out (only the front door is measured).
STUBBED_OPS = ("plan", "verify", "write", "plan_verify")


def add_arguments(parser: argparse.ArgumentParser, *, workload: str, calls: int) -> None:
    """``--workload``, ``--calls`` and ``--top``, with this script's defaults."""
    parser.add_argument("--workload", default=workload, choices=sorted(WORKLOADS))
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions of each profile")


def workload(name: str) -> dict:
    """The named workload's arrays, built with NumPy (``move`` puts them elsewhere)."""
    return build(WORKLOADS[name], np)


def placed(d: dict, move) -> dict:
    """The workload's arrays, each through ``move`` (its scalars, such as ``bs``, stay in ``d``)."""
    return {k: move(v) for k, v in d.items() if isinstance(v, np.ndarray)}


def free_ops(d: dict, a: dict, vp, wp, log) -> dict:
    """kc.plan / kc.verify / kc.write / kc.plan_and_verify on the placed arrays ``a`` and the long-lived
    ``vp``, ``wp`` and ``log``."""
    vcap = d["total_verify"]
    inputs = (a["rp"], a["prefix"], a["extend"], a["rtt"])
    tokens = (a["ids"], a["pos"], a["loc"])
    return {
        "plan": lambda: kc.plan(*inputs, verify_capacity=vcap, out=(vp, wp)),
        "verify": lambda: kc.verify(a["canary"], vp, log=log),
        "write": lambda: kc.write(a["canary"], wp, *tokens, log=log),
        "plan_and_verify": lambda: kc.plan_and_verify(*inputs, a["canary"], log=log, verify_capacity=vcap, out=(vp, wp)),
    }


def measure(fn, calls: int, top: int) -> tuple[float, float]:
    """Host microseconds per call over ``calls`` calls (after one warm-up call), and the
    Python-level calls per call of 100 more under cProfile (its ``top`` costliest printed)."""
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        fn()
    profile.disable()
    stats = pstats.Stats(profile)
    if top:
        print_profile(stats, 100, top, "call")
    return us, stats.total_calls / 100


def print_profile(stats: pstats.Stats, per: int, top: int, unit: str = "step") -> None:
    """The ``top`` costliest functions of ``stats`` by own and by cumulative time, in us and calls
    per ``unit`` (``per`` of them profiled): pstats prints seconds to the millisecond, too coarse
    for a call of a few hundred microseconds."""
    rows = [(tt, ct, nc, f"{func} ({file.rsplit('/', 1)[-1]}:{line})" if line else func)
            for (file, line, func), (_, nc, tt, ct, _) in stats.stats.items()]
    print(f"  {sum(r[2] for r in rows) / per:.0f} Python-level calls a {unit}")
    for title, key in (("own", 0), ("cumulative", 1)):
        print(f"  {'calls':>8} {'own us':>8} {'cum us':>8}  a {unit}, by {title} time")
        for tt, ct, nc, where in sorted(rows, key=lambda r: r[key], reverse=True)[:top]:
            print(f"  {nc / per:>8.1f} {1e6 * tt / per:>8.1f} {1e6 * ct / per:>8.1f}  {where}")


def quiet_staging(stub, mark) -> None:
    """The NumPy staging stood in for by ``mark(record, layout)`` on each staged record (a step in
    which nothing happened; ``layout``: the record's), through ``stub`` of :func:`stubbed_numpy_backend`.  It replaces the
    backend's ``prepare_stage``, which a session binds when it is built: call this before."""
    stub("prepare_stage", lambda a: lambda stamp, stream=None, staging=None: mark(
        a.staging if staging is None else staging, a.layout))


@contextlib.contextmanager
def stubbed_numpy_backend():
    """The NumPy backend's :data:`STUBBED_OPS` as no-ops for the block; yields ``stub(name, fn)``,
    which replaces one more of its functions until the block ends.  All are put back on the way out.
    A name is replaced in the module the front door calls (numpy_fast) and in the reference under
    it (numpy_backend), wherever it is defined."""
    from kvcanary_cupy.backends import get_backend, numpy_backend

    modules = (get_backend("numpy"), numpy_backend)
    saved = {}

    def stub(name, fn):
        for module in modules:
            if hasattr(module, name):
                saved.setdefault((module, name), getattr(module, name))
                setattr(module, name, fn)

    try:
        for op in STUBBED_OPS:
            stub(op, lambda a: None)
        yield stub
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
