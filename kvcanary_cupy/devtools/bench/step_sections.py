"""The ``tables``, ``capacity``, ``step``, ``overlap`` and ``host`` sections."""

from __future__ import annotations

import statistics
import time

import kvcanary_cupy as kc
from .workloads import (BLOCK_SIZE, SGLANG_US, TABLE_REPEAT, WORKLOADS, build, build_paged, check_tables_agree,
                        materialise_block_table, materialise_paged_kv, table_plans)
from .timing import time_eager, time_graph, time_graphs_interleaved
from .ops_sections import baseline_plan, cell, gather_floor_call, gpu_ops, reference_module


def run_tables(cupy, names, rows: list):
    """Plan device time through each engine table (block size 16), and what a vLLM / FlashInfer
    user writes without them: materialise the slot table with vectorised CuPy ops, then plan with
    vectorised CuPy ops (eager)."""
    lines = [f"engine tables, block/page size {BLOCK_SIZE}: plan device us (graph of 50; the tables' replays in turn, "
             "median of 60 each); baseline = materialise the slot table + vectorised plan, eager",
             f"{'workload':<16} {'table':<13} {'device us':>10} {'x req_to_token':>15} {'table MB':>9} {'baseline us':>12} {'x faster':>9}"]
    for key in names:
        d = build_paged(WORKLOADS[key], cupy)
        vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["prefix"])
        wp = kc.WritePlan.allocate(d["bs"], like=d["prefix"])
        check_tables_agree(cupy, d, vp, wp)
        table_bytes = {"req_to_token": d["rtt"].nbytes, "block_table": d["bt"].nbytes,
                       "paged_kv": d["indptr"].nbytes + d["indices"].nbytes}
        baselines = {
            "req_to_token": lambda: baseline_plan(cupy, dict(rp=d["rp_rtt"], prefix=d["prefix"], rtt=d["rtt"], extend=d["extend"])),
            "block_table": lambda: baseline_plan(cupy, dict(rp=d["rp_rtt"], prefix=d["prefix"], extend=d["extend"],
                                                            rtt=materialise_block_table(cupy, d))),
            "paged_kv": lambda: baseline_plan(cupy, dict(rp=d["rp_rtt"], prefix=d["prefix"], extend=d["extend"],
                                                         rtt=materialise_paged_kv(cupy, d))),
        }
        plans = table_plans(d, vp, wp)
        # A second graph of the req_to_token plans, timed in the same turns: how far apart two
        # timings of the same calls come out, beside the tables' differences.
        device_us = time_graphs_interleaved(cupy, {**plans, TABLE_REPEAT: plans["req_to_token"]})
        reference, repeat = device_us["req_to_token"], device_us.pop(TABLE_REPEAT)
        for name, us in device_us.items():
            base = time_eager(cupy, baselines[name])
            rows.append({"workload": key, "op": f"plan[{name}]", "device_us": round(us, 3), "x_req_to_token": round(us / reference, 3),
                         "table_bytes": table_bytes[name], "baseline_us": round(base, 1)})
            lines.append(f"{WORKLOADS[key].name:<16} {name:<13} {us:>10.2f} {us / reference:>15.3f} "
                         f"{table_bytes[name] / 1e6:>9.2f} {base:>12.1f} {base / us:>9.1f}")
        rows.append({"workload": key, "op": f"plan[{TABLE_REPEAT}]", "device_us": round(repeat, 3),
                     "x_req_to_token": round(repeat / reference, 3)})
        lines.append(f"{WORKLOADS[key].name:<16} {TABLE_REPEAT:<13} {repeat:>10.2f} {repeat / reference:>15.3f}")
    lines.append(f"({TABLE_REPEAT}: a second graph of the req_to_token plans, timed in the same turns: the comparison's "
                 "own spread)")
    return lines


