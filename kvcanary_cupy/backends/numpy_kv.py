"""The NumPy backend's decode write and real-KV fingerprints (used by :mod:`.numpy_fast`): the same
bytes as :mod:`.numpy_backend`'s, with fewer array calls for a decode step's few tokens."""

from __future__ import annotations

import numpy as np

from ..args import CanaryTarget, SourceViews
from ..constants import (REAL_KV_PARTIAL_BYTES, SPLITMIX64_MUL1, SPLITMIX64_MUL2, SPLITMIX64_SHIFT1, SPLITMIX64_SHIFT2,
                         SPLITMIX64_SHIFT3, FailReason, RealKvHashMode)
from ..hashing import ANCHOR_HASH, splitmix64_inplace
from ..validation import I64
from . import numpy_backend as ref

U64 = np.uint64
_ANCHOR = U64(ANCHOR_HASH)
_WRITE_TOKEN_BIT = FailReason.WRITE_TOKEN_MISMATCH.value
_WRITE_POSITION_BIT = FailReason.WRITE_POSITION_MISMATCH.value


# ----------------------------------------------------------------------------------------------
# write

_ramp = np.arange(0, dtype=I64)  # 0, 1, ...: a decode step's write offsets


def _decode_requests(a) -> int:
    """The requests of a write whose offsets are ``0, 1, ..., n`` (n >= 1 requests of one token each,
    all within the tokens) without write waves; else 0 (the general write)."""
    global _ramp
    if a.write_waves is not None:
        return 0
    n = min(max(int(a.write_num_valid_reqs[0]), 0), a.write_seed_slot_indices.shape[0])
    if n == 0 or n > a.input_ids.shape[0]:
        return 0
    ramp = _ramp
    if ramp.shape[0] <= n:
        ramp = _ramp = np.arange(2 * n + 2, dtype=I64)
    offsets = a.write_offsets[: n + 1]
    return n if offsets.dtype == I64 and not np.count_nonzero(offsets != ramp[: n + 1]) else 0


def _write_decode(a, target: CanaryTarget, n: int) -> None:
    """:func:`numpy_backend._write_one` when request r writes token r alone: the walk order is the
    token order, every request's chain is its seed's and its position follows the seed record's."""
    log, kind, canary = a.log, target.kernel_kind, target.canary
    num_slots = canary.shape[0]
    log.kernel_run_counters[kind] += 1
    seed = np.asarray(a.write_seed_slot_indices[:n], I64)
    seed_oob = seed >= num_slots
    errors = int(np.count_nonzero(seed_oob))
    seed_ok = (seed > 0) & ~seed_oob  # seed 0 is the padding slot: no predecessor, like -1
    seed_rec = canary[np.where(seed_ok, seed, 0)]
    chain = np.where(seed_ok, ref._next_chains(seed_rec, "write"), _ANCHOR)
    slot = np.asarray(a.out_cache_loc[:n], I64)
    oob = slot >= num_slots
    errors += int(np.count_nonzero(oob))
    ok = (slot >= 0) & ~oob
    token, pos = np.asarray(a.input_ids[:n], I64), np.asarray(a.positions[:n], I64)
    idx = _ramp[:n]
    assert_pos = seed_ok & ref._flag_value(a.chain_position_assert)
    want = seed_rec[:, 1] + 1
    if np.count_nonzero(ok) < n:
        idx = idx[ok]
        slot, token, pos, chain, assert_pos, want = slot[ok], token[ok], pos[ok], chain[ok], assert_pos[ok], want[ok]
    fingerprints = real_kv_hashes(target.sources, a.real_kv_hash_mode, slot)
    rows, row_keys = [], []
    if a.expected_input_tokens is not None:
        want_tok, want_pos = a.expected_input_tokens[idx], a.expected_input_positions[idx]
        bits = np.where(token != want_tok, _WRITE_TOKEN_BIT, 0)
        bits |= np.where(pos != want_pos, _WRITE_POSITION_BIT, 0)
        hit = bits != 0
        if np.count_nonzero(hit):
            rows.append(ref._rows(kind, slot[hit], pos[hit], token[hit], want_tok[hit], ref._as_i64(chain[hit]),
                                  want_pos[hit], bits[hit]))
            row_keys.append(idx[hit] * 2)
    hit = assert_pos & (pos != want)  # each token follows its seed record
    if np.count_nonzero(hit):
        rows.append(ref._rows(kind, slot[hit], pos[hit], token[hit], token[hit], ref._as_i64(chain[hit]), want[hit],
                              _WRITE_POSITION_BIT))
        row_keys.append(idx[hit] * 2 + 1)
    stored = slot != 0  # the padding slot keeps its bytes; a later token of a repeated slot wins
    if np.count_nonzero(stored) < stored.shape[0]:
        slot, token, pos, chain, fingerprints = slot[stored], token[stored], pos[stored], chain[stored], fingerprints[stored]
    canary[slot, 0] = token
    canary[slot, 1] = pos
    canary[slot, 2] = ref._as_i64(chain)
    canary[slot, 3] = ref._as_i64(fingerprints)
    if rows:
        all_rows = np.concatenate(rows)
        ref.append_rows(log, kind, all_rows[np.argsort(np.concatenate(row_keys), kind="stable")])
    log.slot_run_counters[kind] += int(idx.shape[0])
    log.out_of_range_counters[kind] += errors


