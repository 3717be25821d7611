"""The digest on the CPU: the NumPy backend of :func:`digest_pages` and :func:`verify_digest`.

It is also the reference the CUDA kernels (``kernels/digest.cu``) must match byte for byte.
The digest of one request (docs/transfer.md, "The digest")::

    key(l, c, h, p) = smix(SEED ^ smix(l << 48 | c << 47 | h << 32 | p))
    KV  = sum over valid positions p, sampled layers l, halves c, heads h, sampled words w of
          smix(word ^ (key(l, c, h, p) + w * WORD_STRIDE))
    REC = sum over valid positions p of smix(token_p ^ key(REC, 0, 0, p)) + smix(position_p ^ key(REC, 1, 0, p))
          + smix(prev_hash_at_start ^ key(REC, 0, 1, start))

all modulo 2**64, with global layer and head indices and logical positions: page ids, page sizes
and strides never enter it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ..hashing import ANCHOR_HASH, splitmix64_array, splitmix64_inplace, to_signed
from ..tables import TableKind
from ..backends.numpy_backend import append_rows
from .format import (DIGEST_LAYER_ROTATION, DIGEST_MAX_POSITION, DIGEST_REC_LAYER, DIGEST_SEED, DIGEST_WORD_STRIDE,
                     DigestFailReason, DigestVerdict, FLAG_PRESENT, DIGEST_MAGIC, DIGEST_FORMAT_VERSION)

U64 = np.uint64
SLOT_LIMIT = 2**62  # a page id at or past 2**62 // page_size is out of range before it is multiplied


class DigestArgs(NamedTuple):
    """A validated digest call, as views (the front door builds it; both backends take it)."""

    layout: Any  # KvLayout
    table: Any  # args.TableView
    req_pool_indices: Optional[Any]  # int64 [bs] (None with PAGED_KV)
    starts: Any  # int64 [bs]
    ends: Any  # int64 [bs]
    sample_keys: Any  # int64 [bs]
    records: Optional[Any]  # int64 [num_slots, fields] canary view
    expected_tokens: Optional[Any]  # int32/int64 [rows, C]
    valid_lens: Optional[Any]  # int64 [bs]
    seam: Optional[Any]  # int64 [bs]: -1 anchor, else the slot whose record precedes start
    out: Any  # int64 [capacity, 8]
    out_of_range_count: Any  # int64 [1]
    num_layers_total: int
    sample_layers: int
    window_bytes: int
    token_offset: int
    mode: int  # REC_NONE, REC_SENDER or REC_RECEIVER
    signature: int
    header: int


REC_NONE, REC_SENDER, REC_RECEIVER = 0, 1, 2


def smix(x) -> np.ndarray:
    return splitmix64_array(np.asarray(x, U64))


_SEED = np.array(DIGEST_SEED, U64)  # 0-d: a ufunc converts a scalar operand on every call


def strip_key(layer, half, head, pos) -> np.ndarray:
    """key(l, c, h, p) for broadcastable uint64 arrays (or ints)."""
    with np.errstate(over="ignore"):
        pack = (U64(layer) << U64(48)) | (U64(half) << U64(47)) | (np.asarray(head, U64) << U64(32)) | np.asarray(pos, U64)
        return smix(U64(DIGEST_SEED) ^ smix(pack))


def sampled_layers(key: int, num_layers_total: int, sample_layers: int) -> list:
    """The global layers a request of sample key ``key`` hashes (every layer for 0)."""
    if sample_layers == 0 or sample_layers >= num_layers_total:
        return list(range(num_layers_total))
    first = int(smix(U64(key & (2**64 - 1)) ^ U64(DIGEST_LAYER_ROTATION))) % num_layers_total
    return sorted((first + i * num_layers_total // sample_layers) % num_layers_total for i in range(sample_layers))


def window(key: int, layer: int, strip_words: int, window_bytes: int) -> tuple[int, int]:
    """``(first word, words)`` of layer ``layer``'s sampled window of every strip."""
    words = window_bytes // 8
    if words == 0 or words >= strip_words:
        return 0, strip_words
    with np.errstate(over="ignore"):
        salt = U64((layer + 1) * DIGEST_WORD_STRIDE & (2**64 - 1))
        pick = int(smix(U64(key & (2**64 - 1)) ^ salt)) % (strip_words // words)
    return pick * words, words


def _row_ok(t, rp: int, bs_row: int) -> tuple[bool, int, int]:
    """Whether request row is in the table, its base (row or first kv_indices entry) and its length in tokens."""
    if t.kind == TableKind.PAGED_KV:
        lo, hi = int(t.kv_indptr[bs_row]), int(t.kv_indptr[bs_row + 1])
        ok = 0 <= lo <= hi <= t.entries.shape[0]
        return ok, lo, (hi - lo) * t.page_size if ok else 0
    rows, cols = t.entries.shape
    ok = 0 <= rp < rows
    return ok, rp, cols * (t.page_size if t.kind == TableKind.BLOCK else 1)


def _page_slot(xp, ids, page_size, pos):
    ok = (ids >= 0) & (ids < SLOT_LIMIT // page_size)
    return xp.where(ok, xp.where(ok, ids, 0) * page_size + pos % page_size, -1)


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    from ..runtime import import_cupy

    return import_cupy()


def resolve_slots(t, base: int, pos: np.ndarray) -> np.ndarray:
    """The slot of each position of one table row (``0 <= pos < row length``), or -1 where the
    table holds no slot: a negative entry, a virtual page past the map or unbound, a null block."""
    xp = _xp(t.entries)
    if t.kind == TableKind.REQ_TO_TOKEN:
        return t.entries[base, pos].astype(xp.int64)
    if t.kind == TableKind.VIRTUAL_PAGES:
        v = t.entries[base, pos].astype(xp.int64)
        v2p = t.virtual_to_physical.astype(xp.int64)
        page = xp.where(v >= 0, v, 0) // t.page_size
        known = (v >= 0) & (page < v2p.shape[0])
        phys = xp.where(known, v2p[xp.where(known, page, 0)], -1)
        return xp.where(known, _page_slot(xp, phys, t.page_size, xp.where(v >= 0, v, 0)), -1)
    if t.kind == TableKind.BLOCK:
        ids = t.entries[base, pos // t.page_size].astype(xp.int64)
        return xp.where(ids == t.null_block, -1, _page_slot(xp, ids, t.page_size, pos))
    return _page_slot(xp, t.entries[base + pos // t.page_size].astype(xp.int64), t.page_size, pos)


def _slot_hash(records, slot: int) -> int:
    if records is None or not 0 <= slot < records.shape[0]:
        return -1
    tok, pos, prev = (int(v) for v in records[slot, :3])
    h = smix(U64(prev & (2**64 - 1)))
    h = smix(h ^ U64(tok & (2**64 - 1)))
    return int(smix(h ^ U64(pos & (2**64 - 1))))


def _strips(lay, span, w0: int, nw: int) -> np.ndarray:
    """The pool's words as ``uint64 [num_pages, page_size, num_heads, nw]`` (words ``[w0, w0 + nw)`` of
    every strip), a strided view of ``span``: fancy indexing by (page, token) then copies whole
    windows, never word by word."""
    words = span[: span.shape[0] // 8 * 8].view("<u8")[w0:]
    shape = (lay.num_pages, lay.page_size, lay.num_heads, nw)
    strides = (lay.page_stride, lay.token_stride, lay.head_stride, 8)
    return np.lib.stride_tricks.as_strided(words, shape, strides, writeable=False)


class Positions(NamedTuple):
    """What request b digests: its table row (``base``), pool row, range and the positions whose
    slot is in range, with their slots, and how many items were skipped as out of range."""

    base: int
    rp: int
    start: int
    end: int
    pos: np.ndarray
    slot: np.ndarray
    skipped: int


def positions(a: DigestArgs, b: int) -> Positions | None:
    """Request b's positions, or None when the request is out of range (counted once)."""
    rp = int(a.req_pool_indices[b]) if a.req_pool_indices is not None else b
    start, end = int(a.starts[b]), int(a.ends[b])
    row_ok, base, length = _row_ok(a.table, rp, b)
    if not (row_ok and 0 <= start <= end <= min(length, DIGEST_MAX_POSITION)):
        return None
    pos = np.arange(start, end, dtype=np.int64)
    slot = resolve_slots(a.table, base, pos)
    ok = (slot >= 0) & (slot < a.layout.num_slots)
    if a.records is not None:
        ok &= slot < a.records.shape[0]
    return Positions(base, rp, start, end, pos[ok], slot[ok], int(np.count_nonzero(~ok)))


def digest(a: DigestArgs) -> None:
    """Fill ``a.out[b]`` for every request b (the wire record's columns) and count skips."""
    skipped = 0
    for b in range(a.starts.shape[0]):
        start, end, key = int(a.starts[b]), int(a.ends[b]), int(a.sample_keys[b])
        kv = rec = words = 0
        at = positions(a, b)
        if at is None:
            skipped += 1
        elif start < end:
            skipped += at.skipped
            kv, words = kv_sum(a, key, at.pos, at.slot)
            if a.mode != REC_NONE:
                rec, seam_skipped = _provenance(a, b, at.base, at.rp, start, at.pos, at.slot)
                skipped += seam_skipped
        a.out[b] = [to_signed(v) for v in (a.header, a.signature, key, start, end, kv, rec, words)]
    a.out_of_range_count[0] += skipped


#: Strip words a chunk of :func:`kv_sum` hashes at once: its terms and their scratch stay in the L2.
KV_CHUNK_WORDS = 32768


def kv_sum(a: DigestArgs, key: int, pos: np.ndarray, slot: np.ndarray) -> tuple[int, int]:
    """``(KV, words)`` of one request's positions ``pos`` (slots ``slot``, all in range): for each
    sampled layer and half, chunk by chunk of positions, the keys of its strips, the words of their
    windows gathered and the terms hashed and summed, every array of the chunk in the L2."""
    lay = a.layout
    lo_layer = lay.layer_offset
    layers = [l for l in sampled_layers(key, a.num_layers_total, a.sample_layers) if lo_layer <= l < lo_layer + lay.num_layers]
    if not layers:
        return 0, 0
    n, heads, strip_words = pos.shape[0], lay.num_heads, lay.strip_bytes // 8
    page, tok = slot // lay.page_size, slot % lay.page_size
    # the head and position bits of every strip key, [n, heads]: each layer and half ORs in its own
    head_pos = (np.arange(heads, dtype=np.int64) + lay.head_offset).astype(U64) << U64(32) | pos.astype(U64)[:, None]
    nw = window(key, layers[0], strip_words, a.window_bytes)[1]  # the same width for every layer
    # Where every stride is a multiple of the window's bytes, the windows are rows of each span seen
    # as [-1, nw] words from its layer's first sampled word: one take of whole rows gathers them.
    row_bytes = nw * 8
    rows = None
    if not (lay.page_stride % row_bytes or lay.token_stride % row_bytes or lay.head_stride % row_bytes):
        rows = ((page * (lay.page_stride // row_bytes) + tok * (lay.token_stride // row_bytes))[:, None]
                + np.arange(heads, dtype=np.int64) * (lay.head_stride // row_bytes))
    step = max(1, KV_CHUNK_WORDS // (heads * nw))
    terms, scratch = np.empty((min(step, n), heads, nw), U64), np.empty((min(step, n), heads, nw), U64)
    keys, key_scratch = np.empty((min(step, n), heads), U64), np.empty((min(step, n), heads), U64)
    total = 0
    for layer in layers:
        w0 = window(key, layer, strip_words, a.window_bytes)[0]
        salt = np.arange(w0, w0 + nw, dtype=U64) * U64(DIGEST_WORD_STRIDE)
        for half in range(lay.halves):
            span = lay._spans[layer - lo_layer][half]
            if rows is None:
                strips = _strips(lay, span, w0, nw)
            else:
                words = span[: span.shape[0] // 8 * 8].view("<u8")[w0:]
                windows = words[: words.shape[0] // nw * nw].reshape(-1, nw)
            high = U64(layer << 48 | half << 47)
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                t, s, k = terms[: hi - lo], scratch[: hi - lo], keys[: hi - lo]
                np.bitwise_or(head_pos[lo:hi], high, out=k)  # key(layer, half, h, p)
                splitmix64_inplace(k, key_scratch[: hi - lo])
                np.bitwise_xor(k, _SEED, out=k)
                splitmix64_inplace(k, key_scratch[: hi - lo])
                if rows is None:
                    t[...] = strips[page[lo:hi], tok[lo:hi]]
                else:  # every row index lies in the span (the layout's reach covers each strip)
                    np.take(windows, rows[lo:hi].reshape(-1), axis=0, out=t.reshape(-1, nw), mode="clip")
                for w in range(nw):  # key + w * stride, word by word (a broadcast add of nw-long rows is slow)
                    np.add(k, salt[w], out=s[:, :, w])
                np.bitwise_xor(t, s, out=t)
                splitmix64_inplace(t, s)
                total += int(t.sum(dtype=U64))
    return total & (2**64 - 1), len(layers) * lay.halves * n * heads * nw


def _provenance(a: DigestArgs, b: int, base: int, rp: int, start: int, pos, slot) -> tuple[int, int]:
    """REC of request b over its valid positions, and the seam lookups skipped (0 or 1)."""
    if a.mode == REC_SENDER:
        tokens, positions = a.records[slot, 0], a.records[slot, 1]
        prev = int(a.records[slot[0], 2]) if pos.size and pos[0] == start else 0
        skipped = 0
    else:
        pool = a.expected_tokens
        idx = pos + a.token_offset
        limit = pool.shape[1] if a.valid_lens is None else min(max(int(a.valid_lens[b]), 0), pool.shape[1])
        known = (idx >= 0) & (idx < limit) & (0 <= rp < pool.shape[0])
        tokens = np.where(known, pool[rp if 0 <= rp < pool.shape[0] else 0, np.where(known, idx, 0)].astype(np.int64), -1)
        positions = pos
        prev, skipped = seam_hash(a, b, base, start)
    with np.errstate(over="ignore"):
        p = pos.astype(U64)
        terms = smix(tokens.astype(np.int64).view(U64) ^ strip_key(DIGEST_REC_LAYER, 0, 0, p))
        terms += smix(positions.astype(np.int64).view(U64) ^ strip_key(DIGEST_REC_LAYER, 1, 0, p))
        total = int(terms.sum(dtype=U64))
        total += int(smix(U64(prev & (2**64 - 1)) ^ strip_key(DIGEST_REC_LAYER, 0, 1, start)))
    return total & (2**64 - 1), skipped


def seam_hash(a: DigestArgs, b: int, base: int, start: int) -> tuple[int, int]:
    """The receiver's chain hash at ``start``: the anchor, or the hash of its own record before it."""
    if a.seam is not None:
        seam = int(a.seam[b])
    elif start == 0:
        seam = -1
    else:
        seam = int(resolve_slots(a.table, base, np.array([start - 1]))[0])
        if seam < 0:
            return 0, 1
    if seam == -1:
        return ANCHOR_HASH, 0
    h = _slot_hash(a.records, seam)
    return (0, 1) if h < 0 else (h, 0)


# ---- verify ----------------------------------------------------------------------------------

HEADER_MASK = (1 << 48) - 1  # magic and version; the flags above them may differ


def verdicts(expected: np.ndarray, actual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verdict codes and fail-reason bits of record rows ``expected`` vs ``actual`` (int64 [n, 8])."""
    e, x = expected.view(U64), actual.view(U64)
    good_header = U64(DIGEST_MAGIC | DIGEST_FORMAT_VERSION << 32)
    mask = U64(HEADER_MASK)
    magic_mask = U64(0xFFFFFFFF)
    present = lambda r: ((r[:, 0] & magic_mask) == U64(DIGEST_MAGIC)) & ((r[:, 0] >> U64(48)) & U64(FLAG_PRESENT) != 0)
    missing = ~present(e) | ~present(x) | (e[:, 7] == 0) | (x[:, 7] == 0)
    version = ((e[:, 0] & mask) != good_header) | ((x[:, 0] & mask) != good_header) | (e[:, 1] != x[:, 1])
    rng = (e[:, 2] != x[:, 2]) | (e[:, 3] != x[:, 3]) | (e[:, 4] != x[:, 4])
    kv = (e[:, 5] != x[:, 5]) | (e[:, 7] != x[:, 7])
    rec = e[:, 6] != x[:, 6]
    incomparable = ~missing & (version | rng)
    bits = np.where(missing, int(DigestFailReason.DIGEST_MISSING), 0)
    bits |= np.where(incomparable, int(DigestFailReason.DIGEST_INCOMPARABLE), 0)
    bits |= np.where(incomparable & rng, int(DigestFailReason.DIGEST_RANGE), 0)
    compared = ~missing & ~incomparable
    bits |= np.where(compared & kv, int(DigestFailReason.DIGEST_MISMATCH_KV), 0)
    bits |= np.where(compared & rec, int(DigestFailReason.DIGEST_MISMATCH_REC), 0)
    code = np.select([missing, incomparable, compared & kv, compared & rec],
                     [DigestVerdict.MISSING, DigestVerdict.INCOMPARABLE, DigestVerdict.MISMATCH_KV,
                      DigestVerdict.MISMATCH_PROVENANCE], DigestVerdict.MATCH).astype(np.int32)
    return code, bits.astype(np.int64)


def verify(expected, actual, out, log, kind: int) -> None:
    """Write verdict codes into ``out`` and a violation row per non-MATCH row into ``log``."""
    n = expected.shape[0]
    code, bits = verdicts(np.asarray(expected), np.asarray(actual[:n]))
    out[:n] = code
    bad = np.flatnonzero(code != DigestVerdict.MATCH)
    rows = np.empty((bad.size, 8), np.int64)
    rows[:, 0] = kind
    rows[:, 1] = -1 - bad
    rows[:, 2] = actual[bad, 3]
    rows[:, 3] = actual[bad, 4]
    rows[:, 4] = actual[bad, 7]
    rows[:, 5] = actual[bad, 5]
    rows[:, 6] = expected[bad, 5]
    rows[:, 7] = bits[bad]
    append_rows(log, kind, rows)
    log.slot_run_counters[kind] += n
    log.kernel_run_counters[kind] += 1