def run_capacity(cupy, rows: list, names=("W1", "W3"), capacities=(None, 4096, 65536)):
    """Plan device us against write_req_capacity (None: the batch size): the stale rows past the
    batch are cleared up to the previous batch only, so the cost must not grow with the capacity."""
    lines = ["plan device us vs write_req_capacity (graph of 50 plans of one batch):"]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        row = []
        for cap in capacities:
            cap = cap or d["bs"]
            vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["rp"])
            wp = kc.WritePlan.allocate(cap, like=d["rp"])
            us = time_graph(cupy, lambda: kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vp.capacity, out=(vp, wp)))
            rows.append({"workload": key, "op": "plan", "write_req_capacity": cap, "device_us": round(us, 3)})
            row.append(f"{cap}: {us:.2f}")
        lines.append(f"  {WORKLOADS[key].name:<16} " + ", ".join(row))
    return lines


# Reference kernels for the detail table: the loads of a verify alone (a gather floor that counts
# the DRAM sectors random 32-byte records really cost), and one thread running a chain of mix3.

STEP_TARGET_US = {"W1": 12.0}
STEP_WORKLOADS = ("W1", "W3", "W4", "W5")  # W5: the largest batch of one launch; W4 takes plan + verify


def fused_call(d, log):
    """``(kc.plan_and_verify on fixed plans of its own, those plans)``: out[0] holds entries only
    where the batch is too large for one launch (plan_and_verify then takes plan + verify)."""
    from ...backends.cuda import configs

    vcap = d["total_verify"]
    stored = configs.plan_verify_stores_entries(d["bs"])
    out = (kc.VerifyPlan.allocate(vcap if stored else 0, like=d["rp"]), kc.WritePlan.allocate(d["bs"], like=d["rp"]))
    inputs = (d["rp"], d["prefix"], d["extend"], d["rtt"])

    def fused():
        kc.plan_and_verify(*inputs, d["canary"], log=log, verify_capacity=vcap, out=out)

    return fused, out


def step_calls(cupy, d) -> dict:
    """A decode step's calls on fixed buffers of their own: the plan, plan_and_verify (+ write) and
    plan + verify (+ write); checked to verify clean."""
    ops = gpu_ops(cupy, d)
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    fused, out = fused_call(d, log)

    def fused_step():
        fused()
        kc.write(d["canary"], out[1], d["ids"], d["pos"], d["loc"], log=log)

    def unfused():
        ops["plan"]()
        ops["verify"]()

    def unfused_step():
        unfused()
        ops["write"]()

    fused_step()
    if int(log.write_index[0]) != 0:
        raise RuntimeError("the benchmark's canary must verify clean through plan_and_verify")
    return {"plan": ops["plan"], "plan_and_verify + write": fused_step, "plan + verify + write": unfused_step,
            "plan_and_verify": fused, "plan + verify": unfused}


