"""``kvcanary bench``: plan, verify and write on five serving workloads; prints a table of ratios.

GPU (``--backend cupy``, the default): device time per call = one CUDA graph holding K calls,
replayed R times, median replay / K (METHOD: one replay per event pair measures the host).  The
floor of each op is the bytes it must move over the device-to-device copy bandwidth measured in
the same run; the baseline is the same plan/verify written with vectorised CuPy ops (cumsum,
searchsorted, gathers), eager, as a user would without this library.
CPU (``--backend numpy``): wall-clock median of a few calls of the NumPy backend.

    kvcanary bench [--backend cupy|numpy] [--workloads W1,W2,W3,W4,W5]
                   [--sections ops,detail,tables,capacity,step,overlap,host,holes] [--out FILE] [--json FILE]

``tables`` times the plan through a vLLM block table and a FlashInfer CSR table (block size 16)
next to the equivalent req_to_token at W1, W3 and W4, against what a user writes without them;
``capacity`` times the plan at write_req_capacity = bs, 4,096 and 65,536.  ``step`` times the fused
decode step (plan_and_verify + write) against plan + verify + write at W1, W3, W4 and W5.
``overlap`` times the plan and the steps with launch overlap (sm_90 and later,
``kvcanary_cupy.backends.cuda.launch``) against plain CuPy launches.
``host`` (issue #10): host microseconds per eager call, back to back, of the free functions and of
the bound path (CanaryPlanner, VerifyLauncher, WriteLauncher), with CuPy arrays and with CUDA
torch tensors, against the targets and SGLang's eager calls (``benchmarks/host_profile.py``
profiles the same front door on the CPU).  ``holes`` (issue #27): the verify, the bound verify
and plan_and_verify with ``check_holes`` off and on at W1 and W3 (``devtools/bench_holes.py``; with
``--backend numpy`` too).  ``benchmarks/bench_canary.py`` runs the same from a source checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.hashing import ANCHOR_HASH
from kvcanary_cupy.interop import cuda_unavailable_reason
from kvcanary_cupy.devtools.bench_holes import HOLE_WORKLOADS, hole_rows

# SGLang's kernels beside this project on the same H200 (one run, 2026-11-30), device us per call.
SGLANG_US = {
    ("W1", "plan"): 20.0, ("W1", "write"): 2.9, ("W1", "verify"): 22.0,
    ("W2", "plan"): 13.2, ("W2", "write"): 1192.0, ("W2", "verify"): 3.4,
    ("W3", "plan"): 13.1, ("W3", "write"): 2.9, ("W3", "verify"): 3.4,
    ("W4", "write"): 18.3, ("W4", "verify"): 135.6,
    ("W5", "plan"): 56.5,  # its kernels on this project's plan (its plan stops at 4,096)
}
LEGACY_BLOCKS_PER_SM = 8  # what the persistent grids assumed before they were sized by occupancy


@dataclass
class Workload:
    name: str
    bs: int
    prefix_lo: int
    prefix_hi: int  # exclusive
    new_tokens: int


WORKLOADS = {
    "W1": Workload("W1 decode", 256, 1024, 3072, 1),
    "W2": Workload("W2 prefill", 8, 0, 4096, 4096),
    "W3": Workload("W3 small decode", 32, 512, 513, 1),
    "W4": Workload("W4 wide batch", 20000, 16, 256, 1),
    "W5": Workload("W5 4k batch", 4096, 16, 256, 1),
}
# Plan device-time targets of issue #10, us (W4's: 1.15x its floor + one launch, computed per run).
PLAN_TARGET_US = {"W1": 8.0, "W2": 2.5, "W3": 2.5, "W5": 10.0}
PLAN_TARGET_X_FLOOR = 1.15


def build(w: Workload, xp, seed=0):
    """Inputs of one step on a pool whose slots are a random permutation (realistic scatter)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(w.prefix_lo, w.prefix_hi, w.bs).astype(np.int64)
    cols = int(prefix.max()) + w.new_tokens
    rows = w.bs + 1
    need = int((prefix + w.new_tokens).sum())
    slots = rng.permutation(np.arange(1, need + 1))
    rtt = np.zeros((rows, cols), np.int32)
    cursor = 0
    for r in range(w.bs):
        n = int(prefix[r]) + w.new_tokens
        rtt[r + 1, :n] = slots[cursor:cursor + n]
        cursor += n
    rp = np.arange(1, w.bs + 1, dtype=np.int64)
    extend = np.full(w.bs, w.new_tokens, np.int64)
    pos = np.concatenate([prefix[r] + np.arange(w.new_tokens) for r in range(w.bs)]).astype(np.int64)
    loc = np.concatenate([rtt[r + 1, prefix[r]:prefix[r] + w.new_tokens] for r in range(w.bs)]).astype(np.int64)
    ids = rng.integers(0, 32000, loc.size).astype(np.int64)
    # The canary of the prefixes, stamped as earlier steps would have (so verify finds nothing).
    canary = np.zeros((need + 1, 4), np.int64)
    pre_prefix = np.zeros(w.bs, np.int64)
    vp, wp = kc.plan(rp, pre_prefix, prefix, rtt, verify_capacity=0)
    pre_pos = np.concatenate([np.arange(p) for p in prefix]).astype(np.int64)
    pre_loc = np.concatenate([rtt[r + 1, :prefix[r]] for r in range(w.bs)]).astype(np.int64)
    log = kc.ViolationLog.allocate(16)
    kc.write(canary, wp, rng.integers(0, 32000, pre_loc.size).astype(np.int64), pre_pos, pre_loc, log=log)
    a = xp.asarray
    return dict(rp=a(rp), prefix=a(prefix), extend=a(extend), rtt=a(rtt), ids=a(ids), pos=a(pos), loc=a(loc),
                canary=a(canary), total_verify=int(prefix.sum()), bs=w.bs, tokens=int(loc.size))


