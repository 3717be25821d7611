"""Strided real-KV sources (issue 27 item 2, issue 23 library gap 1) and more than four sources.

The expected fingerprints are built independently of the library's byte gather: each slot's bytes
are cut out of the pool with NumPy indexing of the layout's own shape (vLLM's CPU layout: K
transposed ``[D, B]`` per block and head, then V ``[B, D]``) and folded with ``kc.real_kv_fold``.
"""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvHashMode, RealKvSource
from canary_builders import a64, canary, make_log, make_verify_plan, make_write_plan, signed

BLOCKS, HEADS, B, D = 3, 2, 32, 8


def vllm_cpu_pool(dtype, seed=0):
    """``[blocks, heads, B, 2 * D]`` of random bytes (vLLM 0.32's CPU KV cache of one layer)."""
    e = np.dtype(dtype).itemsize
    raw = np.random.default_rng(seed).integers(0, 256, BLOCKS * HEADS * B * 2 * D * e, dtype=np.uint8)
    return raw.view(dtype).reshape(BLOCKS, HEADS, B, 2 * D)


def vllm_sources(kv, *, read_bytes=None):
    e = kv.dtype.itemsize
    head = 2 * B * D * e
    k = RealKvSource.strided(kv, B, token_stride=e, piece_bytes=e, pieces=((HEADS, head), (D, B * e)), read_bytes=read_bytes)
    v = RealKvSource.strided(kv, B, token_stride=D * e, byte_offset=B * D * e, piece_bytes=D * e, pieces=((HEADS, head),),
                             read_bytes=read_bytes)
    return k, v


def token_bytes(kv, slot):
    """The K and V bytes of ``slot`` in stream order (head, then d), cut out with the layout's shape."""
    region = kv.reshape(BLOCKS, HEADS, 2 * B * D)
    k = region[:, :, : B * D].reshape(BLOCKS, HEADS, D, B)  # K transposed: element d of token t at d * B + t
    v = region[:, :, B * D :].reshape(BLOCKS, HEADS, B, D)
    block, t = divmod(slot, B)
    return np.ascontiguousarray(k[block, :, :, t]).tobytes(), np.ascontiguousarray(v[block, :, t, :]).tobytes()


def write(ab, buf, slots, sources, mode, log=None):
    n = len(slots)
    log = make_log(ab) if log is None else log
    kc.write(buf, make_write_plan(ab, [0, n], [-1]), a64(ab, np.arange(1, n + 1)), a64(ab, np.arange(n)), a64(ab, slots),
             log=log, real_kv_sources=sources, real_kv_hash_mode=mode)
    return ab.to_numpy(buf)


def verify_rows(ab, buf, slots, sources, mode):
    log = make_log(ab)
    n = len(slots)
    prev = [-1] + list(slots[:-1])
    kc.verify(buf, make_verify_plan(ab, slots, range(n), prev), log=log, real_kv_sources=sources, real_kv_hash_mode=mode)
    return log.read()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, np.float64])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_vllm_cpu_k_and_v_fingerprints(ab, dtype, mode):
    kv = vllm_cpu_pool(dtype)
    k, v = vllm_sources(ab.asarray(kv))
    slots = [1, 5, B - 1, B, 2 * B + 7, BLOCKS * B - 1]
    n = 16 if mode == RealKvHashMode.PARTIAL else HEADS * D * kv.dtype.itemsize
    for sources, pick in (((k,), lambda kb, vb: [kb]), ((v,), lambda kb, vb: [vb]), ((k, v), lambda kb, vb: [kb, vb])):
        got = write(ab, ab.asarray(canary(BLOCKS * B)), slots, sources, mode)
        for s in slots:
            want = kc.real_kv_fold([x[:n] for x in pick(*token_bytes(kv, s))])
            assert int(got[s, 3]) == signed(want), (dtype, mode, s)


