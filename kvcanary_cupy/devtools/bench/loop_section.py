"""The ``loop`` section: a CanarySession through the simulator's per-step mix.

``kvcanary sim``'s engine (default config, seed 0, SGLang tables, no faults) runs its steps with the
canary in its loop, exactly as a clean simulated run: per pool ``pre_forward`` (plan, HEAD verify,
HEAD write, lost-store snapshot), the model's KV store, ``post_forward`` (TAIL verify, lost-store
check, TAIL write, deep fingerprints and their rotation), ``end_step``, and at the simulator's rates
the prefix-cache sweeps, compaction moves (``kc.move_pages``) and transfers of canary rows.  Per
step it reports the canary's host time, its event time around the eager calls, its kernel time (the
simulator's kernel samples: the stream held by the spin kernel while the step is enqueued, so the
calls run back to back; ``end_step`` and the sweeps stage and cannot be captured in a graph, so
graph replay would leave them out) and the two targets as ratios: host time within 2x the step's
ops at the bound path's per-op host figures, all five measured in this run at W3 (plan, verify and
write through the bound launchers; a coverage launch as half of what the lost-store check's two
launches add to a session step; a stage as an ``end_step`` with nothing to report), since the
host's speed moves between machines; event time within 2x kernel time.
With ``--backend numpy`` the same loop on NumPy sessions: host time and ops only.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ...sim.engine import Engine, EngineConfig
from ...sim.runner import RunStats, cost_summary
from ...sim.session import BOUND_HOST_US

LOOP_STEPS, LOOP_WARMUP = 400, 50


def session_op_us(cupy, d, rounds: int = 5) -> dict:
    """Host us of a bound coverage launch and of a stage at workload ``d`` (a session step with and
    without the lost-store check, with and without ``end_step``): medians over ``rounds`` rounds
    of the differences, the three loops of a round back to back."""
    from .coverage_section import HEAD_DIM, HEADS, LAYERS, session, warmed_step
    from .step_sections import eager_us

    pool = cupy.zeros((LAYERS, 2, d["canary"].shape[0], HEADS * HEAD_DIM), cupy.float16)
    plain, lost = session(d, pool), session(d, pool, check_lost_stores=True)
    plain_step, lost_step = warmed_step(plain, d), warmed_step(lost, d)

    def staged_step():
        plain_step()
        plain.end_step()

    launch, stage = [], []
    for _ in range(rounds):  # one run each a round: the rounds' median is taken below
        base = eager_us(cupy, plain_step, calls=100, runs=1)
        launch.append((eager_us(cupy, lost_step, calls=100, runs=1) - base) / 2)  # the snapshot and the check
        stage.append(eager_us(cupy, staged_step, calls=100, runs=1) - base)
    plain.check()
    if plain.stats["violations"] or int(lost.log.violation_counters.sum()):
        raise RuntimeError("the loop section's per-op sessions must run clean")
    return {"launch": statistics.median(launch), "stage": statistics.median(stage)}


COLD_SWEEP_BYTES = 256 << 20  # more than a server CPU's last-level cache


def idle_us(cupy, fn, calls: int = 200, cold: bool = False) -> float:
    """Host CPU us of one call of ``fn`` launched onto an idle GPU (a device sync before each call,
    left out), as the simulator's calls meet it: its engine reads results back every step.  With
    ``cold``, each call also follows a copy of COLD_SWEEP_BYTES (left out), so that it runs on caches
    holding other work, as between an engine's steps.  CPU time of the thread, as the simulator's
    timer counts it; median of the calls."""
    src = np.ones(COLD_SWEEP_BYTES // 8) if cold else None
    dst = np.empty_like(src) if cold else None
    fn()
    times = []
    for _ in range(calls):
        cupy.cuda.Device().synchronize()
        if cold:
            np.copyto(dst, src)
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    cupy.cuda.Device().synchronize()
    return statistics.median(times) * 1e6


def run_loop(xp, cupy=None, *, steps: int = LOOP_STEPS, warmup: int = LOOP_WARMUP, figures=None) -> dict:
    """The clean simulated loop on ``xp`` (NumPy, or CuPy with ``cupy``): its :func:`cost_summary`,
    with ``figures`` (op kind -> host us) in place of :data:`BOUND_HOST_US` where given, and
    ``op_counts``: each measured step's library ops by kind."""
    engine = Engine(EngineConfig(), seed=0, addressing="sglang", xp=xp, cupy=cupy)
    if figures:
        engine.timer.figures = {**BOUND_HOST_US, **figures}
    stats, op_counts = RunStats(), []
    for i in range(warmup + steps):
        engine.step()
        t = engine.timer.take()
        engine.take_violations()  # as the simulator's loop does (outside the canary's timer)
        if i < warmup:
            continue
        stats.steps += 1
        stats.canary_us.append(t["canary_host_us"])
        stats.canary_device_us.append(t["canary_device_us"])
        stats.canary_kernel_us.append(t["canary_kernel_us"])
        stats.kernel_samples_spoiled += t["kernel_sample"] == "spoiled"
        if t["canary_ops"]:
            stats.canary_ops.append(t["canary_ops"])
            stats.canary_bound_us.append(t["canary_bound_us"])
            op_counts.append(t["canary_op_counts"])
    stats.session_stats = {name: dict(pool.session.stats) for name, pool in engine.pools.items()}
    violations = sum(s["violations"] for s in stats.session_stats.values())
    if violations:
        raise RuntimeError(f"the clean simulated loop must verify clean, got {violations} violations")
    return {**cost_summary(stats), "op_counts": op_counts}


