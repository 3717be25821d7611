"""CanaryCapacities / CanaryPlanner: clamped capacities, buffers reused at fixed addresses."""

import os
import warnings

import numpy as np
import pytest

from kvcanary_cupy import CanaryCapacities, CanaryCapacityWarning, CanaryPlanner
from canary_builders import assert_plan_equals_oracle, host, i64, linear_rtt, oracle_plan

INT32_MAX = 2**31 - 1


def test_capacities_from_engine():
    caps = CanaryCapacities.from_engine(kv_pool_size=1000, max_running_requests=64, req_to_token_pool_size=128,
                                        cuda_graph_max_bs=160)
    assert (caps.verify_capacity, caps.write_req_capacity, caps.notes) == (3000, 160, ())
    caps = CanaryCapacities.from_engine(kv_pool_size=10, max_running_requests=4, verify_headroom=1)
    assert (caps.verify_capacity, caps.write_req_capacity) == (10, 4)


def test_negative_capacities_are_clamped_to_zero():
    caps = CanaryCapacities.from_engine(kv_pool_size=10 - 20, max_running_requests=3 - 5)
    assert (caps.verify_capacity, caps.write_req_capacity) == (0, 0)
    assert any("kv_pool_size=-10 is negative; clamped to 0" in n for n in caps.notes)
    assert any("max_running_requests=-2 is negative; clamped to 0" in n for n in caps.notes)


def test_int32_overflow_is_clamped():
    caps = CanaryCapacities.from_engine(kv_pool_size=2**30, max_running_requests=2**40)
    assert (caps.verify_capacity, caps.write_req_capacity) == (INT32_MAX, INT32_MAX)
    assert any("overflows int32" in n for n in caps.notes)


@pytest.mark.parametrize("name", ["kv_pool_size", "max_running_requests", "req_to_token_pool_size", "cuda_graph_max_bs"])
def test_int32_max_itself_is_not_clamped(name):
    """2**31 - 1 fits int32: no clamp, no note (a planner built from it would not warn)."""
    numbers = {"kv_pool_size": 1, "max_running_requests": 1, "verify_headroom": 1, name: INT32_MAX}
    caps = CanaryCapacities.from_engine(**numbers)
    want_verify = INT32_MAX if name == "kv_pool_size" else 1
    want_write = 1 if name == "kv_pool_size" else INT32_MAX
    assert (caps.verify_capacity, caps.write_req_capacity, caps.notes) == (want_verify, want_write, ())
    caps = CanaryCapacities.from_engine(**{**numbers, name: INT32_MAX + 1})
    assert (caps.verify_capacity, caps.write_req_capacity) == (want_verify, want_write)
    assert caps.notes[0] == f"{name}={INT32_MAX + 1} overflows int32; clamped to {INT32_MAX}"


def test_zero_is_not_clamped():
    caps = CanaryCapacities.from_engine(kv_pool_size=0, max_running_requests=0, verify_headroom=0)
    assert (caps.verify_capacity, caps.write_req_capacity, caps.notes) == (0, 0, ())


def test_capacities_reject_non_ints():
    with pytest.raises(TypeError, match="kv_pool_size must be an int, got float"):
        CanaryCapacities.from_engine(kv_pool_size=1.5, max_running_requests=1)


