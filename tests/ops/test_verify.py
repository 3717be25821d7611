"""verify(): worked examples of verify (docs/format.md §4), the fill-once ring, counters and out-of-range rules."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryLaunchTag, RealKvHashMode, RealKvSource
from canary_builders import (
    ANCHOR_H,
    ANCHOR_S,
    CHAIN,
    POSITION,
    REAL_KV,
    TOKEN,
    HostSource,
    a64,
    canary,
    chain,
    host,
    is_sub_multiset,
    kv_bytes,
    make_log,
    make_verify_plan,
    make_write_plan,
    oracle_verify,
    real_kv,
    record_hash,
    ring_rows,
    signed,
    sm64,
    sorted_rows,
    stamp_chain,
)


def verify(ab, buf_np, slots, positions, prevs, *, tokens=None, log=None, num_valid=None, enable=1,
           capacity=None, buf=None, **kw):
    """Verify a host buffer on backend ``ab``; returns the log's host copy (buffer checked unchanged)."""
    log = make_log(ab) if log is None else log
    buf = ab.asarray(buf_np) if buf is None else buf
    before = ab.to_numpy(buf).copy()
    vp = make_verify_plan(ab, slots, positions, prevs, tokens=tokens, num_valid=num_valid, enable=enable,
                          capacity=capacity)
    kc.verify(buf, vp, log=log, **kw)
    assert np.array_equal(ab.to_numpy(buf), before)  # verify never writes the canary buffer
    return host(ab, log)


def clean_chain(n_slots=16, slots=(1, 2, 3, 4, 5), tokens=(101, 202, 303, 404, 505)):
    buf = canary(n_slots)
    stamp_chain(buf, slots, tokens, range(len(slots)))
    return buf


def test_anchor_record_verifies(ab):
    lg = verify(ab, canary(16, {5: (42, 0, ANCHOR_H)}), [5], [0], [-1])
    assert int(lg["write_index"][0]) == 0
    assert (lg["slot_run_counters"][0], lg["kernel_run_counters"][0]) == (1, 1)


def test_clean_chain_verifies(ab):
    lg = verify(ab, clean_chain(), [1, 2, 3, 4, 5], range(5), [-1, 1, 2, 3, 4])
    assert int(lg["write_index"][0]) == 0 and int(lg["slot_run_counters"][0]) == 5


def test_token_corruption_is_a_chain_mismatch_on_the_next_slot(ab):
    buf = clean_chain()
    buf[2, 0] = 999
    lg = verify(ab, buf, [3], [2], [2])
    assert ring_rows(lg) == [(0, 3, 2, 303, -1, int(buf[3, 2]), signed(record_hash(buf[2])), CHAIN)]
    lg = verify(ab, buf, [1, 2, 3, 4, 5], range(5), [-1, 1, 2, 3, 4], tokens=[101, 202, 303, 404, 505],
                check_expected_token=True)
    assert [(r[1], r[7]) for r in ring_rows(lg)] == [(2, TOKEN), (3, CHAIN)]


@pytest.mark.parametrize("expected_position", [5, 99])
def test_position_mismatch(ab, expected_position):
    lg = verify(ab, canary(16, {7: (11, 0, ANCHOR_H)}), [7], [expected_position], [-1])
    assert ring_rows(lg) == [(0, 7, 0, 11, -1, ANCHOR_S, ANCHOR_S, POSITION)]


def test_prev_hash_corruption(ab):
    buf = clean_chain()
    buf[2, 2] = 0x1234567812345678
    lg = verify(ab, buf, [2], [1], [1])
    assert ring_rows(lg) == [(0, 2, 1, 202, -1, 0x1234567812345678, signed(record_hash(buf[1])), CHAIN)]
    lg = verify(ab, canary(16, {5: (1, 0, 0xDEADBEEF)}), [5], [0], [-1])
    assert [r[7] for r in ring_rows(lg)] == [CHAIN]


