"""plan(): worked examples of the plan (docs/format.md §4), the no-stale-outputs decision and the out-of-range rules."""

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import (
    assert_plan_equals_oracle,
    host,
    linear_rtt,
    oracle_plan,
    plan_entries,
    run_plan,
)
from conftest import get_backend_or_skip

NUMPY = get_backend_or_skip("numpy")


def check(ab, rp, prefix, extend, rtt, *, verify_capacity=4096, **kw):
    """Run plan on ``ab`` and compare every output with the oracle; returns the host plans."""
    vp, wp, vph, wph = run_plan(ab, rp, prefix, extend, rtt, verify_capacity=verify_capacity, **kw)
    oracle_kw = {k: kw[k] for k in ("lut", "pool", "valid_lens", "write_req_capacity") if k in kw}
    want = oracle_plan(rp, prefix, extend, rtt, verify_capacity=verify_capacity,
                       window=kw.get("swa_window_size", 0), offset=kw.get("kv_token_id_vs_position_offset", 0),
                       **oracle_kw)
    assert_plan_equals_oracle(vph, wph, want)
    return vph, wph


# ---- worked examples (§3.4) -------------------------------------------------------------------


def test_prefill_only_request(ab):
    vph, wph = check(ab, [3], [0], [5], linear_rtt(8, 16))
    assert int(vph["verify_num_valid"][0]) == 0
    assert int(wph["write_num_valid_reqs"][0]) == 1
    assert wph["write_offsets"].tolist() == [0, 5]
    assert wph["write_seed_slot_indices"].tolist() == [-1]


def test_decode_seed_is_last_prefix_slot(ab):
    vph, wph = check(ab, [2], [7], [1], linear_rtt(4, 16))
    assert int(vph["verify_num_valid"][0]) == 7
    assert wph["write_seed_slot_indices"].tolist() == [2 * 16 + 6]
    assert plan_entries(vph) == [(32 + p, -1, p, 32 + p - 1 if p else -1) for p in range(7)]


def test_mixed_batch_offsets(ab):
    vph, wph = check(ab, [1, 2, 3], [0, 4, 10], [8, 1, 1], linear_rtt(4, 16))
    assert wph["write_offsets"].tolist() == [0, 8, 9, 10]
    assert wph["verify_offsets"].tolist() == [0, 0, 4, 14]
    assert int(vph["verify_num_valid"][0]) == 14
    assert wph["write_seed_slot_indices"].tolist() == [-1, 2 * 16 + 3, 3 * 16 + 9]


def test_write_offsets_are_exact_past_2_53(ab):
    """write_offsets are int64 sums: past 2**53, where float64 loses the last bit, they stay exact."""
    _, wph = check(ab, [1, 2], [0, 0], [2**53 + 1, 1], linear_rtt(3, 4))
    assert wph["write_offsets"].tolist() == [0, 2**53 + 1, 2**53 + 2]


@pytest.mark.parametrize("garbage", [99, 99999])
def test_padding_row_in_the_middle(ab, garbage):
    vph, wph = check(ab, [1, 0, 2], [5, garbage, 3], [1, garbage, 1], linear_rtt(4, 16))
    assert int(vph["verify_num_valid"][0]) == 8
    assert wph["write_offsets"].tolist() == [0, 1, 1, 2]
    assert wph["write_seed_slot_indices"].tolist() == [16 + 4, -1, 32 + 2]
    assert int(vph["out_of_range_count"][0]) == 0  # padding rows are never counted


def test_trailing_padding_rows(ab):
    vph, wph = check(ab, [1, 2, 0, 0], [3, 5, 99, 99], [1, 1, 99, 99], linear_rtt(4, 16))
    assert wph["write_offsets"].tolist() == [0, 1, 2, 2, 2]
    assert int(wph["write_num_valid_reqs"][0]) == 4  # padding rows included
    assert wph["write_seed_slot_indices"].tolist() == [18, 36, -1, -1]


def test_prev_slots_of_entries(ab):
    vph, _ = check(ab, [1], [4], [1], linear_rtt(4, 16))
    assert vph["verify_prev_slot_indices"][:4].tolist() == [-1, 16, 17, 18]
    vph, _ = check(ab, [2], [4], [1], linear_rtt(4, 16))
    assert vph["verify_prev_slot_indices"][:4].tolist() == [-1, 32, 33, 34]
    assert vph["verify_expected_positions"][:4].tolist() == [0, 1, 2, 3]


def test_swa_window_clips_verify_range(ab):
    rtt = linear_rtt(3, 1100)
    lut = np.arange(3 * 1100, dtype=np.int64)  # identity
    vph, _ = check(ab, [1], [200], [1], rtt, swa_window_size=128, lut=lut)
    assert int(vph["verify_num_valid"][0]) == 128
    assert int(vph["verify_expected_positions"][0]) == 72
    # the window head's predecessor is the real (translated) one, not the anchor
    assert int(vph["verify_prev_slot_indices"][0]) == 1100 + 71
    vph, _ = check(ab, [1], [3], [1], rtt, swa_window_size=128, lut=lut)
    assert int(vph["verify_num_valid"][0]) == 3
    prefixes = [50, 128, 200, 1024]
    vph, wph = check(ab, [1, 2, 1, 2], prefixes, [1, 1, 1, 1], rtt, swa_window_size=128, lut=lut)
    assert int(vph["verify_num_valid"][0]) == sum(min(p, 128) for p in prefixes)


def test_lut_identity_plus_100(ab):
    rtt = linear_rtt(4, 16)
    lut = np.arange(64, dtype=np.int64) + 100
    vph, wph = check(ab, [1], [3], [1], rtt, lut=lut)
    assert vph["verify_slot_indices"][:3].tolist() == [116, 117, 118]
    assert vph["verify_prev_slot_indices"][:3].tolist() == [-1, 116, 117]
    assert wph["write_seed_slot_indices"].tolist() == [118]
    vph, wph = check(ab, [1], [20], [1], linear_rtt(4, 32), swa_window_size=4, lut=np.arange(200) + 100)
    assert vph["verify_slot_indices"][:4].tolist() == [148, 149, 150, 151]
    assert vph["verify_prev_slot_indices"][:4].tolist() == [147, 148, 149, 150]


