"""Bad arguments (the README's array conventions): the right exception, a message naming the
argument, what was expected and what came, and a rejected call that changed nothing."""

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import interop, plans
from kvcanary_cupy import RealKvHashMode, RealKvSource, VerifyPlan, ViolationLog, WritePlan
from conftest import get_backend_or_skip
from canary_builders import (
    HostSource,
    a64,
    canary,
    kv_bytes,
    linear_rtt,
    make_log,
    make_verify_plan,
    make_write_plan,
    real_kv,
    signed,
)


def snapshot(ab, *things) -> list:
    """Host copies of every array in ``things`` (records or arrays)."""
    out = []
    for t in things:
        arrays = t.arrays().values() if hasattr(t, "arrays") else [t]
        out += [ab.to_numpy(a).copy() for a in arrays]
    return out


def assert_rejected(ab, exc, match, call, *outputs):
    """``call()`` raises ``exc`` matching ``match`` and leaves every array of ``outputs`` unchanged."""
    before = snapshot(ab, *outputs)
    with pytest.raises(exc, match=match):
        call()
    after = snapshot(ab, *outputs)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert np.array_equal(b, a)


NUMPY = get_backend_or_skip("numpy")


# ---- plan ------------------------------------------------------------------------------------------


class PlanCall:
    """A valid plan call on backend ``ab`` whose pieces a test can replace."""

    def __init__(self, ab):
        self.ab = ab
        self.rtt = ab.asarray(linear_rtt(4, 16))
        self.args = [a64(ab, [1, 2]), a64(ab, [3, 4]), a64(ab, [1, 1]), self.rtt]
        self.out = (VerifyPlan.allocate(32, like=ab.like), WritePlan.allocate(2, like=ab.like))
        for arr in self.out[0].arrays().values():
            arr[...] = 3  # recognisable contents
        self.kw = dict(verify_capacity=32, out=self.out)

    def __call__(self, *replace, **kw):
        args = list(self.args)
        for i, v in replace:
            args[i] = v
        return kc.plan(*args, **{**self.kw, **kw})


def test_plan_valid_call_works(ab):
    call = PlanCall(ab)
    vp, wp = call()
    assert int(ab.to_numpy(vp.verify_num_valid)[0]) == 7


@pytest.mark.parametrize("index, name, bad_dtype, want", [
    (0, "req_pool_indices", np.int32, "int64"),
    (1, "prefix_lens", np.float64, "int64"),
    (2, "extend_seq_lens", np.uint64, "int64"),
    (3, "req_to_token", np.int64, "int32"),
])
def test_plan_input_dtypes(ab, index, name, bad_dtype, want):
    call = PlanCall(ab)
    good = [np.array([1, 2]), np.array([3, 4]), np.array([1, 1]), linear_rtt(4, 16)][index]
    bad = ab.asarray(good.astype(bad_dtype))
    got = np.dtype(bad_dtype).name
    assert_rejected(ab, TypeError, rf"kv-canary: {name} must have dtype {want}, got {got}",
                    lambda: call((index, bad)), *call.out)


@pytest.mark.parametrize("kw_name, value, exc, match", [
    ("full_to_swa_index_mapping", np.arange(64, dtype=np.int32), TypeError,
     "full_to_swa_index_mapping must have dtype int64, got int32"),
    ("full_to_swa_index_mapping", np.zeros((2, 32), np.int64), ValueError,
     r"full_to_swa_index_mapping must be 1-D, got shape \(2, 32\)"),
    ("full_to_swa_index_mapping", np.zeros(0, np.int64), ValueError,
     "full_to_swa_index_mapping length must be >= 1, got 0"),
])
def test_plan_lut_checks(ab, kw_name, value, exc, match):
    call = PlanCall(ab)
    assert_rejected(ab, exc, match, lambda: call(**{kw_name: ab.asarray(value)}), *call.out)


@pytest.mark.parametrize("window", [1, 4])
def test_plan_window_requires_lut(ab, window):
    call = PlanCall(ab)
    assert_rejected(ab, ValueError, r"^kv-canary: plan requires full_to_swa_index_mapping when swa_window_size > 0; "
                    r"pass the full->SWA slot LUT \(int64\)$", lambda: call(swa_window_size=window), *call.out)


def test_plan_pool_and_valid_lens_come_together(ab):
    call = PlanCall(ab)
    pool = ab.asarray(np.zeros((4, 16), np.int32))
    lens = a64(ab, [1, 1])
    assert_rejected(ab, ValueError, "^kv-canary: plan requires req_to_verify_expected_tokens_valid_lens when "
                    "req_to_verify_expected_tokens is set$", lambda: call(req_to_verify_expected_tokens=pool), *call.out)
    assert_rejected(ab, ValueError, "^kv-canary: req_to_verify_expected_tokens_valid_lens was given without "
                    "req_to_verify_expected_tokens; pass both or neither$",
                    lambda: call(req_to_verify_expected_tokens_valid_lens=lens), *call.out)


@pytest.mark.parametrize("pool, lens, exc, match", [
    (np.zeros((4, 16), np.int64), [1, 1], TypeError, "req_to_verify_expected_tokens must have dtype int32, got int64"),
    (np.zeros(16, np.int32), [1, 1], ValueError, r"req_to_verify_expected_tokens must be 2-D, got shape \(16,\)"),
    (np.zeros((3, 16), np.int32), [1, 1], ValueError,
     r"req_to_verify_expected_tokens must have at least req_to_token.shape\[0\]=4 rows .* got 3"),
    (np.zeros((4, 16), np.int32), [1, 1, 1], ValueError,
     r"req_to_verify_expected_tokens_valid_lens length must be bs \(len\(req_pool_indices\)\)=2, got 3"),
])
def test_plan_expected_token_pool_checks(ab, pool, lens, exc, match):
    call = PlanCall(ab)
    assert_rejected(ab, exc, match, lambda: call(req_to_verify_expected_tokens=ab.asarray(pool),
                                                 req_to_verify_expected_tokens_valid_lens=a64(ab, lens)), *call.out)


def test_plan_shapes(ab):
    call = PlanCall(ab)
    assert_rejected(ab, ValueError, r"req_pool_indices must be 1-D, got shape \(2, 1\)",
                    lambda: call((0, a64(ab, [[1], [2]]))), *call.out)
    assert_rejected(ab, ValueError, r"req_pool_indices must be 1-D, got shape \(\)",  # 0-d: no len() to take
                    lambda: call((0, a64(ab, 1))), *call.out)
    assert_rejected(ab, ValueError, r"prefix_lens length must be bs \(len\(req_pool_indices\)\)=2, got 3",
                    lambda: call((1, a64(ab, [1, 2, 3]))), *call.out)
    assert_rejected(ab, ValueError, r"extend_seq_lens length must be bs .*=2, got 1",
                    lambda: call((2, a64(ab, [1]))), *call.out)
    assert_rejected(ab, ValueError, r"req_to_token must be 2-D, got shape \(64,\)",
                    lambda: call((3, ab.asarray(np.zeros(64, np.int32)))), *call.out)
    strided = ab.asarray(np.zeros((4, 32), np.int32))[:, ::2]
    assert_rejected(ab, ValueError, "req_to_token must have contiguous rows", lambda: call((3, strided)), *call.out)


def test_plan_req_to_token_may_have_a_wider_row_stride(ab):
    wide = np.zeros((4, 40), np.int32)
    wide[:, :16] = linear_rtt(4, 16)
    call = PlanCall(ab)
    vp, wp = call((3, ab.asarray(wide)[:, :16]))
    assert ab.to_numpy(vp.verify_slot_indices)[:7].tolist() == [16, 17, 18, 32, 33, 34, 35]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(verify_capacity=-1, out=None), ValueError, "verify_capacity must be non-negative, got -1"),
    (dict(verify_capacity=2.0, out=None), TypeError, "verify_capacity must be an int, got float"),
    (dict(verify_capacity=True, out=None), TypeError, "verify_capacity must be an int, got bool"),
    (dict(verify_capacity=2**31, out=None), ValueError, "verify_capacity must be at most 2147483647, got 2147483648"),
    # 2**31 - 1 (what CanaryCapacities.from_engine clamps to) is a valid capacity: only the out size differs
    (dict(verify_capacity=2**31 - 1), ValueError,
     r"plan verify_capacity=2147483647 does not match out\[0\].verify_slot_indices.shape\[0\]=32$"),
    (dict(write_req_capacity=2**31 - 1), ValueError,
     r"plan write_req_capacity=2147483647 does not match out\[1\].write_seed_slot_indices.shape\[0\]=2"),
    (dict(write_req_capacity=2**31), ValueError, "write_req_capacity must be at most 2147483647, got 2147483648"),
    (dict(write_req_capacity=-1, out=None), ValueError, "write_req_capacity must be non-negative, got -1"),
    (dict(write_req_capacity=1, out=None), ValueError,
     r"^kv-canary: bs=2 exceeds write_req_capacity=1; size the WritePlan for the largest batch "
     r"\(CanaryCapacities.from_engine\(max_running_requests=...\) for a CanaryPlanner\)$"),
    (dict(verify_capacity=31), ValueError,
     r"plan verify_capacity=31 does not match out\[0\].verify_slot_indices.shape\[0\]=32$"),
    (dict(write_req_capacity=3), ValueError,
     r"plan write_req_capacity=3 does not match out\[1\].write_seed_slot_indices.shape\[0\]=2"),
    (dict(swa_window_size=-1), ValueError, "swa_window_size must be >= 0, got -1"),
    (dict(swa_window_size=1.5), TypeError, "swa_window_size must be an int, got float"),
    (dict(kv_token_id_vs_position_offset="1"), TypeError, "kv_token_id_vs_position_offset must be an int, got str"),
])
def test_plan_scalar_arguments(ab, kw, exc, match):
    call = PlanCall(ab)
    assert_rejected(ab, exc, match, lambda: call(**kw), *call.out)


