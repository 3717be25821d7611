"""``kvcanary bench --sections coverage``: what the checks past the record cost per session step.

A CanarySession step (pre_forward + post_forward) at W1 and W3, on a KV pool of ``LAYERS`` layers of
``HEADS`` x ``HEAD_DIM`` 2-byte elements (K and V), with SGLang's coverage (layer 0's K and V
fingerprinted, PARTIAL) and with each check of :mod:`kvcanary_cupy.coverage` added: device us per
step from a graph of 50 steps, host us per eager step, and each one's share of the plain step.
The deep checks read every byte of every layer of each written slot and of ``DEEP_CHECK_SLOTS``
rotated slots, so their cost scales with the model's bytes per token (printed).
"""

from __future__ import annotations

import kvcanary_cupy as kc

from .step_sections import eager_us
from .timing import time_graphs_interleaved
from .workloads import WORKLOADS, build

LAYERS, HEADS, HEAD_DIM = 4, 8, 128
DEEP_CHECK_SLOTS = 256
COVERAGE_WORKLOADS = ("W1", "W3")
CONFIGS = {
    "canary (SGLang coverage)": {},
    "+ lost stores (layer 0, PARTIAL)": dict(check_lost_stores=True),
    "+ deep (every layer)": dict(deep=True),
    "+ deep + lost stores (every layer)": dict(deep=True, check_lost_stores=True),
}


def session(d, pool, *, deep=False, check_lost_stores=False):
    """A session on workload ``d``'s pool with its prefixes stamped (it verifies clean)."""
    num_slots = d["canary"].shape[0]
    every = tuple(kc.RealKvSource(pool[l, h], 1, pool.shape[3] * 2, pool.shape[3] * 2)
                  for l in range(pool.shape[0]) for h in (0, 1))
    s = kc.CanarySession(num_slots, max_batch_size=d["bs"], verify_capacity=d["total_verify"], like=d["rp"],
                         on_violation="ignore", overlap_head_write=False, real_kv_sources=every[:2],
                         real_kv_hash_mode=kc.RealKvHashMode.PARTIAL, deep_kv_sources=every if deep else (),
                         deep_check_slots=DEEP_CHECK_SLOTS if deep else None, check_lost_stores=check_lost_stores,
                         max_step_tokens=d["tokens"] if check_lost_stores else None)
    s.head_canary[...] = d["canary"]
    s.tail_canary[:, :4] = d["canary"]
    if deep:
        s.tail_canary[1:, 4] = 1  # the deep fingerprint of all-zero KV: every rotated slot is re-fingerprinted
    return s


def warmed_step(s, d):
    """The session's step on ``d``'s inputs, run once (the written slots' TAIL records then match
    what every later step writes, so the lost-store check finds the same records) and the log reset."""
    def step():
        s.pre_forward(d["rp"], d["prefix"], d["extend"], d["rtt"], d["ids"], d["pos"], d["loc"])
        s.post_forward()

    step()
    s.log.reset()
    return step


def coverage_rows(cupy, names, rows: list):
    lines = [
        f"coverage past the record: a session step (pre_forward + post_forward), {LAYERS} layers x {HEADS} heads x "
        f"{HEAD_DIM} x 2 bytes = {2 * LAYERS * HEADS * HEAD_DIM * 2:,} KV bytes per token, deep rotation "
        f"{DEEP_CHECK_SLOTS} slots a step; target: each check <= 10% of the plain step",
        f"{'workload':<16} {'session':<36} {'device us':>10} {'+ us':>8} {'share':>7} {'host us':>9} {'+ us':>8} {'share':>7}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        pool = cupy.zeros((LAYERS, 2, d["canary"].shape[0], HEADS * HEAD_DIM), cupy.float16)
        steps = {}
        for label, options in CONFIGS.items():
            s = session(d, pool, **options)
            steps[label] = (s, warmed_step(s, d))
        device = time_graphs_interleaved(cupy, {label: step for label, (_, step) in steps.items()})
        host = {label: eager_us(cupy, step, calls=100) for label, (_, step) in steps.items()}
        for label, (s, _) in steps.items():
            if int(s.log.violation_counters.sum()):
                raise RuntimeError(f"the coverage benchmark's session {label!r} must run clean")
        base = next(iter(CONFIGS))
        for label in CONFIGS:
            dd, dh = device[label] - device[base], host[label] - host[base]
            rows.append({"workload": key, "op": f"coverage[{label}]", "device_us": round(device[label], 3),
                         "host_us": round(host[label], 3), "device_share": round(dd / device[base], 4),
                         "host_share": round(dh / host[base], 4)})
            lines.append(f"{WORKLOADS[key].name:<16} {label:<36} {device[label]:>10.2f} {dd:>8.2f} {dd / device[base]:>7.1%} "
                         f"{host[label]:>9.2f} {dh:>8.2f} {dh / host[base]:>7.1%}")
        del steps, pool
    return lines
