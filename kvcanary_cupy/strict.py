"""Opt-in host-side value checks (``strict=True``): raise on the first out-of-range value.

They copy the inputs to the host, so they synchronise with the device and cannot run inside a
CUDA graph capture.  They test exactly the conditions the backends skip and count.
"""

from __future__ import annotations

import numpy as np

from .args import CopyArgs, MoveArgs, PlanArgs, ScatterArgs, VerifyArgs, WriteArgs
from .backends.numpy_backend import copy_pair_checks, extend_limit, move_pair_checks, plan_row_checks, scatter_row_checks, table_slots, write_range_checks
from .errors import fail
from .interop import to_numpy
from .runtime import refuse_view_copy_during_capture
from .tables import TableKind


def _host(args):
    arrays = [x for x in args if hasattr(x, "shape")]
    if arrays:
        refuse_view_copy_during_capture(arrays[0], "strict=True copies the arguments to the host (a device sync)",
                                        "pass strict=False while capturing")
    return type(args)(*[to_numpy(x) if hasattr(x, "shape") else x for x in args])


def _row_error(h: PlanArgs, rows, r: int) -> str:
    """Why batch row ``r`` of a plan counted an out-of-range value."""
    t = h.table
    prefix, extend = int(h.prefix_lens[r]), int(h.extend_seq_lens[r])
    if not rows.ok[r]:
        if t.kind == TableKind.PAGED_KV:
            lo, hi = int(t.kv_indptr[r]), int(t.kv_indptr[r + 1])
            return f"kv_indptr[{r}:{r + 2}] = [{lo}, {hi}] is not a range within the {t.entries.shape[0]} entries of kv_indices"
        rp, num = int(h.req_pool_indices[r]), t.entries.shape[0]
        return f"req_pool_indices[{r}] = {rp} is outside [0, {num}) ({_TABLE_NAMES[t.kind]} has {num} rows)"
    length = int(rows.length[r])
    if not 0 <= prefix <= length:
        if t.kind == TableKind.BLOCK:
            held = f"block_table rows hold {t.entries.shape[1]} blocks x block_size {t.page_size} = {length} positions"
        elif t.kind == TableKind.PAGED_KV:
            held = f"request {r} holds {length // t.page_size} pages x page_size {t.page_size} = {length} positions"
        else:
            held = f"req_to_token rows hold {length} positions"
        return f"prefix_lens[{r}] = {prefix} is outside [0, {length}] ({held})"
    if extend < 0:
        return f"extend_seq_lens[{r}] = {extend} is negative"
    bs = h.prefix_lens.shape[0]
    if extend > extend_limit(bs):
        return (f"extend_seq_lens[{r}] = {extend} exceeds (2**63 - 1) // bs = {extend_limit(bs)}: the write offsets of "
                f"{bs} such requests would leave int64")
    cols = h.expected_token_pool.shape[1]
    return f"req_to_verify_expected_tokens_valid_lens[{r}] = {int(h.expected_token_valid_lens[r])} is outside [0, {cols}] (the pool rows hold {cols} tokens)"


_TABLE_NAMES = {TableKind.REQ_TO_TOKEN: "req_to_token", TableKind.VIRTUAL_PAGES: "req_to_token", TableKind.BLOCK: "block_table"}