def test_lut_negative_values_pass_through(ab):
    rtt = linear_rtt(2, 8)
    rtt[1, :3] = [-5, 9, -1]
    lut = np.arange(16, dtype=np.int64) * 2
    vph, wph = check(ab, [1], [3], [1], rtt, lut=lut)
    assert vph["verify_slot_indices"][:3].tolist() == [-5, 18, -1]
    assert vph["verify_prev_slot_indices"][:3].tolist() == [-1, -5, 18]
    assert wph["write_seed_slot_indices"].tolist() == [-1]  # seed -1 passes through the LUT too
    assert int(vph["out_of_range_count"][0]) == 0


def test_lut_translates_slot_zero_and_passes_any_negative(ab):
    """Slot 0 is an index like any other (lut[0], not 0); negatives of any size pass through, even
    with a one-entry LUT."""
    rtt = linear_rtt(2, 8)
    rtt[1, :4] = [0, -1000, 0, 3]
    vph, wph = check(ab, [1], [4], [1], rtt, lut=np.array([7, 8, 9, 10]))
    assert vph["verify_slot_indices"][:4].tolist() == [7, -1000, 7, 10]
    assert vph["verify_prev_slot_indices"][:4].tolist() == [-1, 7, -1000, 7]
    assert wph["write_seed_slot_indices"].tolist() == [10]
    vph, wph = check(ab, [1], [3], [1], rtt, lut=np.array([5]))
    assert vph["verify_slot_indices"][:3].tolist() == [5, -1000, 5]
    assert int(vph["out_of_range_count"][0]) == 0  # 0 is in a one-entry LUT's range


def test_extend_all_zero(ab):
    vph, wph = check(ab, [1, 2], [4, 6], [0, 0], linear_rtt(4, 16))
    assert int(vph["verify_num_valid"][0]) == 10
    assert wph["write_offsets"].tolist() == [0, 0, 0]
    assert wph["write_seed_slot_indices"].tolist() == [-1, -1]


def test_only_padding_rows(ab):
    vph, wph = check(ab, [0, 0, 0], [7, 99999, 5], [3, 99999, 1], linear_rtt(4, 16))
    assert int(vph["verify_num_valid"][0]) == 0 and int(vph["enable"][0]) == 1
    assert wph["write_offsets"].tolist() == [0, 0, 0, 0]


def test_empty_batch(ab):
    vph, wph = check(ab, [], [], [], linear_rtt(4, 16), verify_capacity=0)
    assert int(vph["verify_num_valid"][0]) == 0 and int(vph["enable"][0]) == 1
    assert wph["write_offsets"].tolist() == [0]
    assert int(wph["write_num_valid_reqs"][0]) == 0


def test_zero_verify_capacity(ab):
    vph, _ = check(ab, [1], [0], [4], linear_rtt(4, 16), verify_capacity=0)
    assert (int(vph["verify_num_valid"][0]), int(vph["enable"][0])) == (0, 1)
    vph, _ = check(ab, [1], [2], [4], linear_rtt(4, 16), verify_capacity=0)
    assert (int(vph["verify_num_valid"][0]), int(vph["enable"][0])) == (0, 0)


def _poisoned_out(ab, vcap, wcap):
    vp = kc.VerifyPlan.allocate(vcap, like=ab.like)
    wp = kc.WritePlan.allocate(wcap, like=ab.like)
    for key in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                "verify_prev_slot_indices"):
        getattr(vp, key)[...] = 777
    return vp, wp


@pytest.mark.parametrize("slack, enable", [(0, 1), (-1, 0), (5, 1)])
def test_capacity_tight_and_under_by_one(ab, slack, enable):
    rp, prefix, extend = [1, 2, 3], [5, 0, 9], [1, 4, 1]
    total = 14
    cap = total + slack
    vp, wp = _poisoned_out(ab, cap, 3)
    _, _, vph, wph = run_plan(ab, rp, prefix, extend, linear_rtt(4, 16), verify_capacity=cap, out=(vp, wp))
    assert int(vph["enable"][0]) == enable
    assert int(vph["verify_num_valid"][0]) == min(total, cap)
    if enable:
        assert plan_entries(vph) == oracle_plan(rp, prefix, extend, linear_rtt(4, 16), verify_capacity=cap)["entries"]
    else:  # overflow: not a single verify entry is written
        for key in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                    "verify_prev_slot_indices"):
            assert (vph[key] == 777).all(), key
    # the write side is planned either way
    assert wph["write_offsets"].tolist() == [0, 1, 5, 6]
    assert wph["write_seed_slot_indices"].tolist() == [16 + 4, -1, 48 + 8]


def test_reuse_shrinking_batch_leaves_nothing_stale(ab):
    rtt = linear_rtt(10, 16)
    vp, wp = kc.VerifyPlan.allocate(256, like=ab.like), kc.WritePlan.allocate(8, like=ab.like)
    run_plan(ab, list(range(1, 9)), [3] * 8, [2] * 8, rtt, verify_capacity=256, out=(vp, wp))
    wph = host(ab, wp)
    assert wph["write_offsets"].tolist() == list(range(0, 18, 2))
    assert (wph["write_seed_slot_indices"] >= 0).all()
    _, _, vph, wph = run_plan(ab, [4, 5, 6], [1, 2, 0], [1, 1, 3], rtt, verify_capacity=256, out=(vp, wp))
    assert wph["write_offsets"].tolist() == [0, 1, 2, 5, 0, 0, 0, 0, 0]
    assert wph["verify_offsets"].tolist() == [0, 1, 3, 3, 0, 0, 0, 0, 0]
    assert wph["write_seed_slot_indices"].tolist() == [64, 81, -1, -1, -1, -1, -1, -1]
    assert int(wph["write_num_valid_reqs"][0]) == 3
    assert int(vph["verify_num_valid"][0]) == 3


def _scribble_past(ab, wp, row):
    """Garbage in every per-request output from ``row`` on (as a caller's own code might leave)."""
    for key, first in (("write_seed_slot_indices", row), ("write_offsets", row + 1), ("verify_offsets", row + 1)):
        arr = ab.to_numpy(getattr(wp, key)).copy()
        arr[first:] = 99
        getattr(wp, key)[...] = ab.asarray(arr)