def test_plan_bs_above_out_capacity(ab):
    call = PlanCall(ab)
    out = (VerifyPlan.allocate(32, like=ab.like), WritePlan.allocate(1, like=ab.like))
    assert_rejected(ab, ValueError, "bs=2 exceeds write_req_capacity=1", lambda: call(out=out), *out)


def test_plan_out_types(ab):
    call = PlanCall(ab)
    vp, wp = call.out
    assert_rejected(ab, TypeError, "out must be a \\(VerifyPlan, WritePlan\\) tuple, got list", lambda: call(out=[vp, wp]), vp, wp)
    assert_rejected(ab, TypeError, r"out\[0\] must be a VerifyPlan, got WritePlan", lambda: call(out=(wp, vp)), vp, wp)
    assert_rejected(ab, TypeError, r"out\[1\] must be a WritePlan, got tuple", lambda: call(out=(vp, (1,))), vp, wp)


def test_plan_out_array_checks(ab):
    call = PlanCall(ab)
    vp, wp = call.out
    bad_vp = VerifyPlan(**{**vp.arrays(), "verify_expected_tokens": ab.asarray(np.zeros(32, np.int32))})
    assert_rejected(ab, TypeError, r"out\[0\].verify_expected_tokens must have dtype int64, got int32",
                    lambda: call(out=(bad_vp, wp)), bad_vp, wp)
    bad_vp = VerifyPlan(**{**vp.arrays(), "enable": ab.asarray(np.ones(2, np.int32))})
    assert_rejected(ab, ValueError, r"out\[0\].enable length must be 1, got 2", lambda: call(out=(bad_vp, wp)), bad_vp, wp)
    bad_wp = WritePlan(**{**wp.arrays(), "verify_offsets": ab.asarray(np.zeros(4, np.int64))})
    assert_rejected(ab, ValueError, r"out\[1\].verify_offsets length must be write_req_capacity \+ 1=3, got 4",
                    lambda: call(out=(vp, bad_wp)), vp, bad_wp)
    # two bad fields: the first of the record's field table is named (the capacity field comes second)
    bad_wp = WritePlan(**{**wp.arrays(), "write_offsets": ab.asarray(np.zeros(4, np.int64)),
                          "write_seed_slot_indices": ab.asarray(np.zeros(2, np.int32))})
    assert_rejected(ab, ValueError, r"out\[1\].write_offsets length must be write_req_capacity \+ 1=3, got 4",
                    lambda: call(out=(vp, bad_wp)), vp, bad_wp)
    strided = ab.asarray(np.zeros(64, np.int64))[::2]
    bad_vp = VerifyPlan(**{**vp.arrays(), "verify_prev_slot_indices": strided})
    assert_rejected(ab, ValueError, r"out\[0\].verify_prev_slot_indices must be contiguous",
                    lambda: call(out=(bad_vp, wp)), bad_vp, wp)


def test_plan_negative_stride_outputs(ab):
    if ab.name not in ("numpy", "cupy"):
        pytest.skip("torch tensors cannot have negative strides")
    call = PlanCall(ab)
    vp, wp = call.out
    for key, arr in [("write_offsets", np.zeros(3, np.int64)), ("write_num_valid_reqs", np.zeros(1, np.int32))]:
        bad_wp = WritePlan(**{**wp.arrays(), key: ab.asarray(arr)[::-1]})
        assert_rejected(ab, ValueError, rf"out\[1\].{key} has negative strides",
                        lambda: call(out=(vp, bad_wp)), vp, bad_wp)


def test_plan_non_contiguous_inputs_are_copied(ab):
    call = PlanCall(ab)
    spread = ab.asarray(np.array([3, -9, 4, -9], np.int64))[::2]
    vp, _ = call((1, spread))
    assert int(ab.to_numpy(vp.verify_num_valid)[0]) == 7
    assert ab.to_numpy(spread).tolist() == [3, 4]


def test_plan_rejects_non_arrays():
    with pytest.raises(TypeError, match="req_pool_indices must be a NumPy array, a CuPy array or a PyTorch tensor, got builtins.list"):
        kc.plan([1], np.array([1]), np.array([1]), linear_rtt(2, 4), verify_capacity=4)


# ---- write ---------------------------------------------------------------------------------------


class WriteCall:
    def __init__(self, ab):
        self.ab = ab
        self.buf = ab.asarray(canary(16, {5: (1, 2, 3, 4)}))
        self.wp = make_write_plan(ab, [0, 2], [-1])
        self.log = make_log(ab)
        self.ids, self.pos, self.loc = a64(ab, [1, 2]), a64(ab, [0, 1]), a64(ab, [3, 4])

    def __call__(self, **kw):
        args = dict(canary_buf=self.buf, write_plan=self.wp, input_ids=self.ids, positions=self.pos,
                    out_cache_loc=self.loc)
        args.update({k: kw.pop(k) for k in list(kw) if k in args})
        kw.setdefault("log", self.log)
        return kc.write(*args.values(), **kw)

    def outputs(self):
        return self.buf, self.wp, self.log


def test_write_valid_call_works(ab):
    call = WriteCall(ab)
    call()
    assert int(ab.to_numpy(call.log.slot_run_counters)[0]) == 2


def _source(ab, rows=16):
    return RealKvSource(ab.asarray(np.zeros((rows, 16), np.uint8)), 1, 16, 16)


@pytest.mark.parametrize("case, exc, match", [
    ("nine_sources", ValueError, r"real_kv_sources must hold at most 8 RealKvSource entries \(the CUDA ABI's limit\), got 9"),
    ("not_a_source", TypeError, r"real_kv_sources\[1\] must be a RealKvSource, got tuple"),
    ("bad_mode", ValueError, "real_kv_hash_mode must be a RealKvHashMode"),
    ("plan_type", TypeError, "write_plan must be a WritePlan, got VerifyPlan"),
    ("log_type", TypeError, "log must be a ViolationLog, got dict"),
    ("kind_high", ValueError, r"kernel_kind must be in \[0, 12\) \(the log's num_kinds\), got 12"),
    ("kind_negative", ValueError, r"kernel_kind must be in \[0, 12\) .* got -1"),
    ("kind_type", TypeError, "kernel_kind must be an int, got float"),
    ("one_expected", ValueError, "^kv-canary: expected_input_tokens and expected_input_positions enable the "
                                 "write-input assert together; pass both or neither$"),
    ("flag_int", TypeError, "chain_position_assert must be a bool or a one-element int32 array, got int 1"),
    ("flag_dtype", TypeError, "chain_position_assert must have dtype int32, got int64"),
    ("flag_len", ValueError, "chain_position_assert length must be 1, got 2"),
    ("ids_dtype", TypeError, "input_ids must have dtype int32 or int64, got float64"),  # int32 is read as it is (issue 22)
    ("pos_len", ValueError, r"positions length must be len\(input_ids\)=2, got 3"),
    ("loc_2d", ValueError, r"out_cache_loc must be 1-D, got shape \(2, 1\)"),
    ("expected_len", ValueError, r"expected_input_positions length must be len\(input_ids\)=2, got 1"),
    ("buf_int32", TypeError, "canary_buf must be int64 \\[num_slots, 4\\] or uint8 \\[num_slots, >=32\\], got dtype int32"),
    ("buf_u8_narrow", ValueError, "canary_buf slot stride must hold at least 4 int64 fields .* got 24 bytes"),
    ("buf_u8_ragged", ValueError, "canary_buf slot stride .* got 36 bytes"),
    ("buf_i64_narrow", ValueError, "canary_buf slot stride must hold at least 4 int64 fields, got 3"),
    ("buf_1d", ValueError, r"canary_buf must be 2-D, got shape \(64,\)"),
    ("buf_empty", ValueError, r"^kv-canary: canary_buf must have at least 1 slot \(slot 0 is the padding slot\), got 0$"),
    ("buf_strided", ValueError, "canary_buf must be contiguous"),
    ("offsets_len", ValueError, r"write_plan.write_offsets length must be write_req_capacity \+ 1=2, got 3"),
    ("seeds_dtype", TypeError, "write_plan.write_seed_slot_indices must have dtype int64, got int32"),
    ("num_valid_dtype", TypeError, "write_plan.write_num_valid_reqs must have dtype int32, got int64"),
    ("ring_shape", ValueError, r"log.ring must be int64 \[capacity, 8\], got int64 \(4, 7\)"),
    ("counter_len", ValueError, "log.slot_run_counters length must be num_kinds=12, got 11"),
    ("index_dtype", TypeError, "log.write_index must have dtype int32, got int64"),
    ("uncovered_source", ValueError, r"real_kv_sources\[0\].tensor has 15 rows x page_size=1 = 15 slots but canary_buf has 16"),
])
def test_write_rejections(ab, case, exc, match):
    call = WriteCall(ab)
    log = call.log
    kw = {
        "nine_sources": lambda: dict(real_kv_sources=[_source(ab)] * 9),
        "not_a_source": lambda: dict(real_kv_sources=[_source(ab), (1, 2)]),
        "bad_mode": lambda: dict(real_kv_hash_mode=3),
        "plan_type": lambda: dict(write_plan=make_verify_plan(ab, [1], [0], [-1])),
        "log_type": lambda: dict(log={}),
        "kind_high": lambda: dict(kernel_kind=12),
        "kind_negative": lambda: dict(kernel_kind=-1),
        "kind_type": lambda: dict(kernel_kind=1.0),
        "one_expected": lambda: dict(expected_input_tokens=a64(ab, [1, 2])),
        "flag_int": lambda: dict(chain_position_assert=1),
        "flag_dtype": lambda: dict(chain_position_assert=a64(ab, [1])),
        "flag_len": lambda: dict(chain_position_assert=ab.asarray(np.ones(2, np.int32))),
        "ids_dtype": lambda: dict(input_ids=ab.asarray(np.array([1, 2], np.float64))),
        "pos_len": lambda: dict(positions=a64(ab, [0, 1, 2])),
        "loc_2d": lambda: dict(out_cache_loc=a64(ab, [[3], [4]])),
        "expected_len": lambda: dict(expected_input_tokens=a64(ab, [1, 2]), expected_input_positions=a64(ab, [0])),
        "buf_int32": lambda: dict(canary_buf=ab.asarray(np.zeros((16, 8), np.int32))),
        "buf_u8_narrow": lambda: dict(canary_buf=ab.asarray(np.zeros((16, 24), np.uint8))),
        "buf_u8_ragged": lambda: dict(canary_buf=ab.asarray(np.zeros((16, 36), np.uint8))),
        "buf_i64_narrow": lambda: dict(canary_buf=ab.asarray(np.zeros((16, 3), np.int64))),
        "buf_1d": lambda: dict(canary_buf=ab.asarray(np.zeros(64, np.int64))),
        "buf_empty": lambda: dict(canary_buf=ab.asarray(np.zeros((0, 4), np.int64))),
        "buf_strided": lambda: dict(canary_buf=ab.asarray(np.zeros((32, 4), np.int64))[::2]),
        "offsets_len": lambda: dict(write_plan=WritePlan(**{**call.wp.arrays(), "write_offsets": a64(ab, [0, 2, 0])})),
        "seeds_dtype": lambda: dict(write_plan=WritePlan(**{**call.wp.arrays(),
                                                             "write_seed_slot_indices": ab.asarray(np.array([-1], np.int32))})),
        "num_valid_dtype": lambda: dict(write_plan=WritePlan(**{**call.wp.arrays(), "write_num_valid_reqs": a64(ab, [1])})),
        "ring_shape": lambda: dict(log=ViolationLog(**{**log.arrays(), "ring": ab.asarray(np.zeros((4, 7), np.int64))})),
        "counter_len": lambda: dict(log=ViolationLog(**{**log.arrays(), "slot_run_counters": ab.asarray(np.zeros(11, np.int64))})),
        "index_dtype": lambda: dict(log=ViolationLog(**{**log.arrays(), "write_index": a64(ab, [0])})),
        "uncovered_source": lambda: dict(real_kv_sources=[_source(ab, rows=15)], real_kv_hash_mode=RealKvHashMode.PARTIAL),
    }[case]()
    outputs = [v for v in kw.values() if hasattr(v, "arrays") or hasattr(v, "shape")]
    assert_rejected(ab, exc, match, lambda: call(**kw), *call.outputs(), *outputs)


