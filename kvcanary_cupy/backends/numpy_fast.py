"""The NumPy backend as the front door uses it: :mod:`.numpy_backend` (the reference) with fast
paths for plan through a req_to_token and for verify, which compute the same bytes.

The reference expands a plan's entries with per-entry index arithmetic and verifies through
whole-array fancy indexing (a dozen temporaries of the entries' length).  Here:

* **plan** (a plain req_to_token, with or without a sliding window, a LUT or an expected-token
  pool): each request's entries are a run of its table row, so the slots are the rows' runs
  joined by one ``np.concatenate`` into the VerifyPlan (int32 -> int64 on the way), the
  predecessors the same array shifted by one (each request's first fixed from its table), the
  positions runs of one ``arange`` and the tokens runs of the pool rows between -1 fillers.
* **verify**: in chunks that stay in the L2 cache, one ``np.take(mode="clip")`` gathers the
  records (every index is in range by then), the chain step ``mix3`` of each record is computed
  in place, and since an entry's predecessor is almost always the entry before it, the
  expected chain of entry i is the mix3 of record i - 1: only the other entries ("irregular":
  each request's first, or a table that breaks the run) gather their predecessor's record.
  The checks are OR-ed into one mask; failing entries, rare, get their bits as the reference.

Everything else (write, the page ops, staging, other tables) is the reference's.
``tests/ops/test_numpy_fast.py`` compares every output with the reference on randomized inputs.
"""

from __future__ import annotations

import numpy as np

from ..args import VERIFY_ENTRY_FIELDS, CanaryTarget, PlanArgs, PlanVerifyArgs, VerifyArgs
from ..constants import SPLITMIX64_MUL1, SPLITMIX64_MUL2, SPLITMIX64_SHIFT1, SPLITMIX64_SHIFT2, SPLITMIX64_SHIFT3
from ..constants import FailReason, RealKvHashMode
from ..hashing import ANCHOR_HASH, mix3_array
from ..tables import TableKind
from ..validation import I64
from . import numpy_backend as ref

__all__ = ["copy", "move", "plan", "plan_verify", "plan_verify_stores_entries", "prepare_stage", "scatter", "verify",
           "write"]

U64 = np.uint64
_ANCHOR = U64(ANCHOR_HASH)
_MUL1, _MUL2 = U64(SPLITMIX64_MUL1), U64(SPLITMIX64_MUL2)
_SHIFTS = (U64(SPLITMIX64_SHIFT1), U64(SPLITMIX64_SHIFT2), U64(SPLITMIX64_SHIFT3))
_CHAIN_BIT = FailReason.VERIFY_CHAIN_HASH_MISMATCH.value
_POSITION_BIT = FailReason.VERIFY_POSITION_MISMATCH.value
_REAL_KV_BIT = FailReason.VERIFY_REAL_KV_HASH_MISMATCH.value
_TOKEN_BIT = FailReason.VERIFY_TOKEN_MISMATCH.value
#: Entries verified per chunk: its records (32 bytes each), hashes and masks stay in a 512 KiB L2.
VERIFY_CHUNK = 8192


# ----------------------------------------------------------------------------------------------
# the reference's ops, looked up when called (so a test that replaces one in numpy_backend sees it)


def write(a) -> None:
    ref.write(a)


def move(a) -> None:
    ref.move(a)


def copy(a) -> None:
    ref.copy(a)


def scatter(a) -> None:
    ref.scatter(a)


def prepare_stage(a):
    return ref.prepare_stage(a)


def plan_verify_stores_entries(bs: int) -> bool:
    return ref.plan_verify_stores_entries(bs)


# ----------------------------------------------------------------------------------------------
# plan


def plan(a: PlanArgs, verify_capacity: int | None = None) -> None:
    """:func:`numpy_backend.plan`; through a plain req_to_token its entries are expanded by runs."""
    fast = a.table.kind == TableKind.REQ_TO_TOKEN
    ref.plan(a, verify_capacity, expand=expand_runs if fast else None)


def expand_runs(a: PlanArgs, rows, verify_start, verify_len, voff, total: int) -> int:
    """:func:`numpy_backend.expand_entries` for a plain req_to_token: request r's entries are
    positions ``[start, start + len)`` of table row ``base``, so every array is a join of runs."""
    out, table = a.out, a.table.entries
    live = np.flatnonzero(verify_len)
    base, start, length = rows.base[live], verify_start[live], verify_len[live]
    runs = [(table[b], s, s + n) for b, s, n in zip(base.tolist(), start.tolist(), length.tolist())]
    slots = out.verify_slot_indices[:total]
    np.concatenate([row[s:e] for row, s, e in runs], out=slots, casting="same_kind")
    prev = out.verify_prev_slot_indices[:total]
    prev[1:] = slots[:-1]
    # Each request's first entry: its table's slot before the run, or -1 at position 0.
    prev[voff[live]] = np.where(start > 0, table[base, np.maximum(start - 1, 0)], -1)
    errors = 0
    if a.swa_lut is not None:  # the reference translates slots and predecessors alike; -1 passes through
        for values in (slots, prev):
            translated, clamped = ref._translate(values, a.swa_lut)
            values[...] = translated
            errors += clamped
    ramp = np.arange(int((start + length).max()), dtype=I64)
    np.concatenate([ramp[s:e] for _, s, e in runs], out=out.verify_expected_positions[:total])
    tokens = out.verify_expected_tokens[:total]
    if a.expected_token_pool is None:
        tokens.fill(-1)
    else:
        _pool_runs(a, live, rows.pool_row[live], runs, tokens)
    return errors


