"""write(): worked examples of write (docs/format.md §4), real-KV fingerprints, assertions, out-of-range rules."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import RealKvHashMode, RealKvSource
from canary_builders import (
    ANCHOR_H,
    ANCHOR_S,
    WRITE_POSITION,
    WRITE_TOKEN,
    HostSource,
    a64,
    canary,
    chain,
    fold_strips,
    hmix3,
    host,
    kv_bytes,
    make_log,
    make_verify_plan,
    make_write_plan,
    oracle_write,
    real_kv,
    ring_rows,
    signed,
    sorted_rows,
)


def write(ab, buf, offsets, seeds, ids, pos, loc, *, log=None, num_valid=None, capacity=None, exp=None, **kw):
    """Run kc.write on backend ``ab`` with a caller-built WritePlan; returns (buf_host, log_host)."""
    log = make_log(ab) if log is None else log
    wp = make_write_plan(ab, offsets, seeds, num_valid=num_valid, capacity=capacity)
    if exp is not None:
        kw["expected_input_tokens"], kw["expected_input_positions"] = a64(ab, exp[0]), a64(ab, exp[1])
    kc.write(buf, wp, a64(ab, ids), a64(ab, pos), a64(ab, loc), log=log, **kw)
    return ab.to_numpy(buf), host(ab, log)


def test_single_token_at_anchor(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 1], [-1], [42], [0], [3])
    want = canary(8)
    want[3] = [42, 0, ANCHOR_S, 0]
    assert np.array_equal(b, want)
    assert int(lg["write_index"][0]) == 0
    assert lg["slot_run_counters"].tolist() == [1] + [0] * 11
    assert lg["kernel_run_counters"].tolist() == [1] + [0] * 11


def test_seed_continues_the_chain_and_verifies(ab):
    buf = ab.asarray(canary(16, {7: (100, 4, ANCHOR_H)}))
    b, lg = write(ab, buf, [0, 1], [7], [999], [5], [2])
    assert b[2].tolist() == [999, 5, signed(0x5022670B6356AF64), 0]
    assert int(lg["write_index"][0]) == 0  # chain-position assert: 4 + 1 == 5
    log = make_log(ab)
    kc.verify(buf, make_verify_plan(ab, [2], [5], [7]), log=log)
    assert int(ab.to_numpy(log.write_index)[0]) == 0


def test_five_token_chain_from_anchor(ab):
    buf = ab.asarray(canary(8))
    tokens = [101, 202, 303, 404, 505]
    b, lg = write(ab, buf, [0, 5], [-1], tokens, range(5), range(1, 6))
    want = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634]
    assert b[1:6, 2].tolist() == [signed(h) for h in want]
    assert b[1:6, 0].tolist() == tokens and b[1:6, 1].tolist() == list(range(5))
    assert (b[6:] == 0).all() and (b[0] == 0).all()
    assert int(lg["slot_run_counters"][0]) == 5


def test_slot_zero_writes_are_counted_and_chained_but_not_stored(ab):
    """The slots-0..4 chain example of docs/format.md §2, under the project's padding-slot rule (README)."""
    start = canary(8, {0: (-5, -5, -5, -5)})
    tokens = [101, 202, 303, 404, 505]
    b, lg = write(ab, ab.asarray(start), [0, 5], [-1], tokens, range(5), range(5))
    want = [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634]
    assert b[0].tolist() == [-5, -5, -5, -5]
    assert b[1:5, 2].tolist() == [signed(h) for h in want[1:]]  # the chain advanced through slot 0
    assert int(lg["slot_run_counters"][0]) == 5


def test_padded_tokens_of_many_requests_on_slot_zero(ab):
    b, lg = write(ab, ab.asarray(canary(8)), [0, 2, 4, 6], [-1, -1, -1], [1, 2, 3, 4, 5, 6], [0, 1] * 3,
                  [0, 1, 0, 2, 0, 3])
    assert (b[0] == 0).all()
    for slot, (first, second) in zip([1, 2, 3], [(1, 2), (3, 4), (5, 6)]):
        assert b[slot].tolist() == [second, 1, signed(hmix3(ANCHOR_H, first, 0)), 0]
    assert int(lg["slot_run_counters"][0]) == 6


def test_seed_zero_is_no_seed(ab):
    start = canary(8, {0: (100, 4, ANCHOR_H)})
    b, lg = write(ab, ab.asarray(start), [0, 1], [0], [1], [9], [2])
    assert b[2].tolist() == [1, 9, ANCHOR_S, 0]  # anchored; no chain-position assert
    assert int(lg["write_index"][0]) == 0 and int(lg["out_of_range_counters"][0]) == 0


def test_resume_from_seed_record(ab):
    buf = ab.asarray(canary(16, {9: (7, 10, ANCHOR_H)}))
    b, lg = write(ab, buf, [0, 5], [9], [101, 202, 303, 404, 505], range(11, 16), [1, 2, 3, 4, 5])
    want = [0x5E35681BCFCE7CF6, 0x56D3E7D2989B8E36, 0xDD87E0146C9036A8, 0x1CBB47092FF8336E, 0x3579999BB482D1FC]
    assert b[1:6, 2].tolist() == [signed(h) for h in want]
    assert int(lg["write_index"][0]) == 0


