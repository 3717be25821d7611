"""Benchmark: the host time a process group adds to ``CanarySession.end_step``.

Spawns ``--world`` ranks on 127.0.0.1 (gloo with NumPy sessions, or NCCL with CuPy sessions, rank
r on cuda:r).  Each rank runs the same workload step (``kvcanary bench``'s W1/W3 inputs) through
a session without a group, with a dedicated group (``reduce_every=1``), and with a group and
``replicated_kv=True``; every step is pre_forward + post_forward (the device finished before the
timed call, and the ranks meet at a barrier on the default group, not timed), then the timed
``end_step``, which reads the previous reduction (landed by then) and starts this step's.  With
``--forward-us F`` (a comma-separated list; default ``0,1000``) each step also runs a stand-in
forward of F us between pre_forward and post_forward (a kernel spinning on the step's stream with
NCCL, a sleep with gloo), as an engine's step does: the worker's reduction then runs beside it, as
it would in an engine, where back-to-back steps (F = 0) leave it no time.  Rank 0
prints, per workload and variant, the median and 90th percentile host (wall) time of ``end_step``
on the step's thread (the critical path), the median added over the session without a group and
that as a ratio of issue 25's target (``x target``: <= 1 meets 30 us); then the same from the
calling thread's CPU time, which leaves out the time a loaded machine (or a wait) keeps the
thread off the CPU; then the median wall and CPU time of the group's own part of ``end_step``
(``session.distributed.end_step``, on the step's thread: the critical path the group adds,
without the other variants' noise); then the reduction worker thread's CPU time per reduction
(off the critical path: the collective's issue, its wait, the decode); with NCCL, the step's device
time (CUDA events around pre_forward .. end_step on the step's stream) and what the group adds to
it (issue 26's figure).  ``--profile`` adds, for the "group"
variant of the first workload, rank 0's cProfile of ``end_step`` on the step's thread (its 12
costliest functions by own and by cumulative time, us and calls per step).

    python benchmarks/bench_distributed.py [--backend gloo|nccl] [--world 2] [--workloads W3] [--steps 300]
                                           [--forward-us 0,1000] [--profile]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

ADDED_TARGET_US = 30.0  # issue 25: end_step's added host time with a group, per end_step
PROFILE_TOP = 12  # functions a --profile list prints: both lists and the table fit gpu_check's TAIL=50
VARIANTS = (("no group", {}), ("group", {"group": True}), ("group + replicated_kv", {"group": True, "replicated_kv": True}))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread_cpu(thread) -> float:
    """The CPU seconds ``thread`` has used (0 without a thread or a per-thread clock)."""
    if thread is None or not hasattr(time, "pthread_getcpuclockid"):
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _timed(method, into: list):
    """``method`` recording each call's (wall, thread CPU) seconds into ``into``."""
    def timed(*args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return method(*args)
        finally:
            into.append((time.perf_counter() - t0, time.thread_time() - c0))
    return timed


def _profile(session, d, forward, sync, barrier, steps: int, show: bool) -> None:
    """``steps`` more steps on every rank (the same collectives), ``end_step`` under cProfile; printed if ``show``."""
    import cProfile
    import pstats
    from kvcanary_cupy.devtools.bench.host_setup import print_profile

    profiler = cProfile.Profile()
    for _ in range(steps):
        session.pre_forward(d["rp"], d["prefix"], d["extend"], d["rtt"], d["ids"], d["pos"], d["loc"])
        forward()
        session.post_forward()
        sync()
        barrier()
        profiler.enable()
        session.end_step()
        profiler.disable()
    if show:
        print(f"cProfile of end_step with a group on the step's thread, {steps} steps (the worker thread is not "
              "profiled):")
        print_profile(pstats.Stats(profiler), steps, PROFILE_TOP)


def _rank(rank, world, backend, port, workloads, forwards, steps, profile):
    import torch
    import torch.distributed as dist

    import kvcanary_cupy as kc
    from kvcanary_cupy.devtools.bench import WORKLOADS, build

    torch.set_num_threads(1)
    gpu = backend == "nccl"
    if gpu:
        import cupy

        torch.cuda.set_device(rank)
        cupy.cuda.Device(rank).use()
        xp, sync = cupy, cupy.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    if gpu:
        from kvcanary_cupy.devtools.spin import spin

        cycles_per_us = cupy.cuda.Device().attributes["ClockRate"] / 1e3  # kHz -> cycles per us
        stand_in = lambda us: (lambda: spin(int(us * cycles_per_us)) if us else None)  # noqa: E731
    else:
        stand_in = lambda us: (lambda: time.sleep(us / 1e6) if us else None)  # noqa: E731
    rows = []
    for name, forward_us in [(n, f) for n in workloads for f in forwards]:
        d = build(WORKLOADS[name], xp)
        forward = stand_in(forward_us)
        base = None
        for label, variant in VARIANTS:
            options = {}
            if variant.get("group"):
                options = dict(process_group=dist.new_group(backend=backend), replicated_kv=variant.get("replicated_kv", False))
            session = kc.CanarySession(d["canary"].shape[0], max_batch_size=d["bs"], verify_capacity=d["total_verify"],
                                       like=d["rp"], on_violation="raise", **options)
            session.head_canary[...] = d["canary"]
            session.tail_canary[...] = d["canary"]
            times, cpu, worker_cpu, part, device = [], [], 0.0, [], []
            events = (cupy.cuda.Event(), cupy.cuda.Event()) if gpu else None
            if session.distributed is not None:
                session.distributed.end_step = _timed(session.distributed.end_step, part)
            for i in range(steps + 20):
                if events:
                    events[0].record()
                session.pre_forward(d["rp"], d["prefix"], d["extend"], d["rtt"], d["ids"], d["pos"], d["loc"])
                forward()
                session.post_forward()
                sync()
                dist.barrier()
                if i == 20 and session.distributed is not None:  # warm-up steps first
                    worker_cpu = -_thread_cpu(session.distributed.worker_thread)
                t0, c0 = time.perf_counter(), time.thread_time()
                session.end_step()
                if i >= 20:
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.thread_time() - c0)
                if events:  # the step's device time, pre_forward to end_step's work on the step's stream
                    events[1].record()
                    events[1].synchronize()
                    if i >= 20:
                        device.append(cupy.cuda.get_elapsed_time(*events) * 1e3)
            if session.distributed is not None:
                sync()
                dist.barrier()  # the last reduction done on the worker
                worker_cpu += _thread_cpu(session.distributed.worker_thread)
                if profile and label == "group" and name == workloads[0] and forward_us == forwards[-1]:
                    _profile(session, d, forward, sync, dist.barrier, 200, show=rank == 0)
            session.check()
            session.close()
            us = sorted(t * 1e6 for t in times)
            median, p90, cpu_us = statistics.median(us), us[int(0.9 * (len(us) - 1))], statistics.median(cpu) * 1e6
            device_us = statistics.median(device) if device else None
            base = (median, cpu_us, device_us) if base is None else base
            waits = session.distributed.stats["reduce_waits"] if session.distributed is not None else 0
            part = part[20:] or [(0.0, 0.0)]
            rows.append((WORKLOADS[name].name, forward_us, label, median, p90, median - base[0], cpu_us, cpu_us - base[1], waits,
                         statistics.median(w for w, _ in part) * 1e6, statistics.median(c for _, c in part) * 1e6,
                         worker_cpu / steps * 1e6, device_us, None if device_us is None else device_us - base[2]))
    if rank == 0:
        load = os.getloadavg()[0]
        print(f"{backend}, {world} ranks, {steps} steps, load average {load:.1f} on {os.cpu_count()} CPUs; end_step us: "
              f"wall median, p90, added over no group, x target ({ADDED_TARGET_US:.0f} us); thread CPU median, added, "
              "x target; reduce waits; the group's part on the step's thread, wall and CPU median; the worker "
              "thread's CPU us per reduction (off the critical path); the step's device us (events around pre_forward .. "
              "end_step on the step's stream, NCCL only), added over no group; fwd: the stand-in forward's us per step")
        for (workload, forward_us, label, median, p90, added, cpu_us, cpu_added, waits, part_wall, part_cpu, worker_us,
             device_us, device_added) in rows:
            ratio = (lambda x: "" if label == "no group" else f"{x / ADDED_TARGET_US:.2f}x")
            print(f"  {workload:<16} fwd {forward_us:>5} {label:<22} wall {median:7.1f} {p90:7.1f} +{added:6.1f} {ratio(added):>6}   "
                  f"cpu {cpu_us:6.1f} +{cpu_added:6.1f} {ratio(cpu_added):>6}   waits {waits:3d}   "
                  f"group part {part_wall:5.1f} {part_cpu:5.1f}   worker {worker_us:6.1f}   "
                  + ("device -" if device_us is None else f"device {device_us:8.1f} +{device_added:6.1f}"))
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workloads", default="W3")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--forward-us", default="0,1000",
                        help="stand-in forward us per step, comma-separated (0: back-to-back steps)")
    parser.add_argument("--profile", action="store_true", help="print rank 0's cProfile of end_step (group variant)")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    port = free_port()
    forwards = [int(f) for f in args.forward_us.split(",")]
    mp.start_processes(_rank, args=(args.world, args.backend, port, args.workloads.split(","), forwards, args.steps,
                                    args.profile),
                       nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
