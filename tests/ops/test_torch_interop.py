"""PyTorch tensors: zero-copy in place writes, requires_grad, strides, mixing with NumPy."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy import RealKvHashMode, RealKvSource, VerifyPlan, WritePlan  # noqa: E402
from canary_builders import (  # noqa: E402
    ANCHOR_S,
    a64,
    canary,
    fold_strips,
    i64,
    kv_bytes,
    linear_rtt,
    make_log,
    make_verify_plan,
    make_write_plan,
    signed,
)
from conftest import get_backend_or_skip  # noqa: E402


@pytest.fixture(params=["torch_cpu", "torch_cuda"])
def tab(request):
    """The torch array backends (CUDA skips without a GPU)."""
    return get_backend_or_skip(request.param)


def test_writes_land_in_the_callers_tensors(tab):
    buf = tab.asarray(canary(8))
    ptr = buf.data_ptr()
    log = make_log(tab)
    kc.write(buf, make_write_plan(tab, [0, 1], [-1]), a64(tab, [42]), a64(tab, [0]), a64(tab, [3]), log=log)
    assert buf.data_ptr() == ptr
    assert buf[3].tolist() == [42, 0, ANCHOR_S, 0]
    assert log.slot_run_counters[0].item() == 1 and log.kernel_run_counters[0].item() == 1


def test_uint8_tensor_buffer_is_written_in_place(tab):
    raw = tab.asarray(np.zeros((8, 32), np.uint8))
    kc.write(raw, make_write_plan(tab, [0, 1], [-1]), a64(tab, [42]), a64(tab, [0]), a64(tab, [3]), log=make_log(tab))
    assert raw[3].cpu().numpy().view(np.int64).tolist() == [42, 0, ANCHOR_S, 0]


def test_plan_out_tensors_are_filled_in_place(tab):
    out = (VerifyPlan.allocate(16, like=tab.like), WritePlan.allocate(2, like=tab.like))
    ptrs = [a.data_ptr() for rec in out for a in rec.arrays().values()]
    vp, wp = kc.plan(a64(tab, [1, 2]), a64(tab, [2, 1]), a64(tab, [1, 1]), tab.asarray(linear_rtt(3, 8)),
                     verify_capacity=16, out=out)
    assert [a.data_ptr() for rec in (vp, wp) for a in rec.arrays().values()] == ptrs
    assert out[0].verify_num_valid.item() == 3
    assert out[1].write_seed_slot_indices.tolist() == [9, 16]


def test_plan_returns_torch_tensors_for_torch_inputs(tab):
    vp, wp = kc.plan(a64(tab, [1]), a64(tab, [2]), a64(tab, [1]), tab.asarray(linear_rtt(3, 8)), verify_capacity=4)
    for rec in (vp, wp):
        for key, arr in rec.arrays().items():
            assert isinstance(arr, torch.Tensor) and arr.device == tab.like.device, key
    assert vp.verify_slot_indices[:2].tolist() == [8, 9]


def test_inputs_requiring_grad_are_read(tab):
    data = kv_bytes(8, 64, 3)
    weights = tab.asarray(data.view(np.float32).copy()).requires_grad_(True)  # like a model's KV tensor
    src = (RealKvSource(weights, 1, 64, 64),)
    buf = tab.asarray(canary(8))
    kc.write(buf, make_write_plan(tab, [0, 1], [-1]), a64(tab, [1]), a64(tab, [0]), a64(tab, [5]), log=make_log(tab),
             real_kv_sources=src, real_kv_hash_mode=RealKvHashMode.ALL)
    assert buf[5, 3].item() == signed(fold_strips([data[5].tobytes()]))
    assert weights.requires_grad and weights.grad is None


def test_outputs_requiring_grad_are_rejected(tab):
    vp = make_verify_plan(tab, [1], [0], [-1])
    log = make_log(tab)
    bad = kc.ViolationLog(**{**log.arrays(), "slot_run_counters": torch.zeros(12, device=tab.like.device,
                                                                              requires_grad=True)})
    with pytest.raises(ValueError, match="log.slot_run_counters is a torch tensor that requires grad"):
        kc.verify(tab.asarray(canary(4)), vp, log=bad)
    assert log.kernel_run_counters.sum().item() == 0


def test_non_contiguous_inputs_are_copied(tab):
    spread = lambda values: a64(tab, [v for x in values for v in (x, -99)])[::2]
    buf = tab.asarray(canary(8))
    log = make_log(tab)
    ids, pos, loc = spread([7, 8]), spread([0, 1]), spread([2, 3])
    assert not ids.is_contiguous()
    kc.write(buf, make_write_plan(tab, [0, 2], [-1]), ids, pos, loc, log=log)
    assert buf[2:4, 0].tolist() == [7, 8] and buf[2:4, 1].tolist() == [0, 1]
    assert ids.tolist() == [7, 8]  # the caller's strided view is left alone
    vp, _ = kc.plan(spread([1, 2]), spread([3, 1]), spread([0, 0]), tab.asarray(linear_rtt(3, 8)), verify_capacity=8)
    assert vp.verify_num_valid.item() == 4


def test_non_contiguous_outputs_are_rejected(tab):
    log = make_log(tab)
    ids, pos, loc = a64(tab, [1]), a64(tab, [0]), a64(tab, [1])
    wp = make_write_plan(tab, [0, 1], [-1])
    strided = tab.asarray(canary(16))[::2]
    with pytest.raises(ValueError, match="canary_buf must be contiguous"):
        kc.write(strided, wp, ids, pos, loc, log=log)
    transposed = tab.asarray(np.zeros((4, 8), np.int64)).t()
    with pytest.raises(ValueError, match="canary_buf must be contiguous"):
        kc.write(transposed, wp, ids, pos, loc, log=log)
    out = (VerifyPlan.allocate(4, like=tab.like), WritePlan.allocate(1, like=tab.like))
    bad = WritePlan(**{**out[1].arrays(), "write_offsets": a64(tab, [0, 0, 0, 0])[::2]})
    with pytest.raises(ValueError, match=r"out\[1\].write_offsets must be contiguous"):
        kc.plan(a64(tab, [1]), a64(tab, [1]), a64(tab, [1]), tab.asarray(linear_rtt(2, 4)), verify_capacity=4,
                out=(out[0], bad))
    assert log.kernel_run_counters.sum().item() == 0


def test_torch_tensor_on_an_unsupported_device_is_rejected():
    with pytest.raises(TypeError, match="req_pool_indices is a torch tensor on device meta"):
        kc.plan(torch.zeros(1, dtype=torch.int64, device="meta"), i64([1]), i64([1]), linear_rtt(2, 4), verify_capacity=4)


# ---- mixing NumPy and CPU torch tensors in one call -------------------------------------------------


def test_mixed_numpy_and_torch_cpu_write_and_verify():
    buf = canary(8)  # NumPy buffer, torch plan and inputs
    t = lambda a: torch.from_numpy(np.asarray(a, np.int64))
    wp = WritePlan(write_offsets=t([0, 2]), write_seed_slot_indices=t([-1]),
                   write_num_valid_reqs=torch.tensor([1], dtype=torch.int32), verify_offsets=t([0, 0]))
    log = kc.ViolationLog.allocate()
    kc.write(buf, wp, t([5, 6]), i64([0, 1]), t([1, 2]), log=log)
    assert buf[1].tolist() == [5, 0, ANCHOR_S, 0]
    tbuf = torch.from_numpy(buf)  # shares memory with buf
    vp = kc.VerifyPlan.allocate(2)
    vp.verify_slot_indices[:] = [1, 2]
    vp.verify_expected_positions[:] = [0, 1]
    vp.verify_prev_slot_indices[:] = [-1, 1]
    vp.verify_num_valid[0] = 2
    kc.verify(tbuf, vp, log=log)
    assert int(log.write_index[0]) == 0 and log.slot_run_counters[0] == 4


def test_mixed_numpy_and_torch_cpu_plan():
    rtt = torch.from_numpy(linear_rtt(3, 8))
    out = (VerifyPlan.allocate(8, like=rtt), WritePlan.allocate(2))  # torch and NumPy records
    vp, wp = kc.plan(i64([1, 2]), torch.tensor([2, 1]), i64([1, 1]), rtt, verify_capacity=8, out=out)
    assert vp.verify_slot_indices[:3].tolist() == [8, 9, 16]
    assert wp.write_seed_slot_indices.tolist() == [9, 16]
    assert isinstance(wp.write_offsets, np.ndarray) and isinstance(vp.enable, torch.Tensor)


def test_mixed_plan_without_out_allocates_like_req_to_token():
    """README: plan with out=None allocates in the framework of req_to_token."""
    t = lambda a: torch.from_numpy(np.asarray(a, np.int64))
    vp, wp = kc.plan(t([1]), t([2]), t([1]), linear_rtt(3, 8), verify_capacity=4)
    assert isinstance(vp.verify_slot_indices, np.ndarray) and isinstance(wp.write_offsets, np.ndarray)
    vp, wp = kc.plan(i64([1]), i64([2]), i64([1]), torch.from_numpy(linear_rtt(3, 8)), verify_capacity=4)
    assert isinstance(vp.verify_slot_indices, torch.Tensor) and isinstance(wp.write_offsets, torch.Tensor)
    assert vp.verify_slot_indices[:2].tolist() == [8, 9] and wp.write_seed_slot_indices.tolist() == [9]


def test_record_views_follow_a_tensor_whose_storage_changed(tab):
    """Views of a record's tensors are reused across calls, but never once the tensor moved."""
    log = kc.ViolationLog.allocate(4, like=tab.like)
    buf = tab.asarray(canary(8))
    # slot 3 is empty: expecting position 5 there is a position violation (chain head: anchor too)
    vp = make_verify_plan(tab, slots=[3], positions=[5], prevs=[-1])
    kc.verify(buf, vp, log=log)
    kc.verify(buf, vp, log=log)
    assert tab.to_numpy(log.write_index)[0] == 2
    old_ring = log.ring.clone()
    log.ring.set_(torch.zeros_like(old_ring))  # the same tensor object on new storage
    kept = log.ring.data_ptr()
    log.write_index.zero_()
    kc.verify(buf, vp, log=log)
    assert log.ring.data_ptr() == kept
    np.testing.assert_array_equal(tab.to_numpy(log.ring)[0], tab.to_numpy(old_ring)[0])  # the row landed anew
    np.testing.assert_array_equal(tab.to_numpy(log.ring)[1:], 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_torch_dtypes_numpy_lacks_are_type_errors_naming_the_argument(tab, dtype):
    """bf16 / fp8 where integers are expected: a TypeError naming the argument, not DLPack's RuntimeError."""
    dt = getattr(torch, dtype)
    odd = lambda a: tab.asarray(np.asarray(a, np.float32)).to(dt)
    log = make_log(tab)
    with pytest.raises(TypeError, match=rf"^kv-canary: prefix_lens is a torch tensor of dtype torch.{dtype}, which kv-canary cannot read"):
        kc.plan(a64(tab, [1]), odd([1]), a64(tab, [1]), tab.asarray(linear_rtt(2, 4)), verify_capacity=4)
    wp = make_write_plan(tab, [0, 1], [-1])
    with pytest.raises(TypeError, match=rf"^kv-canary: input_ids is a torch tensor of dtype torch.{dtype}"):
        kc.write(tab.asarray(canary(8)), wp, odd([7]), a64(tab, [0]), a64(tab, [3]), log=log)
    with pytest.raises(TypeError, match=rf"^kv-canary: canary_buf is a torch tensor of dtype torch.{dtype}"):
        kc.verify(odd(np.zeros((8, 4))), make_verify_plan(tab, [1], [0], [-1]), log=log)
    log.write_index.data = log.write_index.data.to(dt)  # a record's tensor too
    with pytest.raises(TypeError, match=rf"^kv-canary: log.write_index is a torch tensor of dtype torch.{dtype}"):
        kc.verify(tab.asarray(canary(8)), make_verify_plan(tab, [1], [0], [-1]), log=log)


def test_record_views_follow_a_tensor_reviewed_with_another_dtype(tab):
    """The kept view of a record's tensor is keyed by its dtype too: the same address re-viewed as
    another dtype is checked again instead of reusing the stale int32 view."""
    log = kc.ViolationLog.allocate(4, like=tab.like)
    buf = tab.asarray(canary(8))
    vp = make_verify_plan(tab, slots=[3], positions=[5], prevs=[-1])
    kc.verify(buf, vp, log=log)
    ptr = log.write_index.data_ptr()
    log.write_index.data = log.write_index.data.view(torch.float32)  # same tensor, address, shape and strides
    assert log.write_index.data_ptr() == ptr
    with pytest.raises(TypeError, match="^kv-canary: log.write_index must have dtype int32, got float32"):
        kc.verify(buf, vp, log=log)
    log.write_index.data = log.write_index.data.view(torch.int32)
    kc.verify(buf, vp, log=log)
    assert tab.to_numpy(log.write_index)[0] == 2