def test_negative_slot_is_skipped_without_advancing(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 2], [-1], [11, 22], [0, 1], [4, -1])
    want = canary(8)
    want[4] = [11, 0, ANCHOR_S, 0]
    assert np.array_equal(b, want)
    assert int(lg["slot_run_counters"][0]) == 1
    sentinel = canary(8, {s: (s, s, s, s) for s in range(8)})
    buf = ab.asarray(sentinel)
    b, lg = write(ab, buf, [0, 3], [-1], [50, 60, 70], [0, 1, 2], [5, -1, 7])
    untouched = [s for s in range(8) if s not in (5, 7)]
    assert np.array_equal(b[untouched], sentinel[untouched])
    # the skipped token does not advance the hash: slot 7 links straight to slot 5
    assert b[7].tolist() == [70, 2, signed(hmix3(ANCHOR_H, 50, 0)), 0]
    assert int(lg["slot_run_counters"][0]) == 2
    assert int(lg["out_of_range_counters"][0]) == 0  # negative slots are the normal "none"


def test_no_valid_requests_only_bumps_kernel_counter(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 2], [-1], [1, 2], [0, 1], [1, 2], num_valid=0, kernel_kind=5)
    assert (b == 0).all()
    assert lg["kernel_run_counters"].tolist() == [0] * 5 + [1] + [0] * 6
    assert (lg["slot_run_counters"] == 0).all() and (lg["out_of_range_counters"] == 0).all()


def test_requests_past_num_valid_are_not_written(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 1, 2, 3], [-1, -1, -1], [1, 2, 3], [0, 0, 0], [1, 2, 3], num_valid=2, capacity=4)
    assert b[1:3, 0].tolist() == [1, 2] and (b[3] == 0).all()
    assert int(lg["slot_run_counters"][0]) == 2


def test_two_requests_counters(ab):
    buf = ab.asarray(canary(16))
    b, lg = write(ab, buf, [0, 2, 5], [-1, -1], [1, 2, 3, 4, 5], [0, 1, 0, 1, 2], [1, 2, 3, 4, 5], kernel_kind=3)
    assert int(lg["slot_run_counters"][3]) == 5 and int(lg["kernel_run_counters"][3]) == 1
    h1, _ = chain([1, 2], [0, 1])
    h2, _ = chain([3, 4, 5], [0, 1, 2])
    assert b[1:6, 2].tolist() == [signed(h) for h in h1 + h2]


def test_counters_accumulate_per_kind(ab):
    buf = ab.asarray(canary(8))
    log = make_log(ab)
    for kind in (2, 2, 7):  # each call: 2 tokens written, 1 past the buffer, 1 input-assert violation
        write(ab, buf, [0, 4], [-1], [1, 2, 3, 4], [0, 1, 2, 3], [1, -1, 99, 2], log=log, kernel_kind=kind,
              exp=([1, 2, 3, 0], [0, 1, 2, 3]))
    lg = host(ab, log)
    for key, per_call in (("kernel_run_counters", 1), ("slot_run_counters", 2), ("out_of_range_counters", 1),
                          ("violation_counters", 1)):
        want = np.zeros(12, np.int64)
        want[[2, 7]] = [2 * per_call, per_call]
        assert lg[key].tolist() == want.tolist(), key


def test_tokens_past_the_plan_are_not_written(ab):
    """CUDA-graph padding tokens past write_offsets[num_valid] are never read."""
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 1, 1], [-1, -1], [5, 6, 7], [0, 0, 0], [1, 2, 3])
    assert b[2:].tolist() == canary(8)[2:].tolist()
    assert int(lg["slot_run_counters"][0]) == 1


# ---- write-input assert ------------------------------------------------------------------------


def test_input_assert_matching_gives_no_rows(ab):
    buf = ab.asarray(canary(8))
    _, lg = write(ab, buf, [0, 2], [-1], [42, 43], [0, 1], [1, 2], exp=([42, 43], [0, 1]))
    assert int(lg["write_index"][0]) == 0


def test_input_assert_token_mismatch_row(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 1], [-1], [42], [0], [3], exp=([99], [0]), kernel_kind=2)
    assert ring_rows(lg) == [(2, 3, 0, 42, 99, ANCHOR_S, 0, WRITE_TOKEN)]
    assert b[3].tolist() == [42, 0, ANCHOR_S, 0]  # the actual values are stored


def test_input_assert_position_mismatch_row(ab):
    buf = ab.asarray(canary(8))
    b, lg = write(ab, buf, [0, 1], [-1], [42], [7], [3], exp=([42], [0]))
    assert ring_rows(lg) == [(0, 3, 7, 42, 42, ANCHOR_S, 0, WRITE_POSITION)]
    assert int(b[3, 1]) == 7