def op_bytes(d) -> dict:
    """Fewest bytes each op must move through device memory (each input once, each output once)."""
    v, bs, t = d["total_verify"], d["bs"], d["tokens"]
    return {
        # rp, prefix, extend read; req_to_token read once per entry; 4 int64 written per entry; per-request outputs.
        "plan": bs * 3 * 8 + v * 4 + v * 4 * 8 + bs * (8 * 3),
        # slot, position, prev read per entry; each slot's 32-byte record read once.
        "verify": v * (3 * 8 + 32),
        # per token: id, pos, loc read, record written; per request: offsets, seed, seed record.
        "write": t * (3 * 8 + 32) + bs * (2 * 8 + 32),
        # the batch scan: rp, prefix, extend read; verify/write offsets and seed written.
        "plan[offsets]": bs * 6 * 8,
    }


def _capture(cupy, stream, fn, k):
    """A graph of ``k`` calls of ``fn`` on ``stream``, warmed up by one replay."""
    fn()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(k):
        fn()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return graph


def _replay_us(cupy, stream, graph, k) -> float:
    """Device microseconds of one of a graph's ``k`` calls, from one replay between two events."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1000 / k


def time_graph(cupy, fn, k=50, replays=20) -> float:
    """Median device microseconds of one ``fn()`` from a graph of ``k`` calls."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graph = _capture(cupy, stream, fn, k)
        return statistics.median(_replay_us(cupy, stream, graph, k) for _ in range(replays))


def time_graphs_interleaved(cupy, fns: dict, k=50, rounds=60) -> dict:
    """Median device microseconds of one call of each of ``fns`` (name -> fn), each from a graph of
    ``k`` calls, their replays taken in turn: the GPU's clock and temperature drift over a run, so
    variants compared with each other are timed side by side, not one after another.  Every call
    must leave the same state (the replays of one variant follow another's)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graphs = {name: _capture(cupy, stream, fn, k) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, graph in graphs.items():
                times[name].append(_replay_us(cupy, stream, graph, k))
    return {name: statistics.median(t) for name, t in times.items()}


def time_eager(cupy, fn, reps=20) -> float:
    """Median microseconds of an eager ``fn()`` (host syncs included: that is how it runs)."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(cupy) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 1 << 30
    a = cupy.ones(n, cupy.uint8)
    b = cupy.empty_like(a)
    us = time_graph(cupy, lambda: cupy.copyto(b, a), k=5, replays=10)
    return 2 * n / (us * 1e-6)


