"""The free functions' validation cache changes no byte and no error.

Each test runs the same calls twice, once remembering what was validated and once under
``KVCANARY_FULL_VALIDATION=1`` (every call checks everything), and compares the outputs byte for byte
and the errors message for message, including after an in-place change of a remembered array.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import outcome
from kvcanary_cupy.validation_cache import FULL_VALIDATION_ENV

NUM_SLOTS, ROWS, COLS = 256, 6, 32


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    rtt = rng.permutation(np.arange(1, NUM_SLOTS))[: ROWS * COLS].reshape(ROWS, COLS).astype(np.int32)
    rp = np.array([1, 3, 4], np.int64)
    prefix = rng.integers(0, 12, 3).astype(np.int64)
    extend = rng.integers(0, 4, 3).astype(np.int64)
    total = int(extend.sum())
    loc = np.concatenate([rtt[r, p:p + e] for r, p, e in zip(rp, prefix, extend)]).astype(np.int64)
    pos = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)]).astype(np.int64)
    ids = rng.integers(0, 1000, total).astype(np.int64)
    return rp, prefix, extend, rtt, ids, pos, loc


class _Loop:
    """A script's loop: long-lived canary, plans, log and table; new per-step arrays each step."""

    def __init__(self, ab):
        self.ab = ab
        self.rtt = ab.asarray(_inputs(0)[3])
        self.canary = kc.allocate_canary_buffer(NUM_SLOTS, like=ab.like)
        self.vp = kc.VerifyPlan.allocate(64, like=ab.like)
        self.wp = kc.WritePlan.allocate(4, like=ab.like)
        self.log = kc.ViolationLog.allocate(64, like=ab.like)

    def step(self, seed: int):
        ab = self.ab
        rp, prefix, extend, _, ids, pos, loc = (ab.asarray(a) for a in _inputs(seed))
        kc.plan(rp, prefix, extend, self.rtt, verify_capacity=64, out=(self.vp, self.wp))
        kc.verify(self.canary, self.vp, log=self.log)
        kc.write(self.canary, self.wp, ids, pos, loc, log=self.log)

    def state(self) -> list:
        self.ab.synchronize()
        valid = int(self.ab.to_numpy(self.vp.verify_num_valid)[0])
        entries = [self.ab.to_numpy(a)[:valid] for a in self.vp.arrays().values()][:4]  # the rest is unspecified
        arrays = [self.canary, *list(self.vp.arrays().values())[4:], *self.wp.arrays().values(),
                  *(a for k, a in self.log.arrays().items() if k != "ring")]
        # the ring's rows, as a set: on a GPU, concurrent threads take ring rows in any order
        ring = sorted(map(bytes, self.ab.to_numpy(self.log.ring)))
        return [a.tobytes() for a in entries] + [self.ab.to_numpy(a).tobytes() for a in arrays] + ring


def test_cached_calls_give_the_bytes_of_uncached_ones(ab, monkeypatch):
    cached = _Loop(ab)
    for seed in range(6):
        cached.step(seed)
    for record in (cached.vp, cached.wp):
        assert record.__dict__.get("_kvcanary_validated"), "the repeated calls were remembered"
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    uncached = _Loop(ab)
    for seed in range(6):
        uncached.step(seed)
    assert "_kvcanary_validated" not in uncached.vp.__dict__
    assert "_kvcanary_validated" not in uncached.wp.__dict__
    assert cached.state() == uncached.state()
    assert cached.log.read().total_violations > 0  # the steps verified slots never written


def _both(monkeypatch, call):
    """The outcome of ``call`` with the cache warm, then with every check run."""
    cached = outcome(call)
    with monkeypatch.context() as mp:
        mp.setenv(FULL_VALIDATION_ENV, "1")
        uncached = outcome(call)
    return cached, uncached


def _warm(loop):
    loop.step(1)
    loop.step(2)


