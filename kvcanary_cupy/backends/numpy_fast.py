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

* **write**: a decode step's (request r writes token r alone) without the general walk's
  bookkeeping; any other write is the reference's, both with this module's fingerprints.
* **real-KV fingerprints** (PARTIAL, sources read as whole words): one index for the sources read
  alike, and for a few slots the serial fold of the sources on Python-int lanes.

Everything else (the page ops, staging, other tables) is the reference's.
``tests/ops/test_numpy_fast.py`` compares every output with the reference on randomized inputs.
"""

from __future__ import annotations

import numpy as np

from ..args import VERIFY_ENTRY_FIELDS, CanaryTarget, PlanArgs, PlanVerifyArgs, VerifyArgs
from ..constants import SPLITMIX64_SHIFT1
from ..constants import FailReason, RealKvHashMode
from ..hashing import ANCHOR_HASH, splitmix64_inplace
from ..tables import TableKind
from ..validation import I64
from . import numpy_backend as ref
from .numpy_kv import _decode_requests, _write_decode, real_kv_hashes
from .numpy_paged import _pool_runs, plan_paged_rows, prepare_stage

__all__ = ["copy", "move", "plan", "plan_verify", "plan_verify_stores_entries", "prepare_stage", "scatter", "verify",
           "write"]

U64 = np.uint64
_ANCHOR = U64(ANCHOR_HASH)
_SHIFT1 = U64(SPLITMIX64_SHIFT1)
_CHAIN_BIT = FailReason.VERIFY_CHAIN_HASH_MISMATCH.value
_POSITION_BIT = FailReason.VERIFY_POSITION_MISMATCH.value
_REAL_KV_BIT = FailReason.VERIFY_REAL_KV_HASH_MISMATCH.value
_TOKEN_BIT = FailReason.VERIFY_TOKEN_MISMATCH.value
#: The plan joins slices of the table's rows for runs of at least this many entries a request on
#: average, else gathers them (a slice costs about as much as 400 entries' bytes).
SLICE_MIN_RUN = 400
#: Entries a group of requests of the plan's gather spans (its index arrays stay in the L3; fewer calls).
GATHER_GROUP = 65536
#: Entries verified per chunk: its hashes and masks stay in a 512 KiB L2 (its 32-byte records about do).
VERIFY_CHUNK = 16384
#: No failing entries, no rows (read-only: appending no rows writes nothing).
_NO_HITS, _NO_ROWS = np.zeros(0, I64), np.zeros((0, ref.VIOLATION_FIELDS), I64)
_NO_HITS.flags.writeable = _NO_ROWS.flags.writeable = False
_FIRST = np.zeros(1, I64)  # the first entry of a verify: its predecessor is never the entry before it
_FIRST.flags.writeable = False


# ----------------------------------------------------------------------------------------------
# the reference's ops, looked up when called (so a test that replaces one in numpy_backend sees it)


def write(a) -> None:
    """:func:`numpy_backend.write`; a decode step's (request r writes token r alone, every range valid,
    no waves) through :func:`_write_decode`, which skips the general walk's bookkeeping."""
    n = _decode_requests(a)
    for target in a.targets:
        if n:
            _write_decode(a, target, n)
        else:
            ref._write_one(a, target, real_kv_hashes)


def move(a) -> None:
    ref.move(a)


def copy(a) -> None:
    ref.copy(a)


def scatter(a) -> None:
    ref.scatter(a)


def plan_verify_stores_entries(bs: int) -> bool:
    return ref.plan_verify_stores_entries(bs)


# ----------------------------------------------------------------------------------------------
# plan


def plan(a: PlanArgs, verify_capacity: int | None = None) -> None:
    """:func:`numpy_backend.plan`; through a plain req_to_token its entries are expanded by runs; a
    small batch through a page-size-1 kv_indices whose every row is in range, by :func:`plan_paged_rows`."""
    kind = a.table.kind
    if kind == TableKind.PAGED_KV and plan_paged_rows(a, verify_capacity):
        return
    ref.plan(a, verify_capacity, expand=expand_runs if kind == TableKind.REQ_TO_TOKEN else None)