def _pool_runs(a: PlanArgs, live, pool_rows, runs, tokens) -> None:
    """Expected tokens: position p reads ``pool[row, p + token_offset]`` where that column is below
    ``min(valid_len, pool columns)`` and not negative, else -1 (exact arithmetic: an offset that
    would wrap in int64 lands outside ``[0, limit)`` either way)."""
    pool, off = a.expected_token_pool, a.token_offset
    limits = np.minimum(np.asarray(a.expected_token_valid_lens, I64)[live], pool.shape[1]).tolist()
    filler = np.full(max(e - s for _, s, e in runs), -1, pool.dtype)
    pieces = []
    for row, (_, s, e), limit in zip(pool_rows.tolist(), runs, limits):
        lo, hi = max(s, -off), min(e, limit - off)
        if lo >= hi:
            pieces.append(filler[: e - s])
        else:
            pieces += [filler[: lo - s], pool[row, lo + off : hi + off], filler[: e - hi]]
    np.concatenate(pieces, out=tokens, casting="same_kind")


# ----------------------------------------------------------------------------------------------
# verify


def verify(a: VerifyArgs) -> None:
    """:func:`numpy_backend.verify`: each canary buffer as by its own launch."""
    for target in a.targets:
        _verify_one(a, target)


def _verify_one(a: VerifyArgs, target: CanaryTarget) -> None:
    log, kind, canary = a.log, target.kernel_kind, target.canary
    num_slots = canary.shape[0]
    log.kernel_run_counters[kind] += 1
    if int(a.enable[0]) == 0:
        return
    active = min(max(int(a.verify_num_valid[0]), 0), a.verify_slot_indices.shape[0])
    log.slot_run_counters[kind] += active
    if active == 0:
        return
    slot = np.asarray(a.verify_slot_indices[:active], I64)
    prev = np.asarray(a.verify_prev_slot_indices[:active], I64)
    position = np.asarray(a.verify_expected_positions[:active], I64)
    token = np.asarray(a.verify_expected_tokens[:active], I64) if a.check_expected_token else None
    errors, keep, holes = 0, None, np.zeros(0, I64)
    if int(slot.min()) <= 0 or int(slot.max()) >= num_slots:  # padding or out-of-range slots: the reference's masks
        slot_oob = (slot < 0) | (slot >= num_slots)
        errors = int(np.count_nonzero(slot_oob))
        padding = ref.is_padding_slot(slot)
        holes = np.flatnonzero(padding) if a.check_holes else holes
        keep = np.flatnonzero(~padding & ~slot_oob)
        slot, prev, position = slot[keep], prev[keep], position[keep]
        token = None if token is None else token[keep]
    if prev.size and int(prev.max()) >= num_slots:
        errors += int(np.count_nonzero(prev >= num_slots))
    log.out_of_range_counters[kind] += errors
    hole_tokens = np.asarray(a.verify_expected_tokens, I64)[holes] if a.check_expected_token else np.full(holes.size, -1, I64)
    hole_rows = ref._hole_rows(kind, a, holes, hole_tokens)
    if slot.size == 0:
        ref.append_rows(log, kind, hole_rows)
        return
    hit, rows = _failures(kind, canary, slot, prev, position, token, target.sources, a.real_kv_hash_mode)
    if holes.size:  # entry order, holes among the checked entries' rows
        entries = hit if keep is None else keep[hit]
        rows = np.concatenate([rows, hole_rows])[np.argsort(np.concatenate([entries, holes]), kind="stable")]
    ref.append_rows(log, kind, rows)


def _irregular(canary, slot, prev):
    """The entries whose predecessor is not the entry before them, with their expected chains
    (the anchor for prev < 0) and which of them have no reachable predecessor (0 or past the
    buffer: the chain is not checked, as the reference's expected chain is then the stored one)."""
    num_slots = canary.shape[0]
    irregular = np.flatnonzero(prev[1:] != slot[:-1]) + 1
    irregular = np.concatenate([np.zeros(1, I64), irregular])
    p = prev[irregular]
    ok = (p > 0) & (p < num_slots)
    rec = canary[np.where(ok, p, 0)]
    chain = np.where(p < 0, _ANCHOR, mix3_array(rec[:, 2], rec[:, 0], rec[:, 1]))
    return irregular, chain, ~(ok | (p < 0))