def test_input_assert_every_entry_and_chain_on_actual_values(ab):
    buf = ab.asarray(canary(8))
    ids, pos = [10, 20, 30], [0, 1, 2]
    b, lg = write(ab, buf, [0, 3], [-1], ids, pos, [1, 2, 3], exp=([11, 20, 31], [0, 5, 2]))
    h, _ = chain(ids, pos)
    assert ring_rows(lg) == [
        (0, 1, 0, 10, 11, signed(h[0]), 0, WRITE_TOKEN),
        (0, 2, 1, 20, 20, signed(h[1]), 5, WRITE_POSITION),
        (0, 3, 2, 30, 31, signed(h[2]), 2, WRITE_TOKEN),
    ]
    log = make_log(ab)
    kc.verify(buf, make_verify_plan(ab, [1, 2, 3], [0, 1, 2], [-1, 1, 2], tokens=ids), log=log,
              check_expected_token=True)
    assert int(ab.to_numpy(log.write_index)[0]) == 0  # the stored chain is self-consistent


# ---- chain-position assert ---------------------------------------------------------------------


def test_chain_position_assert_row(ab):
    buf = ab.asarray(canary(16, {7: (100, 4, ANCHOR_H)}))
    b, lg = write(ab, buf, [0, 3], [7], [1, 2, 3], [5, 7, 8], [2, 3, 4], kernel_kind=4)
    running = hmix3(hmix3(ANCHOR_H, 100, 4), 1, 5)
    # expected_aux = running_prev_position + 1; the running position follows the actual one
    assert ring_rows(lg) == [(4, 3, 7, 2, 2, signed(running), 6, WRITE_POSITION)]
    assert b[3].tolist() == [2, 7, signed(running), 0]


def test_chain_position_assert_needs_a_seed(ab):
    buf = ab.asarray(canary(8))
    _, lg = write(ab, buf, [0, 2], [-1], [1, 2], [3, 9], [1, 2])
    assert int(lg["write_index"][0]) == 0


def test_chain_position_assert_bool_flag(ab):
    start = canary(16, {7: (100, 4, ANCHOR_H)})
    _, lg = write(ab, ab.asarray(start), [0, 1], [7], [1], [9], [2], chain_position_assert=False)
    assert int(lg["write_index"][0]) == 0
    _, lg = write(ab, ab.asarray(start), [0, 1], [7], [1], [9], [2], chain_position_assert=True)
    assert ring_rows(lg) == [(0, 2, 9, 1, 1, signed(hmix3(ANCHOR_H, 100, 4)), 5, WRITE_POSITION)]


def test_chain_position_assert_array_flag_read_at_run_time(ab):
    start = canary(16, {7: (100, 4, ANCHOR_H)})
    log = make_log(ab)
    flag = ab.asarray(np.array([0], np.int32))
    wp = make_write_plan(ab, [0, 1], [7])
    args = (wp, a64(ab, [1]), a64(ab, [9]), a64(ab, [2]))
    kc.write(ab.asarray(start), *args, log=log, chain_position_assert=flag)
    assert int(ab.to_numpy(log.write_index)[0]) == 0
    flag[...] = 1  # flipped in place between calls, same array object
    kc.write(ab.asarray(start), *args, log=log, chain_position_assert=flag)
    assert int(ab.to_numpy(log.write_index)[0]) == 1
    flag[...] = 0
    kc.write(ab.asarray(start), *args, log=log, chain_position_assert=flag)
    assert int(ab.to_numpy(log.write_index)[0]) == 1


def test_input_assert_row_precedes_chain_position_row(ab):
    buf = ab.asarray(canary(16, {7: (100, 4, ANCHOR_H)}))
    _, lg = write(ab, buf, [0, 1], [7], [1], [9], [2], exp=([2], [5]))
    run = signed(hmix3(ANCHOR_H, 100, 4))
    rows = lg["ring"][: int(lg["write_index"][0])].tolist()  # one request: rows in program order
    assert rows == [[0, 2, 9, 1, 2, run, 5, WRITE_TOKEN | WRITE_POSITION], [0, 2, 9, 1, 1, run, 5, WRITE_POSITION]]


def test_ring_rows_follow_token_order_on_the_cpu(ab):
    """The NumPy backend draws tickets in flat token order, a token's input-assert row first; GPU
    threads draw them in any order (the same rows)."""
    buf = canary(16, {7: (100, 4, ANCHOR_H)})
    offsets, seeds = [0, 4, 6], [7, -1]
    ids, pos, loc = [1, 2, 3, 4, 5, 6], [9, 6, 7, 12, 0, 3], [2, 3, 4, 5, 10, 11]
    exp = ([1, 0, 0, 0, 0, 6], [9, 6, 8, 1, 0, 3])  # input-assert rows for tokens 1, 2, 3 and 4
    want_buf = buf.copy()
    want, _, _ = oracle_write(want_buf, offsets, seeds, 2, ids, pos, loc, kind=4, expected_tokens=exp[0],
                              expected_positions=exp[1])
    assert [r[1] for r in want] == [2, 3, 3, 4, 5, 5, 10]  # chain-position rows of tokens 0, 1 and 3
    b, lg = write(ab, ab.asarray(buf), offsets, seeds, ids, pos, loc, exp=exp, kernel_kind=4)
    assert np.array_equal(b, want_buf)
    rows = [tuple(int(x) for x in r) for r in lg["ring"][: int(lg["write_index"][0])]]
    assert (sorted(rows) if ab.is_gpu else rows) == (sorted(want) if ab.is_gpu else want)