def test_plan_clears_only_the_rows_the_previous_plan_wrote(ab):
    """The plan's cost does not grow with the capacity: it clears rows [bs, previous batch size)."""
    rtt = linear_rtt(10, 16)
    vp, wp = kc.VerifyPlan.allocate(256, like=ab.like), kc.WritePlan.allocate(8, like=ab.like)
    run_plan(ab, list(range(1, 7)), [3] * 6, [2] * 6, rtt, verify_capacity=256, out=(vp, wp))
    _scribble_past(ab, wp, 6)  # past the batch the plan wrote: outside its contract
    _, _, _, wph = run_plan(ab, [4, 5], [1, 2], [1, 1], rtt, verify_capacity=256, out=(vp, wp))
    assert wph["write_seed_slot_indices"].tolist() == [64, 81, -1, -1, -1, -1, 99, 99]
    assert wph["write_offsets"].tolist() == [0, 1, 2, 0, 0, 0, 0, 99, 99]
    assert wph["verify_offsets"].tolist() == [0, 1, 3, 0, 0, 0, 0, 99, 99]


def _built_write_plan(ab, cap, num_valid):
    """A WritePlan built from the caller's own arrays, garbage everywhere."""
    return kc.WritePlan(write_offsets=ab.asarray(np.full(cap + 1, 99, np.int64)),
                        write_seed_slot_indices=ab.asarray(np.full(cap, 99, np.int64)),
                        write_num_valid_reqs=ab.asarray(np.array([num_valid], np.int32)),
                        verify_offsets=ab.asarray(np.full(cap + 1, 99, np.int64)))


@pytest.mark.parametrize("num_valid", [0, 2, 5])
def test_a_caller_built_write_plan_is_cleared_over_its_whole_capacity(ab, num_valid):
    """A WritePlan not from WritePlan.allocate or a plan may hold anything past its count."""
    rtt = linear_rtt(10, 16)
    vp, wp = kc.VerifyPlan.allocate(64, like=ab.like), _built_write_plan(ab, 5, num_valid)
    _, _, _, wph = run_plan(ab, [4, 5], [1, 2], [1, 1], rtt, verify_capacity=64, out=(vp, wp))
    assert wph["write_seed_slot_indices"].tolist() == [64, 81, -1, -1, -1]
    assert wph["write_offsets"].tolist() == [0, 1, 2, 0, 0, 0]
    _scribble_past(ab, wp, 2)  # from now on the plan knows the record: it clears up to its last batch only
    _, _, _, wph = run_plan(ab, [4], [1], [1], rtt, verify_capacity=64, out=(vp, wp))
    assert wph["write_seed_slot_indices"].tolist() == [64, -1, 99, 99, 99]


@pytest.mark.parametrize("previous", [-3, 6, 2**31 - 1])
def test_a_count_that_is_no_batch_size_clears_the_whole_capacity(ab, previous):
    rtt = linear_rtt(10, 16)
    vp, wp = kc.VerifyPlan.allocate(64, like=ab.like), kc.WritePlan.allocate(5, like=ab.like)
    run_plan(ab, [1, 2, 3], [1, 1, 1], [1, 1, 1], rtt, verify_capacity=64, out=(vp, wp))
    _scribble_past(ab, wp, 3)
    wp.write_num_valid_reqs[...] = ab.asarray(np.array([previous], np.int32))
    _, _, _, wph = run_plan(ab, [4], [1], [1], rtt, verify_capacity=64, out=(vp, wp))
    assert wph["write_seed_slot_indices"].tolist() == [64, -1, -1, -1, -1]
    assert wph["verify_offsets"].tolist() == [0, 1, 0, 0, 0, 0]


def test_backend_argument_records_keep_their_field_names():
    """VerifyArgs and StageArgs derive their plan views from the field table; their names and order
    are the backends' interface and stay as they were."""
    from kvcanary_cupy.args import StageArgs, VerifyArgs

    verify_reads = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
                    "verify_num_valid", "enable")
    assert VerifyArgs._fields == ("targets", *verify_reads, "check_expected_token", "check_holes", "real_kv_hash_mode", "log")
    assert StageArgs._fields == ("log", *verify_reads, "plan_out_of_range_count", "verify_offsets", "write_num_valid_reqs",
                                 "marks", "staging", "layout")
    assert VerifyArgs.__module__ == StageArgs.__module__ == "kvcanary_cupy.args"


def test_plan_records_derive_from_one_field_table():
    """plans.py's field table is the one source of the records, the backends' views and the kernel struct."""
    from kvcanary_cupy.args import PlanOutputs
    from kvcanary_cupy.backends.cuda.abi import PLAN_OUTPUTS
    from kvcanary_cupy.plans import VERIFY_PLAN_FIELDS, WRITE_PLAN_FIELDS

    names = [f.name for f in VERIFY_PLAN_FIELDS + WRITE_PLAN_FIELDS]
    assert list(kc.VerifyPlan.__dataclass_fields__) + list(kc.WritePlan.__dataclass_fields__) == names
    assert list(PlanOutputs._fields) == names
    assert list(PLAN_OUTPUTS.names) == names + ["verify_capacity", "write_req_capacity", "clear_whole_capacity", "scan_state",
                                         "scan_state_min_rows"]
    for cls, cap in ((kc.VerifyPlan, 3), (kc.WritePlan, 3)):
        rec = cls.allocate(cap)
        for f in cls.FIELDS:
            arr = getattr(rec, f.name)
            assert arr.dtype == f.dtype and arr.shape == (f.length(cap),), f
            if f.fill is not None:
                assert (arr == f.fill).all(), f


def test_write_req_capacity_defaults(ab):
    rtt = linear_rtt(4, 16)
    _, _, _, wph = run_plan(ab, [1, 2], [1, 1], [1, 1], rtt, verify_capacity=8)
    assert wph["write_seed_slot_indices"].shape == (2,) and wph["write_offsets"].shape == (3,)
    _, _, _, wph = run_plan(ab, [1, 2], [1, 1], [1, 1], rtt, verify_capacity=8, write_req_capacity=5)
    assert wph["write_seed_slot_indices"].tolist() == [16, 32, -1, -1, -1]
    assert wph["write_offsets"].tolist() == [0, 1, 2, 0, 0, 0]
    out = (kc.VerifyPlan.allocate(8, like=ab.like), kc.WritePlan.allocate(6, like=ab.like))
    vp, wp, _, wph = run_plan(ab, [1, 2], [1, 1], [1, 1], rtt, verify_capacity=8, out=out)
    assert vp is out[0] and wp is out[1]
    assert wph["write_offsets"].shape == (7,)