def baseline_plan(cupy, d):
    """The plan as vectorised CuPy ops: cumsum, a host read of the total, searchsorted, gathers."""
    rp, prefix, rtt = d["rp"], d["prefix"], d["rtt"]
    vlen = cupy.where(rp != 0, prefix, 0)
    incl = cupy.cumsum(vlen)
    total = int(incl[-1])
    t = cupy.arange(total)
    owner = cupy.searchsorted(incl, t, side="right")
    pos = t - (incl[owner] - vlen[owner])
    row = rp[owner]
    slot = rtt[row, pos].astype(cupy.int64)
    prev = cupy.where(pos > 0, rtt[row, cupy.maximum(pos - 1, 0)], -1).astype(cupy.int64)
    woff = cupy.concatenate([cupy.zeros(1, cupy.int64), cupy.cumsum(d["extend"])])
    seed = rtt[rp, cupy.maximum(prefix - 1, 0)]
    return slot, prev, pos, woff, seed


def baseline_verify(cupy, canary, slot, prev, pos):
    """The verify as vectorised CuPy ops (uint64 SplitMix64 elementwise), rows via nonzero."""
    def sm(x):
        x = x ^ (x >> 30); x = x * cupy.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> 27); x = x * cupy.uint64(0x94D049BB133111EB)
        return x ^ (x >> 31)
    u = canary.view(cupy.uint64)
    rec, pr = u[slot], u[cupy.maximum(prev, 0)]
    expected = cupy.where(prev < 0, cupy.uint64(ANCHOR_HASH), sm(sm(sm(pr[:, 2]) ^ pr[:, 0]) ^ pr[:, 1]))
    bits = (rec[:, 2] != expected).astype(cupy.int64) | ((canary[slot, 1] != pos).astype(cupy.int64) << 1)
    return cupy.nonzero(bits)[0]


def gpu_ops(cupy, d):
    """The timed calls of one workload, on fixed buffers (plan[offsets]: the batch scan alone,
    as a plan into a zero-capacity VerifyPlan expands no entry)."""
    vcap = d["total_verify"]
    vp = kc.VerifyPlan.allocate(vcap, like=d["rp"])
    vp_empty = kc.VerifyPlan.allocate(0, like=d["rp"])
    wp = kc.WritePlan.allocate(d["bs"], like=d["rp"])
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    inputs = (d["rp"], d["prefix"], d["extend"], d["rtt"])
    ops = {
        "plan": lambda: kc.plan(*inputs, verify_capacity=vcap, out=(vp, wp)),
        "plan[offsets]": lambda: kc.plan(*inputs, verify_capacity=0, out=(vp_empty, wp)),
        "verify": lambda: kc.verify(d["canary"], vp, log=log),
        "write": lambda: kc.write(d["canary"], wp, d["ids"], d["pos"], d["loc"], log=log),
    }
    ops["plan"]()
    ops["verify"]()
    if int(log.write_index[0]) != 0:
        raise RuntimeError("the benchmark's canary must verify clean")
    return ops


def _cell(value, fmt):
    """``format(value, fmt)``, or a dash of the same width for a missing value."""
    return format(value, fmt) if value is not None else "-".rjust(int(fmt.split(".")[0]))