def expand_runs(a: PlanArgs, rows, verify_start, verify_len, voff, total: int) -> int:
    """:func:`numpy_backend.expand_entries` for a plain req_to_token: request r's entries are
    positions ``[start, start + len)`` of table row ``base``, so every array is a join of runs:
    slices of the rows joined, or (short runs, where a slice a request would cost more than its
    entries) gathered through computed indices, in groups of requests that stay in the cache."""
    out, table = a.out, a.table.entries
    live = np.flatnonzero(verify_len)
    base, start, length = rows.base[live], verify_start[live], verify_len[live]
    slots, positions = out.verify_slot_indices[:total], out.verify_expected_positions[:total]
    flat = _flat_view(table) if total < SLICE_MIN_RUN * live.size else None
    if flat is None:
        b, s, n = base.tolist(), start.tolist(), length.tolist()
        np.concatenate([table[r, x : x + k] for r, x, k in zip(b, s, n)], out=slots, casting="same_kind")
        ramp = np.arange(int((start + length).max()), dtype=I64)
        np.concatenate([ramp[x : x + k] for x, k in zip(s, n)], out=positions)
    else:
        _gather_runs(flat, base, start, length, voff[live], slots, positions)
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
    tokens = out.verify_expected_tokens[:total]
    if a.expected_token_pool is None:
        tokens.fill(-1)
    else:
        _pool_runs(a, live, rows.pool_row[live], start.tolist(), length.tolist(), tokens)
    return errors


def _flat_view(table):
    """``(flat, row_stride)``: the table's buffer as a 1-D view, (r, c) at ``r * row_stride + c``;
    None for a row stride that is negative or not a whole number of entries."""
    item, row_bytes = table.itemsize, table.strides[0]
    if row_bytes < 0 or row_bytes % item or table.strides[1] != item:
        return None
    row_stride = row_bytes // item
    span = (table.shape[0] - 1) * row_stride + table.shape[1]
    return np.lib.stride_tricks.as_strided(table, shape=(span,), strides=(item,)), row_stride


def _gather_runs(flat, base, start, length, first, slots, positions) -> None:
    """Slots and positions of the runs (request r: ``length[r]`` entries from ``first[r]``) by one
    gather a group of requests of about GATHER_GROUP entries, its index arrays cache-sized."""
    flat, row_stride = flat
    total = slots.shape[0]
    cuts = np.searchsorted(first, np.arange(GATHER_GROUP, total, GATHER_GROUP))
    bounds = [0, *np.unique(cuts[(cuts > 0) & (cuts < first.shape[0])]).tolist(), first.shape[0]]
    ends = (first + length).tolist()
    firsts = first.tolist()
    widest = max(ends[j - 1] - firsts[i] for i, j in zip(bounds, bounds[1:]))
    ramp = np.arange(widest, dtype=I64)
    shift, row_first = start - first, base * row_stride
    index, values = np.empty(widest, I64), np.empty(widest, flat.dtype)
    for i, j in zip(bounds, bounds[1:]):
        lo, hi = firsts[i], ends[j - 1]
        m, runs = hi - lo, length[i:j]
        pos = positions[lo:hi]
        np.add(ramp[:m], np.repeat(shift[i:j] + lo, runs), out=pos)  # start + (entry - first)
        idx = index[:m]
        np.add(np.repeat(row_first[i:j], runs), pos, out=idx)
        np.take(flat, idx, out=values[:m], mode="clip")  # every index lies in a row's run
        np.copyto(slots[lo:hi], values[:m], casting="same_kind")


# ----------------------------------------------------------------------------------------------
# verify


def verify(a: VerifyArgs) -> None:
    """:func:`numpy_backend.verify`: each canary buffer as by its own launch."""
    for target in a.targets:
        _verify_one(a, target)


