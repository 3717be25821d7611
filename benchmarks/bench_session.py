"""Benchmark of CanarySession on the workloads of `kvcanary bench`; prints one row per workload.

- ``end_step us``: host time of ``end_step`` when nothing happened (median and 90th percentile
  over 500 steps, each a graph replay of pre_forward + post_forward that the device finishes before
  the timed end_step, which so handles the previous step's record and stages this one), and the
  median as a ratio of issue 7's target (``x target``: <= 1 meets 30 us).
- ``step device us``: device time of a whole session step (pre_forward + post_forward: plan, HEAD
  verify + write, TAIL verify + write): a CUDA graph of K = 50 steps, median synchronised replay / K.
- ``step eager us``: host wall time per eager step (pre_forward + post_forward + end_step) over
  200 back-to-back steps, one sync at the end.
- host us per op through the session (issue 10's targets: <= 15 us per op with CuPy arrays, <= 25
  us with CUDA torch tensors): eager ``pre_forward`` (plan + HEAD verify + HEAD write: 3 ops) and
  ``post_forward`` (TAIL verify + TAIL write: 2 ops), each call timed over 200 back-to-back steps
  (one sync at the end), the median of each: host time, which the device keeps up with at W1 and
  W3 (a whole step's device time is below its host time there).
- the HEAD write on the side stream: device us of a W2 prefill step (8 x 4,096 tokens, a serial
  chain of about 530 us per buffer) around a stand-in forward pass (a kernel spinning on the step's
  stream), with ``overlap_head_write`` on and off.

GPU (``--backend cupy``, the default) for CuPy arrays (graphs captured on a CuPy stream) and CUDA
torch tensors (torch.cuda.graph); ``--backend numpy`` times the NumPy session (no graphs).

    python benchmarks/bench_session.py [--backend cupy|numpy] [--workloads W1,W3] [--forward-us 500] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.devtools.bench import HOST_TARGET_US, WORKLOADS, build  # noqa: E402

END_STEP_TARGET_US = 30.0  # issue 7: end_step's host cost when nothing happened
OVERLAP_WORKLOAD = "W2"
SPIN_CYCLES_PER_US = 1980  # an H200 SM's clock (1.98 GHz): the stand-in forward's length


def make_session(d, **options):
    """A session whose HEAD and TAIL canaries hold the clean prefixes of the workload."""
    session = kc.CanarySession(d["canary"].shape[0], max_batch_size=d["bs"], verify_capacity=d["total_verify"],
                               like=d["rp"], on_violation="raise", **options)
    session.head_canary[...] = d["canary"]
    session.tail_canary[...] = d["canary"]
    return session


def pre_fn(session, d):
    return lambda: session.pre_forward(d["rp"], d["prefix"], d["extend"], d["rtt"], d["ids"], d["pos"], d["loc"])


def step_fn(session, d, forward=None):
    pre = pre_fn(session, d)

    def step():
        pre()
        if forward is not None:
            forward()
        session.post_forward()

    return step


def percentiles(values_s) -> tuple:
    us = sorted(v * 1e6 for v in values_s)
    return statistics.median(us), us[int(0.9 * (len(us) - 1))]


def capture(framework: str, fn, k: int = 1):
    """``(replay, stream context)``: a CUDA graph of ``k`` calls of ``fn`` (after one eager call)
    and the context whose current stream replays it (torch.cuda.graph for torch tensors)."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    if framework == "torch":
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(k):
                fn()
        return graph.replay, contextlib.nullcontext()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(k):
            fn()
        graph = stream.end_capture()
    return (lambda: graph.launch(stream)), stream


def device_us(cupy, framework, step, session=None, k=50, replays=20) -> float:
    """Median wall time of one replay of a graph of ``k`` steps, synchronised, divided by ``k``."""
    replay, stream = capture(framework, step, k)
    times = []
    with stream:
        for _ in range(replays):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            replay()
            cupy.cuda.Device().synchronize()
            times.append((time.perf_counter() - t0) / k)
        if session is not None:
            session.end_step()  # every replay above as one step
    return statistics.median(times) * 1e6


def end_step_cost(cupy, framework, session, step, steps=500):
    """end_step host time, each step a graph replay of pre_forward + post_forward finished by the
    device before end_step (so the host never runs ahead: no staging waits)."""
    replay, stream = capture(framework, step)
    times = []
    with stream:
        session.end_step()  # the eager warm-up step of capture()
        for _ in range(steps):
            replay()
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            session.end_step()
            times.append(time.perf_counter() - t0)
        session.check()
    return percentiles(times)