def test_write_torch_out_requires_grad_is_rejected(ab):
    if not ab.name.startswith("torch"):
        pytest.skip("requires_grad is a torch thing")
    call = WriteCall(ab)
    ring = ab.asarray(np.zeros((4, 8), np.float32)).requires_grad_(True)
    log = ViolationLog(**{**call.log.arrays(), "ring": ring})
    with pytest.raises(ValueError, match="log.ring is a torch tensor that requires grad; kv-canary writes into it"):
        call(log=log)
    assert (ab.to_numpy(call.buf)[3:5] == 0).all()


# ---- verify --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, exc, match", [
    ("nine_sources", ValueError, r"real_kv_sources must hold at most 8 RealKvSource entries \(the CUDA ABI's limit\), got 9"),
    ("plan_type", TypeError, "verify_plan must be a VerifyPlan, got WritePlan"),
    ("log_type", TypeError, "log must be a ViolationLog, got NoneType"),
    ("kind", ValueError, r"kernel_kind must be in \[0, 3\) \(the log's num_kinds\), got 3"),
    ("check_flag", TypeError, "check_expected_token must be a bool, got int"),
    ("mode", ValueError, "real_kv_hash_mode must be a RealKvHashMode"),
    ("entries_len", ValueError, r"verify_plan.verify_prev_slot_indices length must be verify_capacity=2, got 3"),
    ("entries_dtype", TypeError, "verify_plan.verify_expected_positions must have dtype int64, got int32"),
    ("num_valid_dtype", TypeError, "verify_plan.verify_num_valid must have dtype int32, got int64"),
    ("enable_len", ValueError, "verify_plan.enable length must be 1, got 2"),
    ("buf_u8_narrow", ValueError, "canary_buf slot stride must hold at least 4 int64 fields"),
    ("uncovered_source", ValueError, r"has 2 rows x page_size=4 = 8 slots but canary_buf has 16"),
])
def test_verify_rejections(ab, case, exc, match):
    buf = ab.asarray(canary(16))
    vp = make_verify_plan(ab, [1, 2], [0, 1], [-1, 1])
    log = make_log(ab, num_kinds=3)
    kw = dict(log=log)
    if case == "nine_sources":
        kw["real_kv_sources"] = [_source(ab)] * 9
    elif case == "plan_type":
        vp = make_write_plan(ab, [0, 1], [-1])
    elif case == "log_type":
        kw["log"] = None
    elif case == "kind":
        kw["kernel_kind"] = 3
    elif case == "check_flag":
        kw["check_expected_token"] = 1
    elif case == "mode":
        kw["real_kv_hash_mode"] = "all"
    elif case == "entries_len":
        vp = VerifyPlan(**{**vp.arrays(), "verify_prev_slot_indices": a64(ab, [-1, 1, 2])})
    elif case == "entries_dtype":
        vp = VerifyPlan(**{**vp.arrays(), "verify_expected_positions": ab.asarray(np.zeros(2, np.int32))})
    elif case == "num_valid_dtype":
        vp = VerifyPlan(**{**vp.arrays(), "verify_num_valid": a64(ab, [2])})
    elif case == "enable_len":
        vp = VerifyPlan(**{**vp.arrays(), "enable": ab.asarray(np.ones(2, np.int32))})
    elif case == "buf_u8_narrow":
        buf = ab.asarray(np.zeros((16, 16), np.uint8))
    elif case == "uncovered_source":
        kw["real_kv_sources"] = [RealKvSource(ab.asarray(np.zeros((2, 64), np.uint8)), 4, 16, 16)]
        kw["real_kv_hash_mode"] = RealKvHashMode.ALL
    assert_rejected(ab, exc, match, lambda: kc.verify(buf, vp, **kw), buf, vp, log)


def test_verify_needs_a_contiguous_canary_buffer(ab):
    buf = ab.asarray(canary(32))[::2]
    log = make_log(ab)
    vp = make_verify_plan(ab, [1, 2], [0, 1], [-1, 1])
    assert_rejected(ab, ValueError, r"^kv-canary: canary_buf must be contiguous, got strides \(64, 8\) for shape \(16, 4\)$",
                    lambda: kc.verify(buf, vp, log=log), buf, vp, log)


def test_a_canary_of_only_the_padding_slot(ab):
    """One slot (slot 0, never stored) is a valid buffer: writes are counted and chained, nothing else."""
    buf = ab.asarray(canary(1))
    log = make_log(ab)
    kc.write(buf, make_write_plan(ab, [0, 2, 3], [-1, 0]), a64(ab, [1, 2, 3]), a64(ab, [0, 1, 0]), a64(ab, [0, 0, 0]),
             log=log)
    kc.verify(buf, make_verify_plan(ab, [0, 0], [0, 1], [-1, 0]), log=log)
    assert not ab.to_numpy(buf).any()
    assert ab.to_numpy(log.slot_run_counters)[0] == 5 and not ab.to_numpy(log.ring).any()


# ---- scatter -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case, exc, match", [
    ("flat_dtype", TypeError, "scatter_req_token_ids flat_in must be int64, got int32"),
    ("offsets_dtype", TypeError, "scatter_req_token_ids offsets must be int64, got float64"),
    ("rp_dtype", TypeError, "scatter_req_token_ids req_pool_indices must be int64, got int32"),
    ("pool_dtype", TypeError, "scatter_req_token_ids pool_out must be int32, got int64"),
    ("flat_2d", ValueError, r"scatter_req_token_ids flat_in must be 1-D, got shape \(2, 2\)"),
    ("offsets_2d", ValueError, r"scatter_req_token_ids offsets must be 1-D, got shape \(3, 1\)"),
    ("rp_2d", ValueError, r"scatter_req_token_ids req_pool_indices must be 1-D, got shape \(1, 2\)"),
    ("pool_1d", ValueError, r"scatter_req_token_ids pool_out must be 2-D, got shape \(12,\)"),
    ("offsets_len", ValueError, r"scatter_req_token_ids offsets length 2 != bs\+1 \(3\)"),
    ("count_dtype", TypeError, "out_of_range_count must have dtype int64, got int32"),
    ("count_len", ValueError, "out_of_range_count length must be 1, got 2"),
])
def test_scatter_rejections(ab, case, exc, match):
    args = dict(flat_in=np.array([1, 2, 3, 4], np.int64), offsets=np.array([0, 1, 4], np.int64),
                req_pool_indices=np.array([1, 2], np.int64), pool_out=np.full((3, 4), -7, np.int32))
    count = np.zeros(1, np.int64)
    if case == "flat_dtype":
        args["flat_in"] = args["flat_in"].astype(np.int32)
    elif case == "offsets_dtype":
        args["offsets"] = args["offsets"].astype(np.float64)
    elif case == "rp_dtype":
        args["req_pool_indices"] = args["req_pool_indices"].astype(np.int32)
    elif case == "pool_dtype":
        args["pool_out"] = args["pool_out"].astype(np.int64)
    elif case == "flat_2d":
        args["flat_in"] = args["flat_in"].reshape(2, 2)
    elif case == "offsets_2d":
        args["offsets"] = args["offsets"].reshape(3, 1)
    elif case == "rp_2d":
        args["req_pool_indices"] = args["req_pool_indices"].reshape(1, 2)
    elif case == "pool_1d":
        args["pool_out"] = args["pool_out"].reshape(12)
    elif case == "offsets_len":
        args["offsets"] = args["offsets"][:2]
    elif case == "count_dtype":
        count = count.astype(np.int32)
    elif case == "count_len":
        count = np.zeros(2, np.int64)
    native = {k: ab.asarray(v) for k, v in args.items()}
    count = ab.asarray(count)
    assert_rejected(ab, exc, match, lambda: kc.scatter_req_token_ids(*native.values(), out_of_range_count=count),
                    native["pool_out"], count)