def _verify_one(a: VerifyArgs, target: CanaryTarget) -> None:
    log, kind, canary = a.log, target.kernel_kind, target.canary
    num_slots = canary.shape[0]
    active = ref.verify_launch(a, kind)
    if not active:  # disabled or empty
        return
    slot = np.asarray(a.verify_slot_indices[:active], I64)
    prev = np.asarray(a.verify_prev_slot_indices[:active], I64)
    position = np.asarray(a.verify_expected_positions[:active], I64)
    token = np.asarray(a.verify_expected_tokens[:active], I64) if a.check_expected_token else None
    errors, keep, holes = 0, None, _NO_HITS
    facts = _clean_entries(slot, prev, num_slots)
    if facts is None:  # padding or out-of-range slots: the reference's masks
        slot_oob = (slot < 0) | (slot >= num_slots)
        errors = int(np.count_nonzero(slot_oob))
        padding = ref.is_padding_slot(slot)
        holes = np.flatnonzero(padding) if a.check_holes else holes
        keep = np.flatnonzero(~padding & ~slot_oob)
        slot, prev, position = slot[keep], prev[keep], position[keep]
        token = None if token is None else token[keep]
        if prev.size and int(prev.max()) >= num_slots:
            errors += int(np.count_nonzero(prev >= num_slots))
        links = None
    else:
        prev_errors, links = facts
        errors += prev_errors
    log.out_of_range_counters[kind] += errors
    hole_rows = _NO_ROWS
    if holes.size:
        hole_tokens = np.asarray(a.verify_expected_tokens, I64)[holes] if a.check_expected_token else np.full(holes.size, -1, I64)
        hole_rows = ref._hole_rows(kind, a, holes, hole_tokens)
    if slot.size == 0:
        ref.append_rows(log, kind, hole_rows)
        return
    hit, rows = _failures(kind, canary, slot, prev, position, token, target.sources, a.real_kv_hash_mode, links)
    if holes.size:  # entry order, holes among the checked entries' rows
        entries = hit if keep is None else keep[hit]
        rows = np.concatenate([rows, hole_rows])[np.argsort(np.concatenate([entries, holes]), kind="stable")]
    ref.append_rows(log, kind, rows)


#: The last verify's entries (copies) and what :func:`_clean_entries` derived from them: a step's TAIL
#: verify reads its HEAD verify's plan (compared, never assumed; one read: threads may replace it).
_last_entries: dict = {}


def _clean_entries(slot, prev, num_slots):
    """None when a slot is the padding slot or out of range; else ``(prev_errors, links)``: the
    predecessors past the buffer, and :func:`_links` of the entries."""
    size = min(slot.shape[0], VERIFY_CHUNK)
    last = _last_entries.get("verify")
    if last is not None and last[0] == (num_slots, size) and ref._same(last[1], slot) and ref._same(last[2], prev):
        return last[3]
    if int(slot.min()) <= 0 or int(slot.max()) >= num_slots:
        return None
    prev_errors = int(np.count_nonzero(prev >= num_slots)) if prev.size and int(prev.max()) >= num_slots else 0
    facts = prev_errors, _links(num_slots, slot, prev, size)
    _last_entries["verify"] = ((num_slots, size), slot.copy(), prev.copy(), facts)
    return facts


def _links(num_slots, slot, prev, size):
    """How the entries chain, for :func:`_failures` in chunks of ``size``: :func:`_irregular`'s four
    arrays, each chunk's first irregular entry (and the end), the most a chunk has, and whether any
    predecessor is unreachable."""
    irregular, source, anchored, unreachable = _irregular(num_slots, slot, prev)
    n = slot.shape[0]
    bounds = np.searchsorted(irregular, np.arange(0, n + size, size)).tolist()  # each chunk's irregular entries
    extra = max(j - i for i, j in zip(bounds, bounds[1:]))  # the most irregular entries a chunk has
    return irregular, source, anchored, unreachable, bounds, extra, bool(unreachable.any())


def _irregular(num_slots, slot, prev):
    """The entries whose predecessor is not the entry before them (the first entry among them), the
    slot of each one's predecessor record (0 where there is none), which of them follow the anchor
    (prev < 0) and which have no reachable predecessor (0 or past the buffer: the chain is not
    checked, as the reference's expected chain is then the stored one)."""
    irregular = np.concatenate([_FIRST, np.flatnonzero(prev[1:] != slot[:-1]) + 1])
    p = prev[irregular]
    ok = (p > 0) & (p < num_slots)
    anchored = p < 0
    return irregular, np.where(ok, p, 0), anchored, ~(ok | anchored)