def test_exact_row_bytes(ab):
    buf = canary(16, {5: (33, 0, ANCHOR_H)})
    lg = verify(ab, buf, [5], [99], [-1], kernel_kind=CanaryLaunchTag.HEAD_K_FULL)
    assert lg["ring"][0].tolist() == [0, 5, 0, 33, -1, ANCHOR_S, ANCHOR_S, 2]
    assert (lg["ring"][1:] == 0).all()
    lg = verify(ab, buf, [5], [99], [-1], tokens=[34], check_expected_token=True, kernel_kind=CanaryLaunchTag.TAIL_V_SWA)
    assert lg["ring"][0].tolist() == [9, 5, 0, 33, 34, ANCHOR_S, ANCHOR_S, POSITION | TOKEN]


@pytest.mark.parametrize("tag", [CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.SWEEP_V_SWA, CanaryLaunchTag.HEAD_V_SWA])
def test_kernel_kind_stamping_and_counters(ab, tag):
    lg = verify(ab, canary(16, {5: (1, 3, ANCHOR_H)}), [5, 0, 6], [0, 0, 0], [-1, -1, -1], kernel_kind=tag)
    assert [r[0] for r in ring_rows(lg)] == [int(tag)] * 2  # slot 5: position; slot 6: zero record at pos 0
    want = np.zeros(12, np.int64)
    want[int(tag)] = 1
    assert lg["kernel_run_counters"].tolist() == want.tolist()
    want[int(tag)] = 3
    assert lg["slot_run_counters"].tolist() == want.tolist()


def test_token_check(ab):
    buf = clean_chain()
    tokens = [101, 999, -1, 404, 0]
    slots, pos, prevs = [1, 2, 3, 4, 5], range(5), [-1, 1, 2, 3, 4]
    lg = verify(ab, buf, slots, pos, prevs, tokens=tokens)  # check off: nothing, expected column -1
    assert int(lg["write_index"][0]) == 0
    lg = verify(ab, buf, slots, pos, prevs, tokens=tokens, check_expected_token=True)
    assert ring_rows(lg) == sorted_rows([
        (0, 2, 1, 202, 999, int(buf[2, 2]), int(buf[2, 2]), TOKEN),
        (0, 5, 4, 505, 0, int(buf[5, 2]), int(buf[5, 2]), TOKEN),
    ])
    # with the token check off the row carries expected_token -1 even when the plan has one
    buf[3, 1] = 7
    lg = verify(ab, buf, slots, pos, prevs, tokens=tokens)
    assert [(r[1], r[4], r[7]) for r in ring_rows(lg)] == [(3, -1, POSITION), (4, -1, CHAIN)]


def test_zero_predecessor_skips_only_the_chain_check(ab):
    buf = clean_chain()
    buf[3, 2] = 12345  # broken chain, but the predecessor is unknown
    lg = verify(ab, buf, [3], [2], [0])
    assert int(lg["write_index"][0]) == 0
    lg = verify(ab, buf, [3], [9], [0], tokens=[1], check_expected_token=True)
    assert ring_rows(lg) == [(0, 3, 2, 303, 1, 12345, 12345, POSITION | TOKEN)]


def test_negative_predecessor_is_the_anchor(ab):
    lg = verify(ab, canary(16, {4: (1, 0, ANCHOR_H), 5: (1, 0, 777)}), [4, 5], [0, 0], [-7, -1])
    assert ring_rows(lg) == [(0, 5, 0, 1, -1, 777, ANCHOR_S, CHAIN)]


def test_slot_zero_is_skipped_after_counting(ab):
    buf = canary(16, {0: (5, 5, 5)})
    lg = verify(ab, buf, [0, 0, 0], [1, 2, 3], [-1, -1, -1])
    assert int(lg["write_index"][0]) == 0
    assert int(lg["slot_run_counters"][0]) == 3 and int(lg["out_of_range_counters"][0]) == 0