def run_gpu(names, rows: list):
    import cupy

    kc.warmup()
    bw = copy_bandwidth(cupy)
    tiny = cupy.zeros(1, cupy.int32)
    one_launch = time_graph(cupy, lambda: tiny.fill(0))
    rows.append({"copy_bandwidth_tb_s": round(bw / 1e12, 3), "one_launch_us": round(one_launch, 3)})
    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write); one tiny kernel in a graph {one_launch:.2f} us",
        f"{'workload':<16} {'op':<13} {'device us':>10} {'us-1launch':>10} {'MB moved':>9} {'floor us':>9} "
        f"{'x(floor+launch)':>15} {'GB/s':>7} {'baseline us':>12} {'x faster':>9} {'SGLang us':>10}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        bytes_ = op_bytes(d)
        baselines = {"plan": time_eager(cupy, lambda: baseline_plan(cupy, d))}
        slot, prev, pos, _, _ = baseline_plan(cupy, d)
        baselines["verify"] = time_eager(cupy, lambda: baseline_verify(cupy, d["canary"], slot, prev, pos))
        for op, fn in gpu_ops(cupy, d).items():
            us = time_graph(cupy, fn)
            floor = bytes_[op] / bw * 1e6
            base = baselines.get(op)
            sglang = SGLANG_US.get((key, op))
            rows.append({"workload": key, "op": op, "device_us": round(us, 3), "bytes": bytes_[op],
                         "floor_us": round(floor, 3), "x_floor_plus_launch": round(us / (floor + one_launch), 3),
                         "baseline_us": base and round(base, 1), "sglang_us": sglang})
            lines.append(
                f"{WORKLOADS[key].name:<16} {op:<13} {us:>10.2f} {us - one_launch:>10.2f} {bytes_[op] / 1e6:>9.2f} "
                f"{floor:>9.2f} {us / (floor + one_launch):>15.2f} {bytes_[op] / (us * 1e-6) / 1e9:>7.0f} "
                f"{_cell(base, '12.1f')} {_cell(base and base / us, '9.1f')} {_cell(sglang, '10.1f')}"
            )
    lines.append("plan against its target (issue #10): " + ", ".join(
        f"{key} {r['device_us']:.2f} / {target:.2f} us = {r['device_us'] / target:.2f}x"
        for key in names for r in rows if r.get("workload") == key and r.get("op") == "plan"
        for target in [PLAN_TARGET_US.get(key) or PLAN_TARGET_X_FLOOR * (r["floor_us"] + one_launch)]))
    return lines


# ---- engine tables --------------------------------------------------------------------------------

BLOCK_SIZE = 16
TABLE_WORKLOADS = ("W1", "W3", "W4")
TABLE_REPEAT = "req_to_token'"


def build_paged(w: Workload, xp, block_size=BLOCK_SIZE, seed=0):
    """A step over KV pages of ``block_size`` slots in a permuted pool, three ways: a vLLM block
    table (rows 0..bs-1), FlashInfer's CSR page table, and the equivalent req_to_token (rows 1..bs)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(w.prefix_lo, w.prefix_hi, w.bs).astype(np.int64)
    pages = -(-(prefix + w.new_tokens) // block_size)
    ids = rng.permutation(np.arange(1, int(pages.sum()) + 1)).astype(np.int32)  # page 0: vLLM's null block
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    width = int(pages.max())
    bt = np.zeros((w.bs, width), np.int32)
    for r in range(w.bs):
        bt[r, :pages[r]] = ids[indptr[r]:indptr[r + 1]]
    pos = np.arange(width * block_size)
    rtt = np.zeros((w.bs + 1, width * block_size), np.int32)
    rtt[1:] = np.where(bt[:, pos // block_size] == 0, 0, bt[:, pos // block_size] * block_size + pos % block_size)
    a = xp.asarray
    return dict(prefix=a(prefix), extend=a(np.full(w.bs, w.new_tokens, np.int64)), bt=a(bt), indptr=a(indptr),
                indices=a(ids), rtt=a(rtt), rp_rtt=a(np.arange(1, w.bs + 1, dtype=np.int64)),
                rp_bt=a(np.arange(w.bs, dtype=np.int64)), total_verify=int(prefix.sum()), bs=w.bs, width=width)


def materialise_block_table(xp, d, block_size=BLOCK_SIZE):
    """What a vLLM user writes without kv-canary's tables: the per-token slot table of the block
    table, with vectorised ops (padding row 0 on top, the null block mapped to slot 0)."""
    pos = xp.arange(d["bt"].shape[1] * block_size)
    blocks = d["bt"][:, pos // block_size]
    slots = xp.where(blocks == 0, 0, blocks * block_size + pos % block_size).astype(xp.int32)
    return xp.concatenate([xp.zeros((1, slots.shape[1]), xp.int32), slots])


def materialise_paged_kv(xp, d, page_size=BLOCK_SIZE):
    """The same for a CSR page table: each request's pages, padded to the longest request."""
    indptr, indices = d["indptr"].astype(xp.int64), d["indices"]
    pos = xp.arange(d["width"] * page_size)
    col = indptr[:-1, None] + pos[None, :] // page_size
    inside = col < indptr[1:, None]
    slots = xp.where(inside, indices[xp.minimum(col, indices.shape[0] - 1)] * page_size + pos % page_size, 0)
    return xp.concatenate([xp.zeros((1, slots.shape[1]), xp.int32), slots.astype(xp.int32)])


