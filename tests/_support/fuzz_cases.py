"""Random canary steps, valid and not, run on any array backend and compared byte for byte.

``make_case(seed)`` draws two serving steps (a prefill-like step that stamps chains, then a mixed
step) over a random pool layout read through one of the engine tables (a sparse permuted
``req_to_token`` with padding rows, virtual pages with unbound ones, a vLLM block table with null
blocks, or a FlashInfer CSR table built per step), SWA window with an LUT (sometimes too short,
so lookups clamp), an expected-token pool, real-KV sources, tight or overflowing capacities, a
small ring, and out-of-range values injected into any input, the tables included (bad ids,
columns past a row, bad ``kv_indptr`` ranges, virtual ids past the page map).
``run_case(ab, case)`` runs plan -> verify -> write -> verify for both steps and returns host
copies of every output.  ``assert_same(ref, got)`` compares them (rings as multisets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.args import VERIFY_ENTRY_FIELDS
from kvcanary_cupy.backends import get_backend

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
    kv_indptr: np.ndarray | None = None  # "csr" cases: the step's page table (rows = batch rows)
    kv_indices: np.ndarray | None = None


TABLE_KINDS = ("rtt", "virtual", "block", "csr")


@dataclass
class Case:
    seed: int
    num_slots: int
    table_kind: str  # one of TABLE_KINDS
    table: dict  # the table's arrays and sizes (see _layout)
    slots: np.ndarray  # int64 [rows, cols]: the KV slot of every (table row, position)
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
    buffers: int = 1  # canary buffers written and verified together (K/V halves and more)


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


def _layout(rng, kind: str, rows: int, cols: int):
    """``(table, slots, full_slots)``: the table of ``kind``, the slot of each of its positions
    (distinct but for 0) and the bound of those slots.  Block and CSR tables address pages of a
    permuted pool; virtual pages map a permuted virtual space onto it, some unbound."""
    if kind == "rtt":
        full_slots = rows * cols + 1
        perm = rng.permutation(np.arange(1, full_slots)) if rng.random() < 0.7 else np.arange(1, full_slots)
        rtt = perm.reshape(rows, cols).astype(np.int32)
        return {"req_to_token": rtt}, rtt.astype(np.int64), full_slots
    page_size = int(rng.choice([1, 2, 3, 4, 16]))
    width = -(-cols // page_size)
    pages = rows * width
    physical = (rng.permutation(np.arange(1, pages + 1)) if rng.random() < 0.7 else np.arange(1, pages + 1)).reshape(rows, width)
    offset = np.arange(width * page_size) % page_size
    if kind == "virtual":
        virtual = rng.permutation(np.arange(1, pages + 1)).reshape(rows, width)
        v2p = np.full(pages + 1 + int(rng.integers(0, 3)), -1, np.int64)
        v2p[0] = 0
        v2p[virtual] = physical
        v2p[rng.random(v2p.shape[0]) < 0.1] = -1  # unbound pages
        page_of = np.repeat(virtual, page_size, axis=1)
        bound = v2p[page_of]
        table = {"req_to_token": (page_of * page_size + offset).astype(np.int32), "virtual_to_physical": v2p,
                 "page_size": page_size}
        return table, np.where(bound == -1, 0, bound * page_size + offset), (pages + 1) * page_size
    if kind == "block":
        physical[rng.random(physical.shape) < 0.1] = 0  # null blocks
    page_of = np.repeat(physical, page_size, axis=1)
    slots = np.where(page_of == 0, 0, page_of * page_size + offset)
    table = {"block_table": physical.astype(rng.choice([np.int32, np.int64])), "block_size": page_size, "null_block": 0}
    return table, slots, (pages + 1) * page_size


def make_case(seed: int, *, big: bool = False, table_kind: str | None = None, bs: int | None = None) -> Case:
    """Case ``seed``; its table kind cycles with the seed unless ``table_kind`` is given.  A big
    case has 4,000 to 20,000 requests, or ``bs``."""
    rng = np.random.default_rng(seed)
    kind = table_kind or TABLE_KINDS[seed % len(TABLE_KINDS)]
    if big:
        drawn, rows, cols = int(rng.integers(4000, 20001)), 0, int(rng.integers(4, 17))
        bs = bs or drawn  # drawn either way: the other draws stay what they were
        rows = bs + 1
    else:
        bs, rows, cols = int(rng.integers(0, 48)), int(rng.integers(2, 40)), int(rng.integers(1, 200))
    table, slots, full_slots = _layout(rng, kind, rows, cols)
    cols = slots.shape[1]
    window = int(rng.choice([0, 0, 1, 3, 16, 64])) if not big else 0
    lut = None
    num_slots = full_slots + int(rng.integers(0, 8))
    lut_optional = kind in ("block", "csr")  # tables of an SWA group's own pages need no LUT
    if (window and not (lut_optional and rng.random() < 0.3)) or rng.random() < 0.2:
        lut_len = full_slots + 1 if rng.random() < 0.8 else int(rng.integers(1, full_slots + 1))
        num_slots = max(2, lut_len + 8)
        # Injective but for evicted entries (0): two requests never write one slot in one launch.
        lut = rng.permutation(np.arange(1, num_slots))[:lut_len].astype(np.int64)
        lut[rng.random(lut_len) < 0.1] = 0  # evicted: chain check skipped
        lut[0] = 0  # the padding slot (a null block, an unbound page) maps to the padding slot
        if lut_len <= full_slots:
            lut[-1] = 0  # a short LUT clamps many lookups onto its last entry: make that the padding slot
    pool = None
    if rng.random() < 0.5:
        pool = rng.integers(0, 50000, (rows + int(rng.integers(0, 3)), cols + int(rng.integers(-1, 3)) if cols > 1 else 1)).astype(np.int32)
    sources = _sources(rng, num_slots) if rng.random() < 0.5 else []
    case = Case(
        seed=seed, num_slots=num_slots, table_kind=kind, table=table, slots=slots, window=window, lut=lut, pool=pool,
        token_offset=int(rng.choice([0, 1])), verify_capacity=0, write_req_capacity=max(bs, 1) + int(rng.integers(0, 5)),
        ring_capacity=int(rng.choice([4, 64, 4096])), sources=sources,
        mode=int(rng.choice([0, 1, 2])) if sources else 0, uint8_canary=bool(rng.random() < 0.2),
    )
    padding_row = kind in ("rtt", "virtual")  # req_to_token row 0 marks a padding request
    free_rows = rng.permutation(np.arange(1 if padding_row else 0, rows))
    rp = np.zeros(bs, np.int64) if padding_row else rng.integers(0, rows, bs)
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
        if padding_row:  # padding rows carry garbage
            prefix = np.where(active, prefix, rng.integers(0, 100000, bs))
            extend = np.where(active, extend, rng.integers(0, 100, bs))
        else:  # every row is real: a padding request is an empty one
            prefix, extend = np.where(active, prefix, 0), np.where(active, extend, 0)
        case.steps.append(_step(rng, case, rp.copy(), prefix, extend, active))
    total = max(int(_verify_total(case, s)) for s in case.steps)
    kind = rng.choice(["loose", "tight", "under"])
    case.verify_capacity = {"loose": total + 64, "tight": total, "under": max(total - 1, 0)}[kind]
    _inject(rng, case)
    # drawn apart so that the cases of every seed stay what they were with one buffer
    case.buffers = int(np.random.default_rng([seed, 1]).choice([1, 1, 2, 3, 4]))
    return case


def _plan_inputs(case: Case, s: Step, a):
    """``(req_pool_indices, table, pool)`` of step ``s`` as arrays made by ``a`` (NumPy -> native)."""
    t = case.table
    pool = None if case.pool is None or s.valid_lens is None else case.pool
    if case.table_kind == "csr":  # rows are batch rows: so are the expected-token pool's
        pool = None if pool is None else np.ascontiguousarray(pool[np.clip(s.req_pool_indices, 0, pool.shape[0] - 1)])
        table = kc.PagedKvIndices(a(s.kv_indptr), a(s.kv_indices), t["block_size"])
        return None, table, None if pool is None else a(pool)
    if case.table_kind == "block":
        table = kc.BlockTable(a(t["block_table"]), t["block_size"], null_block=t["null_block"])
    elif case.table_kind == "virtual":
        table = kc.ReqToToken(a(t["req_to_token"]), virtual_to_physical=a(t["virtual_to_physical"]), page_size=t["page_size"])
    else:
        table = kc.ReqToToken(a(t["req_to_token"]))
    return a(s.req_pool_indices), table, None if pool is None else a(pool)


def _plan_step(case: Case, s: Step, a, *, verify_capacity, out=None, verify=None):
    """kc.plan of step ``s``; with ``verify`` (plan_and_verify's own arguments) kc.plan_and_verify."""
    rp, table, pool = _plan_inputs(case, s, a)
    verify = dict(verify or {})
    op, canary = (kc.plan, ()) if not verify else (kc.plan_and_verify, (verify.pop("canary_buf"),))
    return op(rp, a(s.prefix_lens), a(s.extend_seq_lens), table, *canary, **verify,
              verify_capacity=verify_capacity, write_req_capacity=case.write_req_capacity,
              swa_window_size=case.window, full_to_swa_index_mapping=None if case.lut is None else a(case.lut),
              req_to_verify_expected_tokens=pool,
              req_to_verify_expected_tokens_valid_lens=None if pool is None else a(s.valid_lens),
              kv_token_id_vs_position_offset=case.token_offset, out=out)


def _verify_total(case, s):
    """The step's verify entries, counted by a zero-capacity NumPy plan (it only scans the batch)."""
    _, wp = _plan_step(case, s, np.asarray, verify_capacity=0)
    return int(wp.verify_offsets[s.prefix_lens.shape[0]])


def _csr_rows(rng, case, s: Step, active) -> None:
    """The step's CSR table: each batch row owns its block row's first pages, enough for the step."""
    bt, page_size = case.table["block_table"], case.table["block_size"]
    need = -(-(s.prefix_lens + s.extend_seq_lens) // page_size)
    spare = rng.integers(0, 2, need.shape[0])
    pages = np.where(active, np.minimum(need + spare, bt.shape[1]), 0)
    indices = [bt[s.req_pool_indices[r], :pages[r]] for r in range(pages.shape[0])]
    s.kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(rng.choice([np.int32, np.int64]))
    s.kv_indices = (np.concatenate(indices) if indices else np.zeros(0, np.int64)).astype(rng.choice([np.int32, np.int64]))


def _step(rng, case, rp, prefix, extend, active) -> Step:
    slots = case.slots
    locs, ids, pos = [], [], []
    for r in range(rp.shape[0]):
        n = int(extend[r]) if active[r] else 0
        p = prefix[r] + np.arange(n)
        slot = slots[rp[r], p] if active[r] else np.zeros(0, np.int64)
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
    step = Step(rp, prefix.astype(np.int64), extend.astype(np.int64), ids, positions, loc, valid_lens,
                expected_tokens, expected_positions, tuple(int(k) for k in rng.integers(0, 12, 2)), chain_flag,
                bool(rng.random() < 0.5))
    if case.table_kind == "csr":
        _csr_rows(rng, case, step, active)
    return step


def _inject(rng, case: Case) -> None:
    """Out-of-range values in any input (about a third of the cases)."""
    if rng.random() > 0.35:
        return
    s = case.steps[int(rng.integers(0, 2))]
    bs = s.req_pool_indices.shape[0]
    rows, cols = case.slots.shape
    what = rng.choice(["rp", "rp_neg", "prefix", "extend", "valid_lens", "loc", "table", "table", "lut"])
    r = int(rng.integers(0, bs)) if bs else None
    if what in ("rp", "rp_neg") and bs and case.table_kind == "csr":
        _inject_indptr(rng, s, r)
    elif what == "rp" and bs:
        s.req_pool_indices[r] = rows + int(rng.integers(0, 5))
    elif what == "rp_neg" and bs:
        s.req_pool_indices[r] = -int(rng.integers(1, 5))
    elif what == "prefix" and bs:  # a column past the row (CSR: past the request's own pages)
        s.prefix_lens[r] = (cols if case.table_kind != "csr" else s.prefix_lens[r]) + int(rng.integers(1, 50))
    elif what == "extend" and bs:
        s.extend_seq_lens[r] = -int(rng.integers(1, 5))
    elif what == "valid_lens" and bs and s.valid_lens is not None:
        s.valid_lens[r] = case.pool.shape[1] + int(rng.integers(1, 9))
    elif what == "loc" and s.out_cache_loc.size:
        s.out_cache_loc[rng.integers(0, s.out_cache_loc.size)] = case.num_slots + int(rng.integers(0, 9))
    elif what == "table":
        _inject_table(rng, case, s)
    elif what == "lut" and case.lut is not None:
        case.lut[rng.integers(0, case.lut.shape[0], 2)] = case.num_slots + int(rng.integers(0, 9))


def _inject_indptr(rng, s: Step, r: int) -> None:
    """A kv_indptr range that is not within kv_indices: decreasing, negative or past the end."""
    indptr = s.kv_indptr
    how = rng.choice(["past", "negative", "decreasing"])
    if how == "past":
        indptr[r + 1] = indptr[-1] + int(rng.integers(1, 9))
    elif how == "negative":
        indptr[r] = -int(rng.integers(1, 9))
    else:
        indptr[r + 1] = indptr[r] - int(rng.integers(1, 3))


def _inject_table(rng, case: Case, s: Step) -> None:
    """Bad ids in the table: negative, past the pool (slots >= num_slots), null blocks, unbound
    pages, virtual ids past the page map (never another in-range slot: writes would race)."""
    far = case.num_slots + int(rng.integers(0, 9))
    t = case.table
    if case.table_kind == "rtt":
        flat = t["req_to_token"].reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = far
    elif case.table_kind == "virtual":
        v2p, page_size = t["virtual_to_physical"], t["page_size"]
        v2p[rng.integers(0, v2p.size, 2)] = rng.choice([-1, -2 - int(rng.integers(0, 9)), far])
        flat = t["req_to_token"].reshape(-1)
        flat[rng.integers(0, flat.size, 2)] = v2p.size * page_size + int(rng.integers(0, 9))  # past the map
    elif case.table_kind == "block":
        flat = t["block_table"].reshape(-1)
        flat[rng.integers(0, flat.size, 3)] = rng.choice([0, -int(rng.integers(1, 9)), far])
    elif s.kv_indices.size:
        s.kv_indices[rng.integers(0, s.kv_indices.size, 2)] = rng.choice([-int(rng.integers(1, 9)), far])
        if rng.random() < 0.5 and s.prefix_lens.size:  # a request whose pages end before its prefix
            r = int(rng.integers(0, s.prefix_lens.size))
            s.prefix_lens[r] += int(s.kv_indptr[r + 1] - s.kv_indptr[r]) * case.table["block_size"] + 1


def _initial_canary(case: Case, buffer: int = 0) -> np.ndarray:
    rng = np.random.default_rng(case.seed + 1 if buffer == 0 else [case.seed, 2, buffer])
    canary = np.zeros((case.num_slots, 4), np.int64)
    garbage = rng.random(case.num_slots) < 0.05
    canary[garbage] = rng.integers(-(2**62), 2**62, (int(garbage.sum()), 4))
    return canary


def launch_targets(case: Case, canaries: list, sources: tuple):
    """``targets(kind) -> (canary_buf, kernel_kind, real_kv_sources)`` of one write or verify: the
    one buffer, or (``case.buffers > 1``) every buffer with its own kind and rotated sources."""
    per_buffer = [sources[b % len(sources):] + sources[:b % len(sources)] if sources else () for b in range(case.buffers)]

    def targets(kind):
        if case.buffers == 1:
            return canaries[0], kind, sources
        return canaries, [(kind + b) % kc.NUM_LAUNCH_TAGS for b in range(case.buffers)], per_buffer

    return targets


STEP_KINDS = ("full", "decode", "fused")


def _backend(ab):
    """The kvcanary backend module that runs ``ab``'s arrays."""
    return get_backend("cupy" if ab.is_gpu else "numpy")


def run_case(ab, case: Case, *, bound: bool = False, step: str = "full") -> dict:
    """Run both steps on ``ab``; returns host copies of every output after each launch.

    With ``case.buffers > 1`` every write and verify takes that many canary buffers at once, each
    with its own initial bytes, launch kind and (rotated) real-KV sources.  ``bound=True`` runs
    the steps through a CanaryPlanner and bound launchers instead of the free functions.
    ``step``: "full" plans, verifies (HEAD), writes and verifies (TAIL, the one that checks real
    KV); "decode" drops the TAIL verify and checks real KV at the HEAD verify; "fused" is "decode"
    through kc.plan_and_verify (one buffer: the VerifyPlan's entry arrays keep the poison each step
    starts with, unless the backend stores the entries of a batch that size, and "decode"'s
    snapshot drops them to compare).
    """
    assert step in STEP_KINDS and (step != "fused" or (case.buffers == 1 and not bound))
    a = ab.asarray
    canaries = []
    for b in range(case.buffers):
        canary_np = _initial_canary(case, b)
        canaries.append(a(canary_np.view(np.uint8).reshape(case.num_slots, 32)) if case.uint8_canary else a(canary_np))
    sources = tuple(kc.RealKvSource(a(t), p, n, r) for t, p, n, r in case.sources)
    targets = launch_targets(case, canaries, sources)
    log = kc.ViolationLog.allocate(case.ring_capacity, like=ab.like)
    planner = kc.CanaryPlanner(kc.CanaryCapacities(case.verify_capacity, case.write_req_capacity), like=ab.like,
                               swa_window_size=case.window, full_to_swa_index_mapping=None if case.lut is None else a(case.lut),
                               kv_token_id_vs_position_offset=case.token_offset)
    vp, wp = planner.verify_plan, planner.write_plan
    poison = np.full(case.verify_capacity, 0x5A5A, np.int64)
    snapshots = []
    for s in case.steps:
        for k in VERIFY_ENTRY_FIELDS:
            getattr(vp, k)[...] = a(poison)
        head, tail = s.kinds
        head_buf, head_kinds, head_srcs = targets(head)
        buf, kinds, srcs = targets(tail)
        flag = s.chain_flag if isinstance(s.chain_flag, bool) else a(s.chain_flag)
        real_kv = dict(real_kv_sources=srcs, real_kv_hash_mode=case.mode)
        head_real_kv = {} if step == "full" else dict(real_kv_sources=head_srcs, real_kv_hash_mode=case.mode)
        write_options = dict(log=log, kernel_kind=kinds, chain_position_assert=flag, **real_kv)
        tokens = (a(s.input_ids), a(s.positions), a(s.out_cache_loc))
        expected = dict(expected_input_tokens=a(s.expected_tokens) if s.expected_tokens is not None else None,
                        expected_input_positions=a(s.expected_positions) if s.expected_positions is not None else None)
        if bound:
            rp, table, pool = _plan_inputs(case, s, a)
            planner.plan(rp, a(s.prefix_lens), a(s.extend_seq_lens), table, req_to_verify_expected_tokens=pool,
                         req_to_verify_expected_tokens_valid_lens=None if pool is None else a(s.valid_lens))
            kc.VerifyLauncher(head_buf, vp, log=log, kernel_kind=head_kinds, check_expected_token=s.check_token)()
            kc.WriteLauncher(buf, wp, **write_options)(*tokens, **expected)
            kc.VerifyLauncher(buf, vp, log=log, kernel_kind=kinds, check_expected_token=s.check_token, **real_kv)()
        elif step == "fused":
            _plan_step(case, s, a, verify_capacity=case.verify_capacity, out=(vp, wp),
                       verify=dict(canary_buf=head_buf, log=log, kernel_kind=head_kinds, check_expected_token=s.check_token,
                                   **head_real_kv))
            kc.write(buf, wp, *tokens, **write_options, **expected)
        else:
            _plan_step(case, s, a, verify_capacity=case.verify_capacity, out=(vp, wp))
            kc.verify(head_buf, vp, log=log, kernel_kind=head_kinds, check_expected_token=s.check_token, **head_real_kv)
            kc.write(buf, wp, *tokens, **write_options, **expected)
            if step == "full":
                kc.verify(buf, vp, log=log, kernel_kind=kinds, check_expected_token=s.check_token, **real_kv)
        snap = {f"vp.{k}": ab.to_numpy(v) for k, v in vp.arrays().items()}
        if step != "full":
            entries = [snap.pop(f"vp.{k}") for k in VERIFY_ENTRY_FIELDS]
            if step == "fused" and not _backend(ab).plan_verify_stores_entries(s.prefix_lens.shape[0]):
                assert all((e == poison).all() for e in entries), "plan_and_verify wrote the VerifyPlan's entries"
        snap.update({f"wp.{k}": ab.to_numpy(v) for k, v in wp.arrays().items()})
        snap.update({f"log.{k}": ab.to_numpy(v) for k, v in log.arrays().items()})
        for b, canary in enumerate(canaries):
            snap[f"canary{b}"] = ab.to_numpy(canary).view(np.int64).reshape(case.num_slots, 4)
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


# ---- move_pages ------------------------------------------------------------------------------------


@dataclass
class MoveCase:
    canary: np.ndarray  # int64 [N, fields]
    src: np.ndarray
    dst: np.ndarray  # distinct (a repeated destination is timing-dependent on the GPU)
    page_size: int
    uint8_canary: bool


def make_move_case(seed: int) -> MoveCase:
    """Cycles, chains, repeated sources, overlapping pages, out-of-range ids, both id dtypes,
    both canary layouts, a partial last page."""
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 2, 3, 16]))
    num_pages = int(rng.integers(1, 40))
    fields = int(rng.choice([4, 6]))
    canary = rng.integers(-(2**62), 2**62, (num_pages * page_size + int(rng.integers(0, page_size)), fields), dtype=np.int64)
    n = int(rng.integers(0, min(30, num_pages + 3) + 1))  # dst draws n distinct pages of num_pages + 3
    dst = rng.permutation(num_pages + 3)[:n] - int(rng.integers(0, 2))  # distinct; sometimes -1 or past the end
    src = rng.integers(-1, num_pages + 2, n) if rng.random() < 0.5 else rng.permutation(num_pages + 3)[:n]
    dtype = rng.choice([np.int32, np.int64])
    return MoveCase(canary, src.astype(dtype), dst.astype(dtype), page_size, fields == 4 and bool(rng.random() < 0.5))


def run_move_case(ab, case: MoveCase) -> tuple:
    """``(canary after the move, out_of_range_count)`` as host arrays."""
    canary = ab.asarray(case.canary.view(np.uint8) if case.uint8_canary else case.canary)
    count = ab.asarray(np.full(1, 5, np.int64))
    kc.move_pages(canary, ab.asarray(case.src), ab.asarray(case.dst), page_size=case.page_size, out_of_range_count=count)
    return ab.to_numpy(canary).view(np.int64).reshape(case.canary.shape), ab.to_numpy(count)

