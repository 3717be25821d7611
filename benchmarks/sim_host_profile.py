"""CPU profile of the simulator's canary calls per step, the backend's work taken out.

``kvcanary sim``'s clean run (seed 0, default engine) on NumPy sessions with the NumPy backend's
kernels stubbed to no-ops (``host_setup.stubbed_numpy_backend``: plan, verify, write, the coverage
checks, the page moves and copies; the staging stood in for by marking each record as a step in
which the HEAD and TAIL kernels ran and nothing happened), so what is left of the canary's host
time per simulated step is the front door: the session's bookkeeping, argument checks, staging
and handling, the bound launchers' per-call work, the sweeps, moves and copies.  Prints host us
per step (median of the measured steps), the library ops per step (``sim.session.call_ops``), us
per op, the share of each canary call, and with ``--top N`` the N costliest functions under the
canary calls (cProfile, by own time).

The simulator cannot run on the fake CuPy device (its engine does CuPy math of its own: the KV
bytes, the tables); ``kvcanary bench --sections loop`` measures the same calls on the GPU.  ``--device cuda`` runs
the simulator on CuPy with the real kernels instead (no stubs; needs a GPU) and profiles only inside
the canary calls, so the top functions are the canary's host time on the device path.

    python benchmarks/sim_host_profile.py [--steps 600] [--top 0] [--device numpy|cuda] [--dump FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import os
import pstats
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

from kvcanary_cupy.args import STAGE_HEADER  # noqa: E402
from kvcanary_cupy.constants import CanaryLaunchTag  # noqa: E402
from kvcanary_cupy.devtools.bench.host_setup import print_profile, quiet_staging, stubbed_numpy_backend  # noqa: E402

COVERAGE_OPS = ("deep_write", "deep_check", "lost_snapshot", "lost_check")
CALLS = ("pre_forward", "post_forward", "end_step", "sweep", "move", "copy")


def stub_everything(stub) -> None:
    """The backend's remaining work as no-ops, the staging as a quiet record (see the module doc)."""
    from kvcanary_cupy.backends import numpy_coverage

    for name in ("move", "copy"):
        stub(name, lambda a: None)
    saved = {name: getattr(numpy_coverage, name) for name in COVERAGE_OPS}
    for name in COVERAGE_OPS:
        setattr(numpy_coverage, name, lambda *a, **k: None)
    enable, runs = STAGE_HEADER.index("enable"), [0]

    def quiet_stage(out, layout):
        runs[0] += 1
        out[: layout.ring] = 0  # the header and the counters, as a clean staging writes them
        out[enable] = 1
        for tag in (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL):
            out[layout.counters + 2 * layout.num_kinds + int(tag)] = runs[0]

    quiet_staging(stub, quiet_stage)
    return saved


def restore(saved) -> None:
    from kvcanary_cupy.backends import numpy_coverage

    for name, fn in saved.items():
        setattr(numpy_coverage, name, fn)


class CallTimer:
    """Wraps the engine's StepTimer.canary to add up host time per canary call kind."""

    def __init__(self):
        self.us = collections.Counter()
        self.count = collections.Counter()


def run(steps: int, top: int, device: str = "numpy", dump: str | None = None) -> dict:
    if device == "cuda":
        import cupy

        return _run(steps, top, cupy, cupy, dump)
    with stubbed_numpy_backend() as stub:
        saved = stub_everything(stub)
        try:
            import numpy as np

            return _run(steps, top, np, None, dump)
        finally:
            restore(saved)


def _run(steps: int, top: int, xp, cupy, dump: str | None) -> dict:
    import contextlib

    from kvcanary_cupy.sim import engine as engine_mod
    from kvcanary_cupy.sim.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(), seed=0, addressing="sglang", xp=xp, cupy=cupy)
    per_call, calls, each = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    timer, plain = engine.timer, engine_mod.StepTimer.canary
    profile, profiling = cProfile.Profile(), [False]

    @contextlib.contextmanager
    def timed(self, call=("other", ())):
        t0 = time.thread_time()
        if profiling[0]:
            profile.enable()
        try:
            with plain(self, call):
                yield
        finally:
            if profiling[0]:
                profile.disable()
        us = (time.thread_time() - t0) * 1e6
        per_call[call[0]] += us
        calls[call[0]] += 1
        each[call[0]].append(us)

    engine_mod.StepTimer.canary = timed
    host, ops = [], []
    try:
        for i in range(steps + 50):
            if i == 50:  # warm: the first steps bind the launchers and fill the prefix cache
                per_call.clear()
                calls.clear()
                each.clear()
            engine.step()
            t = timer.take()
            if i >= 50 and t["canary_ops"]:
                host.append(t["canary_host_us"])
                ops.append(t["canary_ops"])
        measured, call_us, call_count = len(host), dict(per_call), dict(calls)  # before the profiled steps
        spread = {c: (statistics.median(v), max(v)) for c, v in each.items()}
        profiling[0] = True  # then as many steps again, the canary calls under the profiler (it slows them)
        for _ in range(steps):
            engine.step()
            timer.take()
    finally:
        engine_mod.StepTimer.canary = plain
    if dump:
        profile.dump_stats(dump)
    stats = pstats.Stats(profile)
    if top:
        print_profile(stats, steps, top)
    return dict(host_us=statistics.median(host), mean_host_us=statistics.fmean(host), ops=statistics.median(ops),
                mean_ops=statistics.fmean(ops), per_call={c: call_us[c] / measured for c in call_us},
                calls={c: call_count[c] / measured for c in call_count}, spread=spread,
                python_calls=stats.total_calls / steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions (own and cumulative time)")
    parser.add_argument("--device", choices=("numpy", "cuda"), default="numpy")
    parser.add_argument("--dump", metavar="FILE", help="write the profile's pstats file (for pstats' callers/callees)")
    args = parser.parse_args()
    r = run(args.steps, args.top, args.device, args.dump)
    what = "CuPy sessions, the real kernels" if args.device == "cuda" else "NumPy sessions, backend work stubbed"
    print(f"kvcanary sim clean run, seed 0, {args.steps} steps after 50, {what}")
    print(f"canary host us per step: median {r['host_us']:.1f}, mean {r['mean_host_us']:.1f}; ops per step: median "
          f"{r['ops']:g}, mean {r['mean_ops']:.1f}; us per op (means): {r['mean_host_us'] / r['mean_ops']:.2f}; "
          f"Python-level calls per step (profiled): {r['python_calls']:.0f}")
    print(f"{'call':<14} {'per step':>9} {'us per step':>12} {'us per call':>12} {'median us':>10} {'max us':>9}")
    for call in CALLS + ("other",):
        if r["calls"].get(call):
            median, most = r["spread"][call]
            print(f"{call:<14} {r['calls'][call]:>9.2f} {r['per_call'][call]:>12.1f} "
                  f"{r['per_call'][call] / r['calls'][call]:>12.1f} {median:>10.1f} {most:>9.1f}")


if __name__ == "__main__":
    main()