# ---- every array's dtype -------------------------------------------------------------------------


def dtype_error(name: str, want: str, got: str) -> str:
    """The full message of a dtype check, conversion hint included."""
    method = "long" if want == "int64" else "int"
    return (rf"^kv-canary: {re.escape(name)} must have dtype {want}, got {got}; "
            rf"convert with \.astype\({want}\) \(NumPy/CuPy\) or \.{method}\(\) \(torch\)$")


def _wrong_dtype(ab, arr):
    """``arr`` (a native array) with the other integer width: int32 for int64 and vice versa."""
    host_arr = ab.to_numpy(arr)
    return ab.asarray(host_arr.astype(np.int32 if host_arr.dtype == np.int64 else np.int64))


def _with(record, key, value):
    return type(record)(**{**record.arrays(), key: value})


def _record_arrays(prefix, record):
    return {f"{prefix}.{k}": v for k, v in record.arrays().items()}


PLAN_OUT_KEYS = [(0, k) for k in VerifyPlan.__dataclass_fields__] + [(1, k) for k in WritePlan.__dataclass_fields__]


@pytest.mark.parametrize("which, key", PLAN_OUT_KEYS)
def test_plan_out_array_dtypes(ab, which, key):
    call = PlanCall(ab)
    out = list(call.out)
    arr = getattr(out[which], key)
    out[which] = _with(out[which], key, _wrong_dtype(ab, arr))
    want, got = ab.to_numpy(arr).dtype.name, "int32" if ab.to_numpy(arr).dtype == np.int64 else "int64"
    assert_rejected(ab, TypeError, dtype_error(f"out[{which}].{key}", want, got), lambda: call(out=tuple(out)), *out)


def test_plan_valid_lens_dtype(ab):
    call = PlanCall(ab)
    pool = ab.asarray(np.zeros((4, 16), np.int32))
    lens = ab.asarray(np.array([1, 1], np.int32))
    assert_rejected(ab, TypeError, dtype_error("req_to_verify_expected_tokens_valid_lens", "int64", "int32"),
                    lambda: call(req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=lens),
                    *call.out)


@pytest.mark.parametrize("key, dtype, want", [
    ("positions", np.float32, "int32 or int64"), ("out_cache_loc", np.uint64, "int32 or int64"),
    ("expected_input_tokens", np.int32, "int64"), ("expected_input_positions", np.int32, "int64")])
def test_write_token_array_dtypes(ab, key, dtype, want):
    """input_ids, positions and out_cache_loc may be int32 (tests/test_int32_step_inputs.py); the
    write-input assert's copies stay int64."""
    call = WriteCall(ab)
    kw = dict(expected_input_tokens=a64(ab, [1, 2]), expected_input_positions=a64(ab, [0, 1]))
    kw[key] = ab.asarray(np.array([1, 2], dtype))
    message = (dtype_error(key, want, np.dtype(dtype).name) if want == "int64"
               else rf"^kv-canary: {key} must have dtype int32 or int64, got {np.dtype(dtype).name}$")
    assert_rejected(ab, TypeError, message, lambda: call(**kw), *call.outputs())


@pytest.mark.parametrize("key", ["write_offsets", "write_seed_slot_indices", "write_num_valid_reqs"])
def test_write_plan_array_dtypes(ab, key):
    call = WriteCall(ab)
    arr = getattr(call.wp, key)
    wp = _with(call.wp, key, _wrong_dtype(ab, arr))
    want = ab.to_numpy(arr).dtype.name
    assert_rejected(ab, TypeError, dtype_error(f"write_plan.{key}", want, "int32" if want == "int64" else "int64"),
                    lambda: call(write_plan=wp), *call.outputs(), wp)


@pytest.mark.parametrize("key", [k for k in VerifyPlan.__dataclass_fields__ if k != "out_of_range_count"])
def test_verify_plan_array_dtypes(ab, key):
    buf = ab.asarray(canary(16))
    log = make_log(ab)
    vp = make_verify_plan(ab, [1, 2], [0, 1], [-1, 1])
    arr = getattr(vp, key)
    bad = _with(vp, key, _wrong_dtype(ab, arr))
    want = ab.to_numpy(arr).dtype.name
    assert_rejected(ab, TypeError, dtype_error(f"verify_plan.{key}", want, "int32" if want == "int64" else "int64"),
                    lambda: kc.verify(buf, bad, log=log), buf, bad, log)


@pytest.mark.parametrize("op", ["write", "verify"])
@pytest.mark.parametrize("key, dtype, exc, match", [
    ("ring", np.int32, ValueError, r"log\.ring must be int64 \[capacity, 8\], got int32 \(4, 8\)"),
    ("ring", np.float64, ValueError, r"log\.ring must be int64 \[capacity, 8\], got float64 \(4, 8\)"),
    ("write_index", np.int64, TypeError, r"log\.write_index must have dtype int32, got int64"),
    ("slot_run_counters", np.int32, TypeError, r"log\.slot_run_counters must have dtype int64, got int32"),
    ("kernel_run_counters", np.int32, TypeError, r"log\.kernel_run_counters must have dtype int64, got int32"),
    ("out_of_range_counters", np.uint64, TypeError, r"log\.out_of_range_counters must have dtype int64, got uint64"),
])
def test_log_array_dtypes(ab, op, key, dtype, exc, match):
    """An int32 ring would cut the 64-bit chain hashes of every violation row: refused like the rest."""
    log = make_log(ab, capacity=4)
    bad = _with(log, key, ab.asarray(ab.to_numpy(getattr(log, key)).astype(dtype)))
    buf = ab.asarray(canary(16))
    if op == "write":
        call = WriteCall(ab)
        assert_rejected(ab, exc, match, lambda: call(log=bad), *call.outputs(), bad)
    else:
        vp = make_verify_plan(ab, [1, 2], [5, 5], [-1, -1])  # two violations if it ran
        assert_rejected(ab, exc, match, lambda: kc.verify(buf, vp, log=bad), buf, bad)


@pytest.mark.parametrize("dtype", [np.float64, np.uint64, np.int32])
@pytest.mark.parametrize("op", ["write", "verify"])
def test_canary_buffer_dtypes(ab, op, dtype):
    """Only int64 [N, >=4] (or its bytes, uint8 [N, >=32]) is a canary buffer: a float64 one would
    store hashes lossily, a uint64 one would compare them unsigned."""
    buf = ab.asarray(np.zeros((16, 4), dtype))
    log = make_log(ab)
    match = rf"canary_buf must be int64 \[num_slots, 4\] or uint8 \[num_slots, >=32\], got dtype {np.dtype(dtype).name}"
    if op == "write":
        call = WriteCall(ab)
        assert_rejected(ab, TypeError, match, lambda: call(canary_buf=buf), buf, call.wp, call.log)
    else:
        vp = make_verify_plan(ab, [1, 2], [0, 1], [-1, 1])
        assert_rejected(ab, TypeError, match, lambda: kc.verify(buf, vp, log=log), buf, vp, log)


# ---- lengths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which, key, length, match", [
    (0, "verify_expected_positions", 31, r"out\[0\]\.verify_expected_positions length must be verify_capacity=32, got 31"),
    (0, "out_of_range_count", 2, r"out\[0\]\.out_of_range_count length must be 1, got 2"),
    (1, "write_num_valid_reqs", 2, r"out\[1\]\.write_num_valid_reqs length must be 1, got 2"),
])
def test_plan_out_array_lengths(ab, which, key, length, match):
    call = PlanCall(ab)
    out = list(call.out)
    dtype = ab.to_numpy(getattr(out[which], key)).dtype
    out[which] = _with(out[which], key, ab.asarray(np.zeros(length, dtype)))
    assert_rejected(ab, ValueError, "^kv-canary: " + match + "$", lambda: call(out=tuple(out)), *out)


def test_single_element_arrays_of_write_and_verify(ab):
    call = WriteCall(ab)
    wp = _with(call.wp, "write_num_valid_reqs", ab.asarray(np.ones(2, np.int32)))
    assert_rejected(ab, ValueError, r"^kv-canary: write_plan\.write_num_valid_reqs length must be 1, got 2$",
                    lambda: call(write_plan=wp), *call.outputs())
    log = _with(call.log, "write_index", ab.asarray(np.zeros(2, np.int32)))
    assert_rejected(ab, ValueError, r"^kv-canary: log\.write_index length must be 1, got 2$",
                    lambda: call(log=log), call.buf, log)


