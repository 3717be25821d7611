"""The canary on the CPU with NumPy: the reference every other backend matches byte for byte.

Plan and verify are vectorised over entries; write is vectorised over requests and walks the
tokens of all requests in lock-step (the chain hash is serial along a request).
Out-of-range rules (docs/usage.md, "Out-of-range values") are implemented by :func:`plan_row_checks`
and the masks below; the CUDA kernels apply the same rules.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..args import (STAGE_HEADER, STAGE_HEADER_FIELDS, VERIFY_ENTRY_FIELDS, CanaryTarget, CopyArgs, LogViews, MoveArgs, PlanArgs,
                    PlanVerifyArgs, ScatterArgs, SourceView, StageArgs, TableView, VerifyArgs, WriteArgs, stage_rings)
from ..constants import (
    SPLITMIX64_MUL1,
    SPLITMIX64_MUL2,
    SPLITMIX64_SHIFT1,
    SPLITMIX64_SHIFT2,
    SPLITMIX64_SHIFT3,
    FailReason,
    RealKvHashMode,
    REAL_KV_PARTIAL_BYTES,
    VIOLATION_FIELDS,
)
from ..hashing import ANCHOR_HASH, mix3_array, splitmix64_inplace
from ..tables import TableKind
from ..validation import I64

_ANCHOR_U64 = np.uint64(ANCHOR_HASH)


def _as_i64(u: np.ndarray) -> np.ndarray:
    return u.astype(np.uint64, copy=False).view(np.int64)


# ----------------------------------------------------------------------------------------------
# plan


_I64_MAX = np.iinfo(np.int64).max


class TableRows(NamedTuple):
    """Per batch row: what the plan reads of it (all arrays ``[bs]``)."""

    active: np.ndarray  # bool: not a padding request (a req_to_token row 0)
    ok: np.ndarray  # bool: the row lies in the table
    base: np.ndarray  # int64: the table row (req_to_token / block_table) or the first kv_indices entry
    length: np.ndarray  # int64: the row's length in tokens, the bound of prefix_lens (0 when not ok)
    pool_row: np.ndarray  # int64: the expected-token pool row


def table_rows(a: PlanArgs) -> TableRows:
    t = a.table
    bs = a.prefix_lens.shape[0]
    if t.kind == TableKind.PAGED_KV:
        indptr = np.asarray(t.kv_indptr, I64)
        lo, hi = indptr[:-1], indptr[1:]
        ok = (lo >= 0) & (lo <= hi) & (hi <= t.entries.shape[0])
        return TableRows(np.ones(bs, bool), ok, np.where(ok, lo, 0), np.where(ok, hi - lo, 0) * t.page_size,
                         np.arange(bs, dtype=I64))
    rp = np.asarray(a.req_pool_indices, I64)
    rows, cols = t.entries.shape
    ok = (rp >= 0) & (rp < rows)
    padding = rp == 0 if t.kind != TableKind.BLOCK else np.zeros(bs, bool)
    length = cols * t.page_size if t.kind == TableKind.BLOCK else cols
    return TableRows(~padding, ok, np.where(ok, rp, 0), np.full(bs, length, I64), rp)


def page_slot(ids: np.ndarray, page_size: int, offset: np.ndarray) -> np.ndarray:
    """``ids * page_size + offset``, or +-(2**63 - 1) for ids at or beyond +-((2**63 - 1) // page_size),
    whose slots could leave int64 (page_slot in plan.cu)."""
    limit = _I64_MAX // page_size
    exact = ids * page_size + offset  # wraps only where replaced below
    return np.where(ids >= limit, _I64_MAX, np.where(ids <= -limit, -_I64_MAX, exact))


def table_slots(t: TableView, base: np.ndarray, pos: np.ndarray):
    """The KV slots of positions ``pos`` of table rows ``base`` (valid rows, ``0 <= pos < length``),
    and how many virtual token ids lay past ``virtual_to_physical`` (table_slot in plan.cu)."""
    if t.kind in (TableKind.REQ_TO_TOKEN, TableKind.VIRTUAL_PAGES):
        values = t.entries[base, pos].astype(I64)
        if t.kind == TableKind.REQ_TO_TOKEN:
            return values, 0
        v2p = np.asarray(t.virtual_to_physical, I64)
        negative = values < 0  # passes through, as in a plain req_to_token
        page, offset = np.divmod(np.maximum(values, 0), t.page_size)
        past = ~negative & (page >= v2p.shape[0])
        physical = v2p[np.where(negative | past, 0, page)]
        slots = np.where(past | (physical == -1), 0, page_slot(physical, t.page_size, offset))
        return np.where(negative, values, slots), int(np.count_nonzero(past))
    if t.page_size == 1 and t.kind == TableKind.PAGED_KV:  # page_slot(ids, 1, 0): ids, INT64_MIN raised to -MAX
        ids = t.entries[base + pos]
        return (np.maximum(ids, -_I64_MAX) if ids.dtype == I64 else ids.astype(I64)), 0
    page, offset = np.divmod(pos, t.page_size)
    if t.kind == TableKind.BLOCK:
        ids = t.entries[base, page].astype(I64)
        return np.where(ids == t.null_block, 0, page_slot(ids, t.page_size, offset)), 0
    return page_slot(t.entries[base + page].astype(I64), t.page_size, offset), 0


def extend_limit(bs: int) -> int:
    """The most new tokens a request of a batch of ``bs`` plans: ``bs`` of them sum to at most
    2**63 - 1, so no write offset leaves int64 (extend_fits in plan.cu)."""
    return int(_I64_MAX) // max(bs, 1)


def plan_row_checks(a: PlanArgs):
    """Per-request quantities of a plan and the number of out-of-range values per request.

    Returns ``(rows, verify_start, verify_len, write_len, seed_ok, row_errors)``: the
    :class:`TableRows` and ``[bs]`` int64 arrays (``seed_ok`` bool).  Only active rows count.
    """
    rows = table_rows(a)
    prefix = np.asarray(a.prefix_lens, I64)
    extend = np.asarray(a.extend_seq_lens, I64)
    prefix_ok = (prefix >= 0) & (prefix <= rows.length)
    extend_ok = (extend >= 0) & (extend <= extend_limit(prefix.shape[0]))
    errors = (~rows.ok).astype(I64) + ~prefix_ok + ~extend_ok
    if a.expected_token_pool is not None:
        lens = np.asarray(a.expected_token_valid_lens, I64)
        errors += (lens < 0) | (lens > a.expected_token_pool.shape[1])
    errors = np.where(rows.active, errors, 0)

    window = a.swa_window_size
    verify_start = np.maximum(prefix - window, 0) if window > 0 else np.zeros_like(prefix)
    verify_end = np.minimum(np.maximum(prefix, 0), rows.length)  # rows.length >= 0
    verify_len = np.where(rows.active & rows.ok, np.maximum(verify_end - verify_start, 0), 0)
    write_len = np.where(rows.active & extend_ok, extend, 0)
    seed_ok = rows.active & rows.ok & prefix_ok & (prefix > 0) & (write_len > 0)
    return rows, verify_start, verify_len, write_len, seed_ok, errors


def _translate(values: np.ndarray, lut):
    """SWA LUT lookup: negatives pass through, indices past the end clamp to the last entry.

    Returns ``(translated, clamped_count)``.
    """
    if lut is None:
        return values, 0
    n = lut.shape[0]
    neg = values < 0
    over = values > n - 1
    idx = np.where(neg, 0, np.minimum(values, n - 1))
    return np.where(neg, values, lut[idx]), int(np.count_nonzero(over))


def _slots(a: PlanArgs, base, pos):
    """Table slots of ``pos`` in rows ``base``, through the SWA LUT; and the out-of-range count."""
    slots, past = table_slots(a.table, base, pos)
    slots, clamped = _translate(slots, a.swa_lut)
    return slots, past + clamped


def stale_rows_end(a: PlanArgs) -> int:
    """Rows ``[bs, end)`` of the WritePlan may hold an earlier plan's outputs (stale_rows_end in plan.cu)."""
    cap = a.out.write_seed_slot_indices.shape[0]
    previous = int(a.out.write_num_valid_reqs[0])
    return cap if a.clear_whole_capacity or not 0 <= previous <= cap else previous


def expand_entries(a: PlanArgs, rows: TableRows, verify_start, verify_len, voff, total: int) -> int:
    """Write the ``total`` (> 0) verify entries of the batch into the first entries of ``a.out``'s
    entry arrays; returns the out-of-range values met (virtual ids past the table, LUT clamps)."""
    out, bs = a.out, verify_len.shape[0]
    owner = np.repeat(np.arange(bs), verify_len)
    pos = verify_start[owner] + (np.arange(total, dtype=I64) - voff[owner])
    base = rows.base[owner]
    slots, slot_errors = _slots(a, base, pos)
    has_prev = pos > 0
    prev = np.full(total, -1, I64)
    prev[has_prev], prev_errors = _slots(a, base[has_prev], pos[has_prev] - 1)
    tokens = np.full(total, -1, I64)
    if a.expected_token_pool is not None:
        pool = a.expected_token_pool
        q = pos + a.token_offset
        limit = np.minimum(np.asarray(a.expected_token_valid_lens, I64)[owner], pool.shape[1])
        ok = (q >= 0) & (q < limit)
        tokens[ok] = pool[rows.pool_row[owner][ok], q[ok]]
    out.verify_slot_indices[:total] = slots
    out.verify_expected_tokens[:total] = tokens
    out.verify_expected_positions[:total] = pos
    out.verify_prev_slot_indices[:total] = prev
    return slot_errors + prev_errors


def plan(a: PlanArgs, verify_capacity: int | None = None, expand=None) -> None:
    """``verify_capacity`` (default: the length of the entry arrays) decides whether the entries
    are expanded (into the first entries of those arrays), by ``expand`` (default
    :func:`expand_entries`; the fast backend passes its own)."""
    out = a.out
    bs = a.prefix_lens.shape[0]
    vcap = out.verify_slot_indices.shape[0] if verify_capacity is None else verify_capacity
    rows, verify_start, verify_len, write_len, seed_ok, row_errors = plan_row_checks(a)
    errors = int(row_errors.sum())
    stale_end = stale_rows_end(a)

    prefix = np.asarray(a.prefix_lens, I64)
    seed_rows = seed_ok.nonzero()[0]
    seeds = np.full(bs, -1, I64)
    if seed_rows.size:
        seeds[seed_rows], seed_errors = _slots(a, rows.base[seed_rows], prefix[seed_rows] - 1)
        errors += seed_errors

    voff = np.zeros(bs + 1, I64)
    np.cumsum(verify_len, out=voff[1:])
    woff = np.zeros(bs + 1, I64)
    np.cumsum(write_len, out=woff[1:])
    total = int(voff[bs])
    enabled = total <= vcap
    if enabled and total > 0:
        errors += (expand or expand_entries)(a, rows, verify_start, verify_len, voff, total)

    out.verify_num_valid[0] = min(total, vcap)
    out.enable[0] = 1 if enabled else 0
    out.out_of_range_count[0] += errors
    out.write_offsets[: bs + 1] = woff
    out.verify_offsets[: bs + 1] = voff
    out.write_seed_slot_indices[:bs] = seeds
    # Nothing stale past the batch: the rows the earlier plan wrote.
    out.write_offsets[bs + 1 : stale_end + 1] = 0
    out.verify_offsets[bs + 1 : stale_end + 1] = 0
    out.write_seed_slot_indices[bs:stale_end] = -1
    out.write_num_valid_reqs[0] = bs


# ----------------------------------------------------------------------------------------------
# real-KV fingerprint and the violation ring


# The most KV bytes real_kv_hashes gathers at once (their gather indices take 8x as much), so ALL
# mode over a large batch hashes in bounded memory.
HASH_CHUNK_BYTES = 1 << 20


def _pool_slots(slots: np.ndarray, slot_offset: int):
    """The pool slots a source of ``slot_offset`` reads for canary ``slots`` (0 below it), and which
    slots lie below it (no KV bytes: their strip's hash stays 0, as the kernels fold it; None: none)."""
    if not slot_offset:
        return slots, None
    pool_slots = slots - slot_offset
    below = pool_slots < 0
    if not np.count_nonzero(below):
        return pool_slots, None
    return np.where(below, 0, pool_slots), below


def _word_gather(src: SourceView, nbytes: int):
    """``(words, row_words)`` when each slot's first ``nbytes`` bytes are whole little-endian words of
    one row, from byte_offset (page size 1, a contiguous stream) of a C-contiguous buffer of whole-word
    rows: the buffer as a flat uint64 view (row r's word c at ``r * row_words + c``); else None."""
    data = src.data
    if (src.page_size != 1 or src.unit != 16 or src.byte_offset % 8 or data.shape[1] % 8
            or not data.flags.c_contiguous):
        return None
    return data.reshape(-1).view("<u8"), data.shape[1] // 8


def _strip_words(src: SourceView, nbytes: int, pool_slots: np.ndarray, out: np.ndarray, gathers: dict) -> None:
    """The first ``nbytes`` bytes of each pool slot's stream as little-endian words into ``out``
    (``uint64 [nbytes // 8, n]``: word w of every slot together); ``gathers`` keeps the word indices
    of the sources read the same way (the K and V buffers of every layer, usually)."""
    flat = _word_gather(src, nbytes)
    if flat is not None:
        words, row_words = flat
        key = (id(pool_slots), row_words, src.byte_offset)
        index = gathers.get(key)
        if index is None:
            first = pool_slots * row_words + src.byte_offset // 8
            index = gathers[key] = first[None, :] + np.arange(nbytes // 8, dtype=I64)[:, None]
        np.take(words, index, out=out, mode="clip")  # in range: every pool slot is within the rows
        return
    if src.page_size == 1 and src.unit == 16:  # one row per slot, its bytes contiguous from byte_offset
        strips = src.data[pool_slots, src.byte_offset : src.byte_offset + nbytes]
    else:
        row = pool_slots // src.page_size
        col = src.byte_offset + (pool_slots % src.page_size) * src.stride
        offsets = np.arange(nbytes) if src.unit == 16 else src.stream_offsets(nbytes)
        strips = src.data[row[:, None], col[:, None] + offsets]
    out[...] = np.ascontiguousarray(strips).view("<u8").T


def fold_rows(hashes: np.ndarray) -> np.ndarray:
    """``acc = splitmix64(acc ^ h)`` from ``acc = 0`` over ``hashes[0], hashes[1], ...`` (uint64
    arrays of one shape): a strip's fold of its words, or a slot's fold of its sources' hashes."""
    if not len(hashes):
        return np.zeros(hashes.shape[1:], np.uint64)
    acc = np.array(hashes[0], np.uint64)  # splitmix64(0 ^ h) is splitmix64(h)
    scratch = np.empty_like(acc)
    splitmix64_inplace(acc, scratch)
    for h in hashes[1:]:
        np.bitwise_xor(acc, h, out=acc)
        splitmix64_inplace(acc, scratch)
    return acc


def strip_hashes(sources: tuple, slots: np.ndarray) -> np.ndarray:
    """uint64 ``[len(sources), len(slots)]``: each source's strip fold (``acc = splitmix64(acc ^ w)``
    over its words) of each slot; ``sources`` are ``(SourceView, nbytes)`` pairs.  Sources of one
    ``nbytes`` are folded together, word by word, in chunks of at most ``HASH_CHUNK_BYTES``."""
    out = np.zeros((len(sources), slots.shape[0]), np.uint64)
    groups: dict = {}
    for j, (_, nbytes) in enumerate(sources):
        groups.setdefault(nbytes, []).append(j)
    for nbytes, members in groups.items():
        step = max(1, HASH_CHUNK_BYTES // (nbytes * len(members)))
        for lo in range(0, slots.shape[0], step):
            part, placed, gathers = slots[lo : lo + step], {}, {}  # slot_offset -> (pool slots, below)
            words = np.empty((len(members), nbytes // 8, part.shape[0]), np.uint64)  # [sources, words, n]
            for i, j in enumerate(members):
                src = sources[j][0]
                if src.slot_offset not in placed:
                    placed[src.slot_offset] = _pool_slots(part, src.slot_offset)
                _strip_words(src, nbytes, placed[src.slot_offset][0], words[i], gathers)
            h = fold_rows(words.transpose(1, 0, 2))  # [sources, n]
            for j, row in zip(members, h):
                below = placed[sources[j][0].slot_offset][1]
                if below is not None:
                    row[below] = 0
            out[members, lo : lo + step] = h
    return out


def real_kv_hashes(sources: tuple, mode: int, slots: np.ndarray) -> np.ndarray:
    """``real_kv_hash`` (uint64) of each slot in ``slots`` (all within every source's rows)."""
    if mode == RealKvHashMode.NONE or not sources or slots.size == 0:
        return np.zeros(slots.shape[0], np.uint64)
    pairs = tuple((src, REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else src.read_bytes) for src in sources)
    return fold_rows(strip_hashes(pairs, slots))


def append_rows(log: LogViews, kind: int, rows: np.ndarray) -> None:
    """Count ``rows`` in ``violation_counters[kind]`` and append them to the fill-once ring.

    Row i takes ticket ``write_index + i`` and is kept if the ticket is in ``[0, capacity)``.
    Tickets are drawn only while the ring has room: ``write_index`` becomes
    ``min(write_index + n, capacity)`` when it was below the capacity and is left alone otherwise,
    so it never wraps; the exact totals live in ``violation_counters``.
    """
    n = rows.shape[0]
    if n == 0:
        return
    log.violation_counters[kind] += n
    capacity = log.ring.shape[0]
    base = int(log.write_index[0])
    if base >= capacity:
        return
    tickets = base + np.arange(n)
    keep = (tickets >= 0) & (tickets < capacity)
    log.ring[tickets[keep]] = rows[keep]
    log.write_index[0] = min(base + n, capacity)


def _rows(kind, slot, position, stored_token, expected_token, chain, aux, bits) -> np.ndarray:
    n = slot.shape[0]
    rows = np.empty((n, VIOLATION_FIELDS), I64)
    for col, values in enumerate((kind, slot, position, stored_token, expected_token, chain, aux, bits)):
        rows[:, col] = values
    return rows


# ----------------------------------------------------------------------------------------------
# write

#: Per caller ("verify", "write"): the last records ``_next_chains`` hashed and the result.  A step's
#: HEAD and TAIL launches hash the same records of both buffers when they agree: the second reuses it.
_last_records: dict = {}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two arrays of one dtype, without its conversions."""
    return a.shape == b.shape and not np.count_nonzero(a != b)


def _next_chains(records: np.ndarray, caller: str) -> np.ndarray:
    """``mix3(prev_hash, token, position)`` of each record (rows of a canary buffer): the chain hash
    of the record that follows it."""
    key = records[:, :3]
    last = _last_records.get(caller)  # one read: another thread may replace it meanwhile
    if last is not None and _same(last[0], key):
        return last[1]
    out = mix3_array(key[:, 2], key[:, 0], key[:, 1])
    _last_records[caller] = (key.copy(), out)
    return out



def write_range_checks(offsets, num_valid_reqs: int, num_tokens: int):
    """Each request's token range ``[start, end)`` clamped into ``[0, num_tokens]``, and a mask of
    requests whose raw range was out of range (counted once each)."""
    start_raw = np.asarray(offsets[:num_valid_reqs], I64)
    end_raw = np.asarray(offsets[1 : num_valid_reqs + 1], I64)
    start = np.minimum(np.maximum(start_raw, 0), num_tokens)  # np.clip, without its dispatch cost
    end = np.minimum(np.maximum(end_raw, start), num_tokens)
    bad = (start_raw < 0) | (start_raw > num_tokens) | (end_raw < start_raw) | (end_raw > num_tokens)
    return start, end, bad


def _flag_value(flag) -> bool:
    if isinstance(flag, (bool, np.bool_)):
        return bool(flag)
    return int(np.asarray(flag).reshape(-1)[0]) != 0


def write(a: WriteArgs) -> None:
    """Each canary buffer is written as by its own launch (the kernel gives each its own warps)."""
    for target in a.targets:
        _write_one(a, target)


def _write_one(a: WriteArgs, target: CanaryTarget, hashes=None) -> None:
    """One buffer's write; ``hashes``: the fingerprints' function (None: :func:`real_kv_hashes`; the
    fast backend passes its own)."""
    log, kind, canary = a.log, target.kernel_kind, target.canary
    num_slots = canary.shape[0]
    cap = a.write_seed_slot_indices.shape[0]
    num_reqs = min(max(int(a.write_num_valid_reqs[0]), 0), cap)
    log.kernel_run_counters[kind] += 1
    if num_reqs == 0:
        return
    num_tokens = a.input_ids.shape[0]
    seed = np.asarray(a.write_seed_slot_indices[:num_reqs], I64)
    start, end, bad_range = write_range_checks(a.write_offsets, num_reqs, num_tokens)
    # A request of another write wave is written by that wave's launch: here an empty range, no seed.
    skipped = None if a.write_waves is None else np.asarray(a.write_waves[:num_reqs]) != a.wave
    if skipped is not None:
        start, end, bad_range = np.where(skipped, 0, start), np.where(skipped, 0, end), bad_range & ~skipped
        seed = np.where(skipped, -1, seed)
    errors = int(np.count_nonzero(bad_range))

    seed_oob = seed >= num_slots
    errors += int(np.count_nonzero(seed_oob))
    seed_ok = (seed > 0) & ~seed_oob  # seed 0 is the padding slot: no predecessor, like -1
    seed_rec = canary[np.where(seed_ok, seed, 0)]
    running = np.where(
        seed_ok, _next_chains(seed_rec, "write"), _ANCHOR_U64
    )
    pos_assert = seed_ok & _flag_value(a.chain_position_assert)
    running_pos = seed_rec[:, 1].copy()

    loc = np.asarray(a.out_cache_loc, I64)
    # Fingerprints depend only on each slot's KV bytes, which a write never changes: hash every
    # in-range slot once, up front, rather than token by token inside the serial chain walk.
    in_range = (loc >= 0) & (loc < num_slots)
    if int((end - start).sum()) < loc.shape[0] or (skipped is not None and skipped.any()):  # only the tokens this launch writes
        covered = np.zeros(loc.shape[0], np.int64)
        np.add.at(covered, start[start < loc.shape[0]], 1)  # a range [T, T) at the end covers nothing
        np.add.at(covered, end[end < loc.shape[0]], -1)
        in_range &= np.cumsum(covered) > 0
    fingerprints = np.zeros(loc.shape[0], np.uint64)
    fingerprints[in_range] = (hashes or real_kv_hashes)(target.sources, a.real_kv_hash_mode, loc[in_range])
    # Every token of every request, in the order the kernel's lock-step walk takes them: the k-th
    # token of each request (requests in order), k = 0, 1, ...; the serial chain walk is the only
    # part done token by token (_chains), and only over the tokens whose slot is in range.
    length = end - start
    req = np.repeat(np.arange(num_reqs), length)
    req_first = np.cumsum(length) - length
    k = np.arange(req.shape[0], dtype=I64) - req_first[req]
    # At most one token a request (a decode step): the walk order and the request order are the token order.
    single = int(length.max()) <= 1
    order = slice(None) if single else np.lexsort((req, k))
    req, idx = req[order], start[req[order]] + k[order]
    slot = loc[idx]
    oob = slot >= num_slots
    errors += int(np.count_nonzero(oob))
    ok = (slot >= 0) & ~oob
    req, idx, slot = req[ok], idx[ok], slot[ok]
    token = np.asarray(a.input_ids[idx], I64)
    pos = np.asarray(a.positions[idx], I64)
    by_req = slice(None) if single else np.argsort(req, kind="stable")  # each request's tokens together, in walk order
    chain = np.empty(req.shape[0], np.uint64)
    chain[by_req] = _chains(running, req[by_req], token[by_req], pos[by_req])

    rows, row_keys = [], []
    if a.expected_input_tokens is not None:
        want_tok, want_pos = a.expected_input_tokens[idx], a.expected_input_positions[idx]
        bits = np.where(token != want_tok, FailReason.WRITE_TOKEN_MISMATCH.value, 0)
        bits |= np.where(pos != want_pos, FailReason.WRITE_POSITION_MISMATCH.value, 0)
        hit = bits != 0
        if np.count_nonzero(hit):
            rows.append(_rows(kind, slot[hit], pos[hit], token[hit], want_tok[hit], _as_i64(chain[hit]), want_pos[hit],
                              bits[hit]))
            row_keys.append(idx[hit] * 2)
    # the position assert: each token's position follows the request's previous in-range token
    # (its first follows the seed record), on the requests whose seed is a real slot
    r_sorted = req[by_req]
    previous = np.empty(req.shape[0], I64)
    previous[1:] = pos[by_req][:-1]
    head = np.ones(req.shape[0], bool)
    head[1:] = r_sorted[1:] != r_sorted[:-1]
    previous[head] = running_pos[r_sorted[head]]
    want = np.empty(req.shape[0], I64)
    want[by_req] = previous + 1
    hit = pos_assert[req] & (pos != want)
    if np.count_nonzero(hit):
        rows.append(_rows(kind, slot[hit], pos[hit], token[hit], token[hit], _as_i64(chain[hit]), want[hit],
                          FailReason.WRITE_POSITION_MISMATCH.value))
        row_keys.append(idx[hit] * 2 + 1)
    # The padding slot 0 keeps its bytes: padded tokens of many requests land there at once.  Later
    # tokens of the walk overwrite earlier ones, as the lock-step walk's stores do.
    stored = slot != 0
    dst = slot[stored]
    canary[dst, 0] = token[stored]
    canary[dst, 1] = pos[stored]
    canary[dst, 2] = _as_i64(chain[stored])
    canary[dst, 3] = _as_i64(fingerprints[idx[stored]])

    if rows:
        all_rows = np.concatenate(rows)
        append_rows(log, kind, all_rows[np.argsort(np.concatenate(row_keys), kind="stable")])
    log.slot_run_counters[kind] += int(req.shape[0])
    log.out_of_range_counters[kind] += errors


#: Tokens per request above which the chain walk runs on NumPy arrays (all requests in lock-step)
#: rather than on Python ints (token by token): each lock-step round costs about as much as this many
#: Python-int mix3 steps.
LOCKSTEP_TOKENS_PER_ROUND = 12
_M64 = (1 << 64) - 1
#: The last walk's inputs and result: a step's HEAD and TAIL writes walk the same chains (the same
#: seeds, tokens and positions) when both buffers agree, and the second one reuses the first's.
_last_walk: tuple = ()


def _chains(running: np.ndarray, req: np.ndarray, token: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The chain hash (uint64) before each token, for tokens grouped by request (``req`` sorted, each
    request's tokens in order): a request's first token gets ``running[req]``, each next one
    ``mix3(chain, token, position)`` of the token before it."""
    global _last_walk
    seeds = running[req]
    if not np.count_nonzero(req[1:] == req[:-1]):  # one token a request: each chain is its seed
        return seeds
    last = _last_walk  # one read: another thread may replace it meanwhile
    if last and _same(last[0], seeds) and _same(last[1], req) and _same(last[2], token) and _same(last[3], pos):
        return last[4]
    n = req.shape[0]
    out = np.empty(n, np.uint64)
    if n:
        head = np.ones(n, bool)
        head[1:] = req[1:] != req[:-1]
        rank = np.arange(n) - np.maximum.accumulate(np.where(head, np.arange(n), 0))
        rounds = int(rank.max()) + 1
        if n <= LOCKSTEP_TOKENS_PER_ROUND * rounds:
            _walk_ints(out, seeds.tolist(), head.tolist(), token.tolist(), pos.tolist())
        else:
            _walk_lockstep(out, running, req, rank, rounds, token, pos)
    _last_walk = (seeds, req, token, pos, out)
    return out


def _walk_ints(out: np.ndarray, seeds: list, head: list, token: list, pos: list) -> None:
    """The chain walk on Python ints: ``mix3`` (hashing.py) written out, one token at a time."""
    m, m1, m2, s1, s2, s3 = _M64, SPLITMIX64_MUL1, SPLITMIX64_MUL2, SPLITMIX64_SHIFT1, SPLITMIX64_SHIFT2, SPLITMIX64_SHIFT3
    chains, h = [], 0
    keep = chains.append
    for seed, first, t, p in zip(seeds, head, token, pos):
        if first:
            h = seed
        keep(h)
        h ^= h >> s1
        h = (h * m1) & m
        h ^= h >> s2
        h = (h * m2) & m
        h ^= (h >> s3) ^ (t & m)
        h ^= h >> s1
        h = (h * m1) & m
        h ^= h >> s2
        h = (h * m2) & m
        h ^= (h >> s3) ^ (p & m)
        h ^= h >> s1
        h = (h * m1) & m
        h ^= h >> s2
        h = (h * m2) & m
        h ^= h >> s3
    out[:] = chains


def _walk_lockstep(out, running, req, rank, rounds: int, token, pos) -> None:
    """The chain walk on arrays: the j-th token of every request at once, j = 0, 1, ..."""
    by_rank = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[by_rank], np.arange(rounds + 1))
    current = running.copy()
    for j in range(rounds):
        sel = by_rank[bounds[j] : bounds[j + 1]]
        r = req[sel]
        chain = current[r]
        out[sel] = chain
        current[r] = mix3_array(chain, token[sel], pos[sel])


# ----------------------------------------------------------------------------------------------
# verify


def verify(a: VerifyArgs) -> None:
    """Each canary buffer is verified as by its own launch (the kernel interleaves them)."""
    for target in a.targets:
        _verify_one(a, target)


def is_padding_slot(slot: np.ndarray) -> np.ndarray:
    """Which verify slots are the padding slot: never checked; with ``check_holes``, holes
    (is_padding_slot in canary_common.cuh)."""
    return slot == 0


def _hole_rows(kind: int, a: VerifyArgs, entries: np.ndarray, expected_tok: np.ndarray) -> np.ndarray:
    """The hole rows of the entries ``entries`` (docs/format.md, sections 5 and 6): slot, expected position,
    stored token -1, stored chain 0, the entry index in expected_aux, VERIFY_TABLE_HOLE."""
    slot = np.asarray(a.verify_slot_indices, I64)[entries]
    position = np.asarray(a.verify_expected_positions, I64)[entries]
    return _rows(kind, slot, position, -1, expected_tok, 0, entries, FailReason.VERIFY_TABLE_HOLE.value)


def verify_launch(a: VerifyArgs, kind: int) -> int | None:
    """A verify launch's counters (every launch; its entries only when the plan is enabled) and
    its active entries, None when the plan is disabled."""
    a.log.kernel_run_counters[kind] += 1
    if int(a.enable[0]) == 0:
        return None
    active = min(max(int(a.verify_num_valid[0]), 0), a.verify_slot_indices.shape[0])
    a.log.slot_run_counters[kind] += active
    return active


def _verify_one(a: VerifyArgs, target: CanaryTarget) -> None:
    log, kind, canary = a.log, target.kernel_kind, target.canary
    num_slots = canary.shape[0]
    active = verify_launch(a, kind)
    if active is None:
        return
    slot = np.asarray(a.verify_slot_indices[:active], I64)
    slot_oob = (slot < 0) | (slot >= num_slots)
    errors = int(np.count_nonzero(slot_oob))
    padding = is_padding_slot(slot)
    holes = padding.nonzero()[0] if a.check_holes else np.zeros(0, I64)
    keep = (~padding & ~slot_oob).nonzero()[0]
    slot = slot[keep]
    prev = np.asarray(a.verify_prev_slot_indices[:active], I64)[keep]
    prev_oob = prev >= num_slots
    errors += int(np.count_nonzero(prev_oob))
    log.out_of_range_counters[kind] += errors
    all_tok = (np.asarray(a.verify_expected_tokens[:active], I64) if a.check_expected_token
               else np.full(active, -1, I64))
    if keep.size == 0:
        if holes.size:
            append_rows(log, kind, _hole_rows(kind, a, holes, all_tok[holes]))
        return

    stored = canary[slot, :4]
    prev_ok = (prev > 0) & ~prev_oob
    prev_rec = canary[np.where(prev_ok, prev, 0)]
    expected_chain = np.where(
        prev < 0, _ANCHOR_U64, _next_chains(prev_rec, "verify")
    )
    reachable = (prev < 0) | prev_ok
    stored_chain = stored[:, 2].view(np.uint64)
    expected_chain = np.where(reachable, expected_chain, stored_chain)
    expected_pos = np.asarray(a.verify_expected_positions[:active], I64)[keep]
    expected_tok = all_tok[keep]
    expected_rkv = _as_i64(real_kv_hashes(target.sources, a.real_kv_hash_mode, slot))

    bits = np.where(stored_chain != expected_chain, _BIT_CHAIN, _BIT_NONE)
    bits |= np.where(stored[:, 1] != expected_pos, _BIT_POSITION, _BIT_NONE)
    bits |= np.where(stored[:, 3] != expected_rkv, _BIT_REAL_KV, _BIT_NONE)
    if a.check_expected_token:
        token_bad = (expected_tok != -1) & (stored[:, 0] != expected_tok)
        bits |= np.where(token_bad, _BIT_TOKEN, _BIT_NONE)
    hit = bits != 0
    if not holes.size:
        if np.count_nonzero(hit):
            append_rows(log, kind, _rows(kind, slot[hit], stored[hit, 1], stored[hit, 0], expected_tok[hit],
                                         stored[hit, 2], _as_i64(expected_chain[hit]), bits[hit]))
        return
    rows = _rows(kind, slot[hit], stored[hit, 1], stored[hit, 0], expected_tok[hit], stored[hit, 2],
                 _as_i64(expected_chain[hit]), bits[hit])
    hole_rows = _hole_rows(kind, a, holes, all_tok[holes])  # entry order, holes among the checked entries' rows
    append_rows(log, kind, np.concatenate([rows, hole_rows])[np.argsort(np.concatenate([keep[hit], holes]), kind="stable")])


#: The verify fail bits as 0-d arrays (np.where converts a Python int operand on every call).
_BIT_CHAIN, _BIT_POSITION, _BIT_REAL_KV, _BIT_TOKEN, _BIT_NONE = (np.array(v, I64) for v in (
    FailReason.VERIFY_CHAIN_HASH_MISMATCH.value, FailReason.VERIFY_POSITION_MISMATCH.value,
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH.value, FailReason.VERIFY_TOKEN_MISMATCH.value, 0))


# ----------------------------------------------------------------------------------------------
# plan + verify (the fused decode step)

def plan_verify_stores_entries(bs: int) -> bool:
    """plan_and_verify on the CPU never stores its entries (see :func:`plan_verify`)."""
    return False


def plan_verify(a: PlanVerifyArgs) -> None:
    """:func:`plan` then :func:`verify` through scratch entry arrays of exactly the plan's entries:
    the caller's VerifyPlan gets the plan's counters, never its entries."""
    total = int(plan_row_checks(a.plan)[2].sum())
    scratch = {k: np.empty(total if total <= a.verify_capacity else 0, I64) for k in VERIFY_ENTRY_FIELDS}
    plan(a.plan._replace(out=a.plan.out._replace(**scratch)), a.verify_capacity)
    verify(a.verify._replace(**scratch))


# ----------------------------------------------------------------------------------------------
# scatter


def scatter_row_checks(a: ScatterArgs):
    """Per request: pool row (-1 when it writes nothing), source start, the pool columns
    ``[lo, hi)`` it writes (those below ``min(length, cols)`` with a source inside ``flat_in``),
    and whether a value was out of range.  The kernel's ``scatter_row`` computes the same."""
    rp = np.asarray(a.req_pool_indices, I64)
    offsets = np.asarray(a.offsets, I64)
    rows, cols = a.pool_out.shape
    n = a.flat_in.shape[0]
    start = offsets[:-1]
    length = offsets[1:] - start  # wraps on overflow, like the kernel's unsigned difference
    width = np.clip(length, 0, cols)
    none = (start >= n) | (start < -width)
    lo = np.where(none | (start >= 0), 0, -start)
    hi = np.where(none, 0, np.minimum(width, n - start))
    rp_ok = (rp >= 0) & (rp < rows)
    bad = ~rp_ok | (length < 0) | (hi - lo < width)
    return np.where(rp_ok & (lo < hi), rp, -1), start, lo, hi, bad


def scatter(a: ScatterArgs) -> None:
    rp, start, lo, hi, bad = scatter_row_checks(a)
    if a.out_of_range_count is not None:
        a.out_of_range_count[0] += int(np.count_nonzero(bad))
    width = np.where(rp >= 0, hi - lo, 0)
    total = int(width.sum())
    if total == 0:
        return
    owner = np.repeat(np.arange(rp.shape[0]), width)  # batch rows in increasing order
    first = np.zeros(rp.shape[0] + 1, I64)
    np.cumsum(width, out=first[1:])
    col = lo[owner] + np.arange(total, dtype=I64) - first[owner]
    writers = rp[width > 0]
    if np.unique(writers).size < writers.size:
        # Rows share a pool row: per (pool row, column) the largest batch row writing it wins.
        # NumPy leaves the winner of a repeated fancy-index assignment unspecified, so keep it alone.
        key = rp[owner] * a.pool_out.shape[1] + col
        _, last = np.unique(key[::-1], return_index=True)
        keep = total - 1 - last
        owner, col = owner[keep], col[keep]
    a.pool_out[rp[owner], col] = a.flat_in[start[owner] + col].astype(np.int32)


# ----------------------------------------------------------------------------------------------
# session staging (kernels/session.cu)

_WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH.value | FailReason.WRITE_POSITION_MISMATCH.value
_HOLE_BIT = FailReason.VERIFY_TABLE_HOLE.value


def session_stage(a: StageArgs, stamp: int) -> None:
    """Snapshot the log into ``a.staging``, reset ``write_index`` and attribute verify rows.

    The record (layout ``a.layout``) gets the header, the four counter arrays and, share after
    share (:func:`stage_rings`), the ring rows ``[0, min(write_index[g], share))`` of each share g
    of the ring; every slot named by a verify row gets ``marks[slot] =
    stamp``; then the plan's active verify entries that read a marked slot are listed (the first
    ``attribution_capacity`` of them; ``matches`` counts them all) with their batch row.
    """
    layout, log, out = a.layout, a.log, a.staging
    kinds, (rings, share) = layout.num_kinds, stage_rings(log)
    counts = [min(max(int(log.write_index[g]), 0), share) for g in range(rings)]
    n = sum(counts)
    header = dict(rows=n, stamp=stamp, matches=0, enable=int(a.enable[0]), verify_num_valid=int(a.verify_num_valid[0]),
                  batch_size=int(a.write_num_valid_reqs[0]), plan_out_of_range=int(a.plan_out_of_range_count[0]))
    out[:STAGE_HEADER_FIELDS] = [header[k] for k in STAGE_HEADER] + [0] * (STAGE_HEADER_FIELDS - len(STAGE_HEADER))
    for i, counters in enumerate((log.violation_counters, log.slot_run_counters, log.kernel_run_counters,
                                  log.out_of_range_counters)):
        out[layout.counters + i * kinds : layout.counters + (i + 1) * kinds] = counters
    if n == 0:  # a clean step (most): no rows to copy, no slot to mark, nothing to attribute
        log.write_index[:] = 0
        return
    rows = np.concatenate([log.ring[g * share : g * share + c] for g, c in enumerate(counts)])
    out[layout.ring : layout.ring + n * VIOLATION_FIELDS] = rows.reshape(-1)
    num_slots = a.marks.shape[0]
    slots = rows[:, 1]
    # the padding slot only by a hole row (VERIFY_TABLE_HOLE): its readers are the hole's
    named = (slots > 0) | ((slots == 0) & ((rows[:, 7] & _HOLE_BIT) != 0))
    a.marks[slots[((rows[:, 7] & _WRITE_BITS) == 0) & named & (slots < num_slots)]] = stamp
    log.write_index[:] = 0
    if header["enable"] == 0:
        return

    active = min(max(header["verify_num_valid"], 0), a.verify_slot_indices.shape[0])
    bs = min(max(header["batch_size"], 0), a.verify_offsets.shape[0] - 1)
    entry_slots = np.asarray(a.verify_slot_indices[:active], I64)
    in_range = (entry_slots >= 0) & (entry_slots < num_slots)
    entries = np.nonzero(in_range)[0]
    entries = entries[a.marks[entry_slots[entries]] == stamp]
    out[STAGE_HEADER.index("matches")] = entries.size
    entries = entries[: layout.attribution_capacity]
    rows_before = np.searchsorted(np.asarray(a.verify_offsets[1 : bs + 1], I64), entries, side="right")
    batch_row = np.where(rows_before < bs, rows_before, -1)
    records = np.stack([entry_slots[entries], batch_row, entries, a.verify_expected_positions[entries],
                        a.verify_prev_slot_indices[entries], a.verify_expected_tokens[entries]], axis=1)
    out[layout.attribution : layout.attribution + records.size] = records.reshape(-1)


def prepare_stage(a: StageArgs):
    """``stage(stamp, stream=None, staging=None)``: :func:`session_stage` on fixed arguments, into
    the record ``staging`` (an int64 array of ``a.layout.size``; None: ``a.staging``); ``stream`` unused."""
    stage_rings(a.log)  # refused when bound, as the CUDA stager is
    return lambda stamp, stream=None, staging=None: session_stage(a if staging is None else a._replace(staging=staging), stamp)


# ----------------------------------------------------------------------------------------------
# move_pages


def move_pair_checks(a: MoveArgs):
    """``(src, dst, src_ok, dst_ok)``: the page ids as int64 and which lie in the canary's whole pages."""
    num_pages = a.canary.shape[0] // a.page_size
    src, dst = np.asarray(a.src_pages, I64), np.asarray(a.dst_pages, I64)
    return src, dst, (src >= 0) & (src < num_pages), (dst >= 0) & (dst < num_pages)


def move(a: MoveArgs) -> None:
    src, dst, src_ok, dst_ok = move_pair_checks(a)
    if a.out_of_range_count is not None:
        a.out_of_range_count[0] += int(np.count_nonzero(~src_ok) + np.count_nonzero(~dst_ok))
    src, dst = src[src_ok & dst_ok], dst[src_ok & dst_ok]
    num_pages = a.canary.shape[0] // a.page_size
    if num_pages == 0:  # a canary smaller than one page: every id was out of range
        return
    pages = a.canary[: num_pages * a.page_size].reshape(num_pages, -1)  # a view: the canary is contiguous
    rows = pages[src]  # a copy
    pages[src] = 0
    _, last = np.unique(dst[::-1], return_index=True)  # a repeated destination takes its last pair
    keep = dst.shape[0] - 1 - last
    pages[dst[keep]] = rows[keep]


# ----------------------------------------------------------------------------------------------
# copy_pages


def copy_pair_checks(a: CopyArgs):
    """``(src, dst, src_ok, dst_ok)``: the page ids as int64 and which lie in their buffer's whole pages."""
    src, dst = np.asarray(a.src_pages, I64), np.asarray(a.dst_pages, I64)
    src_pages, dst_pages = a.src_canary.shape[0] // a.page_size, a.dst_canary.shape[0] // a.page_size
    return src, dst, (src >= 0) & (src < src_pages), (dst >= 0) & (dst < dst_pages)


def copy(a: CopyArgs) -> None:
    src, dst, src_ok, dst_ok = copy_pair_checks(a)
    if a.out_of_range_count is not None:
        a.out_of_range_count[0] += int(np.count_nonzero(~src_ok) + np.count_nonzero(~dst_ok))
    keep = src_ok & dst_ok
    src, dst = src[keep], dst[keep]
    if src.size == 0:
        return
    size = a.page_size
    src_view = a.src_canary[: (a.src_canary.shape[0] // size) * size].reshape(-1, size * a.src_canary.shape[1])
    dst_view = a.dst_canary[: (a.dst_canary.shape[0] // size) * size].reshape(-1, size * a.dst_canary.shape[1])
    rows = src_view[src]  # a copy first: a destination that is also a source gets its rows from before
    _, last = np.unique(dst[::-1], return_index=True)  # a repeated destination takes its last pair
    keep = dst.shape[0] - 1 - last
    dst_view[dst[keep]] = rows[keep]
