"""CPU profile of the eager host path: microseconds and Python-level calls per op, no GPU needed.

For plan (through a CanaryPlanner, and kc.plan with ``out=``), verify and write (bound launchers,
and the free functions), kc.plan_and_verify (a free call only: no bound launcher), and a
CanarySession's pre_forward (plan + HEAD verify + HEAD write) and whole step (pre_forward +
post_forward: 5 ops) against the free functions it would otherwise call, at one workload, the backend's own work is taken out so only the front door is measured: NumPy arrays with the NumPy backend stubbed, and CuPy arrays on a fake device
(``kvcanary_cupy/devtools/fake_cupy.py``: real CuPy arrays over host memory, kernel launches recorded, not run).
On a GPU the launch itself adds its driver cost (``kvcanary bench --sections host`` measures that).

Then, on the fake device, a session step with the coverage past the record
(``kvcanary_cupy/coverage.py``: the lost-store check, the deep fingerprints, both) against the
plain step, on a pool of ``COVERAGE_LAYERS`` layers (K and V each a source).  Not with NumPy,
whose coverage kernels are the CPU's own work, not the front door's.

Then the session's ``end_step`` when nothing happened (the HEAD and TAIL kernels ran, no
violation), with the device calls it makes per call on the fake device (launches, event records,
stream waits, copies, event queries, capture queries).  The staging kernels' work is stood in for
by marking the HEAD and TAIL tags as run in each staged record (NumPy: in place of the staging;
fake device: when the record is copied), about a microsecond of the figure;
``benchmarks/bench_session.py`` measures end_step on the GPU against its 30 us target.

    python benchmarks/host_profile.py [--workload W3] [--calls 2000] [--top 0]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.devtools.bench.host_setup import (add_arguments, free_ops, measure, placed,  # noqa: E402
                                                     quiet_staging, stubbed_numpy_backend, workload)


COVERAGE_LAYERS, COVERAGE_ROW = 4, 64  # the coverage rows' pool: layers x (K, V) x slots x bytes
COVERAGE_CONFIGS = {
    "+ lost stores": dict(check_lost_stores=True),
    "+ deep": dict(deep=True),
    "+ deep + lost": dict(deep=True, check_lost_stores=True),
}


def coverage_steps(d, move) -> dict:
    """A session step (pre_forward + post_forward) on the workload, plain and with each coverage option."""
    a = placed(d, move)
    num_slots = a["canary"].shape[0]
    pool = move(np.zeros((COVERAGE_LAYERS, 2, num_slots, COVERAGE_ROW), np.uint8))
    every = tuple(kc.RealKvSource(pool[l, h], 1, COVERAGE_ROW, COVERAGE_ROW) for l in range(COVERAGE_LAYERS) for h in (0, 1))
    steps = {}
    for label, options in {"step": {}, **COVERAGE_CONFIGS}.items():
        lost = options.get("check_lost_stores", False)
        session = kc.CanarySession(num_slots, max_batch_size=d["bs"], verify_capacity=d["total_verify"], like=a["rp"],
                                   on_violation="ignore", real_kv_sources=every[:2],
                                   real_kv_hash_mode=kc.RealKvHashMode.PARTIAL,
                                   deep_kv_sources=every if options.get("deep") else (), check_lost_stores=lost,
                                   max_step_tokens=d["tokens"] if lost else None)

        def step(session=session):
            session.pre_forward(a["rp"], a["prefix"], a["extend"], a["rtt"], a["ids"], a["pos"], a["loc"])
            session.post_forward()

        steps[label] = step
    return steps


def coverage_report(label, steps, args):
    base_us, base_calls = measure(steps["step"], args.calls, args.top)
    print(f"{label:<20} {'step':<15} {base_us:>8.1f} {base_calls:>6.0f}")
    for name in COVERAGE_CONFIGS:
        us, calls = measure(steps[name], args.calls, args.top)
        print(f"{label:<20} {name:<15} {us:>8.1f} {calls:>6.0f} {us - base_us:>8.1f} {calls - base_calls:>6.0f} "
              f"{(us - base_us) / base_us:>7.0%}")


def step_ops(d, move):
    """The timed callables on one workload's arrays; ``move`` puts a NumPy array on the device."""
    vcap, bs = d["total_verify"], d["bs"]
    a = placed(d, move)
    planner = kc.CanaryPlanner(kc.CanaryCapacities(vcap, bs), like=a["rp"])
    log = kc.ViolationLog.allocate(1024, like=a["rp"])
    inputs = (a["rp"], a["prefix"], a["extend"], a["rtt"])
    verify = kc.VerifyLauncher(a["canary"], planner.verify_plan, log=log)
    write = kc.WriteLauncher(a["canary"], planner.write_plan, log=log)
    tokens = (a["ids"], a["pos"], a["loc"])
    free = free_ops(d, a, planner.verify_plan, planner.write_plan, log)
    session = kc.CanarySession(a["canary"].shape[0], max_batch_size=bs, verify_capacity=vcap, like=a["rp"])

    def free_pre_forward():
        free["plan"]()
        free["verify"]()
        free["write"]()

    def pre_forward():
        session.pre_forward(*inputs, *tokens)
        # The session refuses a second pre_forward while a step is open (CanaryUsageError). Close it
        # as post_forward's last line does, without its TAIL verify and write, so that the row times
        # pre_forward alone; an attribute store, no Python call, so the call count is pre_forward's.
        session._step_inputs = None

    def step():
        session.pre_forward(*inputs, *tokens)
        session.post_forward()

    return {
        **{(op, "free"): fn for op, fn in free.items()},
        ("plan", "bound"): lambda: planner.plan(*inputs),
        ("verify", "bound"): verify,
        ("write", "bound"): lambda: write(*tokens),
        ("pre_forward", "free"): free_pre_forward,
        ("pre_forward", "bound"): pre_forward,
        ("step", "free"): lambda: (free_pre_forward(), free["verify"](), free["write"]()),
        ("step", "bound"): step,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, workload="W3", calls=2000)
    args = parser.parse_args()
    d = workload(args.workload)
    print(f"host us and Python-level calls per eager op at {args.workload} (backend work stubbed out)")
    print(f"{'arrays':<20} {'op':<15} {'free us':>8} {'calls':>6} {'bound us':>9} {'calls':>6} {'x faster':>9}")

    end_step_lines = [f"{'arrays':<20} {'op':<15} {'us':>8} {'calls':>6}   device calls per call"]
    with stubbed_numpy_backend() as stub:
        report("NumPy", step_ops(d, lambda x: x), args)
        marks = []  # the stand-in goes in before the session is built, its mark after
        quiet_staging(stub, lambda record, layout: marks[0](record))
        session, mark = quiet_session(d, lambda x: x)
        marks.append(mark)
        end_step_lines.append(end_step_row("NumPy", session, None, args))
    try:
        from kvcanary_cupy.devtools.fake_cupy import fake_device, host_view
    except ImportError:
        print("\n".join(["", *end_step_lines]))
        return
    with fake_device(record_bytes=False) as dev:
        print("")
        report("CuPy (fake device)", step_ops(d, dev.asarray), args)
        print("\n" + COVERAGE_HEADER)
        coverage_report("CuPy (fake device)", coverage_steps(d, dev.asarray), args)
        session, mark = quiet_session(d, dev.asarray)
        size = session._layout.size
        records = {}  # host address -> its view
        dev.on_copy = lambda dst, src, nbytes: mark(records.get(dst) if dst in records else
                                                    records.setdefault(dst, host_view(dst, np.int64, size)))
        end_step_lines.append(end_step_row("CuPy (fake device)", session, dev, args))
    print("\n".join(["", "end_step when nothing happened (HEAD and TAIL ran, no violation)", *end_step_lines]))