def test_ring_capacity_fits_int32(tmp_path):
    """A ring of 2**31 rows is refused (tickets are int32), one of 2**31 - 1 rows is used: both are
    sparse memory-mapped files (one page is written)."""
    log = make_log(NUMPY)
    buf = canary(16)
    vp = make_verify_plan(NUMPY, [1], [0], [-1])  # slot 1 was never written: one violation row
    for rows, ok in ((2**31, False), (2**31 - 1, True)):
        ring = np.memmap(tmp_path / f"ring{rows}", np.int64, "w+", shape=(rows, 8))
        big = _with(log, "ring", ring)
        if ok:
            kc.verify(buf, vp, log=big)
            assert int(big.write_index[0]) == 1 and int(ring[0, 1]) == 1 and int(big.violation_counters[0]) == 1
        else:
            assert_rejected(NUMPY, ValueError, rf"^kv-canary: log\.ring capacity must be at most {2**31 - 1}, got {2**31}$",
                            lambda: kc.verify(buf, vp, log=big), buf, big.write_index, big.kernel_run_counters)
        del big, ring
        (tmp_path / f"ring{rows}").unlink()


# ---- records ---------------------------------------------------------------------------------------


def test_plan_records_allocate_zero_capacity(ab):
    vp = VerifyPlan.allocate(0, like=ab.like)
    assert vp.capacity == 0 and ab.to_numpy(vp.verify_slot_indices).shape == (0,)
    assert ab.to_numpy(vp.enable).tolist() == [1] and ab.to_numpy(vp.verify_num_valid).tolist() == [0]
    assert ab.to_numpy(vp.out_of_range_count).tolist() == [0]
    wp = WritePlan.allocate(0, like=ab.like)
    assert wp.capacity == 0 and ab.to_numpy(wp.write_offsets).tolist() == [0]
    assert ab.to_numpy(wp.verify_offsets).tolist() == [0]
    wp = WritePlan.allocate(3, like=ab.like)
    assert ab.to_numpy(wp.write_seed_slot_indices).tolist() == [-1, -1, -1]
    assert ab.to_numpy(wp.write_num_valid_reqs).tolist() == [0]


def test_plan_records_reject_negative_capacity():
    with pytest.raises(ValueError, match="kv-canary: VerifyPlan verify_capacity must be non-negative, got -1"):
        VerifyPlan.allocate(-1)
    with pytest.raises(ValueError, match="kv-canary: WritePlan write_req_capacity must be non-negative, got -1"):
        WritePlan.allocate(-1)
    with pytest.raises(TypeError, match="VerifyPlan verify_capacity must be an int, got float"):
        VerifyPlan.allocate(1.0)


def test_violation_log_allocate(ab):
    log = ViolationLog.allocate(like=ab.like)
    shapes = {k: (ab.to_numpy(v).shape, ab.to_numpy(v).dtype.name) for k, v in log.arrays().items()}
    assert shapes == {"ring": ((1024, 8), "int64"), "write_index": ((1,), "int32"),
                      "violation_counters": ((12,), "int64"), "slot_run_counters": ((12,), "int64"), "kernel_run_counters": ((12,), "int64"),
                      "out_of_range_counters": ((12,), "int64")}
    assert all((ab.to_numpy(v) == 0).all() for v in log.arrays().values())
    assert (log.capacity, log.num_kinds) == (1024, 12)
    small = ViolationLog.allocate(ring_capacity=3, num_kinds=2, like=ab.like)
    assert ab.to_numpy(small.ring).shape == (3, 8) and small.num_kinds == 2


@pytest.mark.parametrize("kw, match", [
    (dict(ring_capacity=0), "^kv-canary: ViolationLog ring_capacity must be positive, got 0$"),
    (dict(ring_capacity=-1), "^kv-canary: ViolationLog ring_capacity must be positive, got -1$"),
    (dict(num_kinds=0), "^kv-canary: ViolationLog num_kinds must be positive, got 0$"),
    (dict(num_kinds=-2), "^kv-canary: ViolationLog num_kinds must be positive, got -2$"),
])
def test_violation_log_allocate_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        ViolationLog.allocate(**kw)


def test_violation_log_reset(ab):
    log = make_log(ab)
    kc.verify(ab.asarray(canary(4)), make_verify_plan(ab, [1], [3], [-1]), log=log)
    assert int(ab.to_numpy(log.write_index)[0]) == 1
    log.reset()
    assert all((ab.to_numpy(v) == 0).all() for v in log.arrays().values())


def test_allocate_canary_buffer(ab):
    buf = kc.allocate_canary_buffer(5, like=ab.like)
    assert type(buf) is type(ab.like)
    host = ab.to_numpy(buf)
    assert host.shape == (5, 4) and host.dtype == np.int64 and (host == 0).all()
    assert ab.to_numpy(kc.allocate_canary_buffer(125, like=ab.like)).shape == (125, 4)
    with pytest.raises(ValueError, match="num_slots must be non-negative, got -1"):
        kc.allocate_canary_buffer(-1)
    with pytest.raises(ValueError, match=f"num_slots must be at most {2**62}, got {2**62 + 1}"):
        kc.allocate_canary_buffer(2**62 + 1)


def test_allocate_canary_buffer_beyond_int32_slots(monkeypatch):
    """More than 2**31 slots are fine: the buffer asked for (not made here) is int64 [num_slots, 4], zeroed."""
    asked = []
    monkeypatch.setattr(plans, "allocate", lambda shape, dtype, *, like=None, fill=None: asked.append((shape, dtype, fill)))
    kc.allocate_canary_buffer(2**40)
    assert asked == [((2**40, 4), np.int64, 0)]


@pytest.mark.parametrize("shape, page_size, nbpt, read_bytes, match", [
    ((4, 64), 0, 16, 16, r"RealKvSource.page_size must be >= 1, got 0"),
    ((4, 64), 1, 0, 16, r"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 0"),
    ((4, 64), 1, 24, 16, r"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 24"),
    ((4, 64), 1, 32, 0, r"RealKvSource.read_bytes must be a positive multiple of 16 in \(0, num_bytes_per_token=32\], got 0"),
    ((4, 64), 1, 32, 8, r"RealKvSource.read_bytes .* got 8"),
    ((4, 64), 1, 32, 48, r"RealKvSource.read_bytes .* got 48"),
    ((64,), 1, 16, 16, r"RealKvSource.tensor must be at least 2-D, got shape \(64,\)"),
    ((4, 16), 2, 16, 16, r"RealKvSource row is too narrow for its slot layout: dim-1 is 16 bytes but page_size=2 x num_bytes_per_token=16 needs 32"),
    ((4, 64), 1.0, 16, 16, r"RealKvSource.page_size must be >= 1, got 1.0"),
    ((4, 64), True, 16, 16, r"RealKvSource.page_size must be >= 1, got True"),
    ((4, 64), 1, 16.0, 16, r"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 16.0"),
    ((4, 64), 1, 16, np.float32(16), r"RealKvSource.read_bytes .* got 16.0"),
])
def test_real_kv_source_checks(ab, shape, page_size, nbpt, read_bytes, match):
    with pytest.raises(ValueError, match=match):
        RealKvSource(ab.asarray(np.zeros(shape, np.uint8)), page_size, nbpt, read_bytes)


def test_real_kv_source_row_stride(ab):
    holey = ab.asarray(np.zeros((4, 40), np.uint8))[:, :32]
    with pytest.raises(ValueError, match=r"RealKvSource.tensor row stride must be a multiple of 16 bytes, got 40 bytes"):
        RealKvSource(holey, 1, 32, 32)
    ok = ab.asarray(np.zeros((4, 48), np.uint8))[:, :32]
    assert RealKvSource(ok, 1, 32, 32).num_rows == 4


@pytest.mark.parametrize("layout", ["dims_swapped", "dim0_reversed", "inner_strided", "middle_strided"])
def test_real_kv_source_rows_must_be_contiguous(ab, layout):
    """A transposed or strided pool would be hashed in memory order, not slot order: it is refused."""
    if layout == "dim0_reversed" and ab.name.startswith("torch"):
        pytest.skip("torch tensors cannot have negative strides")
    data = ab.asarray(kv_bytes(16, 64, 3))
    tensor = {  # each [16, 32 bytes per row] in logical order
        "dims_swapped": lambda: data[:, :32].reshape(16, 16, 2).swapaxes(1, 2),  # [16, 2, 16]
        "dim0_reversed": lambda: data[::-1, :32],
        "inner_strided": lambda: data[:, ::2],  # [16, 32], elements 2 bytes apart
        "middle_strided": lambda: data.reshape(16, 4, 16)[:, ::2],  # [16, 2, 16], halves 32 bytes apart
    }[layout]()
    src = RealKvSource(tensor, 1, 32, 32)  # row stride and width fit: only the layout is wrong
    call = WriteCall(ab)
    assert_rejected(ab, ValueError, r"real_kv_sources\[0\]\.tensor must be contiguous within each dim-0 row",
                    lambda: call(real_kv_sources=(src,), real_kv_hash_mode=RealKvHashMode.PARTIAL), *call.outputs())
    vp = make_verify_plan(ab, [3, 4], [0, 1], [-1, 3])
    assert_rejected(ab, ValueError, r"real_kv_sources\[0\]\.tensor must be contiguous within each dim-0 row",
                    lambda: kc.verify(call.buf, vp, log=call.log, real_kv_sources=(src,),
                                      real_kv_hash_mode=RealKvHashMode.ALL), *call.outputs())


