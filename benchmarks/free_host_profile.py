"""CPU profile of the free functions' host path (kc.plan / kc.verify / kc.write), no GPU needed.

Each free call runs on long-lived arrays (canary buffer, plans, log, table) as a script would,
with the backend's work taken out: CuPy arrays on the fake device
(``kvcanary_cupy/devtools/fake_cupy.py``: launches recorded, not run), CPU torch tensors and NumPy
arrays with the NumPy backend stubbed.  Prints host microseconds and Python-level calls per call;
``KVCANARY_FULL_VALIDATION=1`` in the environment turns the validation cache off (every call validates
everything), so the two runs show what the cache saves.

    python benchmarks/free_host_profile.py [--workload W1] [--calls 1000] [--top 0]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.devtools import bench as bc  # noqa: E402
from kvcanary_cupy.validation_cache import enabled  # noqa: E402


def free_ops(d, move):
    """kc.plan / kc.verify / kc.write on one workload's arrays; ``move`` puts a NumPy array in place."""
    vcap, bs = d["total_verify"], d["bs"]
    a = {k: move(v) for k, v in d.items() if isinstance(v, np.ndarray)}
    vp = kc.VerifyPlan.allocate(vcap, like=a["rp"])
    wp = kc.WritePlan.allocate(bs, like=a["rp"])
    log = kc.ViolationLog.allocate(1024, like=a["rp"])
    inputs = (a["rp"], a["prefix"], a["extend"], a["rtt"])
    tokens = (a["ids"], a["pos"], a["loc"])
    return {
        "plan": lambda: kc.plan(*inputs, verify_capacity=vcap, out=(vp, wp)),
        "verify": lambda: kc.verify(a["canary"], vp, log=log),
        "write": lambda: kc.write(a["canary"], wp, *tokens, log=log),
    }


def measure(fn, calls: int, top: int):
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
        stats.sort_stats("tottime").print_stats(top)
    return us, stats.total_calls / 100


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions of each profile")
    parser.add_argument("--arrays", default="numpy,torch,cupy")
    args = parser.parse_args()
    d = bc.build(bc.WORKLOADS[args.workload], np)
    cache = "on" if enabled() else "off"
    print(f"free-function host us and Python-level calls per call at {args.workload}, validation cache {cache} "
          "(backend work stubbed out)")
    print(f"{'arrays':<20} {'op':<8} {'us':>8} {'calls':>6}")

    import pytest

    from kvcanary_cupy.backends import numpy_backend

    movers = {"numpy": ("NumPy", lambda x: x)}
    try:
        import torch

        movers["torch"] = ("CPU torch", torch.from_numpy)
    except ImportError:
        pass
    wanted = args.arrays.split(",")
    with pytest.MonkeyPatch.context() as mp:
        for op in ("plan", "verify", "write"):
            mp.setattr(numpy_backend, op, lambda a: None)
        for key, (label, move) in movers.items():
            if key in wanted:
                report(label, free_ops(d, move), args)
    if "cupy" in wanted:
        from kvcanary_cupy.devtools.fake_cupy import fake_device

        with fake_device(record_bytes=False) as dev:
            report("CuPy (fake device)", free_ops(d, dev.asarray), args)


def report(label, ops, args):
    for op, fn in ops.items():
        us, calls = measure(fn, args.calls, args.top)
        print(f"{label:<20} {op:<8} {us:>8.1f} {calls:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