def test_zero_record_weakness(ab):
    """An all-zero slot chains to an all-zero predecessor (mix3(0,0,0)=0): only position/anchor catch it."""
    buf = canary(16)
    lg = verify(ab, buf, [3], [4], [2])
    assert ring_rows(lg) == [(0, 3, 0, 0, -1, 0, 0, POSITION)]
    lg = verify(ab, buf, [3], [0], [2])
    assert int(lg["write_index"][0]) == 0  # undetectable by design
    lg = verify(ab, buf, [1], [0], [-1])
    assert ring_rows(lg) == [(0, 1, 0, 0, -1, 0, ANCHOR_S, CHAIN)]  # issue #38586's row


def test_disabled_plan_only_bumps_kernel_counter(ab):
    log = make_log(ab)
    lg = verify(ab, canary(16), [1, 2], [5, 5], [-1, -1], enable=0, log=log, kernel_kind=4)
    assert int(lg["write_index"][0]) == 0 and (lg["ring"] == 0).all()
    assert (int(lg["kernel_run_counters"][4]), int(lg["slot_run_counters"][4])) == (1, 0)


def test_empty_plan_and_repeated_launches(ab):
    log = make_log(ab)
    lg = verify(ab, canary(16), [], [], [], capacity=4, log=log)
    assert (int(lg["kernel_run_counters"][0]), int(lg["slot_run_counters"][0])) == (1, 0)
    log = make_log(ab)
    buf = ab.asarray(clean_chain())
    for _ in range(2):
        lg = verify(ab, None, [1, 2, 3], [0, 1, 2], [-1, 1, 2], log=log, buf=buf)
    assert (int(lg["kernel_run_counters"][0]), int(lg["slot_run_counters"][0])) == (2, 6)
    assert int(lg["write_index"][0]) == 0


@pytest.mark.parametrize("num_valid, scanned", [(-5, 0), (2, 2), (3, 3), (1000, 3)])
def test_num_valid_clamped(ab, num_valid, scanned):
    lg = verify(ab, canary(16), [1, 2, 3], [9, 9, 9], [0, 0, 0], num_valid=num_valid)
    assert int(lg["slot_run_counters"][0]) == scanned
    assert int(lg["write_index"][0]) == scanned  # every zero record at position 9 fails
    assert sorted(r[1] for r in ring_rows(lg)) == [1, 2, 3][:scanned]


def test_entries_past_num_valid_are_ignored(ab):
    lg = verify(ab, clean_chain(), [1, 2], [0, 1], [-1, 1], capacity=6)  # junk 0x5A5A entries past 2
    assert int(lg["write_index"][0]) == 0 and int(lg["slot_run_counters"][0]) == 2


# ---- ring ---------------------------------------------------------------------------------------


def test_ring_fill_once_overflow(ab):
    log = make_log(ab, capacity=4)
    slots = list(range(1, 11))
    expected, _, _ = oracle_verify(canary(16), [(s, -1, 7, -1) for s in slots])
    lg = verify(ab, canary(16), slots, [7] * 10, [-1] * 10, log=log)
    assert int(lg["write_index"][0]) == 4 and int(lg["violation_counters"][0]) == 10
    stored = ring_rows(lg)
    assert len(stored) == 4 and is_sub_multiset(stored, sorted_rows(expected))
    report = kc.ViolationLog.read(log)
    assert (report.total_violations, len(report.violations), report.dropped) == (10, 4, 6)
    # a full ring keeps its rows and write_index; later violations are only counted
    lg = verify(ab, canary(16), [1], [3], [-1], log=log)
    assert int(lg["write_index"][0]) == 4 and int(lg["violation_counters"][0]) == 11 and ring_rows(lg) == stored


