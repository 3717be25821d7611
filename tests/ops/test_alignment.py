"""Misaligned arrays are refused on every backend before anything is read or written.

The kernels read int64/int32 items whole: a canary buffer or an index array that does not start
at a multiple of its item size faults the GPU with cudaErrorMisalignedAddress, which is sticky and
ends the process.  The NumPy backend refuses the same arrays, so every backend accepts the same
inputs.  On the GPU these tests pass only if nothing was launched on the misaligned memory."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import VerifyPlan, ViolationLog, WritePlan
from canary_builders import a64, canary, linear_rtt, make_log, make_verify_plan, make_write_plan
from test_validation import assert_rejected

SLOTS, SLOT_BYTES = 100, 32


def address(ab, x) -> int:
    if ab.name == "numpy":
        return x.ctypes.data
    if ab.name == "cupy":
        return x.data.ptr
    return x.data_ptr()


def uint8_canary_at(ab, offset: int):
    """A zeroed uint8 ``[100, 32]`` canary view starting ``offset`` bytes into a 16-byte aligned allocation."""
    base = ab.asarray(np.zeros(SLOTS * SLOT_BYTES + 16, np.uint8))
    assert address(ab, base) % 16 == 0
    return base[offset: offset + SLOTS * SLOT_BYTES].reshape(SLOTS, SLOT_BYTES)


def misaligned(ab, values, offset: int):
    """``values`` in a native array starting ``offset`` bytes past a 16-byte aligned address.

    Bytes are copied as uint8 so no typed access touches the misaligned memory.
    """
    values = np.ascontiguousarray(values)
    size = values.nbytes
    if ab.name == "cupy":
        import cupy

        raw = cupy.zeros(size + 16, cupy.uint8)
        raw[offset: offset + size] = cupy.asarray(values.view(np.uint8).reshape(-1))
        return cupy.ndarray(values.shape, values.dtype, memptr=raw.data + offset)
    if ab.name not in ("numpy", "torch_cpu"):
        pytest.skip("torch cannot make a misaligned CUDA tensor of a wider dtype")
    raw = np.zeros(size + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    raw[start: start + size] = values.view(np.uint8).reshape(-1)
    if ab.name == "numpy":
        return raw[start: start + size].view(values.dtype).reshape(values.shape)
    import torch

    return torch.frombuffer(raw, dtype=getattr(torch, values.dtype.name), count=values.size, offset=start).reshape(values.shape)


def _write(ab, buf, log):
    kc.write(buf, make_write_plan(ab, [0, 2], [-1]), a64(ab, [7, 8]), a64(ab, [0, 1]), a64(ab, [3, 4]), log=log)


def test_uint8_canary_three_bytes_into_its_allocation_is_refused(ab):
    """The measured fault: uint8 [100, 32] starting 3 bytes into an allocation."""
    buf = uint8_canary_at(ab, 3)
    log = make_log(ab)
    match = r"canary_buf must start at a multiple of 8 bytes \(its slots are read as int64 fields\), got an address 3 bytes past one"
    assert_rejected(ab, ValueError, match, lambda: _write(ab, buf, log), buf, log)
    vp = make_verify_plan(ab, [3], [0], [-1])
    assert_rejected(ab, ValueError, match, lambda: kc.verify(buf, vp, log=log), buf, log)


def test_uint8_canary_at_an_aligned_offset_works(ab):
    buf = uint8_canary_at(ab, 8)
    log = make_log(ab)
    _write(ab, buf, log)
    slots = ab.to_numpy(buf).view(np.int64)
    assert slots[3, :2].tolist() == [7, 0] and slots[4, :2].tolist() == [8, 1]
    kc.verify(buf, make_verify_plan(ab, [3, 4], [0, 1], [-1, 3]), log=log)
    assert int(ab.to_numpy(log.write_index)[0]) == 0


def test_misaligned_int64_canary_is_refused(ab):
    buf = misaligned(ab, canary(16), 4)
    log = make_log(ab)
    assert_rejected(ab, ValueError, r"canary_buf must start at a multiple of 8 bytes .* got an address 4 bytes past one",
                    lambda: _write(ab, buf, log), log)
    assert (ab.to_numpy(buf) == 0).all()


@pytest.mark.parametrize("name", ["input_ids", "positions", "out_cache_loc", "write_plan.write_offsets",
                                  "write_plan.write_num_valid_reqs", "log.ring", "log.write_index"])
def test_misaligned_write_arguments_are_refused(ab, name):
    buf = ab.asarray(canary(16))
    log = make_log(ab)
    wp = make_write_plan(ab, [0, 2], [-1])
    tokens = {"input_ids": a64(ab, [7, 8]), "positions": a64(ab, [0, 1]), "out_cache_loc": a64(ab, [3, 4])}
    record, _, key = name.rpartition(".")
    owner = {"": tokens, "write_plan": wp.arrays(), "log": log.arrays()}[record]
    values = ab.to_numpy(owner[key])
    owner[key] = misaligned(ab, values, values.itemsize // 2)
    if record == "write_plan":
        wp = WritePlan(**owner)
    elif record == "log":
        log = ViolationLog(**owner)
    match = rf"{name.replace('.', '[.]')} must start at a multiple of {values.itemsize} bytes .* {values.itemsize // 2} bytes past one"
    assert_rejected(ab, ValueError, match, lambda: kc.write(buf, wp, *tokens.values(), log=log), buf, wp, log)


@pytest.mark.parametrize("name", ["prefix_lens", "req_to_token", "out[0].verify_slot_indices"])
def test_misaligned_plan_arguments_are_refused(ab, name):
    args = {"req_pool_indices": a64(ab, [1, 2]), "prefix_lens": a64(ab, [3, 4]), "extend_seq_lens": a64(ab, [1, 1]),
            "req_to_token": ab.asarray(linear_rtt(4, 16))}
    vp, wp = VerifyPlan.allocate(32, like=ab.like), WritePlan.allocate(2, like=ab.like)
    if name == "prefix_lens":
        args[name] = misaligned(ab, np.array([3, 4], np.int64), 4)
    elif name == "req_to_token":
        args[name] = misaligned(ab, linear_rtt(4, 16), 2)
    else:
        vp = VerifyPlan(**{**vp.arrays(), "verify_slot_indices": misaligned(ab, np.zeros(32, np.int64), 4)})
    match = rf"{name.replace('[', '.').replace(']', '.')} must start at a multiple of {4 if name == 'req_to_token' else 8} bytes"
    assert_rejected(ab, ValueError, match, lambda: kc.plan(*args.values(), verify_capacity=32, out=(vp, wp)), vp, wp)


def test_misaligned_scatter_arguments_are_refused(ab):
    pool = ab.asarray(np.full((3, 4), -7, np.int32))
    flat = misaligned(ab, np.array([1, 2, 3], np.int64), 4)
    assert_rejected(ab, ValueError, r"flat_in must start at a multiple of 8 bytes",
                    lambda: kc.scatter_req_token_ids(flat, a64(ab, [0, 3]), a64(ab, [1]), pool), pool)
    bad_pool = misaligned(ab, np.full((3, 4), -7, np.int32), 2)
    assert_rejected(ab, ValueError, r"pool_out must start at a multiple of 4 bytes",
                    lambda: kc.scatter_req_token_ids(a64(ab, [1, 2, 3]), a64(ab, [0, 3]), a64(ab, [1]), bad_pool), bad_pool)