def record_hashes(records, h, scratch) -> None:
    """``h[j]`` = mix3(prev_hash, token, position) of record j (uint64 views), in place: 26 elementwise passes."""
    np.right_shift(records[:, 2], _SHIFT1, out=scratch)  # the first xorshift reads the column itself
    np.bitwise_xor(records[:, 2], scratch, out=h)
    splitmix64_inplace(h, scratch, first=False)
    np.bitwise_xor(h, records[:, 0], out=h)
    splitmix64_inplace(h, scratch)
    np.bitwise_xor(h, records[:, 1], out=h)
    splitmix64_inplace(h, scratch)


#: The records the last verify chunk hashed (their hashed fields, a copy) and their hashes: a step's
#: TAIL verify gathers its HEAD verify's records, equal in both buffers when they agree.
_last_hashed: dict = {}


def _hashed_records(records, h, scratch, remember: bool) -> None:
    """:func:`record_hashes` of ``records`` (int64 rows) into ``h``, or the last call's hashes when
    its records held the same three hashed fields (compared); ``remember``: whether this call may
    take or leave them (a verify of one chunk: only such a verify's records come back whole)."""
    if not remember:
        record_hashes(records.view(U64), h, scratch)
        return
    key = records[:, :3]
    last = _last_hashed.get("verify")  # one read: another thread may replace it meanwhile
    if last is not None and ref._same(last[0], key):
        h[...] = last[1]
        return
    record_hashes(records.view(U64), h, scratch)
    _last_hashed["verify"] = (key.copy(), h.copy())


def _failures(kind, canary, slot, prev, position, token, sources, mode, links=None):
    """``(hit, rows)``: the indices of the failing entries among ``slot`` (all in range and not
    the padding slot) and their violation rows, as the reference computes them; ``links``: the
    entries' :func:`_links` (None: derived here)."""
    n = slot.shape[0]
    size = min(n, VERIFY_CHUNK)
    if links is None:
        links = _links(canary.shape[0], slot, prev, size)
    irregular, source, anchored, unreachable, bounds, extra, any_unreachable = links
    # A chunk's records, then its irregular entries' predecessors' records (hashed with them);
    # hashes[1 + j] = mix3 of record j; hashes[0] that of the record before the chunk.
    records = np.empty((size + extra, canary.shape[1]), I64)
    hashes, scratch = np.empty(size + extra + 1, U64), np.empty(size + extra, U64)
    bad, check = np.empty(size, bool), np.empty(size, bool)
    real_kv = mode != RealKvHashMode.NONE and bool(sources)
    hits, rows = [], []
    for k, lo in enumerate(range(0, n, size)):
        hi = min(lo + size, n)
        m = hi - lo
        first, last = bounds[k], bounds[k + 1]
        r = last - first
        # in range (the predecessors are slots of the buffer or 0): clip only skips the buffered check
        np.take(canary, slot[lo:hi], axis=0, out=records[:m], mode="clip")
        if r:
            np.take(canary, source[first:last], axis=0, out=records[m : m + r], mode="clip")
        _hashed_records(records[: m + r], hashes[1 : m + r + 1], scratch[: m + r], n <= size)
        rec = records[:m]
        u = rec.view(U64)
        expected = hashes[:m]
        if r:
            at = irregular[first:last] - lo
            expected[at] = np.where(anchored[first:last], _ANCHOR, hashes[m + 1 : m + r + 1])
            if any_unreachable:
                lost = at[unreachable[first:last]]
                expected[lost] = u[lost, 2]
        b, c = bad[:m], check[:m]
        np.not_equal(u[:, 2], expected, out=b)
        np.not_equal(rec[:, 1], position[lo:hi], out=c)
        b |= c
        rkv = ref._as_i64(real_kv_hashes(sources, mode, slot[lo:hi])) if real_kv else 0
        if real_kv or rec[:, 3].any():  # without sources the expected fingerprint is 0
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
        return _NO_HITS, _NO_ROWS
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