def back_to_back_us(sync, fn, calls=200) -> float:
    """Host microseconds per eager call: ``calls`` back-to-back calls (after one), one sync at the end."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def eager_step_us(sync, session, step, steps=200) -> float:
    def whole_step():
        step()
        session.end_step()

    return back_to_back_us(sync, whole_step, steps)


def host_per_op(sync, session, d, steps=200) -> tuple:
    """Host us of an eager pre_forward and of the post_forward after it: each timed around its own
    call over ``steps`` back-to-back steps, one sync at the end, and the median of each taken (the
    two timed apart, a noisy host's spikes in one do not land in the other's figure)."""
    pre, post = pre_fn(session, d), session.post_forward
    pre()
    post()
    sync()
    pre_s, post_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        pre()
        t1 = time.perf_counter()
        post()
        pre_s.append(t1 - t0)
        post_s.append(time.perf_counter() - t1)
    sync()
    session.end_step()
    return percentiles(pre_s)[0], percentiles(post_s)[0]


def gpu_frameworks():
    frameworks = [("cupy", lambda d: d)]
    try:
        import torch

        frameworks.append(("torch", lambda d: {k: torch.from_dlpack(v) if hasattr(v, "__dlpack__") else v for k, v in d.items()}))
    except ImportError:
        pass
    return frameworks


def check_clean(session) -> None:
    session.check()
    s = session.stats
    if s["violations"] or s["health_failures"] or s["verify_skipped_steps"]:
        raise RuntimeError(f"the benchmark's session must run clean, got {s}")


def run_gpu(names, forward_us: float):
    import cupy

    kc.warmup()
    step_lines = [f"end_step host us when nothing happened against its target of {END_STEP_TARGET_US:.0f} us; a whole step "
                  "(pre_forward + post_forward) on the device and eagerly",
                  f"{'workload':<16} {'frame':<6} {'end_step us (median, p90)':>26} {'x target':>9} {'step device us':>15} "
                  f"{'step eager us':>14}"]
    op_lines = [
        "host us per op through the session (eager, 200 back-to-back steps, one sync at the end, each call timed: the "
        "median; pre_forward = plan "
        f"+ HEAD verify + HEAD write, post_forward = TAIL verify + TAIL write; target per op: "
        f"{HOST_TARGET_US['cupy']:.0f} us CuPy, {HOST_TARGET_US['torch']:.0f} us torch)",
        f"{'workload':<16} {'frame':<6} {'pre_forward us':>15} {'per op':>7} {'x target':>9} "
        f"{'post_forward us':>16} {'per op':>7} {'x target':>9}",
    ]
    sync = cupy.cuda.Device().synchronize
    for key in names:
        for name, convert in gpu_frameworks():
            d = convert(build(WORKLOADS[key], cupy))
            session = make_session(d)
            step = step_fn(session, d)
            median, p90 = end_step_cost(cupy, name, session, step)
            device = device_us(cupy, name, step, session)
            eager = eager_step_us(sync, session, step)
            pre_us, post_us = host_per_op(sync, session, d)
            check_clean(session)
            target = HOST_TARGET_US[name]
            step_lines.append(f"{WORKLOADS[key].name:<16} {name:<6} {median:>15.1f} {p90:>10.1f} "
                              f"{median / END_STEP_TARGET_US:>9.2f} {device:>15.2f} {eager:>14.0f}")
            op_lines.append(f"{WORKLOADS[key].name:<16} {name:<6} {pre_us:>15.1f} {pre_us / 3:>7.1f} {pre_us / 3 / target:>9.2f} "
                            f"{post_us:>16.1f} {post_us / 2:>7.1f} {post_us / 2 / target:>9.2f}")
    return step_lines + [""] + op_lines + [""] + overlap_rows(cupy, forward_us)


def overlap_rows(cupy, forward_us: float):
    """Device us of a prefill step around a stand-in forward pass, the HEAD write overlapped or in order."""
    from kvcanary_cupy.devtools.spin import spin

    d = build(WORKLOADS[OVERLAP_WORKLOAD], cupy)
    forward = lambda: spin(int(forward_us * SPIN_CYCLES_PER_US))  # noqa: E731 - on the step's (current) stream
    lines = [f"the HEAD write on a side stream: device us per {WORKLOADS[OVERLAP_WORKLOAD].name} step around a "
             f"stand-in forward of ~{forward_us:.0f} us (graph of 10 steps, median replay / 10)",
             f"{'forward only':>13} {'in order':>9} {'overlapped':>11} {'saved':>7}"]
    alone = device_us(cupy, "cupy", forward, k=10, replays=10)
    results = {}
    for overlap in (False, True):
        session = make_session(d, overlap_head_write=overlap)
        results[overlap] = device_us(cupy, "cupy", step_fn(session, d, forward), session, k=10, replays=10)
        check_clean(session)
    lines.append(f"{alone:>13.0f} {results[False]:>9.0f} {results[True]:>11.0f} {results[False] - results[True]:>7.0f}")
    return lines


def run_numpy(names):
    lines = [f"{'workload':<16} {'end_step us (median, p90)':>26} {'step eager ms':>14}"]
    for key in names:
        d = build(WORKLOADS[key], np)
        session = make_session(d)
        step = step_fn(session, d)
        times = []
        for _ in range(20):
            step()
            t0 = time.perf_counter()
            session.end_step()
            times.append(time.perf_counter() - t0)
        median, p90 = percentiles(times)
        eager = eager_step_us(lambda: None, session, step, steps=5) / 1e3
        session.check()
        lines.append(f"{WORKLOADS[key].name:<16} {median:>15.1f} {p90:>10.1f} {eager:>14.1f}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["cupy", "numpy"], default="cupy")
    parser.add_argument("--workloads", default="W1,W3")
    parser.add_argument("--forward-us", type=float, default=500.0,
                        help="length of the stand-in forward pass of the side-stream rows (GPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    names = args.workloads.split(",")
    text = "\n".join(run_gpu(names, args.forward_us) if args.backend == "cupy" else run_numpy(names))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