def test_a_bad_per_step_array_after_a_remembered_call_gets_the_same_error(ab, monkeypatch):
    loop = _Loop(ab)
    _warm(loop)
    rp, prefix, extend, _, ids, pos, loc = _inputs(3)
    bad = ab.asarray(prefix.astype(np.int32))
    short = ab.asarray(ids[:-1]) if ids.size else ab.asarray(np.zeros(1, np.int64))
    calls = [
        lambda: kc.plan(ab.asarray(rp), bad, ab.asarray(extend), loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp)),
        lambda: kc.plan(ab.asarray(rp), None, ab.asarray(extend), loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp)),
        lambda: kc.plan(ab.asarray(np.arange(6)), ab.asarray(np.zeros(6, np.int64)), ab.asarray(np.zeros(6, np.int64)),
                        loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp)),  # bs > write_req_capacity
        lambda: kc.plan(ab.asarray(rp), ab.asarray(prefix), ab.asarray(extend), loop.rtt, verify_capacity=32,
                        out=(loop.vp, loop.wp)),  # another capacity
        lambda: kc.plan(ab.asarray(rp), ab.asarray(prefix), ab.asarray(extend), loop.rtt, verify_capacity=64.0,
                        out=(loop.vp, loop.wp)),
        lambda: kc.write(loop.canary, loop.wp, short, ab.asarray(pos), ab.asarray(loc), log=loop.log),
        lambda: kc.write(loop.canary, loop.wp, ab.asarray(ids.astype(np.int16)), ab.asarray(pos), ab.asarray(loc),
                         log=loop.log),
        lambda: kc.write(loop.canary, loop.wp, ab.asarray(ids), ab.asarray(pos), ab.asarray(loc), log=loop.log,
                         kernel_kind=99),
        lambda: kc.verify(loop.canary, loop.vp, log=loop.log, kernel_kind=1.0),
        lambda: kc.verify(loop.canary, loop.vp, log=loop.log, kernel_kind=True),
    ]
    if ab.is_gpu:  # per-step arrays on the host beside remembered device arrays
        calls.append(lambda: kc.plan(rp, prefix, extend, loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp)))
        calls.append(lambda: kc.write(loop.canary, loop.wp, ids, pos, loc, log=loop.log))
    for i, call in enumerate(calls):
        cached, uncached = _both(monkeypatch, call)
        assert cached is not None and cached == uncached, i