def test_returned_plans_are_in_the_callers_framework(ab):
    vp, wp, _, _ = run_plan(ab, [1], [2], [1], linear_rtt(2, 4), verify_capacity=4)
    native = type(ab.like)
    for rec in (vp, wp):
        for key, arr in rec.arrays().items():
            assert type(arr) is native, key


def test_replay_is_deterministic(ab):
    """Replaying a step into reused buffers (what a CUDA graph replay does) gives what a fresh plan
    on the NumPy reference gives, whatever the buffers held before, every time."""
    rtt = linear_rtt(6, 32)
    args = ([1, 0, 3, 5], [7, 99, 31, 0], [1, 99, 1, 6], rtt)
    _, _, ref_v, ref_w = run_plan(NUMPY, *args, verify_capacity=64, write_req_capacity=6)
    assert_plan_equals_oracle(ref_v, ref_w, oracle_plan(*args, verify_capacity=64, write_req_capacity=6))
    out = _poisoned_out(ab, 64, 6)
    run_plan(ab, [2, 4, 1, 3, 5, 0], [32, 5, 0, 2, 9, 0], [0, 3, 4, 1, 2, 0], rtt, verify_capacity=64, out=out)
    for _ in range(2):
        _, _, vph, wph = run_plan(ab, *args, verify_capacity=64, out=out)
        assert plan_entries(vph) == plan_entries(ref_v)
        for key in ("verify_num_valid", "enable", "out_of_range_count"):
            assert vph[key].tolist() == ref_v[key].tolist(), key
        for key in ref_w:
            assert wph[key].tolist() == ref_w[key].tolist(), key


# ---- expected tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1])
def test_expected_tokens_with_offset_and_valid_lens(ab, offset):
    rtt = linear_rtt(4, 16)
    pool = (np.arange(4 * 12, dtype=np.int32).reshape(4, 12) + 1000)
    valid_lens = [5, 12, 3]
    vph, _ = check(ab, [1, 3, 2], [6, 12, 4], [1, 1, 1], rtt, pool=pool, valid_lens=valid_lens,
                   kv_token_id_vs_position_offset=offset)
    entries = plan_entries(vph)
    tokens = [e[1] for e in entries]
    req1 = [1000 + 12 + p + offset if p + offset < 5 else -1 for p in range(6)]
    req3 = [1000 + 36 + p + offset if p + offset < 12 else -1 for p in range(12)]
    req2 = [1000 + 24 + p + offset if p + offset < 3 else -1 for p in range(4)]
    assert tokens == req1 + req3 + req2


def test_expected_tokens_bounded_by_pool_width(ab):
    """valid_lens past the pool width counts as out of range and reads only the pool's columns."""
    rtt = linear_rtt(3, 16)
    pool = np.arange(3 * 4, dtype=np.int32).reshape(3, 4) + 50
    vph, _ = check(ab, [1], [6], [0], rtt, pool=pool, valid_lens=[9])
    assert [e[1] for e in plan_entries(vph)] == [54, 55, 56, 57, -1, -1]
    assert int(vph["out_of_range_count"][0]) == 1


def test_expected_token_pool_may_have_extra_rows(ab):
    rtt = linear_rtt(3, 8)
    pool = np.arange(5 * 8, dtype=np.int32).reshape(5, 8)
    vph, _ = check(ab, [2], [3], [1], rtt, pool=pool, valid_lens=[8])
    assert [e[1] for e in plan_entries(vph)] == [16, 17, 18]


def test_negative_offset_gives_minus_one_before_position_zero(ab):
    pool = np.arange(2 * 8, dtype=np.int32).reshape(2, 8) + 10
    vph, _ = check(ab, [1], [3], [1], linear_rtt(2, 8), pool=pool, valid_lens=[8], kv_token_id_vs_position_offset=-1)
    assert [e[1] for e in plan_entries(vph)] == [-1, 18, 19]


# ---- sweeps against the oracle ----------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 31, 32, 33, 128])
def test_bs_sweep(ab, bs):
    rng = np.random.default_rng(bs)
    rows, max_len = 140, 64
    rtt = rng.permutation(rows * max_len).astype(np.int32).reshape(rows, max_len) + 1
    rp = rng.integers(1, rows, size=bs)
    rp[rng.random(bs) < 0.2] = 0  # interleaved padding rows
    prefix = rng.integers(0, max_len + 1, size=bs)
    extend = rng.integers(0, 4, size=bs)
    check(ab, rp, prefix, extend, rtt, verify_capacity=int(prefix.sum()) + 3)


