"""``kvcanary bench --sections holes``: the cost of the hole check (``check_holes``) per step.

At W1 and W3, the verify, the fused plan_and_verify and the bound VerifyLauncher with the check
off (SGLang's rule) and on: device microseconds (a graph of 50 calls) and host microseconds per
eager call on a GPU; wall milliseconds with the NumPy backend.  The step's canary time these are
compared with is its plan + verify + write (both verifies of a session step check holes).
"""

from __future__ import annotations

import statistics
import time

import kvcanary_cupy as kc

HOLE_WORKLOADS = ("W1", "W3")


def hole_ops(d, check_holes: bool) -> dict:
    """The calls whose cost the hole check may change, with ``check_holes``, on the workload ``d``
    (bench.build's): free verify, bound verify, the fused plan + verify."""
    vcap = d["total_verify"]
    vp, wp = kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vcap)
    fused_out = (kc.VerifyPlan.allocate(vcap, like=d["rp"]), kc.WritePlan.allocate(d["bs"], like=d["rp"]))
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    launcher = kc.VerifyLauncher(d["canary"], vp, log=log, check_holes=check_holes)
    ops = {
        "verify": lambda: kc.verify(d["canary"], vp, log=log, check_holes=check_holes),
        "verify[bound]": launcher,
        "plan_and_verify": lambda: kc.plan_and_verify(d["rp"], d["prefix"], d["extend"], d["rtt"], d["canary"], log=log,
                                                      verify_capacity=vcap, out=fused_out, check_holes=check_holes),
    }
    for fn in ops.values():
        fn()
    if int(kc.interop.to_numpy(log.write_index)[0]) != 0:
        raise RuntimeError("the benchmark's canary must verify clean (no hole, no violation)")
    return ops


def hole_rows(workloads: dict, rows: list, *, cupy=None, timers=None) -> list:
    """The table lines (and JSON ``rows``) of the hole check's cost at ``workloads`` (name -> the
    inputs of bench.build); on a GPU (``cupy``), ``timers`` = (device us of a call in a graph, host
    us per eager call), bench's own timers."""
    gpu = cupy is not None
    unit = "device us (graph of 50) / host us (eager)" if gpu else "wall ms (median of 5)"
    lines = [f"hole check (check_holes): {unit}, off -> on, and the ratio on/off",
             f"{'workload':<16} {'op':<16} {'off':>9} {'on':>9} {'on/off':>7}" + (f" {'host off':>9} {'host on':>9}" if gpu else "")]
    for key, (title, d) in workloads.items():
        ops = {flag: hole_ops(d, flag) for flag in (False, True)}
        for op in ops[False]:
            if gpu:
                device_us, host_us = timers
                dev = {flag: device_us(cupy, ops[flag][op]) for flag in (False, True)}
                host = {flag: host_us(cupy, ops[flag][op]) for flag in (False, True)}
            else:
                dev = {flag: _wall_ms(ops[flag][op]) for flag in (False, True)}
                host = None
            row = {"section": "holes", "workload": key, "op": op, "off": round(dev[False], 3), "on": round(dev[True], 3),
                   "ratio": round(dev[True] / dev[False], 3), "unit": "device_us" if gpu else "wall_ms"}
            line = f"{title:<16} {op:<16} {dev[False]:>9.2f} {dev[True]:>9.2f} {dev[True] / dev[False]:>7.3f}"
            if host is not None:
                row.update(host_us_off=round(host[False], 1), host_us_on=round(host[True], 1))
                line += f" {host[False]:>9.1f} {host[True]:>9.1f}"
            rows.append(row)
            lines.append(line)
    return lines


def _wall_ms(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