def step_rows(cupy, names, rows: list):
    """A whole decode step, device us: plan_and_verify + write (2 launches, the verify entries
    never stored) against plan + verify + write (3 launches), and plan_and_verify alone against
    plan + verify; SGLang's plan + verify + write for reference."""
    from ...backends.cuda import configs

    lines = [
        "fused decode step: device us per step (graph of 50 steps); target: W1 plan_and_verify + write <= "
        f"{STEP_TARGET_US['W1']:.0f} us",
        f"{'workload':<16} {'op':<28} {'device us':>10} {'unfused us':>11} {'x unfused':>10} {'x target':>9} {'SGLang us':>10}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        calls = step_calls(cupy, d)
        stored = configs.plan_verify_stores_entries(d["bs"])
        sglang = [SGLANG_US.get((key, op)) for op in ("plan", "verify", "write")]
        sglang = sum(sglang) if None not in sglang else None
        for op, ref, theirs in (("plan_and_verify + write", "plan + verify + write", sglang),
                                ("plan_and_verify", "plan + verify", None)):
            us, ref_us = time_graph(cupy, calls[op]), time_graph(cupy, calls[ref])
            target = STEP_TARGET_US.get(key) if ref == "plan + verify + write" else None
            rows.append({"workload": key, "op": f"step[{op}]", "device_us": round(us, 3), "unfused_us": round(ref_us, 3),
                         "target_us": target, "sglang_us": theirs})
            lines.append(f"{WORKLOADS[key].name:<16} {op:<28} {us:>10.2f} {ref_us:>11.2f} {us / ref_us:>10.2f} "
                         f"{cell(target and us / target, '9.2f')} {cell(theirs, '10.1f')}{' (stored)' if stored else ''}")
    lines.append("(unfused: plan + verify + write, resp. plan + verify; SGLang: its plan + verify + write; stored: past "
                 f"{configs.policy().plan_fused_max_rows:,} requests plan_and_verify stores the entries and takes plan + verify)")
    for key in names:
        if key in STEP_TARGET_US:
            lines += step_parts(cupy, key, rows)
    return lines


def step_parts(cupy, key, rows: list):
    """How close the fused step can come: the parts it cannot do without, each timed alone (graph
    replays in turn): the plan with its expansion cut out (launch, batch scan, per-request outputs),
    the verify's loads alone over the stored entries (gather floor) and the write (its own launch).
    Their sum, before any table lookup, hash or compare of the check, against the target."""
    d = build(WORKLOADS[key], cupy)
    ops = gpu_ops(cupy, d)
    vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["rp"])
    kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vp.capacity,
            out=(vp, kc.WritePlan.allocate(d["bs"], like=d["rp"])))
    gather = gather_floor_call(cupy, reference_module(cupy), d, vp, cupy.zeros(2, cupy.int64))
    parts = time_graphs_interleaved(cupy, {"plan[offsets]": ops["plan[offsets]"], "verify[gather floor]": gather,
                                           "write": ops["write"]})
    total, target = sum(parts.values()), STEP_TARGET_US[key]
    rows.append({"workload": key, "op": "step[parts]", **{f"{k}_us": round(v, 3) for k, v in parts.items()},
                 "sum_us": round(total, 3), "target_us": target})
    return [f"{WORKLOADS[key].name}: the fused step's parts alone: plan[offsets] {parts['plan[offsets]']:.2f} + verify[gather floor] "
            f"{parts['verify[gather floor]']:.2f} + write {parts['write']:.2f} = {total:.2f} us = {total / target:.2f}x the "
            f"{target:.0f} us target before the check's table lookups, hashes and compares (plan[offsets]: the plan without "
            "its expansion; gather floor: the verify's loads alone over stored entries)"]


def overlap_rows(cupy, names, rows: list):
    """Device us with launch overlap (the default on sm_90 and later) against plain CuPy launches
    of the same calls (``launch_overlap.plain_launches``): graphs captured each way, their replays
    taken in turn.  A call's time in a graph of 50 includes what its launch overlaps of the call
    before it, as it would behind an engine's kernels."""
    from ...backends.cuda import launch as launch_overlap

    if not launch_overlap.supported(cupy.cuda.Device().id):
        return [f"launch overlap: off on this device (before sm_90, no cuLaunchKernelEx, or {launch_overlap.LAUNCH_OVERLAP_ENV}=0)"]

    def plain(fn):
        def call():
            with launch_overlap.plain_launches():
                fn()
        return call

    lines = ["launch overlap: device us per call (graph of 50 calls; the two ways' replays in turn, median of 30 each)",
             f"{'workload':<16} {'op':<28} {'overlapped':>10} {'plain':>8} {'x plain':>8} {'saved us':>9}"]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        calls = step_calls(cupy, d)
        times = time_graphs_interleaved(cupy, {**calls, **{f"{op} [plain]": plain(fn) for op, fn in calls.items()}}, rounds=30)
        for op in calls:
            us, plain_us = times[op], times[f"{op} [plain]"]
            rows.append({"workload": key, "op": f"overlap[{op}]", "device_us": round(us, 3), "plain_us": round(plain_us, 3)})
            lines.append(f"{WORKLOADS[key].name:<16} {op:<28} {us:>10.2f} {plain_us:>8.2f} {us / plain_us:>8.2f} "
                         f"{plain_us - us:>9.2f}")
    return lines


# Host time per eager op (issue #10): targets, and SGLang's eager calls measured beside this
# project on an H200 (back-to-back calls / count, one sync at the end), for comparison only.
HOST_TARGET_US = {"cupy": 15.0, "torch": 25.0}
SGLANG_EAGER_US = {
    "W1": {"plan": 63, "write": 19, "verify": 23},
    "W2": {"plan": 59, "write": 1192, "verify": 18},
    "W3": {"plan": 62, "write": 19, "verify": 18},
    "W5": {"plan": 61, "write": 19, "verify": 26},
}