@pytest.mark.parametrize("dtype", [np.uint8, np.float16])
def test_real_kv_source_layouts_that_are_read(ab, dtype):
    """Rows may be multi-dimensional, spaced apart, even aliased (dim-0 stride 0): each slot hashes its bytes."""
    data = kv_bytes(8, 64, 21)
    pages = ab.asarray(data.view(dtype).reshape(8, 2, -1))  # 8 pages of 2 slots, 3-D
    row = ab.asarray(data[3].view(dtype))
    if ab.name.startswith("torch"):
        aliased = row.reshape(1, -1).expand(8, -1)
    else:
        xp = np if ab.name == "numpy" else pytest.importorskip("cupy")
        aliased = xp.lib.stride_tricks.as_strided(row, (8, row.shape[0]), (0, row.strides[0]))
    holey = np.zeros((8, 3, 32), np.uint8)  # pages 96 bytes apart, 64 used
    holey[:, :2] = data.reshape(8, 2, 32)
    holey_pages = ab.asarray(holey.view(dtype))[:, :2]
    slots = [1, 2, 5, 14]
    for tensor, host_rows in ((pages, data), (holey_pages, data), (aliased, np.repeat(data[3:4], 8, axis=0))):
        src = (RealKvSource(tensor, 2, 32, 32),)
        buf, log = ab.asarray(canary(16)), make_log(ab)
        kc.write(buf, make_write_plan(ab, [0, 4], [-1]), a64(ab, [1, 2, 3, 4]), a64(ab, range(4)), a64(ab, slots),
                 log=log, real_kv_sources=src, real_kv_hash_mode=RealKvHashMode.ALL)
        hs = (HostSource(host_rows, 2, 32, 32),)
        assert [int(v) for v in ab.to_numpy(buf)[slots, 3]] == [signed(real_kv(hs, 2, s)) for s in slots]


# ---- strided and negative-stride arrays ------------------------------------------------------------------


def _flipped(ab, x):
    """A native view of ``x`` (an array or a record) with negative strides and the same contents."""
    if hasattr(x, "arrays"):
        return type(x)(**{k: _flipped(ab, v) for k, v in x.arrays().items()})
    return ab.asarray(ab.to_numpy(x)[::-1].copy())[::-1]


def _spread(ab, x):
    """A native view of ``x`` (an array or a record) with every other element: not contiguous."""
    if hasattr(x, "arrays"):
        return type(x)(**{k: _spread(ab, v) for k, v in x.arrays().items()})
    return ab.asarray(np.repeat(ab.to_numpy(x), 2, axis=0))[::2]


def _every_op(ab, f, f_canary):
    """plan (with a LUT and the expected-token pool), write (with both asserts), verify and scatter,
    every read-only input passed through ``f`` (the canary verify reads through ``f_canary``): host
    copies of every output."""
    vp, wp = kc.plan(f(a64(ab, [1, 2])), f(a64(ab, [3, 4])), f(a64(ab, [2, 1])), f(ab.asarray(linear_rtt(4, 16))),
                     verify_capacity=7, full_to_swa_index_mapping=f(a64(ab, np.arange(64) + 100)),
                     req_to_verify_expected_tokens=f(ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))),
                     req_to_verify_expected_tokens_valid_lens=f(a64(ab, [2, 16])))
    buf, log = ab.asarray(canary(64)), make_log(ab)
    kc.write(buf, f(make_write_plan(ab, [0, 2, 3], [-1, 5])), f(a64(ab, [7, 8, 9])), f(a64(ab, [0, 1, 4])),
             f(a64(ab, [10, 11, 12])), log=log, expected_input_tokens=f(a64(ab, [7, 0, 9])),
             expected_input_positions=f(a64(ab, [0, 1, 4])), chain_position_assert=f(ab.asarray(np.ones(1, np.int32))))
    kc.verify(f_canary(buf), f(make_verify_plan(ab, [10, 11, 12], [0, 1, 4], [-1, 10, 5])), log=log)  # buf is read-only here
    pool, count = ab.asarray(np.full((3, 4), -7, np.int32)), a64(ab, [0])
    kc.scatter_req_token_ids(f(a64(ab, [1, 2, 3, 4, 5])), f(a64(ab, [0, 3, 9])), f(a64(ab, [2, 0])), pool,
                             out_of_range_count=count)
    named = {"canary": buf, "pool": pool, "count": count, **_record_arrays("vp", vp), **_record_arrays("wp", wp),
             **_record_arrays("log", log)}
    return {k: ab.to_numpy(v) for k, v in named.items()}


@pytest.mark.parametrize("layout", ["negative_strides", "every_other_element"])
def test_strided_inputs_are_read_in_order(ab, layout):
    """Read-only inputs that are not contiguous are copied (those with negative strides because
    DLPack cannot export them) and read in logical order: every result equals the contiguous one."""
    if layout == "negative_strides" and ab.name.startswith("torch"):
        pytest.skip("torch tensors cannot have negative strides")
    same = lambda x: x
    if layout == "negative_strides":
        got = _every_op(ab, lambda x: _flipped(ab, x), lambda x: _flipped(ab, x))
    else:  # a canary buffer must be contiguous, even where it is only read
        got = _every_op(ab, lambda x: _spread(ab, x), same)
    want = _every_op(ab, same, same)
    for result in (got, want):  # GPU threads store ring rows in any order: compare them as a multiset
        result["log.ring"] = np.array(sorted(result["log.ring"].tolist()))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), \
        [k for k in want if not np.array_equal(got[k], want[k])]
    assert want["vp.verify_slot_indices"].tolist() == [116, 117, 118, 132, 133, 134, 135]
    assert want["vp.verify_expected_tokens"].tolist() == [16, 17, -1, 32, 33, 34, 35]
    assert [11, 8, 0, 8] in want["log.ring"][:, [1, 3, 4, 7]].tolist()  # the write-input assert row of token 8
    assert want["log.slot_run_counters"][0] == 6  # 3 written + 3 verified
    assert want["pool"].tolist() == [[4, 5, -7, -7], [-7] * 4, [1, 2, 3, -7]] and want["count"].tolist() == [1]


@pytest.mark.parametrize("target", ["canary_buf", "log.ring", "log.write_index", "log.out_of_range_counters"])
def test_negative_stride_outputs_are_refused(ab, target):
    if ab.name.startswith("torch"):
        pytest.skip("torch tensors cannot have negative strides")
    call = WriteCall(ab)
    if target == "canary_buf":
        kw = dict(canary_buf=_flipped(ab, call.buf))
    else:
        key = target.split(".")[1]
        kw = dict(log=_with(call.log, key, _flipped(ab, getattr(call.log, key))))
    outputs = [kw.get("canary_buf", call.buf), call.wp, kw.get("log", call.log)]
    assert_rejected(ab, ValueError, rf"{re.escape(target)} has negative strides; kv-canary writes into it",
                    lambda: call(**kw), *outputs)


@pytest.mark.parametrize("target", ["pool_out", "out_of_range_count"])
def test_negative_stride_scatter_outputs_are_refused(ab, target):
    if ab.name.startswith("torch"):
        pytest.skip("torch tensors cannot have negative strides")
    args = dict(pool_out=ab.asarray(np.full((3, 4), -7, np.int32)), out_of_range_count=a64(ab, [0, 0]))
    args[target] = args[target][::-1]
    if target == "pool_out":
        args["out_of_range_count"] = args["out_of_range_count"][:1]
    assert_rejected(ab, ValueError, rf"^kv-canary: {target} has negative strides; kv-canary writes into it",
                    lambda: kc.scatter_req_token_ids(a64(ab, [1, 2]), a64(ab, [0, 2]), a64(ab, [1]), args["pool_out"],
                                                     out_of_range_count=args["out_of_range_count"]), *args.values())


def test_req_to_token_row_layouts(ab):
    """Rows must be contiguous; the row stride may be anything, 0 included (every row the same)."""
    call = PlanCall(ab)
    narrow = ab.asarray(np.zeros((4, 4), np.int32))[:, ::2]  # two columns 8 bytes apart
    assert_rejected(ab, ValueError, r"req_to_token must have contiguous rows, got strides \(16, 8\) bytes",
                    lambda: call((3, narrow)), *call.out)
    one_column = ab.asarray(linear_rtt(4, 3))[:, ::3]  # a single column: its stride does not matter
    vp, _ = call((1, a64(ab, [1, 1])), (3, one_column))
    assert ab.to_numpy(vp.verify_slot_indices)[:2].tolist() == [3, 6]
    row = ab.asarray(np.arange(16, dtype=np.int32) + 40)
    if ab.name.startswith("torch"):
        same_rows = row.expand(4, 16)
    else:
        xp = np if ab.name == "numpy" else pytest.importorskip("cupy")
        same_rows = xp.lib.stride_tricks.as_strided(row, (4, 16), (0, 4))
    vp, _ = call((3, same_rows))
    assert ab.to_numpy(vp.verify_slot_indices)[:7].tolist() == [40, 41, 42, 40, 41, 42, 43]


def test_req_to_token_rows_must_start_on_an_element():
    base = np.zeros(64, np.int32)
    odd = np.lib.stride_tricks.as_strided(base, (4, 2), (6, 4))  # rows 6 bytes apart: misaligned int32
    call = PlanCall(NUMPY)
    assert_rejected(NUMPY, ValueError, r"req_to_token must have contiguous rows, got strides \(6, 4\) bytes",
                    lambda: call((3, odd)), *call.out)


# ---- devices ------------------------------------------------------------------------------------------


def test_mixing_cpu_and_gpu_arrays_is_rejected(gpu_ab):
    buf = gpu_ab.asarray(canary(8))
    log = make_log(gpu_ab)
    vp = make_verify_plan(gpu_ab, [1], [0], [-1])
    host_vp = VerifyPlan(**{**vp.arrays(), "verify_slot_indices": np.array([1], np.int64)})
    before = snapshot(gpu_ab, buf, log)
    with pytest.raises(ValueError, match="pass every array of one call on the same device"):
        kc.verify(buf, host_vp, log=log)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(gpu_ab, buf, log)))
    with pytest.raises(ValueError, match="pass every array of one call on the same device"):
        kc.plan(np.array([1]), gpu_ab.asarray(np.array([1])), np.array([1]), linear_rtt(2, 4), verify_capacity=4)