def _splitmix(x, scratch) -> None:
    """SplitMix64 of ``x`` (uint64) in place."""
    s1, s2, s3 = _SHIFTS
    np.right_shift(x, s1, out=scratch)
    np.bitwise_xor(x, scratch, out=x)
    np.multiply(x, _MUL1, out=x)
    np.right_shift(x, s2, out=scratch)
    np.bitwise_xor(x, scratch, out=x)
    np.multiply(x, _MUL2, out=x)
    np.right_shift(x, s3, out=scratch)
    np.bitwise_xor(x, scratch, out=x)


def _failures(kind, canary, slot, prev, position, token, sources, mode):
    """``(hit, rows)``: the indices of the failing entries among ``slot`` (all in range and not
    the padding slot) and their violation rows, as the reference computes them."""
    n = slot.shape[0]
    irregular, irregular_chain, unreachable = _irregular(canary, slot, prev)
    size = min(n, VERIFY_CHUNK)
    records = np.empty((size, canary.shape[1]), I64)
    # hashes[1 + j] = mix3 of record j of the chunk; hashes[0] that of the record before the chunk.
    hashes, scratch = np.empty(size + 1, U64), np.empty(size, U64)
    bad, check = np.empty(size, bool), np.empty(size, bool)
    real_kv = mode != RealKvHashMode.NONE and bool(sources)
    hits, rows = [], []
    for lo in range(0, n, size):
        hi = min(lo + size, n)
        m = hi - lo
        rec = records[:m]
        np.take(canary, slot[lo:hi], axis=0, out=rec, mode="clip")  # in range: clip only skips the buffered check
        u = rec.view(U64)
        h, s = hashes[1 : m + 1], scratch[:m]
        np.copyto(h, u[:, 2])
        _splitmix(h, s)
        np.bitwise_xor(h, u[:, 0], out=h)
        _splitmix(h, s)
        np.bitwise_xor(h, u[:, 1], out=h)
        _splitmix(h, s)
        expected = hashes[:m]
        first, last = np.searchsorted(irregular, (lo, hi))
        if first < last:
            at = irregular[first:last] - lo
            expected[at] = irregular_chain[first:last]
            lost = at[unreachable[first:last]]
            expected[lost] = u[lost, 2]
        b, c = bad[:m], check[:m]
        np.not_equal(u[:, 2], expected, out=b)
        np.not_equal(rec[:, 1], position[lo:hi], out=c)
        b |= c
        rkv = ref._as_i64(ref.real_kv_hashes(sources, mode, slot[lo:hi])) if real_kv else 0
        np.not_equal(rec[:, 3], rkv, out=c)
        b |= c
        if token is not None:
            np.not_equal(rec[:, 0], token[lo:hi], out=c)
            c &= token[lo:hi] != -1
            b |= c
        if b.any():
            at = np.flatnonzero(b)
            hits.append(at + lo)
            rows.append(_rows(kind, slot[lo:hi][at], rec[at], expected[at], position[lo:hi][at],
                              None if token is None else token[lo:hi][at], rkv if np.isscalar(rkv) else rkv[at]))
        hashes[0] = hashes[m]
    if not hits:
        return np.zeros(0, I64), np.zeros((0, ref.VIOLATION_FIELDS), I64)
    return np.concatenate(hits), np.concatenate(rows)


def _rows(kind, slot, rec, expected_chain, position, token, rkv):
    """The reference's violation rows of failing entries (records ``rec``)."""
    stored_chain = rec[:, 2].view(U64)
    bits = np.where(stored_chain != expected_chain, _CHAIN_BIT, 0)
    bits |= np.where(rec[:, 1] != position, _POSITION_BIT, 0)
    bits |= np.where(rec[:, 3] != rkv, _REAL_KV_BIT, 0)
    expected_token = np.full(rec.shape[0], -1, I64) if token is None else token
    if token is not None:
        bits |= np.where((token != -1) & (rec[:, 0] != token), _TOKEN_BIT, 0)
    return ref._rows(kind, slot, rec[:, 1], rec[:, 0], expected_token, rec[:, 2], ref._as_i64(expected_chain), bits)


# ----------------------------------------------------------------------------------------------
# plan + verify (the fused decode step)


def plan_verify(a: PlanVerifyArgs) -> None:
    """:func:`numpy_backend.plan_verify` through this module's plan and verify."""
    total = int(ref.plan_row_checks(a.plan)[2].sum())
    scratch = {k: np.empty(total if total <= a.verify_capacity else 0, I64) for k in VERIFY_ENTRY_FIELDS}
    plan(a.plan._replace(out=a.plan.out._replace(**scratch)), a.verify_capacity)
    verify(a.verify._replace(**scratch))