# ----------------------------------------------------------------------------------------------
# real-KV fingerprints


#: Slots above which the sources' fold runs on NumPy arrays (a round on lanes grows with the slots,
#: a ufunc round barely does at these sizes).
LANE_FOLD_MAX_SLOTS = 64
#: Slots above which the reference hashes (it bounds its gathers' memory).
FAST_HASH_MAX_SLOTS = 4096
_WORD_PAIR = np.arange(2, dtype=I64)[:, None]  # a slot's two PARTIAL words: its first and the next
_lane_masks: dict = {}  # lanes -> the mask of each 128-bit lane's low 64 bits
_M64 = (1 << 64) - 1


def _lane_mask(n: int) -> int:
    mask = _lane_masks.get(n)
    if mask is None:
        if len(_lane_masks) > 256:
            _lane_masks.clear()
        mask = _lane_masks[n] = ((1 << (128 * n)) - 1) // ((1 << 128) - 1) * _M64
    return mask


def _splitmix64_lanes(v: int, mask: int) -> int:
    """SplitMix64 of every 128-bit lane's low 64 bits (its high ones 0) of the Python int ``v`` at once:
    a lane's product by a 64-bit constant stays in its 128 bits, its shifts' spill into the lane
    below is masked off."""
    v ^= (v >> SPLITMIX64_SHIFT1) & mask
    v = (v * SPLITMIX64_MUL1) & mask
    v ^= (v >> SPLITMIX64_SHIFT2) & mask
    v = (v * SPLITMIX64_MUL2) & mask
    return v ^ ((v >> SPLITMIX64_SHIFT3) & mask)


def _word_views(sources):
    """Each source's flat word view, its words a row, its first word and its slot offset; None when
    one is not read as whole words.  Kept on a bound launcher's sources (a :class:`SourceViews`,
    which lives as long as the arrays it views), else made at each call (a microsecond a source)."""
    views = getattr(sources, "words", _UNVIEWED)
    if views is not _UNVIEWED:
        return views
    views = []
    for src in sources:
        flat = ref._word_gather(src, REAL_KV_PARTIAL_BYTES)
        if flat is None:
            views = None
            break
        views.append((flat[0], flat[1], src.byte_offset // 8, src.slot_offset))
    if type(sources) is SourceViews:
        sources.words = views
    return views


_UNVIEWED = object()


def real_kv_hashes(sources: tuple, mode: int, slots: np.ndarray) -> np.ndarray:
    """:func:`numpy_backend.real_kv_hashes`.  PARTIAL over sources read as whole words: each source's two words of every slot by one take through
    indices shared by the sources read alike, the strip folds of all sources together, and for
    a few slots the serial fold of the sources (a round a source) on Python ints holding every
    slot in a 128-bit lane, where a round is a dozen small big-int operations, not nine ufunc calls."""
    n = slots.shape[0]
    if mode != RealKvHashMode.PARTIAL or not sources or not 0 < n <= FAST_HASH_MAX_SLOTS:
        return ref.real_kv_hashes(sources, mode, slots)
    views = _word_views(sources)
    if views is None:
        return ref.real_kv_hashes(sources, mode, slots)
    words = np.empty((2, len(views), n), U64)  # [word, source, slot]
    placed, index = {}, {}
    for j, (flat, row_words, first, offset) in enumerate(views):
        pool = placed.get(offset)
        if pool is None:
            pool = placed[offset] = ref._pool_slots(slots, offset)
        key = (offset, row_words, first)
        at = index.get(key)
        if at is None:
            at = pool[0] * row_words
            at += first
            at = index[key] = at + _WORD_PAIR
        flat.take(at, out=words[:, j], mode="clip")  # in range: every pool slot is within the rows
    h, scratch = words[0], np.empty((len(views), n), U64)  # the strip folds, in place: [source, slot]
    splitmix64_inplace(h, scratch)
    np.bitwise_xor(h, words[1], out=h)
    splitmix64_inplace(h, scratch)
    for j, (_, _, _, offset) in enumerate(views):
        below = placed[offset][1]
        if below is not None:  # no KV bytes below the source's offset: its strip hash stays 0
            h[j][below] = 0
    if n > LANE_FOLD_MAX_SLOTS:
        return ref.fold_rows(h)
    lanes = np.zeros((len(views), n, 2), U64)
    lanes[:, :, 0] = h
    mask, acc = _lane_mask(n), 0
    for j in range(len(views)):
        acc = _splitmix64_lanes(acc ^ int.from_bytes(lanes[j], "little"), mask)
    return np.frombuffer(acc.to_bytes(16 * n, "little"), U64)[::2].copy()