def table_plans(d, vp, wp):
    """The plan through each table of :func:`build_paged`, into the same buffers."""
    kw = dict(verify_capacity=vp.capacity, out=(vp, wp))
    return {
        "req_to_token": lambda: kc.plan(d["rp_rtt"], d["prefix"], d["extend"], d["rtt"], **kw),
        "block_table": lambda: kc.plan(d["rp_bt"], d["prefix"], d["extend"], kc.BlockTable(d["bt"], BLOCK_SIZE), **kw),
        "paged_kv": lambda: kc.plan(None, d["prefix"], d["extend"], kc.PagedKvIndices(d["indptr"], d["indices"], BLOCK_SIZE), **kw),
    }


def check_tables_agree(xp, d, vp, wp):
    """Every table plans the same bytes, and the materialisations equal the equivalent req_to_token."""
    plans = table_plans(d, vp, wp)
    first = None
    for name, fn in plans.items():
        fn()
        got = {k: np.asarray(v.get() if hasattr(v, "get") else v).copy() for k, v in {**vp.arrays(), **wp.arrays()}.items()}
        got["out_of_range_count"] = None
        if first is None:
            first = got
        elif any(not np.array_equal(got[k], first[k]) for k in got if got[k] is not None):
            raise RuntimeError(f"the plan through {name} differs from the plan through req_to_token")
    for fn in (materialise_block_table, materialise_paged_kv):
        if not bool((fn(xp, d) == d["rtt"]).all()):
            raise RuntimeError(f"{fn.__name__} does not give the equivalent req_to_token")


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
REFERENCE_KERNELS = r"""
extern "C" __global__ void gather_floor(const long long* canary, const long long* slots, const long long* pos,
                                        const long long* prev, long long n, long long* out) {
  long long acc = 0;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
    const longlong2* r = reinterpret_cast<const longlong2*>(canary + 4 * slots[e]);
    const longlong2 a = r[0], b = r[1];
    acc ^= a.x ^ a.y ^ b.x ^ b.y ^ pos[e] ^ prev[e];
  }
  if (acc == 0x123456789abcdefLL) out[0] = acc;  // keeps the loads
}

extern "C" __global__ void chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash;
  for (long long i = 0; i < n; ++i) h = kvcanary::mix3(h, i, i);
  out[0] = h;
}

// As chain_floor, but its start value comes from memory, so the chain runs on the per-lane pipes
// as a warp's chain over loaded tokens must (chain_floor's inputs are all constants: the compiler
// runs it once per warp on the uniform datapath, whose 64-bit multiplies are faster).
extern "C" __global__ void lane_chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash ^ out[1];
  for (long long i = 0; i < n; ++i) h = kvcanary::mix3(h, i, i);
  out[0] = h;
}

extern "C" __global__ void two_chain_floor(long long n, unsigned long long* out) {
  unsigned long long h = kvcanary::kAnchorHash, g = ~h;
  for (long long i = 0; i < n; ++i) {
    h = kvcanary::mix3(h, i, i);
    g = kvcanary::mix3(g, i, i);
  }
  out[0] = h ^ g;
}
"""


