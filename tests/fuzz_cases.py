"""Random canary steps, valid and not, run on any array backend and compared byte for byte.

``make_case(seed)`` draws two serving steps (a prefill-like step that stamps chains, then a mixed
step) over a random pool layout: padding rows, sparse permuted ``req_to_token``, SWA window with
an LUT (sometimes too short, so lookups clamp), an expected-token pool, real-KV sources, tight or
overflowing capacities, a small ring, and out-of-range values injected into any input.
``run_case(ab, case)`` runs plan -> verify -> write -> verify for both steps and returns host
copies of every output.  ``assert_same(ref, got)`` compares them (rings as multisets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary_cupy as kc

BOUNDARY_TOKENS = np.array([0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF, 2**63 - 1, -(2**63)], np.int64)


@dataclass
class Step:
    req_pool_indices: np.ndarray
    prefix_lens: np.ndarray
    extend_seq_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    valid_lens: np.ndarray | None
    expected_tokens: np.ndarray | None
    expected_positions: np.ndarray | None
    kinds: tuple  # (head kind, tail kind)
    chain_flag: object  # bool or np.int32 [1]
    check_token: bool


@dataclass
class Case:
    seed: int
    num_slots: int
    req_to_token: np.ndarray
    window: int
    lut: np.ndarray | None
    pool: np.ndarray | None
    token_offset: int
    verify_capacity: int
    write_req_capacity: int
    ring_capacity: int
    sources: list  # of (array, page_size, nbpt, read_bytes)
    mode: int
    uint8_canary: bool
    steps: list = field(default_factory=list)


def _sources(rng, num_slots):
    out = []
    for _ in range(rng.integers(0, 5)):
        page = int(rng.choice([1, 4, 16]))
        nbpt = int(rng.choice([16, 32, 64]))
        read = int(rng.choice([r for r in (16, 32, 48, 64) if r <= nbpt]))
        rows = -(-num_slots // page) + int(rng.integers(0, 3))
        row_bytes = page * nbpt + int(rng.choice([0, 16]))  # sometimes holey rows
        out.append((rng.integers(0, 256, (rows, row_bytes), dtype=np.uint8), page, nbpt, read))
    return out


def make_case(seed: int, *, big: bool = False) -> Case:
    rng = np.random.default_rng(seed)
    if big:
        bs, rows, cols = int(rng.integers(4000, 20001)), 0, int(rng.integers(4, 17))
        rows = bs + 1
    else:
        bs, rows, cols = int(rng.integers(0, 48)), int(rng.integers(2, 40)), int(rng.integers(1, 200))
    full_slots = rows * cols + 1
    perm = rng.permutation(np.arange(1, full_slots)) if rng.random() < 0.7 else np.arange(1, full_slots)
    req_to_token = perm.reshape(rows, cols).astype(np.int32)
    window = int(rng.choice([0, 0, 1, 3, 16, 64])) if not big else 0
    lut = None
    num_slots = full_slots + int(rng.integers(0, 8))
    if window or rng.random() < 0.2:
        lut_len = full_slots + 1 if rng.random() < 0.8 else int(rng.integers(1, full_slots + 1))
        num_slots = max(2, lut_len + 8)
        # Injective but for evicted entries (0): two requests never write one slot in one launch.
        lut = rng.permutation(np.arange(1, num_slots))[:lut_len].astype(np.int64)
        lut[rng.random(lut_len) < 0.1] = 0  # evicted: chain check skipped
        if lut_len <= full_slots:
            lut[-1] = 0  # a short LUT clamps many lookups onto its last entry: make that the padding slot
    pool = None
    if rng.random() < 0.5:
        pool = rng.integers(0, 50000, (rows + int(rng.integers(0, 3)), cols + int(rng.integers(-1, 3)) if cols > 1 else 1)).astype(np.int32)
    sources = _sources(rng, num_slots) if rng.random() < 0.5 else []
    case = Case(
        seed=seed, num_slots=num_slots, req_to_token=req_to_token, window=window, lut=lut, pool=pool,
        token_offset=int(rng.choice([0, 1])), verify_capacity=0, write_req_capacity=max(bs, 1) + int(rng.integers(0, 5)),
        ring_capacity=int(rng.choice([4, 64, 4096])), sources=sources,
        mode=int(rng.choice([0, 1, 2])) if sources else 0, uint8_canary=bool(rng.random() < 0.2),
    )
    free_rows = rng.permutation(np.arange(1, rows))
    rp = np.zeros(bs, np.int64)
    active = rng.random(bs) < 0.8
    n_active = min(int(active.sum()), free_rows.size)
    active[np.nonzero(active)[0][n_active:]] = False
    rp[active] = free_rows[:n_active]
    prefill_len = rng.integers(0, cols + 1, bs)
    for step_no in range(2):
        if step_no == 0:
            prefix = np.zeros(bs, np.int64)
            extend = prefill_len.astype(np.int64)
        else:
            prefix = prefill_len.astype(np.int64)
            extend = np.minimum(rng.integers(0, 4, bs), cols - prefix).astype(np.int64)
        prefix = np.where(active, prefix, rng.integers(0, 100000, bs))  # padding rows carry garbage
        extend = np.where(active, extend, rng.integers(0, 100, bs))
        case.steps.append(_step(rng, case, rp.copy(), prefix, extend, active))
    total = max(int(_verify_total(case, s)) for s in case.steps)
    kind = rng.choice(["loose", "tight", "under"])
    case.verify_capacity = {"loose": total + 64, "tight": total, "under": max(total - 1, 0)}[kind]
    _inject(rng, case)
    return case


def _verify_total(case, s):
    rows, cols = case.req_to_token.shape
    ok = (s.req_pool_indices != 0) & (s.req_pool_indices >= 0) & (s.req_pool_indices < rows)
    end = np.clip(s.prefix_lens, 0, cols)
    start = np.maximum(s.prefix_lens - case.window, 0) if case.window else 0
    return np.where(ok, np.maximum(end - start, 0), 0).sum()


def _step(rng, case, rp, prefix, extend, active) -> Step:
    rtt = case.req_to_token
    locs, ids, pos = [], [], []
    for r in range(rp.shape[0]):
        n = int(extend[r]) if active[r] else 0
        p = prefix[r] + np.arange(n)
        slot = rtt[rp[r], p].astype(np.int64) if active[r] else np.zeros(0, np.int64)
        if case.lut is not None:
            slot = case.lut[np.minimum(slot, case.lut.shape[0] - 1)]
        locs.append(slot)
        pos.append(p)
        ids.append(rng.integers(0, 32000, n))
    loc = np.concatenate(locs).astype(np.int64) if locs else np.zeros(0, np.int64)
    ids = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    positions = np.concatenate(pos).astype(np.int64) if pos else np.zeros(0, np.int64)
    if case.lut is not None and loc.size:
        # Two requests must not write one slot in one launch (that race is itself a bug the canary
        # reports later, and its outcome is timing-dependent on the GPU).
        _, first = np.unique(loc, return_index=True)
        dup = np.ones(loc.size, bool)
        dup[first] = False
        loc[dup] = -1
    pad = int(rng.integers(0, 3))  # CUDA-graph padding tokens past the batch's range
    loc = np.concatenate([loc, np.zeros(pad, np.int64)])
    ids = np.concatenate([ids, np.zeros(pad, np.int64)])
    positions = np.concatenate([positions, np.zeros(pad, np.int64)])
    if ids.size and rng.random() < 0.3:
        ids[rng.integers(0, ids.size, 2)] = rng.choice(BOUNDARY_TOKENS, 2)
    if loc.size and rng.random() < 0.2:
        loc[rng.integers(0, loc.size)] = -1  # skipped slot
    if positions.size and rng.random() < 0.2:
        positions[rng.integers(0, positions.size)] += int(rng.choice([-1, 1, 7]))  # chain-position assert
    expected_tokens = expected_positions = None
    if rng.random() < 0.4:
        expected_tokens, expected_positions = ids.copy(), positions.copy()
        if ids.size:
            expected_tokens[rng.integers(0, ids.size)] ^= 5
            expected_positions[rng.integers(0, ids.size)] += 1
    valid_lens = None
    if case.pool is not None:
        valid_lens = rng.integers(0, case.pool.shape[1] + 1, rp.shape[0]).astype(np.int64)
    chain_flag = bool(rng.random() < 0.7) if rng.random() < 0.5 else np.array([int(rng.random() < 0.7)], np.int32)
    return Step(rp, prefix.astype(np.int64), extend.astype(np.int64), ids, positions, loc, valid_lens,
                expected_tokens, expected_positions, tuple(int(k) for k in rng.integers(0, 12, 2)), chain_flag,
                bool(rng.random() < 0.5))


def _inject(rng, case: Case) -> None:
    """Out-of-range values in any input (about a third of the cases)."""
    if rng.random() > 0.35:
        return
    s = case.steps[int(rng.integers(0, 2))]
    bs = s.req_pool_indices.shape[0]
    rows, cols = case.req_to_token.shape
    what = rng.choice(["rp", "rp_neg", "prefix", "extend", "valid_lens", "loc", "rtt", "lut"])
    r = int(rng.integers(0, bs)) if bs else None
    if what == "rp" and bs:
        s.req_pool_indices[r] = rows + int(rng.integers(0, 5))
    elif what == "rp_neg" and bs:
        s.req_pool_indices[r] = -int(rng.integers(1, 5))
    elif what == "prefix" and bs:
        s.prefix_lens[r] = cols + int(rng.integers(1, 50))
    elif what == "extend" and bs:
        s.extend_seq_lens[r] = -int(rng.integers(1, 5))
    elif what == "valid_lens" and bs and s.valid_lens is not None:
        s.valid_lens[r] = case.pool.shape[1] + int(rng.integers(1, 9))
    elif what == "loc" and s.out_cache_loc.size:
        s.out_cache_loc[rng.integers(0, s.out_cache_loc.size)] = case.num_slots + int(rng.integers(0, 9))
    elif what == "rtt":
        flat = case.req_to_token.reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = case.num_slots + int(rng.integers(0, 9))
    elif what == "lut" and case.lut is not None:
        case.lut[rng.integers(0, case.lut.shape[0], 2)] = case.num_slots + int(rng.integers(0, 9))


def _initial_canary(case: Case) -> np.ndarray:
    rng = np.random.default_rng(case.seed + 1)
    canary = np.zeros((case.num_slots, 4), np.int64)
    garbage = rng.random(case.num_slots) < 0.05
    canary[garbage] = rng.integers(-(2**62), 2**62, (int(garbage.sum()), 4))
    return canary


def run_case(ab, case: Case) -> dict:
    """Run both steps on ``ab``; returns host copies of every output after each launch."""
    a = ab.asarray
    canary_np = _initial_canary(case)
    canary = a(canary_np.view(np.uint8).reshape(case.num_slots, 32)) if case.uint8_canary else a(canary_np)
    rtt = a(case.req_to_token)
    lut = a(case.lut) if case.lut is not None else None
    pool = a(case.pool) if case.pool is not None else None
    sources = tuple(kc.RealKvSource(a(t), p, n, r) for t, p, n, r in case.sources)
    log = kc.ViolationLog.allocate(case.ring_capacity, like=ab.like)
    vp = kc.VerifyPlan.allocate(case.verify_capacity, like=ab.like)
    wp = kc.WritePlan.allocate(case.write_req_capacity, like=ab.like)
    poison = np.full(case.verify_capacity, 0x5A5A, np.int64)
    for arr in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions, vp.verify_prev_slot_indices):
        arr[...] = a(poison)
    snapshots = []
    for s in case.steps:
        kc.plan(a(s.req_pool_indices), a(s.prefix_lens), a(s.extend_seq_lens), rtt,
                verify_capacity=case.verify_capacity, write_req_capacity=case.write_req_capacity,
                swa_window_size=case.window, full_to_swa_index_mapping=lut,
                req_to_verify_expected_tokens=pool if s.valid_lens is not None else None,
                req_to_verify_expected_tokens_valid_lens=a(s.valid_lens) if s.valid_lens is not None else None,
                kv_token_id_vs_position_offset=case.token_offset, out=(vp, wp))
        head, tail = s.kinds
        kc.verify(canary, vp, log=log, kernel_kind=head, check_expected_token=s.check_token)
        flag = s.chain_flag if isinstance(s.chain_flag, bool) else a(s.chain_flag)
        kc.write(canary, wp, a(s.input_ids), a(s.positions), a(s.out_cache_loc), log=log, kernel_kind=tail,
                 real_kv_sources=sources, real_kv_hash_mode=case.mode,
                 expected_input_tokens=a(s.expected_tokens) if s.expected_tokens is not None else None,
                 expected_input_positions=a(s.expected_positions) if s.expected_positions is not None else None,
                 chain_position_assert=flag)
        kc.verify(canary, vp, log=log, kernel_kind=tail, real_kv_sources=sources, real_kv_hash_mode=case.mode,
                  check_expected_token=s.check_token)
        snap = {f"vp.{k}": ab.to_numpy(v) for k, v in vp.arrays().items()}
        snap.update({f"wp.{k}": ab.to_numpy(v) for k, v in wp.arrays().items()})
        snap.update({f"log.{k}": ab.to_numpy(v) for k, v in log.arrays().items()})
        snap["canary"] = ab.to_numpy(canary).view(np.int64).reshape(case.num_slots, 4)
        snapshots.append(snap)
    return {"snapshots": snapshots}


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    return rows[np.lexsort(rows.T[::-1])] if rows.size else rows


def assert_same(ref: dict, got: dict, *, context: str = "") -> None:
    """Byte equality of everything but the ring; ring rows compared as multisets."""
    for step, (r, g) in enumerate(zip(ref["snapshots"], got["snapshots"])):
        for key in r:
            if key == "log.ring":
                continue
            np.testing.assert_array_equal(g[key], r[key], err_msg=f"{context} step {step}: {key}")
        written = int(r["log.write_index"][0])
        cap = r["log.ring"].shape[0]
        if int(r["log.violation_counters"].sum()) <= cap:  # which rows an overflowing ring keeps is timing-dependent
            np.testing.assert_array_equal(_sorted_rows(g["log.ring"][:written]), _sorted_rows(r["log.ring"][:written]),
                                          err_msg=f"{context} step {step}: ring rows")
        np.testing.assert_array_equal(g["log.ring"][min(written, cap):], r["log.ring"][min(written, cap):],
                                      err_msg=f"{context} step {step}: ring tail must stay untouched")
