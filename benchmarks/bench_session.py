"""Benchmark of CanarySession on the workloads of `kvcanary bench`; prints one row per workload.

- ``end_step us``: host time of ``end_step`` when nothing happened (median and 90th percentile
  over 500 steps; the step itself is a graph replay of pre_forward + post_forward); target <= 30 us.
- ``step device us``: device time of a whole session step (pre_forward + post_forward: plan, HEAD
  verify + write, TAIL verify + write): a CUDA graph of K = 50 steps, median synchronised replay / K.
- ``step eager us``: host wall time per eager step (pre_forward + post_forward + end_step) over
  200 back-to-back steps, one sync at the end.

GPU (``--backend cupy``, the default) for CuPy arrays (graphs captured on a CuPy stream) and CUDA
torch tensors (torch.cuda.graph); ``--backend numpy`` times the NumPy session (no graphs).

    python benchmarks/bench_session.py [--backend cupy|numpy] [--workloads W1,W3] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.bench import WORKLOADS, build


def make_session(d):
    """A session whose HEAD and TAIL canaries hold the clean prefixes of the workload."""
    session = kc.CanarySession(d["canary"].shape[0], max_batch_size=d["bs"], verify_capacity=d["total_verify"],
                               like=d["rp"], on_violation="raise")
    session.head_canary[...] = d["canary"]
    session.tail_canary[...] = d["canary"]
    return session


def step_fn(session, d):
    def step():
        session.pre_forward(d["rp"], d["prefix"], d["extend"], d["rtt"], d["ids"], d["pos"], d["loc"])
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


def device_us(cupy, framework, session, step, k=50, replays=20) -> float:
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
        session.end_step()  # every replay above as one step
    return statistics.median(times) * 1e6


def end_step_cost(framework, session, step, steps=500):
    """end_step host time, each step a graph replay of pre_forward + post_forward."""
    replay, stream = capture(framework, step)
    times = []
    with stream:
        session.end_step()  # the eager warm-up step of capture()
        for _ in range(steps):
            replay()
            t0 = time.perf_counter()
            session.end_step()
            times.append(time.perf_counter() - t0)
        session.check()
    return percentiles(times)


def eager_step_us(sync, session, step, steps=200) -> float:
    step()
    session.end_step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
        session.end_step()
    sync()
    return (time.perf_counter() - t0) / steps * 1e6


def run_gpu(names):
    import cupy

    kc.warmup()
    frameworks = [("cupy", lambda d: d)]
    try:
        import torch

        frameworks.append(("torch", lambda d: {k: torch.from_dlpack(v) if hasattr(v, "__dlpack__") else v for k, v in d.items()}))
    except ImportError:
        pass
    lines = [f"{'workload':<16} {'frame':<6} {'end_step us (median, p90)':>26} {'step device us':>15} {'step eager us':>14}"]
    for key in names:
        for name, convert in frameworks:
            d = convert(build(WORKLOADS[key], cupy))
            session = make_session(d)
            step = step_fn(session, d)
            median, p90 = end_step_cost(name, session, step)
            device = device_us(cupy, name, session, step)
            eager = eager_step_us(cupy.cuda.Device().synchronize, session, step)
            session.check()
            s = session.stats
            if s["violations"] or s["health_failures"] or s["verify_skipped_steps"]:
                raise RuntimeError(f"the benchmark's session must run clean, got {s}")
            lines.append(f"{WORKLOADS[key].name:<16} {name:<6} {median:>15.1f} {p90:>10.1f} {device:>15.2f} {eager:>14.0f}")
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
    parser.add_argument("--out")
    args = parser.parse_args()
    names = args.workloads.split(",")
    text = "\n".join(run_gpu(names) if args.backend == "cupy" else run_numpy(names))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