def test_write_index_never_wraps(ab):
    """A write_index already at or past the capacity is left alone; a negative one keeps its rows out."""
    log = make_log(ab, capacity=4)
    log.write_index[...] = 2**31 - 1
    lg = verify(ab, canary(16), [1, 2, 3], [7] * 3, [-1] * 3, log=log)
    assert int(lg["write_index"][0]) == 2**31 - 1 and int(lg["violation_counters"][0]) == 3
    assert (lg["ring"] == 0).all()
    log = make_log(ab, capacity=4)
    log.write_index[...] = -2
    lg = verify(ab, canary(16), [1, 2, 3], [7] * 3, [-1] * 3, log=log)
    assert int(lg["write_index"][0]) == 1 and int(lg["violation_counters"][0]) == 3
    expected, _, _ = oracle_verify(canary(16), [(s, -1, 7, -1) for s in (1, 2, 3)])
    assert ring_rows(lg)[0] in sorted_rows(expected)
    assert (lg["ring"][1:] == 0).all()  # negative tickets never index the ring from its end


def test_fifty_simultaneous_violations(ab):
    log = make_log(ab, capacity=128)
    slots = list(range(1, 51))
    lg = verify(ab, canary(64), slots, [1] * 50, [-1] * 50, log=log)
    assert int(lg["write_index"][0]) == 50
    expected, _, _ = oracle_verify(canary(64), [(s, -1, 1, -1) for s in slots])
    assert ring_rows(lg) == sorted_rows(expected)
    assert (lg["ring"][50:] == 0).all()


@pytest.mark.parametrize("corruption", ["position", "prev_hash", "real_kv"])
@pytest.mark.parametrize("where", [0, 2, 4])
@pytest.mark.parametrize("ring_full", [False, True])
def test_corruption_matrix(ab, corruption, where, ring_full):
    """{position, prev_hash, real_kv} x {head, mid, last} x {ring open, ring full}: the library's
    ring rows, counters and report, against hand-made bits and the oracle's rows."""
    data = kv_bytes(16, 32, 1)
    src = (RealKvSource(ab.asarray(data), 1, 32, 32),)
    hs = (HostSource(data, 1, 32, 32),)
    buf = clean_chain()
    slots = [1, 2, 3, 4, 5]
    for s in slots:
        buf[s, 3] = signed(real_kv(hs, 2, s))
    target = slots[where]
    successor = {slots[where + 1]: CHAIN} if where < 4 else {}
    if corruption == "position":
        buf[target, 1] += 100
        want_bits = {target: POSITION, **successor}
    elif corruption == "prev_hash":
        buf[target, 2] ^= 1
        want_bits = {target: CHAIN, **successor}
    else:
        buf[target, 3] ^= 1 << 40
        want_bits = {target: REAL_KV}
    entries = [(s, -1, i, slots[i - 1] if i else -1) for i, s in enumerate(slots)]
    want, _, _ = oracle_verify(buf, entries, sources=hs, mode=2)
    assert {r[1]: r[7] for r in want} == want_bits  # the oracle agrees with the hand-made bits

    capacity = 2 if ring_full else 8
    log = make_log(ab, capacity=capacity)
    fillers = []
    if ring_full:
        fillers = ring_rows(verify(ab, canary(16), [1, 2], [5, 5], [0, 0], log=log))
        assert [(r[1], r[7]) for r in fillers] == [(1, POSITION), (2, POSITION)]
    lg = verify(ab, buf, slots, range(5), [e[3] for e in entries], log=log, real_kv_sources=src,
                real_kv_hash_mode=RealKvHashMode.ALL)
    runs = 2 if ring_full else 1
    assert (int(lg["kernel_run_counters"][0]), int(lg["slot_run_counters"][0])) == (runs, 5 + 2 * (runs - 1))
    assert not lg["kernel_run_counters"][1:].any() and not lg["slot_run_counters"][1:].any()
    assert not lg["out_of_range_counters"].any()
    assert int(lg["violation_counters"][0]) == len(fillers) + len(want) and not lg["violation_counters"][1:].any()
    assert int(lg["write_index"][0]) == min(len(fillers) + len(want), capacity)
    report = log.read()
    assert (report.total_violations, report.dropped) == (len(fillers) + len(want), len(want) if ring_full else 0)
    if ring_full:
        assert ring_rows(lg) == fillers  # a full ring keeps its rows
    else:
        assert ring_rows(lg) == sorted_rows(want)
        assert {r[1]: r[7] for r in ring_rows(lg)} == want_bits
        assert not lg["ring"][len(want):].any()  # rows past the violations are untouched