def quiet_session(d, move):
    """A session on the workload's arrays, and a function marking a staged record as a step in
    which the HEAD and TAIL kernels ran and nothing happened (the staging's stand-in)."""
    from kvcanary_cupy.args import STAGE_HEADER

    a = placed(d, move)
    session = kc.CanarySession(a["canary"].shape[0], max_batch_size=d["bs"], verify_capacity=d["total_verify"],
                               like=a["rp"], on_violation="raise")
    layout, enable = session._layout, STAGE_HEADER.index("enable")
    runs = [layout.counters + 2 * layout.num_kinds + tag for tag in (session.head_tag, session.tail_tag)]
    step = [0]

    def mark(record):
        step[0] += 1
        record[enable] = 1
        record[runs[0]] = record[runs[1]] = step[0]

    return session, mark


def end_step_row(label, session, dev, args) -> str:
    us, calls = measure(session.end_step, args.calls, args.top)
    if dev is None:
        device = "-"
    else:
        dev.timeline.clear()
        dev.capture_queries = 0
        for _ in range(100):
            session.end_step()
        ops = collections.Counter(op for op, *_ in dev.timeline)
        ops["capture query"] = dev.capture_queries
        device = ", ".join(f"{n / 100:g} {op}" for op, n in ops.items())
    s = session.stats
    assert s["health_failures"] == s["violations"] == 0 and s["steps"] > args.calls, s  # nothing happened
    return f"{label:<20} {'end_step':<15} {us:>8.1f} {calls:>6.0f}   {device}"


COVERAGE_HEADER = (f"a session step with coverage past the record ({COVERAGE_LAYERS} layers x K, V as sources)\n"
                   f"{'arrays':<20} {'session':<15} {'us':>8} {'calls':>6} {'+ us':>8} {'+ calls':>6} {'+ share':>7}")


def report(label, ops, args):
    for op in ("plan", "verify", "write", "plan_and_verify", "pre_forward", "step"):
        free_us, free_calls = measure(ops[(op, "free")], args.calls, args.top)
        if (op, "bound") not in ops:  # a free call only
            print(f"{label:<20} {op:<15} {free_us:>8.1f} {free_calls:>6.0f} {'-':>9} {'-':>6} {'-':>9}")
            continue
        bound_us, bound_calls = measure(ops[(op, "bound")], args.calls, args.top)
        print(f"{label:<20} {op:<15} {free_us:>8.1f} {free_calls:>6.0f} {bound_us:>9.1f} {bound_calls:>6.0f} "
              f"{free_us / bound_us:>9.1f}")


if __name__ == "__main__":
    main()
