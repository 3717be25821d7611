"""The ``cold`` section: seconds to the first plan, verify and write, and of warmup().

Each figure comes from a fresh process (so CuPy's in-memory cache is empty), first with an empty
kernel disk cache (``CUPY_CACHE_DIR`` pointed at a new folder), then again with the cache that run
filled (warm).  The targets and the figures before kernels compiled one instantiation at a time
(H200, 2026-12-01) are printed beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

TARGETS_S = {"import": None, "plan": 2.0, "verify": 2.0, "write": 2.0, "warmup": 20.0}
H200_BEFORE_S = {"import": 0.38, "plan": 14.4, "verify": 4.5, "write": 5.3, "warmup": 114.0}

# Run in the child: the W3 workload's first plan, verify and write (each to its end on the GPU),
# then warmup() of every other variant.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import kvcanary_cupy as kc
import cupy
from kvcanary_cupy.devtools import bench as bc
seconds = {"import": time.perf_counter() - t0}
d = bc.build(bc.WORKLOADS["W3"], cupy)
vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["rp"])
wp = kc.WritePlan.allocate(d["bs"], like=d["rp"])
log = kc.ViolationLog.allocate(1024, like=d["rp"])
cupy.cuda.Device().synchronize()
calls = {
    "plan": lambda: kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=d["total_verify"], out=(vp, wp)),
    "verify": lambda: kc.verify(d["canary"], vp, log=log),
    "write": lambda: kc.write(d["canary"], wp, d["ids"], d["pos"], d["loc"], log=log),
    "warmup": kc.warmup,
}
for op, fn in calls.items():
    t0 = time.perf_counter()
    fn()
    cupy.cuda.Device().synchronize()
    seconds[op] = time.perf_counter() - t0
print(json.dumps(seconds))
"""


def _child_seconds(cache_dir: str) -> dict:
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cold_rows(rows: list) -> list:
    with tempfile.TemporaryDirectory(prefix="kvcanary-cold-") as cache_dir:
        cold = _child_seconds(cache_dir)
        warm = _child_seconds(cache_dir)
    lines = ["", "cold start: seconds in a fresh process (W3), empty kernel cache and then warm",
             f"{'step':<8} {'cold s':>8} {'warm s':>8} {'target s':>9} {'x target':>9} {'H200 before s':>14}"]
    for op in TARGETS_S:
        target, before = TARGETS_S[op], H200_BEFORE_S[op]
        ratio = f"{cold[op] / target:>9.2f}" if target else f"{'-':>9}"
        lines.append(f"{op:<8} {cold[op]:>8.2f} {warm[op]:>8.3f} {target or '-':>9} {ratio} {before:>14}")
        rows.append({"section": "cold", "op": op, "cold_s": round(cold[op], 3), "warm_s": round(warm[op], 4),
                     "target_s": target, "h200_before_s": before})
    lines.append("(warmup: every variant the first calls did not compile; the first calls compile only the kernels they launch)")
    return lines