# ---- real KV ------------------------------------------------------------------------------------


def _written_with_real_kv(ab, sources, mode, n_slots=16, slots=(1, 2, 3, 4, 5)):
    """Write a chain with real KV through kc.write; returns the native buffer."""
    buf = ab.asarray(canary(n_slots))
    wp = make_write_plan(ab, [0, len(slots)], [-1])
    n = len(slots)
    kc.write(buf, wp, a64(ab, range(10, 10 + n)), a64(ab, range(n)), a64(ab, slots), log=make_log(ab),
             real_kv_sources=sources, real_kv_hash_mode=mode)
    return buf


@pytest.mark.parametrize("mode, flip_byte, detected", [
    (RealKvHashMode.ALL, 31, True),
    (RealKvHashMode.ALL, 40, False),  # past read_bytes
    (RealKvHashMode.PARTIAL, 0, True),
    (RealKvHashMode.PARTIAL, 16, False),  # PARTIAL reads 16 bytes only
])
def test_real_kv_byte_flip(ab, mode, flip_byte, detected):
    data = kv_bytes(16, 64, 2)
    kv = ab.asarray(data)
    src = (RealKvSource(kv, 1, 64, 32),)
    buf = _written_with_real_kv(ab, src, mode)
    kv[3, flip_byte] ^= 1  # a single-bit flip in the live KV bytes of slot 3
    log = make_log(ab)
    vp = make_verify_plan(ab, [1, 2, 3, 4, 5], range(5), [-1, 1, 2, 3, 4])
    kc.verify(buf, vp, log=log, real_kv_sources=src, real_kv_hash_mode=mode)
    lg = host(ab, log)
    flipped = data.copy()
    flipped[3, flip_byte] ^= 1
    if detected:
        b = ab.to_numpy(buf)
        want_rkv = real_kv((HostSource(flipped, 1, 64, 32),), mode, 3)
        assert ring_rows(lg) == [(0, 3, 2, 12, -1, int(b[3, 2]), int(b[3, 2]), REAL_KV)]
        assert want_rkv != int(b[3, 3]) & (2**64 - 1)
    else:
        assert int(lg["write_index"][0]) == 0