def _legacy_grids():
    """The persistent grids back at 8 blocks per SM (the launches read the policy at call time)."""
    from ..backends.cuda import configs

    return configs.overridden(resident_blocks=LEGACY_BLOCKS_PER_SM)


def detail_rows(cupy, names, rows: list):
    """verify and write in detail: grids sized by occupancy against 8 blocks per SM, a verify in
    which every entry fails, two buffers in one launch, and the floors of the gather and the chain."""
    from ..backends.cuda import compile as cuda_compile, configs

    module = cupy.RawModule(code=cuda_compile._read("canary_common.cuh") + REFERENCE_KERNELS, options=cuda_compile.NVRTC_OPTIONS)
    gather, chain = module.get_function("gather_floor"), module.get_function("chain_floor")
    two_chains, lane_chain = module.get_function("two_chain_floor"), module.get_function("lane_chain_floor")
    out = cupy.zeros(2, cupy.int64)
    lines = [
        "detail: ratio = device us / the 'against' row's device us (targets: all-fail verify <= 1.3x clean, "
        "two buffers <= 1.1x one at W2 write, decode write W4 <= 4 us, W2 write <= 400 us per buffer)",
        f"{'workload':<16} {'op':<26} {'device us':>10} {'against':<24} {'ratio':>6} {'SGLang us':>10}",
    ]
    for key in names:
        d = build(WORKLOADS[key], cupy)
        ops = gpu_ops(cupy, d)
        vp = kc.VerifyPlan.allocate(d["total_verify"], like=d["rp"])
        wp = kc.WritePlan.allocate(d["bs"], like=d["rp"])
        kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vp.capacity, out=(vp, wp))
        log = kc.ViolationLog.allocate(1024, like=d["rp"])
        bad = d["canary"].copy()
        bad[:, 1] += 1  # every record's position is wrong: every entry fails
        second = d["canary"].copy()
        n = d["total_verify"]
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        timed = {
            "verify": ops["verify"],
            "verify[grid 8/SM]": ("legacy", ops["verify"]),
            "verify[all entries fail]": lambda: kc.verify(bad, vp, log=log),
            "verify[2 buffers]": lambda: kc.verify([d["canary"], second], vp, log=log, kernel_kind=[0, 1]),
            "verify[gather floor]": lambda: gather((sms * 8,), (256,), (d["canary"], vp.verify_slot_indices,
                                                                     vp.verify_expected_positions,
                                                                     vp.verify_prev_slot_indices, np.int64(n), out)),
            "write": ops["write"],
            "write[grid 8/SM]": ("legacy", ops["write"]),
            "write[2 buffers]": lambda: kc.write([d["canary"], second], wp, d["ids"], d["pos"], d["loc"], log=log,
                                                 kernel_kind=[0, 1]),
        }
        if d["tokens"] > d["bs"]:  # a prefill: the serial chain of one request bounds the write
            per_request = np.int64(d["tokens"] // d["bs"])
            timed["write[chain floor]"] = lambda: chain((1,), (1,), (per_request, out))
            timed["write[lane chain floor]"] = lambda: lane_chain((1,), (1,), (per_request, out))
            timed["write[2-chain floor]"] = lambda: two_chains((1,), (1,), (per_request, out))
        if d["bs"] > configs.policy().plan_fused_max_rows:
            timed["plan"] = ops["plan"]
            timed["plan[grid 8/SM]"] = ("legacy", ops["plan"])
        against = {"verify[grid 8/SM]": "verify", "verify[all entries fail]": "verify", "verify[2 buffers]": "verify",
                   "verify": "verify[gather floor]", "write[grid 8/SM]": "write", "write[2 buffers]": "write",
                   "write": "write[lane chain floor]", "write[lane chain floor]": "write[chain floor]",
                   "write[2-chain floor]": "write[chain floor]",
                   "plan[grid 8/SM]": "plan"}
        times = {}
        for op, fn in timed.items():
            if isinstance(fn, tuple):
                with _legacy_grids():
                    times[op] = time_graph(cupy, fn[1])
            else:
                times[op] = time_graph(cupy, fn)
        for op, us in times.items():
            ref = against.get(op)
            ratio = us / times[ref] if ref in times else None
            rows.append({"workload": key, "op": op, "device_us": round(us, 3), "against": ref,
                         "ratio": ratio and round(ratio, 3), "sglang_us": SGLANG_US.get((key, op))})
            lines.append(f"{WORKLOADS[key].name:<16} {op:<26} {us:>10.2f} {ref or '-':<24} {_cell(ratio, '6.2f')} "
                         f"{_cell(SGLANG_US.get((key, op)), '10.1f')}")
    lines.append("(chain floor: one thread hashing a request's tokens as a serial mix3 chain of registers, all constants "
                 "but the count, which the compiler runs on the uniform datapath; lane chain floor: the same chain from a "
                 "loaded start value, on the per-lane pipes as a warp hashing loaded tokens must; 2-chain floor: one "
                 "thread hashing two chains interleaved; gather floor: the verify's loads alone)")
    return lines


# The fused decode step (issue #10 target 5): a whole W1 step in <= 12 us of device time.
STEP_TARGET_US = {"W1": 12.0}
STEP_WORKLOADS = ("W1", "W3", "W4", "W5")  # W5: the largest batch of one launch; W4 takes plan + verify


def step_calls(cupy, d) -> dict:
    """A decode step's calls on fixed buffers of their own: the plan, plan_and_verify (+ write) and
    plan + verify (+ write); checked to verify clean."""
    from ..backends.cuda import configs

    ops = gpu_ops(cupy, d)
    vcap = d["total_verify"]
    log = kc.ViolationLog.allocate(1024, like=d["rp"])
    stored = configs.plan_verify_stores_entries(d["bs"])  # plan_and_verify takes plan + verify
    out = (kc.VerifyPlan.allocate(vcap if stored else 0, like=d["rp"]), kc.WritePlan.allocate(d["bs"], like=d["rp"]))
    inputs = (d["rp"], d["prefix"], d["extend"], d["rtt"])

    def fused():
        kc.plan_and_verify(*inputs, d["canary"], log=log, verify_capacity=vcap, out=out)

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
    from ..backends.cuda import configs

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
                         f"{_cell(target and us / target, '9.2f')} {_cell(theirs, '10.1f')}{' (stored)' if stored else ''}")
    lines.append("(unfused: plan + verify + write, resp. plan + verify; SGLang: its plan + verify + write; stored: past "
                 f"{configs.policy().plan_fused_max_rows:,} requests plan_and_verify stores the entries and takes plan + verify)")
    return lines


