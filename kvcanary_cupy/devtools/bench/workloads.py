"""The benchmark's workloads (batches of a serving engine) and its reference timings and targets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import kvcanary_cupy as kc


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