def test_real_kv_none_mode_is_not_checked(ab):
    data = kv_bytes(16, 32, 4)
    src = (RealKvSource(ab.asarray(data), 1, 32, 32),)
    buf = _written_with_real_kv(ab, src, RealKvHashMode.ALL)
    log = make_log(ab)
    kc.verify(buf, make_verify_plan(ab, [1, 2], [0, 1], [-1, 1]), log=log, real_kv_sources=src)
    assert int(ab.to_numpy(log.write_index)[0]) == 2  # stored hashes != 0 = expected under NONE
    log = make_log(ab)
    kc.verify(buf, make_verify_plan(ab, [1, 2], [0, 1], [-1, 1]), log=log, real_kv_sources=src,
              real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(ab.to_numpy(log.write_index)[0]) == 0
    tiny = (RealKvSource(ab.asarray(np.zeros((1, 16), np.uint8)), 1, 16, 16),)
    log = make_log(ab)
    kc.verify(ab.asarray(clean_chain()), make_verify_plan(ab, [1, 2], [0, 1], [-1, 1]), log=log, real_kv_sources=tiny)
    assert int(ab.to_numpy(log.write_index)[0]) == 0  # NONE never touches the (too small) source


@pytest.mark.parametrize("n_sources", [1, 2, 3, 4])
def test_real_kv_multiple_sources_round_trip(ab, n_sources):
    datas = [kv_bytes(16, 32, 10 + i) for i in range(n_sources)]
    src = tuple(RealKvSource(ab.asarray(d), 1, 32, 32) for d in datas)
    buf = _written_with_real_kv(ab, src, RealKvHashMode.ALL)
    hs = tuple(HostSource(d, 1, 32, 32) for d in datas)
    assert ab.to_numpy(buf)[1:6, 3].tolist() == [signed(real_kv(hs, 2, s)) for s in range(1, 6)]
    log = make_log(ab)
    kc.verify(buf, make_verify_plan(ab, [1, 2, 3, 4, 5], range(5), [-1, 1, 2, 3, 4]), log=log,
              real_kv_sources=src, real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(ab.to_numpy(log.write_index)[0]) == 0
    if n_sources > 1:  # the same sources in another order do not verify
        log = make_log(ab)
        kc.verify(buf, make_verify_plan(ab, [1, 2], [0, 1], [-1, 1]), log=log, real_kv_sources=src[::-1],
                  real_kv_hash_mode=RealKvHashMode.ALL)
        assert [r[7] for r in ring_rows(host(ab, log))] == [REAL_KV, REAL_KV]


def test_paged_source_signatures(ab):
    """page_size 4: slot s is hashed from row s // 4, column (s % 4) * 16."""
    data = np.zeros((4, 64), np.uint8)
    for s in range(16):
        data[s // 4, (s % 4) * 16] = s + 1  # a per-slot signature
    src = (RealKvSource(ab.asarray(data), 4, 16, 16),)
    buf = canary(16)
    stamp_chain(buf, range(1, 16), range(15), range(15))
    for s in range(1, 16):
        buf[s, 3] = signed(sm64(sm64(sm64(s + 1))))  # words (s+1, 0), then the one-source fold
    lg = verify(ab, buf, list(range(1, 16)), range(15), [-1] + list(range(1, 15)), real_kv_sources=src,
                real_kv_hash_mode=RealKvHashMode.PARTIAL)
    assert int(lg["write_index"][0]) == 0


def test_holey_source_rows_give_the_same_result(ab):
    data = kv_bytes(16, 32, 6)
    holey = np.full((16, 48), 0xAA, np.uint8)
    holey[:, :32] = data
    buf = _written_with_real_kv(ab, (RealKvSource(ab.asarray(data), 1, 32, 32),), RealKvHashMode.ALL)
    for tensor in (ab.asarray(holey), ab.asarray(holey)[:, :32]):
        log = make_log(ab)
        kc.verify(buf, make_verify_plan(ab, [1, 2, 3], range(3), [-1, 1, 2]), log=log,
                  real_kv_sources=(RealKvSource(tensor, 1, 32, 32),), real_kv_hash_mode=RealKvHashMode.ALL)
        assert int(ab.to_numpy(log.write_index)[0]) == 0


# ---- boundary values ----------------------------------------------------------------------------


@pytest.mark.parametrize("prev_hash", [0, sm64(0), 2**64 - 1, 2**63, ANCHOR_H])
@pytest.mark.parametrize("real_kv_field", [0, -1, 2**63])
def test_boundary_prev_hash_and_real_kv(ab, prev_hash, real_kv_field):
    buf = canary(8, {2: (7, 0, prev_hash, real_kv_field)})
    lg = verify(ab, buf, [2], [0], [-1])
    want, _, _ = oracle_verify(buf, [(2, -1, 0, -1)])
    assert ring_rows(lg) == sorted_rows(want)
    bits = (CHAIN if prev_hash != ANCHOR_H else 0) | (REAL_KV if real_kv_field else 0)
    assert [r[7] for r in want] == ([bits] if bits else [])


@pytest.mark.parametrize("token", [0, 1, 0xFFFFFFFF, -1, 0x80000000, 0x7FFFFFFF])
@pytest.mark.parametrize("position", [0, 1, 127, 128, 129, 0x7FFFFFFF])
def test_boundary_tokens_and_positions(ab, token, position):
    buf = canary(8)
    stamp_chain(buf, [3, 4], [token, token], [position, position + 1])
    lg = verify(ab, buf, [3, 4], [position, position + 1], [0, 3], tokens=[token, token], check_expected_token=True)
    assert int(lg["write_index"][0]) == 0
    lg = verify(ab, buf, [4], [position], [3], tokens=[token ^ 2], check_expected_token=True)
    assert [r[7] for r in ring_rows(lg)] == [POSITION | TOKEN]


# ---- layouts and random plans ------------------------------------------------------------------


@pytest.mark.parametrize("stride", [32, 40])
def test_uint8_canary_layout(ab, stride):
    buf = clean_chain()
    buf[3, 1] = 9
    raw = np.zeros((16, stride), np.uint8)
    raw[:, :32] = buf.view(np.uint8).reshape(16, 32)
    args = ([1, 2, 3, 4], range(4), [-1, 1, 2, 3])
    assert ring_rows(verify(ab, raw, *args)) == ring_rows(verify(ab, buf, *args))
    assert int(verify(ab, raw, *args)["write_index"][0]) == 2


@pytest.mark.parametrize("seed", range(5))
def test_random_plans_match_oracle(ab, seed):
    rng = np.random.default_rng(seed)
    n_slots, n = 48, int(rng.integers(1, 60))
    buf = canary(n_slots)
    stamp_chain(buf, range(1, n_slots), rng.integers(0, 1000, n_slots - 1), range(n_slots - 1))
    buf[rng.integers(0, n_slots, 5), rng.integers(0, 4, 5)] ^= 3  # a few corruptions
    slots = rng.integers(0, n_slots, n)
    prevs = np.where(rng.random(n) < 0.2, rng.integers(-1, 1, n), slots - 1)
    positions = np.maximum(slots - 1 + rng.integers(-1, 2, n) * (rng.random(n) < 0.2), 0)
    tokens = np.where(rng.random(n) < 0.5, buf[slots, 0], rng.integers(-1, 1000, n))
    check = bool(seed % 2)
    lg = verify(ab, buf, slots, positions, prevs, tokens=tokens, check_expected_token=check, kernel_kind=seed)
    want, scanned, oor = oracle_verify(buf, list(zip(slots, tokens, positions, prevs)), kind=seed, check_token=check)
    assert ring_rows(lg) == sorted_rows(want)
    assert int(lg["write_index"][0]) == len(want)
    assert int(lg["slot_run_counters"][seed]) == scanned == n


# ---- out-of-range values ------------------------------------------------------------------------


def test_out_of_range_slots_are_skipped_and_counted(ab):
    buf = clean_chain()
    lg = verify(ab, buf, [-1, 16, 99, 2, 0], [0, 0, 0, 1, 0], [-1, -1, -1, 1, -1], kernel_kind=11)
    assert int(lg["write_index"][0]) == 0
    assert int(lg["slot_run_counters"][11]) == 5  # skipped entries are still scanned
    assert int(lg["out_of_range_counters"][11]) == 3
    log = make_log(ab)
    for _ in range(2):
        lg = verify(ab, buf, [-1, 16, 99, 2, 0], [0, 0, 0, 1, 0], [-1, -1, -1, 1, -1], kernel_kind=11, log=log)
    assert int(lg["out_of_range_counters"][11]) == 6 and int(lg["out_of_range_counters"].sum()) == 6  # accumulated


def test_out_of_range_predecessor_skips_chain_check(ab):
    buf = clean_chain()
    buf[3, 2] = 4242  # would fail the chain check
    lg = verify(ab, buf, [3, 4], [2, 9], [16, 1000])
    assert ring_rows(lg) == [(0, 4, 3, 404, -1, int(buf[4, 2]), int(buf[4, 2]), POSITION)]
    assert int(lg["out_of_range_counters"][0]) == 2


@pytest.mark.parametrize("slots, prevs, message", [
    ([1, 16], [-1, 1], r"verify_plan.verify_slot_indices\[1\] = 16 is outside canary_buf's 16 slots"),
    ([-3, 2], [-1, 1], r"verify_plan.verify_slot_indices\[0\] = -3 is outside"),
    ([1, 2], [-1, 20], r"verify_plan.verify_prev_slot_indices\[1\] = 20 is outside canary_buf's 16 slots"),
    ([1, 2], [-1, 16], r"verify_plan.verify_prev_slot_indices\[1\] = 16 is outside canary_buf's 16 slots"),
])
def test_strict_verify(ab, slots, prevs, message):
    log = make_log(ab)
    buf = ab.asarray(clean_chain())
    vp = make_verify_plan(ab, slots, [0, 1], prevs)
    with pytest.raises(ValueError, match=message):
        kc.verify(buf, vp, log=log, strict=True)
    assert all((v == 0).all() for v in host(ab, log).values())
    kc.verify(buf, vp, log=log)
    assert int(ab.to_numpy(log.out_of_range_counters)[0]) == 1


def test_strict_verify_ignores_disabled_plans_and_tail_entries(ab):
    log = make_log(ab)
    buf = ab.asarray(clean_chain())
    kc.verify(buf, make_verify_plan(ab, [99], [0], [-1], enable=0), log=log, strict=True)
    kc.verify(buf, make_verify_plan(ab, [1, 99], [0, 0], [-1, -1], num_valid=1), log=log, strict=True)
    kc.verify(buf, make_verify_plan(ab, [99], [0], [99], num_valid=0), log=log, strict=True)
    kc.verify(buf, make_verify_plan(ab, [99], [0], [99], num_valid=-1), log=log, strict=True)
    assert int(ab.to_numpy(log.kernel_run_counters)[0]) == 4
    assert int(ab.to_numpy(log.write_index)[0]) == 0


def test_strict_verify_skips_slot_zero_like_the_backends(ab):
    """A padding entry (slot 0) is never checked, its predecessor included: strict does not raise
    where the backends skip without counting."""
    log = make_log(ab)
    buf = ab.asarray(clean_chain())
    vp = make_verify_plan(ab, [1, 0, 2], [0, 7, 1], [-1, 99, 1])
    kc.verify(buf, vp, log=log, strict=True)
    lg = host(ab, log)
    assert (int(lg["slot_run_counters"][0]), int(lg["out_of_range_counters"][0])) == (3, 0)
    assert int(lg["write_index"][0]) == 0


def test_chain_helper_matches_written_chain(ab):
    """The oracle's chain helper and kc.write agree (guards the helpers the other tests rely on)."""
    buf = _written_with_real_kv(ab, (), RealKvHashMode.NONE)
    h, _ = chain(range(10, 15), range(5))
    assert ab.to_numpy(buf)[1:6, 2].tolist() == [signed(x) for x in h]


@pytest.mark.parametrize("seed", range(5))
def test_random_out_of_range_entries_match_oracle(ab, seed):
    rng = np.random.default_rng(70 + seed)
    n_slots, n = 20, int(rng.integers(1, 40))
    buf = canary(n_slots)
    stamp_chain(buf, range(1, n_slots), rng.integers(0, 1000, n_slots - 1), range(n_slots - 1))
    slots = rng.integers(-3, n_slots + 4, n)
    prevs = np.where(rng.random(n) < 0.3, rng.integers(-2, n_slots + 5, n), slots - 1)
    positions = np.maximum(slots - 1, 0)
    num_valid = int(rng.integers(-1, n + 3))
    lg = verify(ab, buf, slots, positions, prevs, num_valid=num_valid, kernel_kind=2)
    active = min(max(num_valid, 0), n)
    want, scanned, oor = oracle_verify(buf, list(zip(slots, [-1] * n, positions, prevs))[:active], kind=2)
    assert ring_rows(lg) == sorted_rows(want)
    assert (int(lg["slot_run_counters"][2]), int(lg["out_of_range_counters"][2])) == (scanned, oor)
    # strict=True raises exactly when some entry is skipped (and counted)
    call = lambda: verify(ab, buf, slots, positions, prevs, num_valid=num_valid, strict=True)
    if oor:
        with pytest.raises(ValueError, match="is outside canary_buf's 20 slots"):
            call()
    else:
        call()