class FakeDevices:
    """Pretends chosen NumPy arrays live on a GPU: placement_of reports them as CuPy (or CUDA torch)
    arrays on a device, so the one-device rule is checked on a CPU-only machine."""

    def __init__(self, monkeypatch):
        self.where = {}  # id(array) -> (framework, device)
        real = interop.placement_of
        monkeypatch.setattr(interop, "placement_of", lambda x, name: self._placement(real, x, name))

    def _placement(self, real, x, name):
        if id(x) in self.where:
            framework, device = self.where[id(x)]
            return interop.Placement("cupy", framework, device)
        return real(x, name)

    def put(self, x, device=0, framework="cupy"):
        self.where[id(x)] = (framework, device)
        return x


def test_mixing_cpu_and_gpu_arrays_is_rejected_before_anything_runs(monkeypatch):
    gpu = FakeDevices(monkeypatch)
    buf, log = canary(8), make_log(NUMPY)
    vp = make_verify_plan(NUMPY, [1], [0], [-1])
    vp = VerifyPlan(**{**vp.arrays(), "verify_slot_indices": gpu.put(np.array([1], np.int64))})
    assert_rejected(NUMPY, ValueError, r"^kv-canary: verify_plan\.verify_slot_indices is a cupy on cuda:0 array but "
                    r"canary_buf is a numpy array; pass every array of one call on the same device$",
                    lambda: kc.verify(buf, vp, log=log), buf, log)
    rtt = gpu.put(linear_rtt(2, 4), framework="torch")
    out = (VerifyPlan.allocate(4), WritePlan.allocate(1))
    assert_rejected(NUMPY, ValueError, r"req_to_token is a torch on cuda:0 array but req_pool_indices is a numpy array",
                    lambda: kc.plan(np.array([1]), np.array([1]), np.array([1]), rtt, verify_capacity=4, out=out), *out)


@pytest.mark.parametrize("op, name", [
    ("plan", "out[0].verify_slot_indices"),
    ("plan", "out[1].write_offsets"),
    ("write", "write_plan.write_offsets"),
    ("write", "chain_position_assert"),
])
def test_every_array_of_a_call_is_placed(monkeypatch, op, name):
    """Records and the chain-position flag are part of the one-device rule, under their own names."""
    gpu = FakeDevices(monkeypatch)
    if op == "plan":
        out = (VerifyPlan.allocate(4), WritePlan.allocate(1))
        record = out[int(name[4])]
        gpu.put(getattr(record, name.split(".")[1]))
        call = lambda: kc.plan(np.array([1]), np.array([1]), np.array([1]), linear_rtt(2, 4), verify_capacity=4, out=out)
        first, outputs = "req_pool_indices", out
    else:
        wp, flag = make_write_plan(NUMPY, [0, 1], [-1]), np.ones(1, np.int32)
        gpu.put(flag if name == "chain_position_assert" else wp.write_offsets)
        buf, log = canary(8), make_log(NUMPY)
        call = lambda: kc.write(buf, wp, *[np.array([v]) for v in (1, 0, 3)], log=log, chain_position_assert=flag)
        first, outputs = "canary_buf", (buf, wp, log)
    assert_rejected(NUMPY, ValueError, rf"^kv-canary: {re.escape(name)} is a cupy on cuda:0 array but {first} is a numpy array",
                    call, *outputs)


@pytest.mark.parametrize("op, name", [
    ("plan", "req_pool_indices"),
    ("write", "input_ids"),
    ("write", "expected_input_positions"),
    ("write", "chain_position_assert"),
    ("scatter", "flat_in"),
    ("scatter", "pool_out"),
])
def test_sparse_torch_tensors_are_refused(ab, op, name):
    if not ab.name.startswith("torch"):
        pytest.skip("sparse layouts are a torch thing")
    sparse = lambda a: ab.asarray(np.asarray(a)).to_sparse()
    if op == "plan":
        call = PlanCall(ab)
        assert_rejected(ab, TypeError, "^kv-canary: req_pool_indices must be a plain strided torch tensor, got layout torch.sparse_coo$",
                        lambda: call((0, sparse(np.array([1, 2])))), *call.out)
    elif op == "write":
        call = WriteCall(ab)
        kw = dict(expected_input_tokens=a64(ab, [1, 2]), expected_input_positions=a64(ab, [0, 1]),
                  chain_position_assert=ab.asarray(np.ones(1, np.int32)))
        kw[name] = sparse(ab.to_numpy(kw.get(name, call.ids)))
        assert_rejected(ab, TypeError, rf"^kv-canary: {name} must be a plain strided torch tensor, got layout torch.sparse_coo$",
                        lambda: call(**kw), *call.outputs())
    else:
        args = dict(flat_in=a64(ab, [1, 2]), offsets=a64(ab, [0, 2]), req_pool_indices=a64(ab, [1]),
                    pool_out=ab.asarray(np.zeros((2, 2), np.int32)))
        args[name] = args[name].to_sparse()
        assert_rejected(ab, TypeError, rf"^kv-canary: {name} must be a plain strided torch tensor, got layout torch.sparse_coo$",
                        lambda: kc.scatter_req_token_ids(**args), *([] if name == "pool_out" else [args["pool_out"]]))


def test_arrays_on_two_gpus_are_rejected(monkeypatch):
    gpu = FakeDevices(monkeypatch)
    buf = gpu.put(canary(8))
    wp = WritePlan(**{k: gpu.put(v) for k, v in make_write_plan(NUMPY, [0, 1], [-1]).arrays().items()})
    log = ViolationLog(**{k: gpu.put(v, device=1 if k == "ring" else 0) for k, v in make_log(NUMPY).arrays().items()})
    ids = [gpu.put(np.array([v], np.int64)) for v in (1, 0, 3)]
    assert_rejected(NUMPY, ValueError, r"log\.ring is a cupy on cuda:1 array but canary_buf is a cupy on cuda:0 array",
                    lambda: kc.write(buf, wp, *ids, log=log), buf, wp, log)


@pytest.mark.parametrize("placements, want", [
    ([("numpy", "numpy", None), ("numpy", "torch", None)], ("numpy", "torch", None)),
    ([("cupy", "cupy", 1), ("cupy", "torch", 1), ("cupy", "cupy", 1)], ("cupy", "torch", 1)),
    ([("cupy", "cupy", 0), ("cupy", "cupy", 0)], ("cupy", "cupy", 0)),
    ([("cupy", "torch", 0), ("cupy", "torch", 1)], "b is a torch on cuda:1 array but a is a torch on cuda:0 array"),
    ([("cupy", "cupy", 0), ("numpy", "torch", None)], "b is a torch array but a is a cupy on cuda:0 array"),
])
def test_common_placement(monkeypatch, placements, want):
    """One placement per call: the first array's device, torch as framework if any array is torch."""
    arrays = {name: np.zeros(1) for name in "abc"[: len(placements)]}
    by_id = {id(a): interop.Placement(*p) for a, p in zip(arrays.values(), placements)}
    monkeypatch.setattr(interop, "placement_of", lambda x, name: by_id[id(x)])
    arrays["skipped"] = None
    if isinstance(want, tuple):
        assert interop.common_placement(arrays) == interop.Placement(*want)
    else:
        with pytest.raises(ValueError, match=re.escape(want)):
            interop.common_placement(arrays)


def test_common_placement_needs_an_array():
    with pytest.raises(ValueError, match="no array arguments were given"):
        interop.common_placement({"a": None})
    with pytest.raises(ValueError, match="^kv-canary: no array arguments were given$"):
        interop.common_placement({})


def test_real_kv_source_must_start_16_byte_aligned(ab):
    base = ab.asarray(np.zeros(16 * 32 + 16, np.uint8))
    buf = ab.asarray(canary(16))
    log = make_log(ab)
    wp = make_write_plan(ab, [0, 1], [-1])
    args = (buf, wp, a64(ab, [1]), a64(ab, [0]), a64(ab, [3]))
    skewed = RealKvSource(base[8: 8 + 16 * 32].reshape(16, 32), 1, 32, 32)
    assert_rejected(ab, ValueError, r"real_kv_sources\[0\].tensor must start at a multiple of 16 bytes \(real KV is read 16 bytes at a time\), got an address 8 bytes past one",
                    lambda: kc.write(*args, log=log, real_kv_sources=(skewed,), real_kv_hash_mode=RealKvHashMode.ALL),
                    buf, wp, log)
    kc.write(*args, log=log, real_kv_sources=(skewed,))  # NONE never reads the source
    aligned = RealKvSource(base[16: 16 + 16 * 32].reshape(16, 32), 1, 32, 32)
    kc.write(*args, log=log, real_kv_sources=(aligned,), real_kv_hash_mode=RealKvHashMode.ALL)
    assert int(ab.to_numpy(log.kernel_run_counters)[0]) == 2


def test_read_only_numpy_outputs_are_refused_before_anything_is_written():
    import kvcanary_cupy as kc

    canary = kc.allocate_canary_buffer(8)
    canary.flags.writeable = False
    log = kc.ViolationLog.allocate(4)
    wp = kc.WritePlan.allocate(1)
    tokens = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="canary_buf is a read-only array"):
        kc.write(canary, wp, tokens, tokens, tokens + 3, log=log)
    assert int(log.kernel_run_counters.sum()) == 0
    vp = kc.VerifyPlan.allocate(1)
    vp.verify_num_valid[0] = 0
    kc.verify(canary, vp, log=log)  # verify only reads the canary: a read-only one is fine
    assert int(log.kernel_run_counters.sum()) == 1


def _read_only(a):
    a.flags.writeable = False
    return a