def loop_rows(rows: list, *, cupy=None, steps: int = LOOP_STEPS) -> list:
    """Print lines and JSON rows of the loop section (``cupy`` None: NumPy sessions)."""
    figures = None
    if cupy is not None:
        from .step_sections import bound_ops, eager_us
        from .workloads import WORKLOADS, build

        d = build(WORKLOADS["W3"], cupy)
        ops = bound_ops(d)
        figures = {op: eager_us(cupy, fn) for op, fn in ops.items()}
        idle = {op: idle_us(cupy, fn) for op, fn in ops.items()}
        cold = {op: idle_us(cupy, fn, calls=50, cold=True) for op, fn in ops.items()}
        figures.update(session_op_us(cupy, d))
    c = run_loop(cupy if cupy is not None else np, cupy, steps=steps, figures=figures)
    backend = "cupy" if cupy is not None else "numpy"
    row = {"section": "loop", "op": "session loop", "backend": backend, "steps": steps,
           "host_us_per_step": c["canary_host_us"], "event_us_per_step": c["canary_device_us"],
           "kernel_us_per_step": c["canary_kernel_us"], "event_x_kernel": c["canary_event_x_kernel"],
           "ops_per_step": c["canary_ops_per_step"], "bound_host_us": c["canary_bound_host_us"],
           "host_x_bound": c["canary_host_x_bound"], "kernel_samples": c["kernel_samples"],
           "kernel_samples_spoiled": c["kernel_samples_spoiled"],
           "verified_entries_per_step": c["canary_verified_entries_per_step"],
           "bound_op_host_us": {**BOUND_HOST_US, **(figures or {})} if cupy is not None else None}
    rows.append(row)
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"session loop ({backend}): kvcanary sim's clean run, seed 0, {steps} steps after {LOOP_WARMUP}; "
             "per step (median): canary host us, event us (eager calls), kernel us (back to back), ops; "
             "targets <= 2x: host / (ops x bound per-op host us), event / kernel",
             f"{'host us':>9} {'event us':>9} {'kernel us':>10} {'x kernel':>9} {'ops':>5} {'bound us':>9} "
             f"{'x bound':>8} {'samples':>8} {'spoiled':>8} {'entries':>8}",
             f"{fmt(row['host_us_per_step']):>9} {fmt(row['event_us_per_step']):>9} {fmt(row['kernel_us_per_step']):>10} "
             f"{fmt(row['event_x_kernel'], '.2f'):>9} {fmt(row['ops_per_step'], 'g'):>5} {fmt(row['bound_host_us']):>9} "
             f"{fmt(row['host_x_bound'], '.2f'):>8} {row['kernel_samples']:>8} {row['kernel_samples_spoiled']:>8} "
             f"{fmt(row['verified_entries_per_step']):>8}"]
    if figures:
        lines.append("(bound per-op host us measured here at W3: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
                     + ")")
        # The same ops each launched onto an idle GPU: the step's ops at these figures (the coverage
        # launches and the stage kept at their back-to-back ones) bound what eager launches can reach.
        for name, measured, how in (("idle", idle, "each launched onto an idle GPU (a device sync before each)"),
                                    ("cold", cold, f"each after a sync and a {COLD_SWEEP_BYTES >> 20} MiB copy (cold caches)")):
            at = {**figures, **measured}
            bound = statistics.median(sum(at[k] * n for k, n in counts.items()) for counts in c["op_counts"])
            row[f"{name}_op_host_us"] = {k: round(v, 2) for k, v in measured.items()}
            row[f"{name}_bound_host_us"], row[f"host_x_{name}_bound"] = round(bound, 1), round(row["host_us_per_step"] / bound, 3)
            lines.append(f"(plan, verify and write {how}, CPU us: " + ", ".join(f"{k} {v:.1f}" for k, v in measured.items())
                         + f"; the step's ops at these figures {bound:.1f} us, host x that {row[f'host_x_{name}_bound']:.2f})")
    if row["bound_host_us"] and row["kernel_us_per_step"]:
        # Eager calls finish no earlier than the host has launched them: with launches slower than
        # the kernels the GPU waits on the host, so the event window is at least the launch span.
        floor = row["launch_floor_x_kernel"] = round(row["bound_host_us"] / row["kernel_us_per_step"], 3)
        lines.append(f"(event floor of eager calls: the step's ops launched at the bound per-op host figures take "
                     f"{row['bound_host_us']:.1f} us = {floor:.2f}x the kernel time, the GPU waiting on the host between "
                     "kernels; event / kernel <= 2 needs the step's launches cheaper than the bound path's, as a "
                     "replayed graph of the step)")
    return lines