@pytest.mark.parametrize("prefix", [0, 1, 127, 128, 129, 4096])
@pytest.mark.parametrize("extend", [1, 128, 4096])
def test_prefix_extend_sweep(ab, prefix, extend):
    rtt = linear_rtt(3, 4100)
    check(ab, [2, 1], [prefix, prefix // 2], [extend, 1], rtt, verify_capacity=8192)


@pytest.mark.parametrize("window", [1, 4, 129])
def test_swa_sweep_with_permuted_lut(ab, window):
    rng = np.random.default_rng(window)
    rtt = (rng.permutation(6 * 200) + 1).astype(np.int32).reshape(6, 200)
    lut = np.concatenate([[0], rng.permutation(6 * 200) + 1]).astype(np.int64)
    check(ab, [1, 0, 3, 5, 2], [150, 9, 0, 200, 129], [1, 9, 3, 2, 0], rtt, verify_capacity=1000,
          swa_window_size=window, lut=lut)


def test_large_batch_above_4096(ab):
    """No batch-size cap (Part 1, decision 3)."""
    bs = 5000
    rng = np.random.default_rng(1)
    rtt = linear_rtt(bs + 1, 4)
    rp = np.arange(1, bs + 1)
    prefix = rng.integers(0, 5, size=bs)
    check(ab, rp, prefix, np.ones(bs, np.int64), rtt, verify_capacity=4 * bs)


# ---- out-of-range values (project decision: skipped, clamped and counted) --------------------


def test_out_of_range_pool_index(ab):
    rtt = linear_rtt(4, 16)
    vph, wph = check(ab, [4, -1, 2], [3, 3, 2], [2, 1, 1], rtt)
    assert int(vph["out_of_range_count"][0]) == 2
    assert plan_entries(vph) == [(32, -1, 0, -1), (33, -1, 1, 32)]
    assert wph["write_offsets"].tolist() == [0, 2, 3, 4]  # write length still max(extend, 0)
    assert wph["write_seed_slot_indices"].tolist() == [-1, -1, 33]


def test_prefix_longer_than_row(ab):
    rtt = linear_rtt(3, 8)
    vph, wph = check(ab, [1, 2], [11, 8], [1, 1], rtt)
    assert int(vph["out_of_range_count"][0]) == 1  # prefix 8 == row length is in range
    assert [e[2] for e in plan_entries(vph)] == list(range(8)) + list(range(8))
    assert wph["write_seed_slot_indices"].tolist() == [-1, 23]
    vph, wph = check(ab, [1], [11], [1], rtt, swa_window_size=5, lut=np.arange(24))
    assert [e[2] for e in plan_entries(vph)] == [6, 7]  # [ws, L) only
    assert wph["write_seed_slot_indices"].tolist() == [-1]


def test_negative_prefix_and_extend(ab):
    rtt = linear_rtt(3, 8)
    vph, wph = check(ab, [1, 2], [-3, 4], [2, -5], rtt)
    assert int(vph["out_of_range_count"][0]) == 2
    assert plan_entries(vph) == [(16 + p, -1, p, 16 + p - 1 if p else -1) for p in range(4)]
    assert wph["write_offsets"].tolist() == [0, 2, 2]
    assert wph["write_seed_slot_indices"].tolist() == [-1, -1]


def test_valid_lens_out_of_range(ab):
    rtt = linear_rtt(3, 8)
    pool = np.arange(24, dtype=np.int32).reshape(3, 8)
    vph, _ = check(ab, [1, 2, 0], [2, 2, 2], [1, 1, 1], rtt, pool=pool, valid_lens=[-1, 9, -7])
    assert int(vph["out_of_range_count"][0]) == 2  # the padding row's -7 is not counted
    assert [e[1] for e in plan_entries(vph)] == [-1, -1, 16, 17]


def test_lut_clamp_counts_each_translation(ab):
    rtt = linear_rtt(3, 16)  # row 1 holds 16..31
    lut = np.arange(20, dtype=np.int64) * 10  # values >= 20 clamp to lut[19] = 190
    vph, wph = check(ab, [1], [6], [1], rtt, lut=lut)
    assert int(vph["out_of_range_count"][0]) == 4  # slots 20, 21; prev 20; seed 21
    assert vph["verify_slot_indices"][:6].tolist() == [160, 170, 180, 190, 190, 190]
    assert vph["verify_prev_slot_indices"][:6].tolist() == [-1, 160, 170, 180, 190, 190]
    assert wph["write_seed_slot_indices"].tolist() == [190]
    # on overflow only the seed is translated
    vp, wp = _poisoned_out(ab, 2, 1)
    _, _, vph, _ = run_plan(ab, [1], [6], [1], rtt, lut=lut, verify_capacity=2, out=(vp, wp))
    assert int(vph["out_of_range_count"][0]) == 1


def test_out_of_range_count_accumulates(ab):
    rtt = linear_rtt(3, 8)
    vp, wp = kc.VerifyPlan.allocate(32, like=ab.like), kc.WritePlan.allocate(2, like=ab.like)
    run_plan(ab, [5, 1], [1, 9], [1, -1], rtt, verify_capacity=32, out=(vp, wp))
    assert int(ab.to_numpy(vp.out_of_range_count)[0]) == 3
    _, _, vph, _ = run_plan(ab, [5, 1], [1, 2], [1, 1], rtt, verify_capacity=32, out=(vp, wp))
    assert int(vph["out_of_range_count"][0]) == 4


# ---- strict=True -----------------------------------------------------------------------------


STRICT_CASES = [  # (change, message, count without strict)
    (dict(rp=[1, 7]), r"req_pool_indices\[1\] = 7 is outside \[0, 4\)", 1),
    (dict(rp=[-2, 1]), r"req_pool_indices\[0\] = -2", 1),
    (dict(prefix=[3, 17]), r"prefix_lens\[1\] = 17 is outside \[0, 16\] \(req_to_token rows hold 16 positions\)$", 1),
    (dict(prefix=[-1, 3]), r"prefix_lens\[0\] = -1", 1),
    (dict(extend=[1, -4]), r"extend_seq_lens\[1\] = -4 is negative", 1),
    (dict(extend=[2**62, 1]), r"extend_seq_lens\[0\] = 4611686018427387904 exceeds \(2\*\*63 - 1\) // bs = 4611686018427387903", 1),
    (dict(valid_lens=[3, 40]), r"req_to_verify_expected_tokens_valid_lens\[1\] = 40 is outside \[0, 16\]", 1),
    (dict(lut=np.arange(34)), r"req_to_token\[2, 2\] = 34 \(batch row 1\) is outside full_to_swa_index_mapping of length 34", 2),
    # at the bounds, and a row whose first bad value is not its first checked one
    (dict(rp=[1, 4]), r"req_pool_indices\[1\] = 4 is outside \[0, 4\)", 1),
    (dict(prefix=[0, 3], extend=[-1, 1]), r"extend_seq_lens\[0\] = -1 is negative", 1),
    (dict(prefix=[16, 3], extend=[-1, 1]), r"extend_seq_lens\[0\] = -1 is negative", 1),
    (dict(extend=[0, 1], valid_lens=[17, 3]), r"req_to_verify_expected_tokens_valid_lens\[0\] = 17 is outside", 1),
    (dict(valid_lens=[16, -1]), r"req_to_verify_expected_tokens_valid_lens\[1\] = -1 is outside", 1),
]


@pytest.mark.parametrize("change, message, count", STRICT_CASES)
def test_strict_raises_naming_array_row_and_value(ab, change, message, count):
    args = dict(rp=[1, 2], prefix=[3, 3], extend=[1, 1], lut=None, valid_lens=None)
    args.update(change)
    rtt = linear_rtt(4, 16)
    pool = np.zeros((4, 16), np.int32) if args["valid_lens"] is not None else None
    out = (kc.VerifyPlan.allocate(64, like=ab.like), kc.WritePlan.allocate(2, like=ab.like))
    before = {**host(ab, out[0]), **{"w." + k: v for k, v in host(ab, out[1]).items()}}
    kw = dict(lut=args["lut"], pool=pool, valid_lens=args["valid_lens"], verify_capacity=64, out=out)
    with pytest.raises(ValueError, match=message):
        run_plan(ab, args["rp"], args["prefix"], args["extend"], rtt, strict=True, **kw)
    after = {**host(ab, out[0]), **{"w." + k: v for k, v in host(ab, out[1]).items()}}
    for key in before:
        assert np.array_equal(before[key], after[key]), key
    # without strict the same call runs and counts
    _, _, vph, _ = run_plan(ab, args["rp"], args["prefix"], args["extend"], rtt, **kw)
    assert int(vph["out_of_range_count"][0]) == count


def test_strict_accepts_valid_plan_and_ignores_padding_rows(ab):
    rtt = linear_rtt(4, 16)
    _, _, vph, _ = run_plan(ab, [1, 0, 2], [3, 99999, 16], [1, -9, 0], rtt, verify_capacity=64, strict=True)
    assert int(vph["verify_num_valid"][0]) == 19
    assert int(vph["out_of_range_count"][0]) == 0


def test_strict_checks_only_what_the_plan_translates(ab):
    """On overflow no verify entry is translated, so only the seed's LUT lookup can be out of range."""
    rtt = linear_rtt(3, 16)  # row 1 holds 16..31
    lut = np.arange(20, dtype=np.int64)
    # entries would look up 20 and 21, but 6 entries overflow verify_capacity=2; no seed (extend 0)
    _, _, vph, _ = run_plan(ab, [1], [6], [0], rtt, lut=lut, verify_capacity=2, strict=True)
    assert (int(vph["enable"][0]), int(vph["out_of_range_count"][0])) == (0, 0)
    with pytest.raises(ValueError, match=r"req_to_token\[1, 5\] = 21 \(batch row 0\)"):
        run_plan(ab, [1], [6], [1], rtt, lut=lut, verify_capacity=2, strict=True)  # the seed is looked up
    with pytest.raises(ValueError, match=r"req_to_token\[1, 4\] = 20 \(batch row 0\)"):
        run_plan(ab, [1], [6], [0], rtt, lut=lut, verify_capacity=6, strict=True)  # entries fit: looked up


@pytest.mark.parametrize("seed", range(10))
def test_random_plans_with_out_of_range_values_match_oracle(ab, seed):
    rng = np.random.default_rng(100 + seed)
    rows, max_len, bs = 6, 24, int(rng.integers(1, 12))
    rtt = rng.integers(-3, 140, size=(rows, max_len)).astype(np.int32)
    rp = rng.integers(-2, rows + 2, size=bs)
    rp[rng.random(bs) < 0.2] = 0
    prefix = rng.integers(-3, max_len + 4, size=bs)
    extend = rng.integers(-2, 5, size=bs)
    kw = dict(swa_window_size=int(rng.choice([0, 0, 3, 10])))
    if kw["swa_window_size"] or rng.random() < 0.5:
        kw["lut"] = rng.integers(0, 1000, size=int(rng.integers(1, 160)))
    if rng.random() < 0.7:
        kw["pool"] = rng.integers(0, 5000, size=(rows + 1, int(rng.integers(1, 30)))).astype(np.int32)
        kw["valid_lens"] = rng.integers(-2, 32, size=bs)
        kw["kv_token_id_vs_position_offset"] = int(rng.integers(-1, 2))
    cap = int(rng.integers(0, 80))
    wcap = bs + int(rng.integers(0, 3))
    vph, _ = check(ab, rp, prefix, extend, rtt, verify_capacity=cap, write_req_capacity=wcap, **kw)
    # strict=True raises exactly when the plan skips or clamps a value (and counts it)
    if int(vph["out_of_range_count"][0]):
        with pytest.raises(ValueError, match="is outside|is negative"):
            run_plan(ab, rp, prefix, extend, rtt, verify_capacity=cap, write_req_capacity=wcap, strict=True, **kw)
    else:
        run_plan(ab, rp, prefix, extend, rtt, verify_capacity=cap, write_req_capacity=wcap, strict=True, **kw)


@pytest.mark.parametrize("rp, window, prefix, extend, bad_at, lookups", [
    (1, 0, 3, 0, 0, 2),  # position 0: an entry and the predecessor of position 1
    (1, 1, 4, 0, 2, 1),  # a one-entry window: its predecessor is looked up
    (1, 1, 4, 0, 1, 0),  # before the window's predecessor
    (1, 2, 6, 0, 3, 1),
    (1, 2, 6, 0, 2, 0),
    (1, 2, 6, 1, 5, 2),  # an entry and the seed
    (0, 0, 3, 1, 2, 0),  # a padding row looks nothing up
    (1, 0, 0, 1, 0, 0),  # nothing before position 0
])
def test_strict_lut_checks_exactly_the_looked_up_values(ab, rp, window, prefix, extend, bad_at, lookups):
    rtt = linear_rtt(2, 8)
    rtt[rp, bad_at] = 50  # past the 20-entry LUT
    kw = dict(lut=np.arange(20) + 100, swa_window_size=window, verify_capacity=8)
    vph, _ = check(ab, [rp], [prefix], [extend], rtt, **kw)
    assert int(vph["out_of_range_count"][0]) == lookups
    if lookups:
        with pytest.raises(ValueError, match=rf"req_to_token\[{rp}, {bad_at}\] = 50 \(batch row 0\) is outside"):
            run_plan(ab, [rp], [prefix], [extend], rtt, strict=True, **kw)
    else:
        run_plan(ab, [rp], [prefix], [extend], rtt, strict=True, **kw)


@pytest.mark.parametrize("seed", range(12))
def test_strict_lut_checks_match_the_counted_lookups(ab, seed):
    """With an SWA window or not, strict raises iff a LUT lookup the plan makes was clamped: padding
    rows, entries outside the window and plans that overflow look nothing up."""
    rng = np.random.default_rng(300 + seed)
    rows, max_len, bs = 5, 12, int(rng.integers(1, 6))
    lut_len = 60
    rtt = np.where(rng.random((rows, max_len)) < 0.04, lut_len + 5, rng.integers(0, lut_len, (rows, max_len)))
    rtt[0] = lut_len + 5  # the padding row of req_to_token holds garbage
    rp = rng.permutation(np.arange(1, rows))[:bs] if bs < rows else np.arange(1, rows)
    bs = rp.shape[0]
    rp[rng.random(bs) < 0.2] = 0  # padding rows: nothing of theirs is looked up
    prefix = rng.integers(0, max_len + 1, bs)
    extend = rng.integers(0, 3, bs)
    kw = dict(lut=np.arange(100, 100 + lut_len), swa_window_size=int(rng.choice([0, 1, 2, 5])),
              verify_capacity=int(rng.choice([0, 3, 64])))
    vph, _ = check(ab, rp, prefix, extend, rtt.astype(np.int32), **kw)
    counted = int(vph["out_of_range_count"][0])
    if counted:
        with pytest.raises(ValueError, match=r"is outside full_to_swa_index_mapping of length 60"):
            run_plan(ab, rp, prefix, extend, rtt.astype(np.int32), strict=True, **kw)
    else:
        run_plan(ab, rp, prefix, extend, rtt.astype(np.int32), strict=True, **kw)


def test_scan_kernels_opt_in_to_the_device_limit_once_as_they_load_never_at_a_launch():
    """A plan kernel's launches past 48 KiB of dynamic shared memory rely on one opt-in per kernel
    and device, to all a block may take, made as kc.warmup() loads it: a later launch, captured or
    not, of any batch size (a server's batch moving around 3,000-4,096 requests, or a first large
    batch met inside a capture) makes no driver call; kernels without the scan arrays are left as
    they are."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import FakeDevice, fake_device
    from kvcanary_cupy.backends.cuda import abi, compile as cuda_compile, configs

    with fake_device(record_bytes=False) as dev:
        kc.warmup()
        driver = dev.cupy.cuda.driver
        limit = FakeDevice.SHARED_MEM_OPTIN - FakeDevice.STATIC_SHARED_MEM
        expected = sorted((name, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, limit, False)
                          for spec in cuda_compile.FAMILIES.values() for name in spec.instantiations()
                          if cuda_compile.kernel_of(name) in cuda_compile.LARGE_SHARED_MEM_KERNELS)
        assert sorted(dev.attributes_set) == expected
        assert {cuda_compile.kernel_of(e[0]) for e in expected} == {"plan_fused", "plan_offsets", "plan_verify"}
        assert len(expected) == len(abi.TableLayout) * (8 + 4 + 16)  # per table layout: plan_fused, plan_offsets, plan_verify variants

        a = dev.asarray
        for bs in (configs.policy().plan_fused_max_rows, 48 * 1024 // 16 * FakeDevice.SM_COUNT + 1):
            rtt = a(np.arange(2 * bs + 2, dtype=np.int32).reshape(bs + 1, 2))
            args = (a(np.arange(1, bs + 1, dtype=np.int64)), a(np.zeros(bs, np.int64)), a(np.ones(bs, np.int64)), rtt)
            canary, log = a(np.zeros((2 * bs + 2, 4), np.int64)), kc.ViolationLog.allocate(4, like=rtt)
            out = (kc.VerifyPlan.allocate(bs, like=rtt), kc.WritePlan.allocate(bs, like=rtt))
            planner = kc.CanaryPlanner(kc.CanaryCapacities(bs, bs), like=rtt)
            dev.launches.clear()
            dev.current[-1].capturing = True  # a capture of plans too large for 48 KiB, for each plan path
            kc.plan(*args, verify_capacity=bs, out=out)
            kc.plan_and_verify(*args, canary, log=log, verify_capacity=bs, out=out)
            planner.plan(*args)
            dev.current[-1].capturing = False
            assert {cuda_compile.kernel_of(launch.name) for launch in dev.launches} >= (
                {"plan_fused", "plan_verify"} if bs <= configs.policy().plan_fused_max_rows else {"plan_offsets"})
        assert len(dev.attributes_set) == len(expected)  # none while capturing


def test_scan_launches_fit_the_opt_in_and_only_scan_kernels_take_dynamic_shared_memory(monkeypatch, launch_policy):
    """Every plan launch with dynamic shared memory is of a kernel that opts in as it loads
    (compile.LARGE_SHARED_MEM_KERNELS), within the opt-in: the largest scan tile plus the static
    arrays PLAN_SCAN_RESERVED_SMEM keeps."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.backends.cuda import compile as cuda_compile, configs, device as cuda_device
    from kvcanary_cupy.tables import TableKind

    optin = 232_448
    monkeypatch.setattr(cuda_device, "current_id", lambda: 0)
    monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(cuda_device, "shared_mem_optin", lambda device_id: optin)
    launch_policy(resident_blocks=4)
    launches = [launch for kind in TableKind for bs in (5, 3000, 4096, 4097, 10**6, 10**8)
                for launch in (*configs.plan_kernels(kind, bs, bs, True, True),
                               *([] if configs.plan_verify_stores_entries(bs) else [configs.plan_verify_kernel(kind, bs, bs, True, True, True, True)]))]
    shared = {cuda_compile.kernel_of(name): config.shared_mem for _, name, config in launches if config.shared_mem}
    assert set(shared) == cuda_compile.LARGE_SHARED_MEM_KERNELS
    assert max(shared.values()) > 48 * 1024 and max(shared.values()) + configs.PLAN_SCAN_RESERVED_SMEM <= optin


def test_plan_path_and_grid_follow_the_shapes(monkeypatch, launch_policy):
    """Up to PLAN_SMALL_MAX_ROWS requests take plan_small, up to PLAN_FUSED_MAX_ROWS plan_fused
    (scan arrays for the batch), beyond that the two launches; a one-launch plan takes a block per
    PLAN_THREADS entries of verify capacity (a warp per 32; plan_small one more), at least one and
    at most one per SM."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.backends.cuda import abi, configs, device as cuda_device
    from kvcanary_cupy.tables import TableKind

    monkeypatch.setattr(cuda_device, "current_id", lambda: 0)
    monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: 132)
    launch_policy(scan_tile_rows=1000)

    def launches(bs, capacity):
        return [(name.split("<")[0].split("::")[1], config)
                for _, name, config in configs.plan_kernels(TableKind.BLOCK, bs, capacity, False, True)]

    def fused_scan_rows(bs):  # plan_fused's kScanRows, its last template argument
        ((_, name, _),) = configs.plan_kernels(TableKind.BLOCK, bs, 10**6, False, True)
        assert name.startswith("kvcanary::plan_fused<2, false, true, ")
        return int(name[:-1].split(", ")[-1])

    threads = abi.PLAN_THREADS
    assert launches(0, 0) == [("plan_small", configs.LaunchConfig(1, threads))]
    # plan_small: a spare block for the per-request outputs, beside the expansion's.
    assert launches(1, 1) == [("plan_small", configs.LaunchConfig(2, threads))]
    assert launches(32, 16_384) == [("plan_small", configs.LaunchConfig(33, threads))]
    assert launches(32, 16_385) == [("plan_small", configs.LaunchConfig(34, threads))]
    assert launches(32, 10**6) == [("plan_small", configs.LaunchConfig(132, threads))]
    assert launches(33, 0) == [("plan_fused", configs.LaunchConfig(1, threads, 34 * 16))]
    assert launches(256, 524_288) == [("plan_fused", configs.LaunchConfig(132, threads, 257 * 16))]
    assert launches(4096, 10**9) == [("plan_fused", configs.LaunchConfig(132, threads, 4097 * 16))]
    assert launches(4097, 0) == [("plan_offsets", configs.LaunchConfig(132, threads, (32 + 1) * 16))]  # 32 rows per block
    # Past 16 warps x 64 rows plan_fused's scan takes its blocked passes too.
    assert [fused_scan_rows(bs) for bs in (33, 1024, 1025, 4096)] == [1, 1, abi.SCAN_ROWS_PER_LANE, abi.SCAN_ROWS_PER_LANE]


def test_allocated_write_plans_carry_a_zeroed_scan_state_outside_their_fields():
    """plan_offsets' blocks exchange their shares' totals in it; it is no field of the plan (a
    WritePlan made of an engine's own arrays has none, and snapshots of the fields never see it)."""
    from kvcanary_cupy.plans import SCAN_STATE_TILES, scan_state

    wp = kc.WritePlan.allocate(7)
    state = scan_state(wp)
    assert state.dtype == np.int64 and state.shape == (3 * SCAN_STATE_TILES,) and not state.any()
    assert "_kvcanary_scan_state" not in wp.arrays()
    assert scan_state(kc.WritePlan(**wp.arrays())) is None


@pytest.mark.parametrize("op", ["plan", "plan_and_verify"])
def test_plan_refuses_allocations_and_copies_while_capturing(op):
    """Inside a CUDA graph capture (the fake device's capturing stream) plan and plan_and_verify
    refuse to allocate their outputs or to copy a strided input, saying what and what to pass
    instead, and launch nothing."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    values = dict(req_pool_indices=[1, 2], prefix_lens=[3, 4], extend_seq_lens=[1, 1],
                  req_to_verify_expected_tokens_valid_lens=[8, 8], full_to_swa_index_mapping=np.arange(24))
    with fake_device(record_bytes=False) as dev:
        a = dev.asarray
        rtt = a(linear_rtt(3, 8))
        canary, log = a(np.zeros((24, 4), np.int64)), kc.ViolationLog.allocate(4, like=rtt)
        out = (kc.VerifyPlan.allocate(16, like=rtt), kc.WritePlan.allocate(2, like=rtt))
        call = getattr(kc, op)
        fused = (canary,) if op == "plan_and_verify" else ()
        fused_kw = dict(log=log) if op == "plan_and_verify" else {}

        def run(strided=None, out=out):
            kw = {k: a(np.asarray(v, np.int64)) for k, v in values.items()}
            if strided is not None:
                kw[strided] = a(np.repeat(np.asarray(values[strided], np.int64), 2))[::2]
            call(kw.pop("req_pool_indices"), kw.pop("prefix_lens"), kw.pop("extend_seq_lens"), rtt, *fused,
                 req_to_verify_expected_tokens=a(np.zeros((3, 8), np.int32)), verify_capacity=16, out=out, **fused_kw, **kw)

        dev.current[-1].capturing = True
        with pytest.raises(ValueError, match="^" + re.escape(
                f"kv-canary: {op} with out=None allocates its VerifyPlan and WritePlan, but the current stream is capturing a "
                "CUDA graph; pass out=(VerifyPlan, WritePlan) allocated before capturing (a CanaryPlanner holds such a pair)") + "$"):
            run(out=None)
        for name, value in values.items():
            with pytest.raises(ValueError, match="^" + re.escape(
                    f"kv-canary: kv-canary would copy {name} (it is not contiguous: strides (16,) for shape ({len(value)},)), "
                    f"but the current stream is capturing a CUDA graph; make {name} contiguous before capturing") + "$"):
                run(strided=name)
        reversed_offsets = kc.WritePlan(**{**out[1].arrays(), "write_offsets": a(np.zeros(3, np.int64))[::-1]})
        with pytest.raises(ValueError, match=r"^kv-canary: out\[1\]\.write_offsets has negative strides; kv-canary writes "
                                             r"into it, pass a contiguous array$"):  # an output is never copied
            run(out=(out[0], reversed_offsets))
        assert not dev.launches
        dev.current[-1].capturing = False
        run()  # the same call, contiguous and into out, is accepted
        assert dev.launches


@pytest.mark.parametrize("extend", [[2**62, 2**62], [2**62 - 1, 2**62], [3074457345618258602, 3074457345618258603, 3],
                                    [1, 2**63 - 1], [2**63 - 1]])
def test_huge_extend_seq_lens_are_counted_and_skipped_never_wrapping_the_write_offsets(ab, extend):
    """Issue 28 #9: running sums of huge extends wrapped to negative write offsets."""
    bs = len(extend)
    rp, prefix = list(range(1, bs + 1)), [2] * bs
    rtt = linear_rtt(bs + 1, 16)
    _, _, vph, wph = run_plan(ab, rp, prefix, extend, rtt, verify_capacity=64)
    limit = (2**63 - 1) // bs
    kept = [e if e <= limit else 0 for e in extend]
    assert wph["write_offsets"][: bs + 1].tolist() == np.concatenate([[0], np.cumsum(kept)]).tolist()
    assert (wph["write_offsets"] >= 0).all()
    assert int(vph["out_of_range_count"][0]) == sum(e > limit for e in extend)
    want = oracle_plan(rp, prefix, extend, rtt, verify_capacity=64)
    assert_plan_equals_oracle(vph, wph, want)