def bound_ops(d):
    """The calls of :func:`gpu_ops` through a CanaryPlanner and bound launchers (buffers bound once)."""
    planner = kc.CanaryPlanner(kc.CanaryCapacities(d["total_verify"], d["bs"]), like=d["rp"])
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    verify = kc.VerifyLauncher(d["canary"], planner.verify_plan, log=log)
    write = kc.WriteLauncher(d["canary"], planner.write_plan, log=log)
    inputs = (d["rp"], d["prefix"], d["extend"], d["rtt"])
    ops = {
        "plan": lambda: planner.plan(*inputs),
        "verify": verify,
        "write": lambda: write(d["ids"], d["pos"], d["loc"]),
    }
    ops["plan"]()
    return ops


def eager_us(cupy, fn, calls=200, runs=5) -> float:
    """Host microseconds per eager call: the median over ``runs`` of ``calls`` back-to-back calls with
    one sync at the end (a call whose device time is longer than its host time shows its device
    time; the median: one run that an interrupt or a busy neighbour slowed moved a row by 50%)."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def host_times(cupy, names, rows: list):
    """Host us per eager op: free function vs planner / bound launcher, CuPy arrays vs CUDA torch tensors."""
    lines = [
        "host us per eager call (median of 5 runs of 200 back-to-back calls / 200, one sync at the end of each; target: bound <= "
        f"{HOST_TARGET_US['cupy']:.0f} us with CuPy arrays, <= {HOST_TARGET_US['torch']:.0f} us with CUDA torch tensors)",
        "(a call whose device time exceeds its host time shows its device time: W2 write, W4 plan and verify)",
        "(plan_and_verify: a free call only, no bound launcher; its free call replays the last one's packed launch)",
        f"{'workload':<16} {'arrays':<6} {'op':<15} {'free us':>8} {'bound us':>9} {'x faster':>9} {'x target':>9} "
        f"{'SGLang eager':>13} {'x SGLang':>9}",
    ]
    frameworks = [("cupy", lambda d: d)]
    try:
        import torch

        frameworks.append(("torch", lambda d: {k: torch.from_dlpack(v) if hasattr(v, "__dlpack__") else v for k, v in d.items()}))
    except ImportError:
        pass
    for key in names:
        for framework, convert in frameworks:
            d = convert(build(WORKLOADS[key], cupy))
            free, bound = gpu_ops(cupy, d), bound_ops(d)
            for op in ("plan", "verify", "write"):
                free_us, bound_us = eager_us(cupy, free[op]), eager_us(cupy, bound[op])
                sglang = SGLANG_EAGER_US.get(key, {}).get(op)
                rows.append({"workload": key, "op": op, "framework": framework, "host_us_free": round(free_us, 1),
                             "host_us_bound": round(bound_us, 1), "host_target_us": HOST_TARGET_US[framework],
                             "sglang_eager_us": sglang})
                lines.append(
                    f"{WORKLOADS[key].name:<16} {framework:<6} {op:<15} {free_us:>8.1f} {bound_us:>9.1f} "
                    f"{free_us / bound_us:>9.1f} {bound_us / HOST_TARGET_US[framework]:>9.2f} "
                    f"{cell(sglang, '13.0f')} {cell(sglang and bound_us / sglang, '9.2f')}"
                )
            free_us = eager_us(cupy, fused_call(d, kc.ViolationLog.allocate(1024, like=d["rp"]))[0])
            rows.append({"workload": key, "op": "plan_and_verify", "framework": framework, "host_us_free": round(free_us, 1),
                         "host_us_bound": None, "host_target_us": HOST_TARGET_US[framework], "sglang_eager_us": None})
            lines.append(f"{WORKLOADS[key].name:<16} {framework:<6} {'plan_and_verify':<15} {free_us:>8.1f} "
                         f"{cell(None, '9.1f')} {cell(None, '9.1f')} {free_us / HOST_TARGET_US[framework]:>9.2f} "
                         f"{cell(None, '13.0f')} {cell(None, '9.2f')}")
    return lines