def test_planner_warns_once_for_clamped_capacities():
    # two clamps (one negative, one int32 overflow) that still give small buffers
    caps = CanaryCapacities.from_engine(kv_pool_size=0, verify_headroom=2**40, max_running_requests=4,
                                        req_to_token_pool_size=10 - 20)
    assert (caps.verify_capacity, caps.write_req_capacity) == (0, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner = CanaryPlanner(caps)
    relevant = [w for w in caught if issubclass(w.category, CanaryCapacityWarning)]
    assert len(relevant) == 1
    message = str(relevant[0].message)
    assert "req_to_token_pool_size=-10 is negative" in message and "verify_headroom=1099511627776 overflows int32" in message
    assert (planner.verify_plan.capacity, planner.write_plan.capacity) == (0, 4)


def test_planner_without_clamps_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CanaryPlanner.from_engine(kv_pool_size=16, max_running_requests=4)


def test_planner_rejects_a_non_capacities_object():
    with pytest.raises(TypeError, match="capacities must be a CanaryCapacities, got dict"):
        CanaryPlanner({"verify_capacity": 1})


def _buffers(ab, planner):
    return {k: v for rec in (planner.verify_plan, planner.write_plan) for k, v in rec.arrays().items()}


def _address(x):
    if hasattr(x, "data_ptr"):
        return x.data_ptr()
    if hasattr(x, "__array_interface__"):
        return x.__array_interface__["data"][0]
    return x.data.ptr


def test_planner_reuse_with_shrinking_batches(ab):
    planner = CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=8, like=ab.like)
    bufs = _buffers(ab, planner)
    addresses = {k: _address(v) for k, v in bufs.items()}
    rtt = linear_rtt(10, 16)
    batches = [
        ([1, 2, 3, 4, 5, 6, 7, 8], [3] * 8, [2] * 8),
        ([4, 0, 6], [1, 99, 2], [1, 99, 1]),
        ([2], [0], [5]),
        ([], [], []),
    ]
    for rp, prefix, extend in batches:
        vp, wp = planner.plan(ab.asarray(i64(rp)), ab.asarray(i64(prefix)), ab.asarray(i64(extend)), ab.asarray(rtt))
        assert vp is planner.verify_plan and wp is planner.write_plan
        want = oracle_plan(rp, prefix, extend, rtt, verify_capacity=192, write_req_capacity=8)
        assert_plan_equals_oracle(host(ab, vp), host(ab, wp), want)
        assert {k: _address(v) for k, v in _buffers(ab, planner).items()} == addresses


def test_planner_accepts_numpy_inputs_on_any_backend(ab):
    planner = CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=4, like=ab.like)
    vp, wp = planner.plan(i64([1, 2]), i64([2, 3]), i64([1, 1]), linear_rtt(4, 16))
    assert type(vp.verify_slot_indices) is type(ab.like)
    assert ab.to_numpy(wp.write_seed_slot_indices).tolist() == [17, 34, -1, -1]


def test_numpy_planner_accepts_torch_inputs():
    torch = pytest.importorskip("torch")
    planner = CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=4)
    t = lambda a: torch.from_numpy(np.asarray(a))
    vp, wp = planner.plan(t(i64([1, 2])), t(i64([2, 3])), t(i64([1, 1])), t(linear_rtt(4, 16)))
    assert isinstance(vp.verify_slot_indices, np.ndarray)
    assert wp.write_seed_slot_indices.tolist() == [17, 34, -1, -1]


def test_planner_swa_and_expected_tokens(ab):
    lut = np.arange(100, dtype=np.int64) + 1000
    planner = CanaryPlanner.from_engine(kv_pool_size=10, max_running_requests=2, like=ab.like, swa_window_size=2,
                                        full_to_swa_index_mapping=ab.asarray(lut), kv_token_id_vs_position_offset=1)
    pool = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)
    vp, wp = planner.plan(i64([1]), i64([5]), i64([1]), linear_rtt(4, 16), req_to_verify_expected_tokens=pool,
                          req_to_verify_expected_tokens_valid_lens=i64([5]))
    n = int(ab.to_numpy(vp.verify_num_valid)[0])
    assert ab.to_numpy(vp.verify_slot_indices)[:n].tolist() == [1019, 1020]
    assert ab.to_numpy(vp.verify_expected_tokens)[:n].tolist() == [20, -1]  # p+1 < valid_lens only
    assert ab.to_numpy(wp.write_seed_slot_indices).tolist() == [1020, -1]


