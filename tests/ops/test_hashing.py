"""Hash primitives, constants and enums (docs/format.md §2-3, §6-7)."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import constants as C
from kvcanary_cupy.hashing import mix3_array, splitmix64_array
from canary_builders import ANCHOR_H, chain, fold_strips, hmix3, sm64

SPLITMIX_PINNED = [
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (1, 0x5692161D100B05E5),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x8000000000000000, 0x25C26EA579CEA98A),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),
    (0, 0),
]


@pytest.mark.parametrize("x, want", SPLITMIX_PINNED)
def test_splitmix64_pinned_vectors(x, want):
    assert kc.splitmix64(x) == want
    assert sm64(x) == want  # the suite's own oracle agrees


def test_anchor_constants():
    assert kc.CANARY_CHAIN_ANCHOR == 0xC0FFEE1234567890
    assert kc.CANARY_CHAIN_ANCHOR_HASH == 0xDE7FAE23A9A1B716 == kc.ANCHOR_HASH
    assert kc.to_signed(kc.ANCHOR_HASH) == -2414019407054260458


def test_mix3_computed_vectors():
    assert kc.mix3(ANCHOR_H, 100, 4) == 0x5022670B6356AF64
    assert kc.mix3(ANCHOR_H, -1, 0) == 0xE5A9A05404A720CF
    assert kc.mix3(ANCHOR_H, 0xFFFFFFFFFFFFFFFF, 0) == 0xE5A9A05404A720CF  # -1 read as uint64
    assert kc.mix3(0, 0, 0) == 0  # the zero fixed point (§8.11)


def test_mix3_is_ordered_prev_token_position():
    a, b, c = 0x1234, 7, 9
    assert kc.mix3(a, b, c) == sm64(sm64(sm64(a) ^ b) ^ c)
    assert kc.mix3(a, b, c) != kc.mix3(a, c, b)


def _library_chain(tokens, positions, seed_record=None):
    """prev_hashes (unsigned) that ``kc.write`` stamps for one request, and the ``kc.mix3`` fold.

    The request writes ``tokens`` at ``positions`` into slots 1.. of a NumPy canary; with
    ``seed_record`` (token, position, prev_hash) in the last slot, it continues that chain.
    """
    n = len(tokens)
    buf = np.zeros((n + 2, 4), np.int64)
    seed = -1
    if seed_record is not None:
        seed = n + 1
        buf[seed, :3] = [seed_record[0], seed_record[1], kc.to_signed(seed_record[2])]
    wp = kc.WritePlan.allocate(1)
    wp.write_offsets[:] = [0, n]
    wp.write_seed_slot_indices[0] = seed
    wp.write_num_valid_reqs[0] = 1
    log = kc.ViolationLog.allocate(4)
    kc.write(buf, wp, np.asarray(tokens, np.int64), np.asarray(positions, np.int64), np.arange(1, n + 1),
             log=log)
    assert int(log.slot_run_counters[0]) == n and not log.ring.any()  # positions follow the seed
    stored = [kc.to_unsigned(v) for v in buf[1 : n + 1, 2]]
    running = kc.ANCHOR_HASH if seed_record is None else kc.mix3(seed_record[2], seed_record[0], seed_record[1])
    folded = []
    for t, p in zip(tokens, positions):
        folded.append(running)
        running = kc.mix3(running, t, p)
    return stored, folded, running


def test_chain_vectors_tokens_101_to_505():
    want = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634]
    stored, folded, nxt = _library_chain([101, 202, 303, 404, 505], range(5))
    assert stored == folded == want
    assert nxt == 0x3A650FCC4023CD13
    assert chain([101, 202, 303, 404, 505], range(5)) == (want, nxt)  # the suite's oracle agrees


def test_chain_vectors_with_seed_record():
    want = [0x5E35681BCFCE7CF6, 0x56D3E7D2989B8E36, 0xDD87E0146C9036A8, 0x1CBB47092FF8336E, 0x3579999BB482D1FC]
    seed = (7, 10, ANCHOR_H)  # seed record (token 7, position 10, prev anchor_hash)
    stored, folded, _ = _library_chain([101, 202, 303, 404, 505], range(11, 16), seed)
    assert stored == folded == want
    assert chain([101, 202, 303, 404, 505], range(11, 16), hmix3(ANCHOR_H, 7, 10))[0] == want


def test_chain_vectors_golden_ratio_tokens_mix3_not_xor():
    tokens = [(i * 0x9E3779B97F4A7C15) & 0x7FFFFFFF for i in range(5)]
    want = [0xDE7FAE23A9A1B716, 0xF0D7FE5EB92C788F, 0x3DDFEAFEC17352BC, 0xF2A3DB1523A7D509, 0xFCEC3D0431BB9378]
    stored, folded, _ = _library_chain(tokens, range(5))
    assert stored == folded == want
    assert stored[1] != 0xF0F807B576DF665D  # the stale XOR-era golden value
    assert chain(tokens, range(5))[0] == want


REAL_KV_PATTERN = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])


@pytest.mark.parametrize("strips, want", [
    ([REAL_KV_PATTERN], 0x6041580849E6407D),
    ([bytes(16)], 0),
    ([bytes([0x11] * 16), bytes([0x22] * 16)], 0x33109C273CC3CC03),
    ([bytes(range(32))], 0xB44181DFE9420039),
    ([bytes(range(16))], 0xD6D75024DFD6C30C),
    ([], 0),
])
def test_real_kv_fold_vectors(strips, want):
    assert kc.real_kv_fold(strips) == want
    assert fold_strips(strips) == want


def test_real_kv_fold_is_order_dependent():
    a, b = bytes([0x11] * 16), bytes([0x22] * 16)
    assert kc.real_kv_fold([a, b]) != kc.real_kv_fold([b, a])


def test_real_kv_fold_rejects_ragged_strip():
    with pytest.raises(ValueError, match="multiple of 8"):
        kc.real_kv_fold([bytes(12)])


def test_int_and_array_forms_agree():
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**63), 2**63 - 1, size=64, dtype=np.int64)
    b = rng.integers(-(2**63), 2**63 - 1, size=64, dtype=np.int64)
    c = rng.integers(-(2**63), 2**63 - 1, size=64, dtype=np.int64)
    sm = kc.splitmix64(a)
    assert sm.dtype == np.uint64
    assert [int(v) for v in sm] == [kc.splitmix64(int(x)) for x in a]
    assert [int(v) for v in splitmix64_array(a.view(np.uint64))] == [sm64(int(x)) for x in a]
    m = kc.mix3(a, b, c)
    assert m.dtype == np.uint64
    assert [int(v) for v in m] == [hmix3(int(x), int(y), int(z)) for x, y, z in zip(a, b, c)]
    assert np.array_equal(mix3_array(a, b, c), m)


@pytest.mark.parametrize("scalar", [np.int64(-1), np.uint64(2**64 - 1), np.int32(-1), -1])
def test_numpy_scalars_take_the_int_path(scalar):
    """A NumPy scalar gives a Python int (as a Python int would), never a 0-d array."""
    got = kc.splitmix64(scalar)
    assert type(got) is int and got == sm64(2**64 - 1)
    got = kc.mix3(scalar, np.int64(5), 7)
    assert type(got) is int and got == hmix3(2**64 - 1, 5, 7)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.uint64, np.int64])
def test_array_forms_take_any_integer_dtype(dtype):
    """Narrow arrays are widened value by value (never reinterpreted as 64-bit words)."""
    values = np.array([0, 1, 7, 200], dtype)
    assert [int(v) for v in kc.splitmix64(values)] == [sm64(int(v)) for v in values]
    assert [int(v) for v in kc.mix3(values, values[::-1], values + 3)] == [
        hmix3(int(a), int(b), 3 + int(a)) for a, b in zip(values, values[::-1])]


@pytest.mark.parametrize("u, s", [(0, 0), (1, 1), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1),
                                  (0xDE7FAE23A9A1B716, -2414019407054260458)])
def test_to_signed_to_unsigned(u, s):
    assert kc.to_signed(u) == s
    assert kc.to_unsigned(s) == u
    assert kc.to_unsigned(kc.to_signed(u)) == u


def test_constants_of_spec_2_1():
    assert (kc.REQ_POOL_IDX_PADDING, kc.TOKEN_TO_KV_SLOT_PADDING) == (0, 0)
    assert kc.CANARY_FIELDS_PER_SLOT == 4 and kc.CANARY_SLOT_BYTES == 32
    assert (kc.CANARY_FIELD_TOKEN, kc.CANARY_FIELD_POSITION, kc.CANARY_FIELD_PREV_HASH,
            kc.CANARY_FIELD_REAL_KV_HASH) == (0, 1, 2, 3)
    assert kc.VIOLATION_FIELDS == 8
    assert [C.VIOLATION_FIELD_KERNEL_KIND, C.VIOLATION_FIELD_SLOT_IDX, C.VIOLATION_FIELD_POSITION,
            C.VIOLATION_FIELD_STORED_TOKEN, C.VIOLATION_FIELD_EXPECTED_TOKEN, C.VIOLATION_FIELD_STORED_CHAIN_HASH,
            C.VIOLATION_FIELD_EXPECTED_AUX, C.VIOLATION_FIELD_FAIL_REASON_BITS] == list(range(8))
    assert kc.MAX_REAL_KV_SOURCES == 8  # SGLang's ABI took 4; this project's kernels take 8 (issue 23)
    assert C.REAL_KV_SOURCE_FIELDS_PER_ENTRY == 3
    assert (C.REAL_KV_SOURCE_FIELD_PAGE_SIZE, C.REAL_KV_SOURCE_FIELD_NUM_BYTES_PER_TOKEN,
            C.REAL_KV_SOURCE_FIELD_READ_BYTES) == (0, 1, 2)
    assert (C.SPLITMIX64_MUL1, C.SPLITMIX64_MUL2) == (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
    assert (C.SPLITMIX64_SHIFT1, C.SPLITMIX64_SHIFT2, C.SPLITMIX64_SHIFT3) == (30, 27, 31)
    assert kc.NUM_LAUNCH_TAGS == 12


def test_fail_reason_bits():
    F = kc.FailReason
    assert [(m.name, m.value) for m in F] == [
        ("VERIFY_CHAIN_HASH_MISMATCH", 1), ("VERIFY_POSITION_MISMATCH", 2), ("VERIFY_REAL_KV_HASH_MISMATCH", 4),
        ("WRITE_TOKEN_MISMATCH", 8), ("WRITE_POSITION_MISMATCH", 16), ("VERIFY_TOKEN_MISMATCH", 32),
        ("WRITE_KV_NOT_STORED", 2048), ("VERIFY_DEEP_KV_MISMATCH", 4096),  # this project's coverage bits (docs/format.md section 9)
        ("VERIFY_TABLE_HOLE", 1 << 16)]  # and its table-hole bit


@pytest.mark.parametrize("bits, label", [
    (0, "none"),
    (1, "verify_chain_hash"),
    (2, "verify_position"),
    (4, "verify_real_kv_hash"),
    (8, "write_token"),
    (16, "write_position"),
    (32, "verify_token"),
    (3, "verify_chain_hash+verify_position"),
    (1 | 4 | 32, "verify_chain_hash+verify_real_kv_hash+verify_token"),
    (8 | 16, "write_token+write_position"),
])
def test_fail_reason_label(bits, label):
    assert kc.FailReason.label(bits) == label


def test_real_kv_hash_mode_and_launch_tags():
    assert [(m.name, m.value) for m in kc.RealKvHashMode] == [("NONE", 0), ("PARTIAL", 1), ("ALL", 2)]
    assert [(m.name, m.value) for m in kc.CanaryLaunchTag] == [
        ("HEAD_K_FULL", 0), ("HEAD_V_FULL", 1), ("TAIL_K_FULL", 2), ("TAIL_V_FULL", 3),
        ("SWEEP_K_FULL", 4), ("SWEEP_V_FULL", 5), ("HEAD_K_SWA", 6), ("HEAD_V_SWA", 7),
        ("TAIL_K_SWA", 8), ("TAIL_V_SWA", 9), ("SWEEP_K_SWA", 10), ("SWEEP_V_SWA", 11)]


@pytest.mark.parametrize("chunk_bytes", [1, 64, 200, 1 << 20])
def test_all_mode_hashes_in_chunks_to_the_same_bytes(ab, monkeypatch, chunk_bytes):
    """Issue 28 #13: ALL mode gathered every slot's bytes at once (355 MiB over 20,000 entries);
    it now hashes HASH_CHUNK_BYTES at a time (any chunk, down to one slot, gives the same bytes)."""
    from canary_builders import HostSource, kv_bytes, real_kv
    from kvcanary_cupy.backends import numpy_backend

    monkeypatch.setattr(numpy_backend, "HASH_CHUNK_BYTES", chunk_bytes)
    num_slots, page = 37, 2
    data = [kv_bytes(-(-num_slots // page), page * 96, seed=s) for s in (1, 2)]
    sources = (kc.RealKvSource(ab.asarray(data[0]), page, 96, 96), kc.RealKvSource(ab.asarray(data[1]), page, 96, 48))
    host_sources = [HostSource(d, page, 96, s.read_bytes) for d, s in zip(data, sources)]
    buf = kc.allocate_canary_buffer(num_slots, like=ab.like)
    log = kc.ViolationLog.allocate(64, like=ab.like)
    n = num_slots - 1
    wp = kc.WritePlan.allocate(1, like=ab.like)
    wp.write_offsets[1] = n
    wp.write_num_valid_reqs[0] = 1
    loc = ab.asarray(np.arange(1, num_slots, dtype=np.int64)[::-1].copy())
    ids = ab.asarray(np.arange(n, dtype=np.int64))
    kc.write(buf, wp, ids, ids, loc, log=log, real_kv_sources=sources, real_kv_hash_mode=kc.RealKvHashMode.ALL)
    got = ab.to_numpy(buf)[1:, 3].view(np.uint64).tolist()
    assert got == [real_kv(host_sources, 2, s) for s in range(1, num_slots)]
    vp = kc.VerifyPlan.allocate(n, like=ab.like)
    vp.verify_slot_indices[:] = ab.asarray(np.arange(1, num_slots, dtype=np.int64))
    vp.verify_prev_slot_indices[:] = 0
    vp.verify_expected_positions[:] = ab.asarray(np.arange(n, dtype=np.int64)[::-1].copy())
    vp.verify_num_valid[0] = n
    kc.verify(buf, vp, log=log, real_kv_sources=sources, real_kv_hash_mode=kc.RealKvHashMode.ALL)
    assert int(ab.to_numpy(log.violation_counters)[0]) == 0


def test_all_mode_over_a_large_batch_hashes_in_bounded_memory():
    import tracemalloc

    from kvcanary_cupy.backends import SourceView, numpy_backend

    n, read = 20_000, 2048
    data = np.random.default_rng(0).integers(0, 256, (n, read), dtype=np.uint8)
    slots = np.arange(n, dtype=np.int64)
    tracemalloc.start()
    try:
        got = numpy_backend.real_kv_hashes((SourceView(data, 1, read, read),), int(kc.RealKvHashMode.ALL), slots)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB"
    want = numpy_backend.real_kv_hashes((SourceView(data[:64], 1, read, read),), int(kc.RealKvHashMode.ALL), slots[:64])
    assert got[:64].tolist() == want.tolist()


@pytest.mark.parametrize("mode", [int(kc.RealKvHashMode.PARTIAL), int(kc.RealKvHashMode.ALL)])
def test_real_kv_hashes_word_gather_matches_the_strip_fold(mode):
    """real_kv_hashes reads a C-contiguous source of whole-word rows (page size 1) as one flat word
    view and takes each slot's words; a padded-row copy of the same bytes (not C-contiguous), a byte
    offset off the word grid and a paged source take the strided gathers: every one folds to the
    oracle's bytes, with a slot offset (slots below it hash 0 for that source), the padding slot 0
    and the last row among the slots, and no slot at all."""
    from kvcanary_cupy.backends import SourceView, numpy_backend

    rng = np.random.default_rng(mode)
    rows, width = 10, 48
    data = [rng.integers(0, 256, (rows, width), dtype=np.uint8) for _ in range(3)]
    padded = np.zeros((rows, width + 16), np.uint8)
    padded[:, :width] = data[1]
    sources = (SourceView(data[0], 1, 32, 32), SourceView(padded[:, :width], 1, 32, 32, byte_offset=8, slot_offset=3),
               SourceView(data[2], 1, 24, 24, token_stride=width, byte_offset=4, unit=4), SourceView(data[0].reshape(-1, 2 * width), 2, width, 32))
    assert numpy_backend._word_gather(sources[0], 16) is not None
    assert all(numpy_backend._word_gather(s, 16) is None for s in sources[1:])
    slots = np.array([0, 9, 3, 2, 5, 9, 1, 8], np.int64)
    got = numpy_backend.real_kv_hashes(sources, mode, slots).tolist()
    nbytes = [16 if mode == int(kc.RealKvHashMode.PARTIAL) else s.read_bytes for s in sources]

    def strip(j, s):
        src = sources[j]
        pool = s - src.slot_offset
        if pool < 0:
            return b""
        flat = np.ascontiguousarray(src.data).reshape(-1)[: src.data.size]
        start = (pool // src.page_size) * src.data.shape[1] + src.byte_offset + (pool % src.page_size) * src.stride
        return flat[start : start + nbytes[j]].tobytes()

    assert got == [fold_strips([strip(j, s) for j in range(len(sources))]) for s in slots.tolist()]
    assert numpy_backend.real_kv_hashes(sources, mode, slots[:0]).shape == (0,)