def test_read_only_numpy_outputs_of_every_op_are_refused_by_name_before_anything_is_counted():
    """Only NumPy arrays carry a read-only flag (CuPy has none; torch tensors cannot be read-only)."""
    import kvcanary_cupy as kc

    i64 = lambda *v: np.array(v, np.int64)
    count = np.zeros(1, np.int64)
    pool = np.zeros((4, 4), np.int32)
    with pytest.raises(ValueError, match="^kv-canary: pool_out is a read-only array"):
        kc.scatter_req_token_ids(i64(1, 2), i64(0, 2), i64(9), _read_only(pool.copy()), out_of_range_count=count)
    with pytest.raises(ValueError, match="^kv-canary: out_of_range_count is a read-only array"):
        kc.scatter_req_token_ids(i64(1, 2), i64(0, 2), i64(9), pool, out_of_range_count=_read_only(count.copy()))
    assert int(count[0]) == 0 and not pool.any()
    canary = kc.allocate_canary_buffer(4)
    canary[:] = 7
    with pytest.raises(ValueError, match="^kv-canary: out_of_range_count is a read-only array"):
        kc.move_pages(canary, i64(9, 1), i64(1, 2), out_of_range_count=_read_only(np.zeros(1, np.int64)))
    with pytest.raises(ValueError, match="^kv-canary: workspace is a read-only array"):
        kc.move_pages(canary, i64(1), i64(2), out_of_range_count=count, workspace=_read_only(np.zeros(4, np.int64)))
    assert int(count[0]) == 0 and (canary == 7).all()
    vp, wp = kc.VerifyPlan.allocate(4), kc.WritePlan.allocate(1)
    frozen = kc.VerifyPlan(**{k: _read_only(v) if k == "out_of_range_count" else v for k, v in vp.arrays().items()})
    with pytest.raises(ValueError, match=r"^kv-canary: out\[0\]\.out_of_range_count is a read-only array"):
        kc.plan(i64(-1), i64(0), i64(1), np.zeros((2, 4), np.int32), verify_capacity=4, out=(frozen, wp))
    assert int(wp.write_num_valid_reqs[0]) == 0
    log = kc.ViolationLog.allocate(4)
    log = kc.ViolationLog(**{k: _read_only(v) if k == "ring" else v for k, v in log.arrays().items()})
    with pytest.raises(ValueError, match=r"^kv-canary: log\.ring is a read-only array"):
        kc.verify(canary, vp, log=log)
    assert int(log.kernel_run_counters.sum()) == 0


@pytest.mark.parametrize("shared", [("violation_counters", "slot_run_counters"), ("kernel_run_counters", "out_of_range_counters"),
                                    ("violation_counters", "ring")])
def test_a_violation_log_whose_arrays_share_memory_is_refused(ab, shared):
    import kvcanary_cupy as kc

    log = kc.ViolationLog.allocate(4, like=ab.like)
    arrays = log.arrays()
    first, second = shared
    arrays[first] = arrays[second].reshape(-1)[: arrays[first].shape[0]] if second == "ring" else arrays[second]
    aliased = kc.ViolationLog(**arrays)
    vp = kc.VerifyPlan.allocate(1, like=ab.like)
    with pytest.raises(ValueError, match=rf"log\.({first}|{second}) and log\.({first}|{second}) overlap in memory"):
        kc.verify(kc.allocate_canary_buffer(4, like=ab.like), vp, log=aliased)
    assert not ab.to_numpy(log.kernel_run_counters).any()
    kc.verify(kc.allocate_canary_buffer(4, like=ab.like), vp, log=log)
    assert ab.to_numpy(log.kernel_run_counters).tolist()[:1] == [1]


def _none_cases(ab):
    import kvcanary_cupy as kc

    a = lambda *v: ab.asarray(np.array(v, np.int64))
    rtt = ab.asarray(np.zeros((4, 8), np.int32))
    buf = lambda: kc.allocate_canary_buffer(8, like=ab.like)
    log = kc.ViolationLog.allocate(8, like=ab.like)
    vp, wp = kc.VerifyPlan.allocate(8, like=ab.like), kc.WritePlan.allocate(1, like=ab.like)
    pool = ab.asarray(np.zeros((4, 4), np.int32))
    return {
        "prefix_lens": lambda: kc.plan(a(1), None, a(1), rtt, verify_capacity=8),
        "extend_seq_lens": lambda: kc.plan(a(1), a(1), None, rtt, verify_capacity=8),
        "ReqToToken.req_to_token": lambda: kc.plan(a(1), a(1), a(1), kc.ReqToToken(None), verify_capacity=8),
        "BlockTable.block_table": lambda: kc.plan(a(1), a(1), a(1), kc.BlockTable(None, 4), verify_capacity=8),
        "PagedKvIndices.kv_indices": lambda: kc.PagedKvIndices(a(0, 1), None, 4),
        "out[1].write_offsets": lambda: kc.plan(a(1), a(1), a(1), rtt, verify_capacity=8,
                                                out=(vp, kc.WritePlan(**{**wp.arrays(), "write_offsets": None}))),
        "input_ids": lambda: kc.write(buf(), wp, None, a(0), a(1), log=log),
        "positions": lambda: kc.write(buf(), wp, a(0), None, a(1), log=log),
        "out_cache_loc": lambda: kc.write(buf(), wp, a(0), a(0), None, log=log),
        "canary_buf[1]": lambda: kc.write([buf(), None], wp, a(0), a(0), a(1), log=log, kernel_kind=[0, 1]),
        "canary_buf": lambda: kc.verify(None, vp, log=log),
        "verify_plan": lambda: kc.verify(buf(), None, log=log),
        "log.ring": lambda: kc.verify(buf(), vp, log=kc.ViolationLog(**{**log.arrays(), "ring": None})),
        "RealKvSource.tensor": lambda: kc.RealKvSource(None, 1, 16, 16),
        "src_pages": lambda: kc.move_pages(buf(), None, a(1)),
        "dst_pages": lambda: kc.move_pages(buf(), a(1), None),
        "flat_in": lambda: kc.scatter_req_token_ids(None, a(0, 1), a(1), pool),
        "offsets": lambda: kc.scatter_req_token_ids(a(1), None, a(1), pool),
        "req_pool_indices": lambda: kc.scatter_req_token_ids(a(1), a(0, 1), None, pool),
        "pool_out": lambda: kc.scatter_req_token_ids(a(1), a(0, 1), a(1), None),
        "plan_and_verify canary_buf": lambda: kc.plan_and_verify(a(1), a(1), a(1), rtt, None, log=log, verify_capacity=8),
    }, log


NONE_CASES = tuple(_none_cases(get_backend_or_skip("numpy"))[0])


@pytest.mark.parametrize("name", NONE_CASES)
def test_none_for_a_required_array_is_a_type_error_naming_it(ab, name):
    """Issue 28 #10: None raised AttributeError or KeyError from inside the library."""
    cases, log = _none_cases(ab)
    arg = re.escape(name.removeprefix("plan_and_verify "))
    with pytest.raises(TypeError, match=(rf"^kv-canary: {arg} must be a VerifyPlan, got NoneType" if arg == "verify_plan"
                                         else rf"^kv-canary: {arg} is required: pass a NumPy array, a CuPy array or a PyTorch tensor, got None$")):
        cases[name]()
    assert not ab.to_numpy(log.kernel_run_counters).any()


def test_host_integers_the_kernels_narrow_are_refused_by_name():
    """Issue 28 #12: RealKvSource took any page_size, but the CUDA parameters hold it as int32."""
    wide = np.lib.stride_tricks.as_strided(np.zeros(16, np.uint8), (2, 2**36), (16, 0))  # rows wide enough, no memory
    for kw, name in ((dict(page_size=2**31, num_bytes_per_token=16), "page_size"),
                     (dict(page_size=1, num_bytes_per_token=2**32), "num_bytes_per_token")):
        with pytest.raises(ValueError, match=rf"^kv-canary: RealKvSource\.{name} must be at most 2147483647 \(the kernels take it as int32\)"):
            RealKvSource(wide, read_bytes=16, **kw)
    RealKvSource(wide, 2**31 - 1, 16, 16)
    import kvcanary_cupy as kc

    slot = np.lib.stride_tricks.as_strided(np.zeros(4, np.int64), (1, 2**31), (8, 8))  # never read: refused first
    with pytest.raises(ValueError, match=r"^kv-canary: canary_buf slot stride must be at most 2147483647 int64 fields"):
        kc.verify(slot, kc.VerifyPlan.allocate(1), log=kc.ViolationLog.allocate(4))


@pytest.mark.parametrize("kw, match", [
    (dict(kv_token_id_vs_position_offset=2**63), "kv_token_id_vs_position_offset must be at most 9223372036854775807"),
    (dict(kv_token_id_vs_position_offset=-(2**63) - 1), "kv_token_id_vs_position_offset must be >= -9223372036854775808"),
    (dict(swa_window_size=2**64), "swa_window_size must be at most 9223372036854775807"),
])
def test_plan_refuses_ints_past_int64_by_name(ab, kw, match):
    import kvcanary_cupy as kc

    a = lambda *v: ab.asarray(np.array(v, np.int64))
    lut = ab.asarray(np.arange(16, dtype=np.int64))
    with pytest.raises(ValueError, match="^kv-canary: " + re.escape(match)):
        kc.plan(a(1), a(1), a(1), ab.asarray(np.zeros((4, 8), np.int32)), verify_capacity=8, full_to_swa_index_mapping=lut, **kw)
    with pytest.raises(ValueError, match="^kv-canary: " + re.escape(match)):
        kc.CanaryPlanner.from_engine(kv_pool_size=16, max_running_requests=2, like=ab.like, full_to_swa_index_mapping=lut,
                                     **kw).plan(a(1), a(1), a(1), ab.asarray(np.zeros((4, 8), np.int32)))