@pytest.mark.parametrize("build", ["init", "from_engine"])
def test_planner_defaults_are_a_full_group_without_offset(build):
    """No window, no LUT, token ids at their own positions, and out-of-range values counted (not raised)."""
    caps = dict(kv_pool_size=16, max_running_requests=2)
    planner = CanaryPlanner(CanaryCapacities.from_engine(**caps)) if build == "init" else CanaryPlanner.from_engine(**caps)
    pool = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)
    vp, wp = planner.plan(i64([1, 2]), i64([3, 17]), i64([1, 1]), linear_rtt(4, 16), req_to_verify_expected_tokens=pool,
                          req_to_verify_expected_tokens_valid_lens=i64([16, 16]))
    n = int(vp.verify_num_valid[0])
    assert vp.verify_slot_indices[:n].tolist() == [16, 17, 18] + list(range(32, 48))
    assert vp.verify_expected_tokens[:n].tolist() == [16, 17, 18] + list(range(32, 48))
    assert int(vp.out_of_range_count[0]) == 1  # prefix 17 > 16


@pytest.mark.skipif("MUTANT_UNDER_TEST" in os.environ, reason="mutmut's trampolines add a stack frame")
def test_capacity_warnings_point_at_the_caller():
    with pytest.warns(CanaryCapacityWarning, match="clamped") as caught:
        planner = CanaryPlanner(CanaryCapacities.from_engine(kv_pool_size=-1, max_running_requests=1))
    assert caught[0].filename == __file__
    planner.plan(i64([1]), i64([2]), i64([1]), linear_rtt(2, 4))
    with pytest.warns(CanaryCapacityWarning, match="overflowed") as caught:
        planner.verify_overflowed()
    assert caught[0].filename == __file__


def test_clamp_notes_name_what_was_clamped():
    caps = CanaryCapacities.from_engine(kv_pool_size=2**30, max_running_requests=-3, verify_headroom=3)
    assert caps.notes == (f"verify_capacity (verify_headroom * kv_pool_size)={3 * 2**30} overflows int32; clamped to {INT32_MAX}",
                          "max_running_requests=-3 is negative; clamped to 0")
    with pytest.warns(CanaryCapacityWarning) as caught:
        CanaryPlanner(caps)
    assert str(caught[0].message) == "kv-canary: CanaryPlanner capacities were clamped: " + "; ".join(caps.notes)


def test_planner_rejects_batches_above_capacity(ab):
    planner = CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=2, like=ab.like)
    before = {k: ab.to_numpy(v).copy() for k, v in _buffers(ab, planner).items()}
    with pytest.raises(ValueError, match="bs=3 exceeds write_req_capacity=2"):
        planner.plan(i64([1, 2, 3]), i64([1, 1, 1]), i64([1, 1, 1]), linear_rtt(4, 16))
    for k, v in _buffers(ab, planner).items():
        assert np.array_equal(ab.to_numpy(v), before[k]), k


def test_verify_overflowed_warns_once(ab):
    planner = CanaryPlanner.from_engine(kv_pool_size=2, max_running_requests=2, verify_headroom=1, like=ab.like)
    rtt = linear_rtt(4, 16)
    planner.plan(i64([1]), i64([2]), i64([1]), rtt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planner.verify_overflowed() is False
    planner.plan(i64([1, 2]), i64([2, 1]), i64([1, 1]), rtt)
    with pytest.warns(CanaryCapacityWarning) as caught:
        assert planner.verify_overflowed() is True
    assert [str(w.message) for w in caught] == [
        "kv-canary: the verify plan overflowed verify_capacity=2: this step's verify is skipped; "
        "raise verify_headroom or kv_pool_size in CanaryCapacities.from_engine"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planner.verify_overflowed() is True  # no second warning
    assert int(ab.to_numpy(planner.verify_plan.verify_num_valid)[0]) == 2


def test_zero_capacity_planner_plans_empty_batches(ab):
    with pytest.warns(CanaryCapacityWarning):
        planner = CanaryPlanner.from_engine(kv_pool_size=-1, max_running_requests=-1, like=ab.like)
    vp, wp = planner.plan(i64([]), i64([]), i64([]), linear_rtt(2, 4))
    assert ab.to_numpy(wp.write_offsets).tolist() == [0]
    assert ab.to_numpy(vp.enable).tolist() == [1]