def overlap_rows(cupy, names, rows: list):
    """Device us with launch overlap (the default on sm_90 and later) against plain CuPy launches
    of the same calls (``launch_overlap.plain_launches``): graphs captured each way, their replays
    taken in turn.  A call's time in a graph of 50 includes what its launch overlaps of the call
    before it, as it would behind an engine's kernels."""
    from ..backends.cuda import launch as launch_overlap

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


def eager_us(cupy, fn, calls=200) -> float:
    """Host microseconds per eager call: ``calls`` back-to-back calls, one sync at the end (a call
    whose device time is longer than its host time shows its device time)."""
    fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def host_times(cupy, names, rows: list):
    """Host us per eager op: free function vs planner / bound launcher, CuPy arrays vs CUDA torch tensors."""
    lines = [
        "host us per eager call (200 back-to-back calls / 200, one sync at the end; target: bound <= "
        f"{HOST_TARGET_US['cupy']:.0f} us with CuPy arrays, <= {HOST_TARGET_US['torch']:.0f} us with CUDA torch tensors)",
        "(a call whose device time exceeds its host time shows its device time: W2 write, W4 plan and verify)",
        f"{'workload':<16} {'arrays':<6} {'op':<7} {'free us':>8} {'bound us':>9} {'x faster':>9} {'x target':>9} "
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
                    f"{WORKLOADS[key].name:<16} {framework:<6} {op:<7} {free_us:>8.1f} {bound_us:>9.1f} "
                    f"{free_us / bound_us:>9.1f} {bound_us / HOST_TARGET_US[framework]:>9.2f} "
                    f"{_cell(sglang, '13.0f')} {_cell(sglang and bound_us / sglang, '9.2f')}"
                )
    return lines