def _changes(ab, loop):
    """In-place changes of remembered arrays (shape, strides, address, version, flags) this
    framework allows, each as a function making it."""
    name = ab.name
    changes = {}
    if name in ("numpy", "cupy"):
        def reshape_canary():
            loop.canary.shape = (NUM_SLOTS * 2, 2)

        def reshape_plan():
            loop.vp.verify_num_valid.shape = (1, 1)

        changes.update(canary_shape=reshape_canary, plan_shape=reshape_plan)
    if name == "numpy":
        def freeze_canary():
            loop.canary.flags.writeable = False

        def freeze_log():
            loop.log.ring.flags.writeable = False

        changes.update(canary_read_only=freeze_canary, log_read_only=freeze_log)
    if name in ("torch_cpu", "torch_cuda"):
        import torch

        def resize_canary():
            loop.canary.resize_(NUM_SLOTS, 3)

        def move_plan():  # a new address and a length the plan cannot have
            loop.wp.write_offsets.set_(torch.zeros(9, dtype=torch.int64, device=loop.wp.write_offsets.device))

        def restride_table():
            loop.rtt.as_strided_((ROWS, COLS // 2), (COLS, 2))

        def bump_version():  # valid again: the call then succeeds, as an uncached one does
            loop.log.ring.add_(0)

        changes.update(canary_resize=resize_canary, plan_address=move_plan, table_strides=restride_table,
                       version=bump_version)
    return changes


@pytest.mark.parametrize("change", ["canary_shape", "plan_shape", "canary_read_only", "log_read_only", "canary_resize",
                                    "plan_address", "table_strides", "version"])
def test_an_in_place_change_of_a_remembered_array_gets_the_uncachedoutcome(ab, monkeypatch, change):
    loop = _Loop(ab)
    changes = _changes(ab, loop)
    if change not in changes:
        pytest.skip(f"{ab.name} arrays cannot make this change in place")
    _warm(loop)
    changes[change]()
    rp, prefix, extend, _, ids, pos, loc = (ab.asarray(a) for a in _inputs(4))
    calls = {
        "plan": lambda: kc.plan(rp, prefix, extend, loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp)),
        "verify": lambda: kc.verify(loop.canary, loop.vp, log=loop.log),
        "write": lambda: kc.write(loop.canary, loop.wp, ids, pos, loc, log=loop.log),
    }
    outcomes = {op: _both(monkeypatch, call) for op, call in calls.items()}
    for op, (cached, uncached) in outcomes.items():
        assert cached == uncached, op
    if change == "version":
        assert all(cached is None for cached, _ in outcomes.values())
    else:
        assert any(cached is not None for cached, _ in outcomes.values()), "the change is refused somewhere"


def test_a_non_contiguous_long_lived_input_is_never_remembered(ab):
    loop = _Loop(ab)
    for seed in range(3):
        rp, prefix, extend, _, ids, pos, loc = (ab.asarray(a) for a in _inputs(seed))
        kc.plan(rp, prefix, extend, loop.rtt, verify_capacity=64, out=(loop.vp, loop.wp))
        vp = kc.VerifyPlan(**{k: v[::1] for k, v in loop.vp.arrays().items()})
        strided = kc.VerifyPlan(**{**vp.arrays(), "verify_slot_indices": ab.asarray(
            np.repeat(ab.to_numpy(loop.vp.verify_slot_indices), 2))[::2]})
        kc.verify(loop.canary, strided, log=loop.log)
        assert "_kvcanary_validated" not in strided.__dict__  # its copy would go stale


def test_fake_device_launches_are_the_same_cached_or_not(monkeypatch):
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device
    from conftest import ArrayBackend

    def run():
        with fake_device() as dev:
            ab = ArrayBackend("cupy", True, dev.asarray, dev.to_numpy)
            loop = _Loop(ab)
            for seed in range(4):
                loop.step(seed)
            cached = "_kvcanary_validated" in loop.wp.__dict__
            # addresses differ between runs; the kernels, grids, blocks and argument sizes must not
            return cached, [(x.name, x.grid, x.block, x.shared_mem, [len(a) for a in x.args]) for x in dev.launches]

    cached_flag, cached = run()
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    uncached_flag, uncached = run()
    assert cached_flag and not uncached_flag
    assert cached == uncached and len(cached) == 12


def test_strides_that_are_not_whole_items_are_never_remembered():
    loop = _Loop(_numpy_backend())
    loop.step(0)
    slots = loop.vp.verify_slot_indices
    raw = np.zeros(slots.shape[0] * 12 + 8, np.uint8)  # 12-byte steps: an int64 view NumPy calls non-contiguous
    odd = np.lib.stride_tricks.as_strided(raw.view(np.int64), slots.shape, (12,))
    odd[:] = slots
    plan = kc.VerifyPlan(**{**loop.vp.arrays(), "verify_slot_indices": odd})
    kc.verify(loop.canary, plan, log=loop.log)
    kc.verify(loop.canary, plan, log=loop.log)
    assert "_kvcanary_validated" not in plan.__dict__


def test_inference_tensors_are_remembered_and_give_the_same_bytes(ab, monkeypatch):
    if not ab.name.startswith("torch"):
        pytest.skip("inference tensors are torch's")
    import torch

    def run():
        with torch.inference_mode():
            loop = _Loop(ab)
            for seed in range(4):
                loop.step(seed)
            return "_kvcanary_validated" in loop.wp.__dict__, loop.state()

    cached_flag, cached = run()
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    uncached_flag, uncached = run()
    assert cached_flag and not uncached_flag and cached == uncached


def _numpy_backend():
    from conftest import get_backend_or_skip

    return get_backend_or_skip("numpy")


def test_full_validation_is_read_from_the_environment_at_each_call(monkeypatch):
    import os

    from kvcanary_cupy.validation_cache import FULL_VALIDATION_ENV, full_validation_forced

    monkeypatch.delenv(FULL_VALIDATION_ENV, raising=False)
    assert not full_validation_forced()
    for value, forced in (("1", True), ("0", False), ("", False), ("yes", True)):
        monkeypatch.setenv(FULL_VALIDATION_ENV, value)
        assert full_validation_forced() is forced, value
    monkeypatch.delenv(FULL_VALIDATION_ENV)
    assert not full_validation_forced()
    monkeypatch.setattr(os, "environ", {FULL_VALIDATION_ENV: "1"})  # another mapping in its place
    assert full_validation_forced()