@pytest.mark.parametrize("half", ["k", "v"])
def test_a_flip_in_transposed_k_is_caught(ab, half):
    """Issue 23: a flip in vLLM's K was missed because K is stored transposed; now it fails verify."""
    kv = vllm_cpu_pool(np.float32, seed=1)
    dev = ab.asarray(kv)
    sources = vllm_sources(dev)
    slots = [B + 1, B + 2, B + 3]
    buf = ab.asarray(canary(BLOCKS * B))
    write(ab, buf, slots, sources, RealKvHashMode.ALL)
    assert verify_rows(ab, buf, slots, sources, RealKvHashMode.ALL).total_violations == 0
    flipped = kv.copy()
    d, h, t = 5, 1, 2  # token B + 2: block 1, t = 2
    region = flipped.reshape(BLOCKS, HEADS, 2 * B * D).view(np.uint8).reshape(BLOCKS, HEADS, -1)
    index = (d * B + t) * 4 if half == "k" else (B * D + t * D + d) * 4
    region[1, h, index + 1] ^= 0x10
    dev[...] = ab.asarray(flipped)
    report = verify_rows(ab, buf, slots, sources, RealKvHashMode.ALL)
    assert [(v.slot_idx, v.fail_reason_bits) for v in report.violations] == [(B + 2, kc.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]


def test_strided_reader_of_a_contiguous_layout_matches_the_default(ab):
    """The strided path reads the same bytes as the 16-byte path when it describes the same layout;
    the default layout keeps SGLang's pinned value."""
    pattern = np.array([1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF], np.uint8)
    data = ab.asarray(np.tile(pattern, (4, 2)))  # 32 bytes a slot
    plain = RealKvSource(data, 1, 32, 32)
    assert not plain.is_strided
    for piece, pieces in ((4, ((8, 4),)), (2, ((2, 16), (8, 2))), (8, ((4, 8),)), (1, ((32, 1),))):
        strided = RealKvSource.strided(data, 1, token_stride=32, piece_bytes=piece, pieces=pieces)
        assert strided.is_strided
        for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
            a = write(ab, ab.asarray(canary(4)), [2], (plain,), mode)
            b = write(ab, ab.asarray(canary(4)), [2], (strided,), mode)
            assert int(a[2, 3]) == int(b[2, 3])
    b = write(ab, ab.asarray(canary(4)), [2], (RealKvSource(data, 1, 16, 16),), RealKvHashMode.ALL)
    assert int(b[2, 3]) == signed(0x6041580849E6407D)


def test_byte_offset_and_token_stride_without_pieces(ab):
    """A contiguous slot inside a wider row (e.g. one layer's page in an interleaved flat pool)."""
    raw = np.random.default_rng(3).integers(0, 256, (4, 256), dtype=np.uint8)
    src = RealKvSource(ab.asarray(raw), 2, 32, 32, token_stride=96, byte_offset=48)
    got = write(ab, ab.asarray(canary(8)), [1, 2, 7], (src,), RealKvHashMode.ALL)
    for s in (1, 2, 7):
        row, t = divmod(s, 2)
        start = 48 + 96 * t
        assert int(got[s, 3]) == signed(kc.real_kv_fold([raw[row, start : start + 32].tobytes()]))


def test_more_than_four_sources(ab):
    """Eight per-head V sources (the new limit), folded in order; a ninth is refused by name."""
    raw = np.random.default_rng(4).integers(0, 256, (16, 8, 32), dtype=np.uint8)  # [slots, heads, bytes]
    dev = ab.asarray(raw)
    sources = tuple(RealKvSource(dev[:, h], 1, 32, 32) for h in range(8))
    assert kc.MAX_REAL_KV_SOURCES == 8
    got = write(ab, ab.asarray(canary(16)), [3, 9], sources, RealKvHashMode.ALL)
    for s in (3, 9):
        assert int(got[s, 3]) == signed(kc.real_kv_fold([raw[s, h].tobytes() for h in range(8)]))
    with pytest.raises(ValueError, match=r"real_kv_sources must hold at most 8 RealKvSource entries"):
        write(ab, ab.asarray(canary(16)), [3], sources + sources[:1], RealKvHashMode.ALL)


def test_verify_after_write_with_many_strided_sources_and_pages(ab):
    """A mix of strided and plain sources over several pages verifies clean, and every source matters."""
    kv = vllm_cpu_pool(np.float16, seed=5)
    dev = ab.asarray(kv)
    k, v = vllm_sources(dev)
    extra = RealKvSource(ab.asarray(np.random.default_rng(6).integers(0, 256, (BLOCKS * B, 16), dtype=np.uint8)), 1, 16, 16)
    sources = (k, v, extra, k, v)
    slots = list(range(1, BLOCKS * B, 5))
    buf = ab.asarray(canary(BLOCKS * B))
    got = write(ab, buf, slots, sources, RealKvHashMode.ALL)
    extra_host = ab.to_numpy(extra.tensor)
    for s in slots:
        kb, vb = token_bytes(kv, s)
        assert int(got[s, 3]) == signed(kc.real_kv_fold([kb, vb, extra_host[s].tobytes(), kb, vb]))
    assert verify_rows(ab, buf, slots, sources, RealKvHashMode.ALL).total_violations == 0


@pytest.mark.parametrize("kw, match", [
    (dict(piece_bytes=3, pieces=((32, 3),)), r"RealKvSource.piece_bytes must be 1, 2, 4 or a multiple of 8"),
    (dict(piece_bytes=12, pieces=((8, 12),)), r"RealKvSource.piece_bytes must be 1, 2, 4 or a multiple of 8"),
    (dict(piece_bytes=4, pieces=((4, 4),)), r"RealKvSource.pieces=\(\(4, 4\),\) of piece_bytes=4 hold 16 bytes, not num_bytes_per_token=32"),
    (dict(pieces=((8, 4),)), r"RealKvSource.pieces=\(\(8, 4\),\) needs piece_bytes"),
    (dict(piece_bytes=4, pieces=((2, 4), (2, 4), (2, 4))), r"RealKvSource.pieces must be a tuple of at most 2"),
    (dict(piece_bytes=4, pieces=((8, -4),)), r"RealKvSource.pieces must be a tuple of at most 2 \(count >= 1, stride >= 0\)"),
    (dict(piece_bytes=4, pieces=((8, 6),)), r"RealKvSource.pieces\[0\] stride must be a multiple of 4 bytes"),
    (dict(piece_bytes=4, pieces=((8, 4),), token_stride=2), r"RealKvSource.token_stride must be a multiple of 4 bytes"),
    (dict(piece_bytes=4, pieces=((8, 4),), byte_offset=-4), r"RealKvSource.byte_offset must be an int in \[0, 2\*\*62\]"),
    (dict(piece_bytes=4, pieces=((8, 40),)), r"RealKvSource row is too narrow for its layout: dim-1 is 64 bytes but the last byte a slot reads lies 284"),
    (dict(token_stride=48), r"RealKvSource row is too narrow for its layout: dim-1 is 64 bytes but the last byte a slot reads lies 80"),
])
def test_strided_source_checks(ab, kw, match):
    with pytest.raises(ValueError, match=match):
        RealKvSource(ab.asarray(np.zeros((4, 64), np.uint8)), 2 if "token_stride" in kw and "pieces" not in kw else 1,
                     32, 32, **kw)


def test_strided_source_alignment_of_the_tensor(ab):
    """A 4-byte-piece source needs a 4-byte-aligned tensor; a 1-byte one takes any address."""
    base = ab.asarray(np.zeros((4, 68), np.uint8))
    shifted = base[:, 2:66]
    src = RealKvSource.strided(shifted, 1, token_stride=64, piece_bytes=4, pieces=((8, 4),))
    with pytest.raises(ValueError, match=r"real_kv_sources\[0\]\.tensor must start at a multiple of 4 bytes"):
        write(ab, ab.asarray(canary(4)), [1], (src,), RealKvHashMode.ALL)
    ok = RealKvSource.strided(base[:, 1:65], 1, token_stride=64, piece_bytes=1, pieces=((32, 1),))
    got = write(ab, ab.asarray(canary(4)), [1], (ok,), RealKvHashMode.ALL)
    assert int(got[1, 3]) == signed(kc.real_kv_fold([bytes(32)]))


def test_interleaved_flat_pages_one_source_per_layer_and_half(ab):
    """transformers 5.23's flat uint8 cache: each block holds the K and V pages of every layer in
    turn; one source per (layer, half) reads its page through byte_offset."""
    blocks, layers, page, n = 3, 2, 4, 32
    flat = np.random.default_rng(9).integers(0, 256, blocks * 2 * layers * page * n, dtype=np.uint8)
    pool = ab.asarray(flat.reshape(blocks, 2 * layers * page * n))
    sources = tuple(RealKvSource(pool, page, n, n, token_stride=n, byte_offset=(2 * layer + half) * page * n)
                    for layer in range(layers) for half in (0, 1))
    slots = [1, 5, 11]
    got = write(ab, ab.asarray(canary(blocks * page)), slots, sources, RealKvHashMode.ALL)
    cut = flat.reshape(blocks, layers, 2, page, n)
    for s in slots:
        block, t = divmod(s, page)
        want = kc.real_kv_fold([cut[block, layer, half, t].tobytes() for layer in range(layers) for half in (0, 1)])
        assert int(got[s, 3]) == signed(want)


def test_slot_offset_composes_with_strided_layouts(ab):
    """A strided source with slot_offset: canary slot s reads pool slot s - slot_offset through the
    strided layout; slots below the offset have no bytes and fold as 0."""
    kv = vllm_cpu_pool(np.float32, seed=10)
    e = kv.dtype.itemsize
    head = 2 * B * D * e
    k = RealKvSource.strided(ab.asarray(kv), B, token_stride=e, piece_bytes=e, pieces=((HEADS, head), (D, B * e)),
                             slot_offset=B)
    assert k.slot_offset == B
    slots = [3, B, B + 5, BLOCKS * B + B - 1]  # the first lies below the offset
    got = write(ab, ab.asarray(canary((BLOCKS + 1) * B)), slots, (k,), RealKvHashMode.ALL)
    assert int(got[3, 3]) == 0
    for s in slots[1:]:
        assert int(got[s, 3]) == signed(kc.real_kv_fold([token_bytes(kv, s - B)[0]]))