def run_numpy(names, rows: list):
    lines = [f"{'workload':<16} {'op':<7} {'wall ms (median of 5)':>22} {'verify entries':>15}"]
    for key in names:
        d = build(WORKLOADS[key], np)
        for op, fn in numpy_ops(d).items():
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(times)
            rows.append({"workload": key, "op": op, "wall_ms": round(ms, 2), "verify_entries": d["total_verify"]})
            lines.append(f"{WORKLOADS[key].name:<16} {op:<7} {ms:>22.1f} {d['total_verify']:>15}")
    return lines


def numpy_ops(d):
    vcap = d["total_verify"]
    vp, wp = kc.VerifyPlan.allocate(vcap), kc.WritePlan.allocate(d["bs"])
    log = kc.ViolationLog.allocate(1024)
    return {
        "plan": lambda: kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=vcap, out=(vp, wp)),
        "verify": lambda: kc.verify(d["canary"], vp, log=log),
        "write": lambda: kc.write(d["canary"], wp, d["ids"], d["pos"], d["loc"], log=log),
    }


def _hole_workloads(names, xp) -> dict:
    """name -> (title, inputs) of the workloads of ``names`` the holes section times."""
    return {n: (WORKLOADS[n].name, build(WORKLOADS[n], xp)) for n in names if n in HOLE_WORKLOADS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["cupy", "numpy"], default="cupy",
                        help="cupy: this machine's GPU; numpy: the CPU backend")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--sections", default="ops,detail,tables,capacity,step,overlap,host,holes",
                        help="GPU sections: ops (plan/verify/write), detail (verify/write: grids, floors, several "
                             "buffers), tables (engine tables), capacity, step (the fused decode step), overlap "
                             "(overlapped launches against plain ones), host, holes (the hole check's cost, "
                             "also with --backend numpy)")
    parser.add_argument("--out", metavar="FILE", help="also write the table to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the measurements as JSON to FILE")


def run(args) -> int:
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"kvcanary bench: unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    rows: list = []
    if args.backend == "cupy":
        reason = cuda_unavailable_reason()
        if reason:
            print(f"kvcanary bench: {reason} (or run --backend numpy)", file=sys.stderr)
            return 2
        import cupy

        sections = args.sections.split(",")
        lines = run_gpu(names, rows) if "ops" in sections else []
        if "detail" in sections:
            lines += detail_rows(cupy, names, rows)
        if "tables" in sections:
            lines += run_tables(cupy, [n for n in names if n in TABLE_WORKLOADS], rows)
        if "capacity" in sections:
            lines += run_capacity(cupy, rows)
        if "step" in sections:
            lines += step_rows(cupy, [n for n in names if n in STEP_WORKLOADS], rows)
        if "overlap" in sections:
            lines += overlap_rows(cupy, [n for n in names if n in STEP_WORKLOADS], rows)
        if "host" in sections:
            lines += host_times(cupy, names, rows)
        if "holes" in sections:
            lines += hole_rows(_hole_workloads(names, cupy), rows, cupy=cupy, timers=(time_graph, eager_us))
    else:
        lines = run_numpy(names, rows)
        if "holes" in args.sections.split(","):
            lines += hole_rows(_hole_workloads(names, np), rows)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "workloads": names, "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvcanary bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
