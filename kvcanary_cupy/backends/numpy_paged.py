"""The NumPy backend's plan through a small batch's page-size-1 kv_indices and its clean staging (used by
:mod:`.numpy_fast`): the same bytes as :mod:`.numpy_backend`'s, with a fraction of its array calls."""

from __future__ import annotations

import numpy as np

from ..args import STAGE_HEADER, STAGE_HEADER_FIELDS, PlanArgs
from ..validation import I64
from . import numpy_backend as ref

__all__ = ["plan_paged_rows", "prepare_stage"]


def prepare_stage(a):
    """:func:`numpy_backend.prepare_stage`; a clean staging (no ring rows: most steps) writes the
    header and the counters through a few fixed views, anything else is the reference's."""
    stage = ref.prepare_stage(a)  # refuses what the reference refuses
    layout, log = a.layout, a.log
    counters = (log.violation_counters, log.slot_run_counters, log.kernel_run_counters, log.out_of_range_counters)
    lo = layout.counters
    hi = lo + sum(c.shape[0] for c in counters)
    contiguous = all(c.shape[0] == layout.num_kinds for c in counters)
    pad = [0] * (STAGE_HEADER_FIELDS - len(STAGE_HEADER))
    enable, num_valid, bs, plan_oor = a.enable, a.verify_num_valid, a.write_num_valid_reqs, a.plan_out_of_range_count
    write_index = log.write_index

    def staged(stamp, stream=None, staging=None):
        out = a.staging if staging is None else staging
        if not contiguous or max(write_index.tolist()) > 0:  # rows to copy, mark and attribute
            return stage(stamp, stream, staging)
        # the header in STAGE_HEADER's order: rows, stamp, matches, enable, verify_num_valid, batch_size, plan_out_of_range
        out[:STAGE_HEADER_FIELDS] = [0, stamp, 0, int(enable[0]), int(num_valid[0]), int(bs[0]), int(plan_oor[0]), *pad]
        np.concatenate(counters, out=out[lo:hi])
        write_index[:] = 0

    return staged


#: The most requests :func:`plan_paged_rows` takes: its per-request checks run on Python ints (a
#: NumPy call costs what a dozen requests' arithmetic does), so it gains only for small batches.
PAGED_ROWS_MAX_BS = 64
_I64_MAX = int(np.iinfo(np.int64).max)
_paged_ramp = np.arange(0, dtype=I64)  # 0, 1, ...: the positions of a request's run


def plan_paged_rows(a: PlanArgs, verify_capacity: int | None) -> bool:
    """:func:`numpy_backend.plan` of a FULL group (no window, no LUT) through a page-size-1
    kv_indices (transformers' read_index), when every request's row, prefix, extend and pool length
    is in range: nothing is out of range, request r verifies the first ``prefix[r]`` entries of its
    row (positions from 0) and its write seed is the entry before its new tokens.  The per-request
    checks run on Python ints, the entries are joined runs of kv_indices.  False (nothing written):
    the reference plans it (a value out of range, a window, a LUT, a large batch)."""
    global _paged_ramp
    t, out = a.table, a.out
    bs = a.prefix_lens.shape[0]
    if t.page_size != 1 or a.swa_window_size > 0 or a.swa_lut is not None or not 0 < bs <= PAGED_ROWS_MAX_BS:
        return False
    indptr = t.kv_indptr.tolist()
    if len(indptr) != bs + 1:
        return False
    entries, pool = t.entries, a.expected_token_pool
    num_entries, limit = entries.shape[0], ref.extend_limit(bs)
    prefix, extend = a.prefix_lens.tolist(), a.extend_seq_lens.tolist()
    if pool is not None:
        columns, valid = pool.shape[1], a.expected_token_valid_lens.tolist()
        if len(valid) != bs or not all(0 <= n <= columns for n in valid):
            return False
    voff, woff, seed_rows, seed_at, runs = [0], [0], [], [], []
    v = w = 0
    for r in range(bs):
        lo, p, e = indptr[r], prefix[r], extend[r]
        if not (0 <= lo <= indptr[r + 1] <= num_entries and 0 <= p <= indptr[r + 1] - lo and 0 <= e <= limit):
            return False
        if p:
            runs.append((r, lo, p, v))
            if e:
                seed_rows.append(r)
                seed_at.append(lo + p - 1)
        v += p
        w += e
        voff.append(v)
        woff.append(w)
    vcap = out.verify_slot_indices.shape[0] if verify_capacity is None else verify_capacity
    seeds = [-1] * bs  # page_slot(ids, 1, 0): the entry itself, INT64_MIN raised to -(2**63 - 1)
    for r, s in zip(seed_rows, entries[seed_at].tolist() if seed_rows else ()):
        seeds[r] = max(s, -_I64_MAX)
    if 0 < v <= vcap:
        slots, positions = out.verify_slot_indices[:v], out.verify_expected_positions[:v]
        np.concatenate([entries[lo : lo + p] for _, lo, p, _ in runs], out=slots, casting="same_kind")
        if entries.dtype == I64:
            np.maximum(slots, -_I64_MAX, out=slots)
        widest, ramp = max(p for _, _, p, _ in runs), _paged_ramp
        if ramp.shape[0] < widest:
            ramp = _paged_ramp = np.arange(2 * widest, dtype=I64)
        np.concatenate([ramp[:p] for _, _, p, _ in runs], out=positions)
        prev = out.verify_prev_slot_indices[:v]
        prev[1:] = slots[:-1]
        prev[[first for _, _, _, first in runs]] = -1  # every run starts at position 0
        tokens = out.verify_expected_tokens[:v]
        if pool is None:
            tokens.fill(-1)
        else:
            live = np.array([r for r, _, _, _ in runs], I64)
            _pool_runs(a, live, live, [0] * len(runs), [p for _, _, p, _ in runs], tokens)
    stale_end = ref.stale_rows_end(a)
    out.verify_num_valid[0] = min(v, vcap)
    out.enable[0] = 1 if v <= vcap else 0
    out.write_offsets[: bs + 1] = woff
    out.verify_offsets[: bs + 1] = voff
    out.write_seed_slot_indices[:bs] = seeds
    out.write_offsets[bs + 1 : stale_end + 1] = out.verify_offsets[bs + 1 : stale_end + 1] = 0
    out.write_seed_slot_indices[bs:stale_end] = -1
    out.write_num_valid_reqs[0] = bs
    return True


def _pool_runs(a: PlanArgs, live, pool_rows, starts, lengths, tokens) -> None:
    """Expected tokens: position p reads ``pool[row, p + token_offset]`` where that column is below
    ``min(valid_len, pool columns)`` and not negative, else -1 (exact arithmetic: an offset that
    would wrap in int64 lands outside ``[0, limit)`` either way)."""
    pool, off = a.expected_token_pool, a.token_offset
    limits = np.minimum(np.asarray(a.expected_token_valid_lens, I64)[live], pool.shape[1]).tolist()
    filler = np.full(max(lengths), -1, pool.dtype)
    pieces = []
    for row, s, n, limit in zip(pool_rows.tolist(), starts, lengths, limits):
        e = s + n
        lo, hi = max(s, -off), min(e, limit - off)
        if lo >= hi:
            pieces.append(filler[:n])
        else:
            pieces += [filler[: lo - s], pool[row, lo + off : hi + off], filler[: e - hi]]
    np.concatenate(pieces, out=tokens, casting="same_kind")