# ---- boundary values ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", [0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 0x7FFFFFFF])
def test_boundary_tokens_and_positions(ab, token, position):
    buf = ab.asarray(canary(4, {1: (token, position - 1, ANCHOR_H)}))
    b, lg = write(ab, buf, [0, 2], [1], [token, token ^ 1], [position, position + 1], [2, 3])
    want = canary(4, {1: (token, position - 1, ANCHOR_H)})
    rows, _, _ = oracle_write(want, [0, 2], [1], 1, [token, token ^ 1], [position, position + 1], [2, 3])
    assert np.array_equal(b, want)
    assert ring_rows(lg) == sorted_rows(rows) == []


# ---- real-KV fingerprints -----------------------------------------------------------------------


def _sources(ab, n_sources, *, page_size=1, nbpt=32, read_bytes=32, rows=16, seed=0):
    datas = [kv_bytes(rows, page_size * nbpt, seed + i) for i in range(n_sources)]
    dev = tuple(RealKvSource(ab.asarray(d), page_size, nbpt, read_bytes) for d in datas)
    hst = tuple(HostSource(d, page_size, nbpt, read_bytes) for d in datas)
    return dev, hst


@pytest.mark.parametrize("n_sources", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_real_kv_field_matches_fold(ab, n_sources, mode):
    dev, hst = _sources(ab, n_sources, nbpt=48, read_bytes=48)
    buf = ab.asarray(canary(16))
    b, _ = write(ab, buf, [0, 3], [-1], [1, 2, 3], [0, 1, 2], [3, 9, 15], real_kv_sources=dev, real_kv_hash_mode=mode)
    for slot in (3, 9, 15):
        assert int(b[slot, 3]) == signed(real_kv(hst, mode, slot)) != 0
    h, _ = chain([1, 2, 3], [0, 1, 2])
    assert b[[3, 9, 15], 2].tolist() == [signed(x) for x in h]  # real KV never enters the chain


def test_real_kv_none_mode_ignores_sources(ab):
    dev, _ = _sources(ab, 3)
    buf = ab.asarray(canary(16))
    b, _ = write(ab, buf, [0, 1], [-1], [1], [0], [3], real_kv_sources=dev, real_kv_hash_mode=RealKvHashMode.NONE)
    assert int(b[3, 3]) == 0


def test_real_kv_none_mode_never_reads_sources(ab):
    tiny = RealKvSource(ab.asarray(np.zeros((1, 16), np.uint8)), 1, 16, 16)  # covers 1 of 16 slots
    buf = ab.asarray(canary(16))
    b, _ = write(ab, buf, [0, 1], [-1], [1], [0], [9], real_kv_sources=(tiny,))
    assert int(b[9, 3]) == 0
    with pytest.raises(ValueError, match="every canary slot needs its real-KV bytes"):
        write(ab, buf, [0, 1], [-1], [1], [0], [9], real_kv_sources=(tiny,), real_kv_hash_mode=RealKvHashMode.ALL)


def test_real_kv_source_order_matters(ab):
    dev, hst = _sources(ab, 2)
    b1, _ = write(ab, ab.asarray(canary(16)), [0, 1], [-1], [1], [0], [5], real_kv_sources=dev,
                  real_kv_hash_mode=RealKvHashMode.ALL)
    b2, _ = write(ab, ab.asarray(canary(16)), [0, 1], [-1], [1], [0], [5], real_kv_sources=dev[::-1],
                  real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(b1[5, 3]) == signed(real_kv(hst, 2, 5))
    assert int(b2[5, 3]) == signed(real_kv(hst[::-1], 2, 5))
    assert b1[5, 3] != b2[5, 3]


def test_real_kv_pinned_pattern(ab):
    pattern = np.array([1, 2, 4, 8, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF], np.uint8)
    data = np.tile(pattern, (4, 1))
    src = RealKvSource(ab.asarray(data), 1, 16, 16)
    for mode in (RealKvHashMode.PARTIAL, RealKvHashMode.ALL):
        b, _ = write(ab, ab.asarray(canary(4)), [0, 1], [-1], [1], [0], [2], real_kv_sources=(src,), real_kv_hash_mode=mode)
        assert int(b[2, 3]) == signed(0x6041580849E6407D)


def test_partial_reads_16_bytes_all_reads_read_bytes(ab):
    data = np.zeros((8, 64), np.uint8)
    data[:, 20] = 0x5A  # past the first 16 bytes, inside read_bytes=32
    data[:, 40] = 0x77  # past read_bytes: never read
    src = (RealKvSource(ab.asarray(data), 1, 64, 32),)
    b, _ = write(ab, ab.asarray(canary(8)), [0, 1], [-1], [1], [0], [4], real_kv_sources=src,
                 real_kv_hash_mode=RealKvHashMode.PARTIAL)
    assert int(b[4, 3]) == 0  # an all-zero strip folds to 0
    b, _ = write(ab, ab.asarray(canary(8)), [0, 1], [-1], [1], [0], [4], real_kv_sources=src,
                 real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(b[4, 3]) == signed(fold_strips([data[4, :32].tobytes()]))


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_source_slots_in_one_page_are_independent(ab, page_size):
    nbpt = 16
    data = kv_bytes(4, page_size * nbpt, 3)
    src = (RealKvSource(ab.asarray(data), page_size, nbpt, nbpt),)
    slots = [3, 7, page_size - 1, page_size, 2 * page_size + 1]
    b, _ = write(ab, ab.asarray(canary(4 * page_size)), [0, 5], [-1], [1, 2, 3, 4, 5], range(5), slots,
                 real_kv_sources=src, real_kv_hash_mode=RealKvHashMode.ALL)
    for s in slots:
        row, col = s // page_size, (s % page_size) * nbpt
        assert int(b[s, 3]) == signed(fold_strips([data[row, col:col + nbpt].tobytes()])), s
    assert b[3, 3] != b[7, 3]


@pytest.mark.parametrize("holey", ["strided_view", "trailing_bytes"])
def test_holey_rows(ab, holey):
    page_size, nbpt = 4, 16
    data = kv_bytes(4, page_size * nbpt, 5)
    wide = np.full((4, page_size * nbpt + 32), 0xAA, np.uint8)
    wide[:, : page_size * nbpt] = data
    if holey == "strided_view":  # row stride 96 > page_size * nbpt = 64
        tensor = ab.asarray(wide)[:, : page_size * nbpt]
    else:  # trailing garbage bytes inside each row
        tensor = ab.asarray(wide)
    src = (RealKvSource(tensor, page_size, nbpt, nbpt),)
    slots = [1, 3, 6, 13]
    b, _ = write(ab, ab.asarray(canary(16)), [0, 4], [-1], [1, 2, 3, 4], range(4), slots, real_kv_sources=src,
                 real_kv_hash_mode=RealKvHashMode.ALL)
    hs = (HostSource(data, page_size, nbpt, nbpt),)
    assert [int(b[s, 3]) for s in slots] == [signed(real_kv(hs, 2, s)) for s in slots]


def test_float16_source_is_read_as_bytes(ab):
    data = kv_bytes(8, 64, 9)
    f16 = data.view(np.float16)  # [8, 32] float16, the same bytes
    src = (RealKvSource(ab.asarray(f16), 1, 64, 64),)
    b, _ = write(ab, ab.asarray(canary(8)), [0, 2], [-1], [1, 2], [0, 1], [2, 5], real_kv_sources=src,
                 real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(b[5, 3]) == signed(fold_strips([data[5].tobytes()]))


def test_bfloat16_torch_source_is_read_as_bytes(ab):
    if not ab.name.startswith("torch"):
        pytest.skip("bfloat16 tensors are a torch thing")
    import torch

    data = kv_bytes(8, 256, 11)  # 8 rows of [2, 4, 16] bfloat16 = 256 bytes
    tensor = ab.asarray(data).view(torch.bfloat16).reshape(8, 2, 4, 16)
    src = (RealKvSource(tensor, 2, 128, 64),)
    b, _ = write(ab, ab.asarray(canary(16)), [0, 2], [-1], [1, 2], [0, 1], [4, 7], real_kv_sources=src,
                 real_kv_hash_mode=RealKvHashMode.ALL)
    hs = (HostSource(data, 2, 128, 64),)
    assert [int(b[s, 3]) for s in (4, 7)] == [signed(real_kv(hs, 2, s)) for s in (4, 7)]


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("mode", [RealKvHashMode.PARTIAL, RealKvHashMode.ALL])
def test_fp8_torch_source_is_read_as_bytes(ab, fp8, mode):
    """fp8 KV pools (one byte per element, NaN patterns included) are fingerprinted from their bytes."""
    if not ab.name.startswith("torch"):
        pytest.skip("fp8 tensors are a torch thing")
    import torch

    data = kv_bytes(8, 2 * 64, 13)  # 8 pages of 2 slots x [4 heads, 16] fp8
    data[:, :8] = 0x7F  # NaN in e4m3fn and e5m2: the bytes, not the values, are hashed
    tensor = ab.asarray(data).view(getattr(torch, fp8)).reshape(8, 2, 4, 16)
    verify_plan = make_verify_plan(ab, [3, 12], [0, 1], [-1, 3])
    src = (RealKvSource(tensor, 2, 64, 48),)
    log = make_log(ab)
    b, _ = write(ab, ab.asarray(canary(16)), [0, 2], [-1], [1, 2], [0, 1], [3, 12], log=log, real_kv_sources=src,
                 real_kv_hash_mode=mode)
    hs = (HostSource(data, 2, 64, 48),)
    assert [int(b[s, 3]) for s in (3, 12)] == [signed(real_kv(hs, int(mode), s)) for s in (3, 12)]
    buf = ab.asarray(b)
    kc.verify(buf, verify_plan, log=log, real_kv_sources=src, real_kv_hash_mode=mode)
    data[6, 64 + 47] ^= 1  # slot 13's last read byte: not a verified slot
    data[6, 47] ^= 1  # slot 12's last read byte: ALL reads it, PARTIAL does not
    tensor.view(torch.uint8).reshape(8, -1)[...] = ab.asarray(data)
    kc.verify(buf, verify_plan, log=log, real_kv_sources=src, real_kv_hash_mode=mode)
    rows = ring_rows(host(ab, log))
    assert [(r[1], r[7]) for r in rows] == ([(12, 4)] if mode == RealKvHashMode.ALL else [])


def test_out_of_range_slots_are_never_fingerprinted(ab):
    """Slots past the buffer (or negative) are skipped before their real-KV bytes would be read:
    a source covering exactly the buffer's slots is never read out of bounds."""
    data = kv_bytes(16, 32, 17)
    src = (RealKvSource(ab.asarray(data), 1, 32, 32),)
    b, lg = write(ab, ab.asarray(canary(16)), [0, 5], [-1], [1, 2, 3, 4, 5], range(5), [3, 16, -2, 99, 4],
                  real_kv_sources=src, real_kv_hash_mode=RealKvHashMode.ALL)
    hs = (HostSource(data, 1, 32, 32),)
    assert [int(b[s, 3]) for s in (3, 4)] == [signed(real_kv(hs, 2, s)) for s in (3, 4)]
    assert (int(lg["slot_run_counters"][0]), int(lg["out_of_range_counters"][0])) == (2, 2)


def test_source_rows_must_cover_every_slot(ab):
    src = (RealKvSource(ab.asarray(np.zeros((3, 64), np.uint8)), 4, 16, 16),)  # 12 slots
    buf = ab.asarray(canary(13))
    log = make_log(ab)
    with pytest.raises(ValueError, match=r"has 3 rows x page_size=4 = 12 slots but canary_buf has 13"):
        write(ab, buf, [0, 1], [-1], [1], [0], [2], log=log, real_kv_sources=src,
              real_kv_hash_mode=RealKvHashMode.PARTIAL)
    assert (ab.to_numpy(buf) == 0).all() and int(ab.to_numpy(log.kernel_run_counters).sum()) == 0


# ---- canary buffer layouts ----------------------------------------------------------------------


@pytest.mark.parametrize("stride", [32, 48])
def test_uint8_canary_layout_gives_the_same_bytes(ab, stride):
    dev, _ = _sources(ab, 2)
    args = ([0, 2, 3], [4, -1], [7, 8, 9], [5, 6, 0], [1, 2, 3])
    start = canary(16, {4: (3, 4, ANCHOR_H)})
    kw = dict(real_kv_sources=dev, real_kv_hash_mode=RealKvHashMode.ALL)
    ref, lg_ref = write(ab, ab.asarray(start), *args, **kw)
    raw = np.full((16, stride), 0xEE, np.uint8)
    raw[:, :32] = start.view(np.uint8).reshape(16, 32)
    b, lg = write(ab, ab.asarray(raw), *args, **kw)
    assert np.array_equal(b[:, :32], ref.view(np.uint8).reshape(16, 32))
    assert (b[:, 32:] == 0xEE).all()  # bytes past the 4 fields are never touched
    assert ring_rows(lg) == ring_rows(lg_ref)


def test_wider_int64_canary_rows(ab):
    start = np.full((8, 6), -7, np.int64)
    b, _ = write(ab, ab.asarray(start), [0, 1], [-1], [42], [0], [3])
    assert b[3].tolist() == [42, 0, ANCHOR_S, 0, -7, -7]


# ---- random batches against the oracle ---------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_oracle(ab, seed):
    rng = np.random.default_rng(seed)
    n_slots, n_req = 64, int(rng.integers(1, 9))
    lens = rng.integers(0, 6, size=n_req)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    total = int(offsets[-1])
    pad = int(rng.integers(0, 3))
    loc = rng.permutation(np.arange(1, n_slots))[: total + pad]
    loc[rng.random(total + pad) < 0.15] = -1
    loc[rng.random(total + pad) < 0.1] = 0  # the padding slot
    start = rng.integers(-(2**62), 2**62, size=(n_slots, 4))
    unwritten = np.setdiff1d(np.arange(1, n_slots), loc)  # a seed written in the same launch is a race
    seeds = rng.choice(np.concatenate([[-1, 0], unwritten]), size=n_req)
    ids = rng.integers(0, 50000, size=total + pad)
    pos = rng.integers(0, 100, size=total + pad)
    exp_t = np.where(rng.random(total + pad) < 0.3, ids + 1, ids)
    exp_p = np.where(rng.random(total + pad) < 0.3, pos + 1, pos)
    dev, hst = _sources(ab, 2, page_size=4, rows=16, seed=seed)
    mode = [RealKvHashMode.NONE, RealKvHashMode.PARTIAL, RealKvHashMode.ALL][seed % 3]
    b, lg = write(ab, ab.asarray(start), offsets, seeds, ids, pos, loc, exp=(exp_t, exp_p), kernel_kind=seed,
                  real_kv_sources=dev, real_kv_hash_mode=mode)
    want = start.copy()
    rows, written, oor = oracle_write(want, offsets, seeds, n_req, ids, pos, loc, kind=seed,
                                      expected_tokens=exp_t, expected_positions=exp_p, sources=hst, mode=mode)
    assert np.array_equal(b, want)
    assert ring_rows(lg) == sorted_rows(rows)
    assert int(lg["write_index"][0]) == len(rows)
    assert int(lg["slot_run_counters"][seed]) == written
    assert oor == 0 and int(lg["out_of_range_counters"].sum()) == 0


# ---- out-of-range values -------------------------------------------------------------------------


def test_num_valid_reqs_clamped_without_counting(ab):
    _, lg = write(ab, ab.asarray(canary(8)), [0, 1, 2], [-1, -1], [1, 2], [0, 0], [1, 2], num_valid=9)
    assert int(lg["slot_run_counters"][0]) == 2 and int(lg["out_of_range_counters"][0]) == 0
    b, lg = write(ab, ab.asarray(canary(8)), [0, 1, 2], [-1, -1], [1, 2], [0, 0], [1, 2], num_valid=-3)
    assert (b == 0).all()
    assert (int(lg["slot_run_counters"][0]), int(lg["kernel_run_counters"][0])) == (0, 1)
    assert int(lg["out_of_range_counters"][0]) == 0


def test_request_ranges_clamped_into_tokens(ab):
    ids, pos, loc = [1, 2, 3, 4], [0, 1, 2, 3], [1, 2, 3, 4]
    offsets = [-2, 1, 9, 9, 3]  # req0 starts < 0, req1 ends > T, req2 starts > T, req3 ends < start
    b, lg = write(ab, ab.asarray(canary(8)), offsets, [-1] * 4, ids, pos, loc)
    want = canary(8)
    rows, written, oor = oracle_write(want, offsets, [-1] * 4, 4, ids, pos, loc)
    assert oor == 4 and written == 4
    assert np.array_equal(b, want)
    assert int(lg["out_of_range_counters"][0]) == 4
    assert int(lg["slot_run_counters"][0]) == 4
    assert b[1].tolist() == [1, 0, ANCHOR_S, 0]  # req0 = [0, 1)
    assert b[2:5, 0].tolist() == [2, 3, 4]  # req1 = [1, 4)


def test_seed_past_buffer_is_no_seed(ab):
    b, lg = write(ab, ab.asarray(canary(8)), [0, 2], [8], [1, 2], [5, 9], [1, 2])
    h, _ = chain([1, 2], [5, 9])  # anchored, and no chain-position assert
    assert b[1:3, 2].tolist() == [signed(x) for x in h]
    assert int(lg["write_index"][0]) == 0
    assert int(lg["out_of_range_counters"][0]) == 1


def test_slot_past_buffer_is_skipped_and_counted(ab):
    b, lg = write(ab, ab.asarray(canary(8)), [0, 3], [-1], [1, 2, 3], [0, 1, 2], [1, 8, 3], kernel_kind=9)
    assert b[3].tolist() == [3, 2, signed(hmix3(ANCHOR_H, 1, 0)), 0]  # no hash advance for slot 8
    assert int(lg["slot_run_counters"][9]) == 2
    assert int(lg["out_of_range_counters"][9]) == 1


@pytest.mark.parametrize("case, message", [
    (dict(offsets=[0, 5]), r"write_plan.write_offsets\[0:2\] = \[0, 5\] is not a range within the 2 tokens"),
    (dict(seeds=[8]), r"write_plan.write_seed_slot_indices\[0\] = 8 is outside canary_buf's 8 slots"),
    (dict(loc=[1, 12]), r"out_cache_loc\[1\] = 12 is outside canary_buf's 8 slots"),
    (dict(loc=[8, 1]), r"out_cache_loc\[0\] = 8 is outside canary_buf's 8 slots"),
    (dict(offsets=[0, 1, 5], seeds=[-1, -1]),
     r"^kv-canary: write_plan.write_offsets\[1:3\] = \[1, 5\] is not a range within the 2 tokens of input_ids$"),
])
def test_strict_write(ab, case, message):
    args = dict(offsets=[0, 2], seeds=[-1], loc=[1, 2])
    args.update(case)
    buf = ab.asarray(canary(8))
    log = make_log(ab)
    with pytest.raises(ValueError, match=message):
        write(ab, buf, args["offsets"], args["seeds"], [1, 2], [0, 1], args["loc"], log=log, strict=True)
    assert (ab.to_numpy(buf) == 0).all()
    assert all((v == 0).all() for v in host(ab, log).values())
    _, lg = write(ab, buf, args["offsets"], args["seeds"], [1, 2], [0, 1], args["loc"], log=log)
    assert int(lg["out_of_range_counters"][0]) == 1


def test_strict_write_accepts_negative_slots_and_seeds(ab):
    b, lg = write(ab, ab.asarray(canary(8)), [0, 2], [-1], [1, 2], [0, 1], [-1, 2], strict=True)
    assert int(lg["slot_run_counters"][0]) == 1


@pytest.mark.parametrize("num_valid", [0, -1])
def test_strict_write_ignores_requests_past_num_valid(ab, num_valid):
    b, lg = write(ab, ab.asarray(canary(8)), [0, 5], [99], [1, 2], [0, 1], [1, 20], num_valid=num_valid, strict=True)
    assert (int(lg["kernel_run_counters"][0]), int(lg["out_of_range_counters"][0])) == (1, 0)
    assert not b.any()


@pytest.mark.parametrize("seed", range(8))
def test_random_out_of_range_values_match_oracle(ab, seed):
    rng = np.random.default_rng(50 + seed)
    n_slots, n_req, t_len = 24, int(rng.integers(1, 7)), int(rng.integers(0, 20))
    # out-of-range ranges that never make two requests share a token (that would be a write race)
    offsets = np.sort(rng.integers(0, t_len + 1, size=n_req + 1))
    if rng.random() < 0.5:
        offsets[0] = -int(rng.integers(1, 4))  # the first request starts before token 0
    tail = rng.integers(4)
    if tail == 1:
        offsets[-1] = t_len + int(rng.integers(1, 4))  # the last request ends past T
    elif tail == 2:
        offsets[-1] = offsets[-2] - int(rng.integers(1, 4))  # the last request runs backwards
    elif tail == 3 and n_req > 1:
        offsets[-2:] = [t_len + 2, t_len + 5]  # the last request starts past T
    loc = rng.permutation(np.arange(-4, n_slots + 8))[:t_len]  # unique: no two writers per slot
    start = canary(n_slots, {s: (s, s, s * 7919, 0) for s in range(n_slots)})
    unwritten = np.setdiff1d(np.arange(1, n_slots), loc)
    seeds = rng.choice(np.concatenate([[-2, -1, 0, n_slots, n_slots + 9], unwritten]), size=n_req)
    ids, pos = rng.integers(0, 100, size=t_len), rng.integers(0, 30, size=t_len)
    num_valid = n_req if rng.random() < 0.6 else int(rng.integers(-1, n_req + 2))
    b, lg = write(ab, ab.asarray(start), offsets, seeds, ids, pos, loc, num_valid=num_valid, kernel_kind=1)
    want = start.copy()
    rows, written, oor = oracle_write(want, offsets, seeds, num_valid, ids, pos, loc, kind=1)
    assert np.array_equal(b, want)
    assert ring_rows(lg) == sorted_rows(rows)
    assert (int(lg["slot_run_counters"][1]), int(lg["out_of_range_counters"][1])) == (written, oor)
    # strict=True raises exactly when some value is skipped or clamped (and counted)
    call = lambda: write(ab, ab.asarray(start), offsets, seeds, ids, pos, loc, num_valid=num_valid, strict=True)
    if oor:
        with pytest.raises(ValueError, match="is outside|is not a range"):
            call()
    else:
        call()


@pytest.mark.parametrize("capacity, buffers, blocks", [
    (8, 1, 2),  # a prefill's requests: a warp each (4 warps per block)
    (8, 2, 4),  # and a warp per request and buffer
    (256, 1, 64),
    (4096, 1, 132),  # a warp per scheduler (132 SMs x 4), each taking requests w, w + 528, ...
    (20000, 1, 157),  # a warp per 32 requests: 625 warps
    (20000, 2, 313),
    (10**6, 1, 132 * 16),  # never more than the resident warps
    (10**6, 4, 132 * 16),
])
def test_write_grid(monkeypatch, launch_policy, capacity, buffers, blocks):
    """The write grid on a 132-SM device holding 16 write blocks per SM: a warp per request up to one
    per warp scheduler, then a warp per 32 requests, for each canary buffer."""
    from kvcanary_cupy.backends.cuda import abi, configs, device as cuda_device

    monkeypatch.setattr(cuda_device, "current_id", lambda: 0)
    monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: 132)
    launch_policy(resident_blocks=16)
    config = configs.write_config("kvcanary::canary_write<1, false, false>", capacity, buffers)
    assert config == configs.LaunchConfig(blocks, abi.WRITE_THREADS)