def _lookup_error(h: PlanArgs, rows, r: int, positions: np.ndarray) -> str | None:
    """The first lookup of ``positions`` (batch row ``r``) that leaves virtual_to_physical or the SWA LUT."""
    t = h.table
    base = np.full(positions.shape[0], rows.base[r])
    if t.kind == TableKind.VIRTUAL_PAGES:
        tokens = t.entries[base, positions].astype(np.int64)
        bad = np.nonzero(tokens // t.page_size >= t.virtual_to_physical.shape[0])[0]
        if bad.size:
            p, token = int(positions[bad[0]]), int(tokens[bad[0]])
            return (f"req_to_token[{int(base[0])}, {p}] = {token} (batch row {r}) is in virtual page {token // t.page_size}, "
                    f"outside virtual_to_physical of length {t.virtual_to_physical.shape[0]}")
    if h.swa_lut is None:
        return None
    lut_len = h.swa_lut.shape[0]
    slots, _ = table_slots(t, base, positions)
    bad = np.nonzero(slots >= lut_len)[0]
    if not bad.size:
        return None
    p, slot = int(positions[bad[0]]), int(slots[bad[0]])
    if t.kind == TableKind.REQ_TO_TOKEN:
        where = f"req_to_token[{int(base[0])}, {p}] = {slot} (batch row {r})"
    else:
        where = f"slot {slot} of batch row {r}, position {p} ({_TABLE_NAMES.get(t.kind, 'kv_indices')})"
    return f"{where} is outside full_to_swa_index_mapping of length {lut_len}"


def check_plan(a: PlanArgs, verify_capacity: int | None = None) -> None:
    """``verify_capacity``: the plan's (default: the length of its entry arrays)."""
    h = _host(a)
    h = h._replace(table=h.table._replace(**{k: to_numpy(getattr(h.table, k)) for k in ("entries", "kv_indptr", "virtual_to_physical")
                                              if getattr(h.table, k) is not None}))
    rows, _, verify_len, _, seed_ok, errors = plan_row_checks(h)
    for r in np.nonzero(errors)[0]:
        fail(ValueError, _row_error(h, rows, int(r)))
    if h.swa_lut is None and h.table.kind != TableKind.VIRTUAL_PAGES:
        return
    window = h.swa_window_size
    # verify entries are only translated when the plan fits verify_capacity (else only seeds are)
    vcap = h.out.verify_slot_indices.shape[0] if verify_capacity is None else verify_capacity
    entries = int(verify_len.sum()) <= vcap
    for r in np.nonzero((verify_len > 0) & entries | seed_ok)[0]:
        prefix = int(h.prefix_lens[r])
        first = max(prefix - window, 0) if window > 0 else 0
        lo = max(first - 1, 0) if verify_len[r] and entries else prefix - 1
        hi = min(prefix, int(rows.length[r]))
        message = _lookup_error(h, rows, int(r), np.arange(lo, hi, dtype=np.int64))
        if message:
            fail(ValueError, message)


def check_write(a: WriteArgs) -> None:
    h = _host(a)
    num_slots = h.targets[0].canary.shape[0]
    cap = h.write_seed_slot_indices.shape[0]
    num_reqs = min(max(int(h.write_num_valid_reqs[0]), 0), cap)
    num_tokens = h.input_ids.shape[0]
    start, end, bad = write_range_checks(h.write_offsets, num_reqs, num_tokens)
    ours = np.ones(num_reqs, bool) if h.write_waves is None else np.asarray(h.write_waves[:num_reqs]) == h.wave
    bad &= ours  # a request of another write wave is that wave's launch's to check
    for r in np.nonzero(bad)[0]:
        fail(ValueError, f"write_plan.write_offsets[{r}:{r + 2}] = [{int(h.write_offsets[r])}, {int(h.write_offsets[r + 1])}] is not a range within the {num_tokens} tokens of input_ids")
    for r in np.nonzero(ours)[0]:
        seed = int(h.write_seed_slot_indices[r])
        if seed >= num_slots:
            fail(ValueError, f"write_plan.write_seed_slot_indices[{r}] = {seed} is outside canary_buf's {num_slots} slots")
        loc = h.out_cache_loc[start[r]:end[r]]
        over = np.nonzero(loc >= num_slots)[0]
        if over.size:
            i = int(start[r] + over[0])
            fail(ValueError, f"out_cache_loc[{i}] = {int(h.out_cache_loc[i])} is outside canary_buf's {num_slots} slots")


def check_verify(a: VerifyArgs) -> None:
    h = _host(a)
    if int(h.enable[0]) == 0:
        return
    num_slots = h.targets[0].canary.shape[0]
    active = min(max(int(h.verify_num_valid[0]), 0), h.verify_slot_indices.shape[0])
    slots = h.verify_slot_indices[:active]
    bad = np.nonzero((slots < 0) | (slots >= num_slots))[0]
    if bad.size:
        e = int(bad[0])
        fail(ValueError, f"verify_plan.verify_slot_indices[{e}] = {int(slots[e])} is outside canary_buf's {num_slots} slots")
    prev = h.verify_prev_slot_indices[:active]
    bad = np.nonzero((prev >= num_slots) & (slots != 0))[0]
    if bad.size:
        e = int(bad[0])
        fail(ValueError, f"verify_plan.verify_prev_slot_indices[{e}] = {int(prev[e])} is outside canary_buf's {num_slots} slots")


def check_scatter(a: ScatterArgs) -> None:
    h = _host(a)
    rows = h.pool_out.shape[0]
    *_, bad = scatter_row_checks(h)
    for r in np.nonzero(bad)[0]:
        rp, lo, hi = int(h.req_pool_indices[r]), int(h.offsets[r]), int(h.offsets[r + 1])
        if not 0 <= rp < rows:
            fail(ValueError, f"req_pool_indices[{r}] = {rp} is outside [0, {rows}) (pool_out has {rows} rows)")
        fail(ValueError, f"offsets[{r}:{r + 2}] = [{lo}, {hi}] is not a range within the {h.flat_in.shape[0]} values of flat_in")


def check_move(a: MoveArgs) -> None:
    h = _host(a)
    num_slots = h.canary.shape[0]
    src, dst, src_ok, dst_ok = move_pair_checks(h)
    for name, ids, ok in (("src_pages", src, src_ok), ("dst_pages", dst, dst_ok)):
        bad = np.nonzero(~ok)[0]
        if bad.size:
            i = int(bad[0])
            fail(ValueError, f"{name}[{i}] = {int(ids[i])} is outside [0, {num_slots // h.page_size}) (canary_buf's "
                             f"{num_slots} slots hold {num_slots // h.page_size} whole pages of page_size={h.page_size})")
    pages, counts = np.unique(dst, return_counts=True)
    repeated = pages[counts > 1]
    if repeated.size:
        i, j = np.nonzero(dst == repeated[0])[0][:2]
        fail(ValueError, f"dst_pages[{i}] and dst_pages[{j}] are both {int(repeated[0])}; a page can receive one source only")


def check_copy(a: CopyArgs) -> None:
    h = _host(a)
    src, dst, src_ok, dst_ok = copy_pair_checks(h)
    for name, buffer, ids, ok in (("src_pages", "src_canary", src, src_ok), ("dst_pages", "dst_canary", dst, dst_ok)):
        bad = np.nonzero(~ok)[0]
        if bad.size:
            i, slots = int(bad[0]), getattr(h, buffer).shape[0]
            fail(ValueError, f"{name}[{i}] = {int(ids[i])} is outside [0, {slots // h.page_size}) ({buffer}'s "
                             f"{slots} slots hold {slots // h.page_size} whole pages of page_size={h.page_size})")
