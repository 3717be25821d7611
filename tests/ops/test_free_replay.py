"""kc.plan, kc.verify and kc.write replay their last CUDA call (kvcanary_cupy/last_call.py).

On the fake device (kvcanary_cupy/devtools/fake_cupy.py: launches recorded with each argument's
bytes and their stream, nothing run): a call with the last call's objects, unchanged, issues the
launches of the checked path (the path every call takes under KVCANARY_FULL_VALIDATION=1) byte for
byte on the same stream without checking again; a new object, an in-place reshape, a side stream,
``strict`` or the variable take the checked path, with its errors; the memo keeps no array alive.
On a GPU: replayed steps leave the bytes of checked ones.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import outcome
from kvcanary_cupy.ops import canary, plan_cache
from kvcanary_cupy.validation_cache import FULL_VALIDATION_ENV

NUM_SLOTS = 256
RP, PREFIX, EXTEND = np.array([1, 3, 4], np.int64), np.array([5, 0, 9], np.int64), np.array([2, 3, 1], np.int64)


def _table() -> np.ndarray:
    return np.random.default_rng(0).permutation(np.arange(1, NUM_SLOTS))[:6 * 32].reshape(6, 32).astype(np.int32)


def _step_arrays(rtt: np.ndarray, seed: int = 0):
    """input_ids, positions, out_cache_loc of the planned batch (the tokens from ``seed``)."""
    loc = np.concatenate([rtt[r, p:p + e] for r, p, e in zip(RP, PREFIX, EXTEND)]).astype(np.int64)
    pos = np.concatenate([np.arange(p, p + e) for p, e in zip(PREFIX, EXTEND)]).astype(np.int64)
    ids = np.random.default_rng(seed).integers(0, 1000, loc.shape[0]).astype(np.int64)
    return ids, pos, loc


class Script:
    """A script's step on ``asarray``'s arrays, every one of them long-lived (the per-step arrays refilled in place)."""

    def __init__(self, asarray, like):
        rtt = _table()
        self.rtt = asarray(rtt)
        self.canary = kc.allocate_canary_buffer(NUM_SLOTS, like=like)
        self.vp = kc.VerifyPlan.allocate(64, like=like)
        self.wp = kc.WritePlan.allocate(4, like=like)
        self.log = kc.ViolationLog.allocate(64, like=like)
        self.rp, self.prefix, self.extend = (asarray(a) for a in (RP, PREFIX, EXTEND))
        self.ids, self.pos, self.loc = (asarray(a) for a in _step_arrays(rtt))

    def plan(self):
        kc.plan(self.rp, self.prefix, self.extend, self.rtt, verify_capacity=64, out=(self.vp, self.wp))

    def verify(self, **kw):
        kc.verify(self.canary, self.vp, log=self.log, **kw)

    def write(self, **kw):
        kc.write(self.canary, self.wp, self.ids, self.pos, self.loc, log=self.log, **kw)


@pytest.fixture(params=[False, True], ids=["cupy-launch", "overlapped"])
def dev(request):
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    for memo in (canary._VERIFY, canary._WRITE, plan_cache._PLAN):
        memo.clear()
    with fake_device(overlap=request.param) as d:
        yield d
    for memo in (canary._VERIFY, canary._WRITE, plan_cache._PLAN):
        memo.clear()


@pytest.fixture
def script(dev):
    s = Script(dev.asarray, dev.asarray(np.zeros(1, np.int32)))
    s.plan()
    return s


def launches(dev, fn) -> list:
    dev.launches.clear()
    fn()
    return [(x.name, x.grid, x.block, x.shared_mem, getattr(x.stream, "name", x.stream), x.args) for x in dev.launches]


def counting(monkeypatch, module, name) -> list:
    """Count the calls of ``module.name``: each packs a launch (the checked path does, a replay does not)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def checked(monkeypatch, fn):
    """What ``fn`` does on the checked path alone (every check, nothing remembered or replayed)."""
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    try:
        return fn()
    finally:
        monkeypatch.delenv(FULL_VALIDATION_ENV)


@pytest.mark.parametrize("op", ["verify", "write"])
def test_a_replayed_call_issues_the_checked_launches_on_the_same_stream(dev, script, monkeypatch, op):
    from kvcanary_cupy.backends.cuda import ops

    run = getattr(script, op)
    packs = counting(monkeypatch, ops, f"{op}_launch")
    want = checked(monkeypatch, lambda: launches(dev, run))
    assert len(want) == 1 and len(packs) == 1
    first, second, third = (launches(dev, run) for _ in range(3))
    assert first == second == third == want
    assert len(packs) == 2  # packed once, by the first call; the others replayed it
    side = dev.cupy.cuda.Stream()
    with side:  # another current stream: the replay launches there, as the checked path does
        want_side = checked(monkeypatch, lambda: launches(dev, run))
        assert want_side[0][4] == "stream1" and launches(dev, run) == want_side
    assert len(packs) == 3


def test_a_replayed_plan_issues_the_checked_launches_copy_and_event(dev, script, monkeypatch):
    """The plan's launches, then its overflow note (event query, 4-byte copy of enable, event
    record) on the same stream, every call; a plan into a WritePlan not known clean clears it whole."""
    from kvcanary_cupy.backends.cuda import ops

    def device_calls():
        dev.timeline.clear()
        got = launches(dev, script.plan)
        return got, [e for e in dev.timeline if e[0] != "launch"]

    packs = counting(monkeypatch, ops, "plan_params")
    want = checked(monkeypatch, device_calls)  # the fixture's plan (into fresh, clean plans) was remembered
    assert len(want[0]) >= 1 and [e[0] for e in want[1]] == ["query", "copy", "record"]
    assert device_calls() == device_calls() == want and len(packs) == 1
    side = dev.cupy.cuda.Stream()
    with side:
        want_side = checked(monkeypatch, device_calls)
        assert want_side[1][-1][2] == "stream1" and device_calls() == want_side and len(packs) == 2
    script.wp.__dict__.pop("_kvcanary_clean")  # as a bound planner's or an engine's plan leaves it
    dirty = device_calls()
    assert len(packs) == 3 and dirty[0] != want[0]  # checked: clear_whole_capacity set
    assert device_calls() == want and len(packs) == 4  # clean again: checked once, remembered
    assert device_calls() == want and len(packs) == 4
    script.rtt = dev.asarray(dev.to_numpy(script.rtt))  # another table
    device_calls()
    assert len(packs) == 5
    script.prefix.shape = (1, 3)  # reshaped in place
    got = outcome(script.plan)
    assert got is not None and got[0] is ValueError and got == checked(monkeypatch, lambda: outcome(script.plan))
    script.prefix.shape = (3,)
    device_calls()
    assert len(packs) == 5  # back as remembered: replayed
    table = kc.ReqToToken(script.rtt)
    for _ in range(3):
        kc.plan(script.rp, script.prefix, script.extend, table, verify_capacity=64, out=(script.vp, script.wp))
    assert len(packs) == 6  # a ReqToToken record counts by identity
    from kvcanary_cupy import strict as strict_checks

    monkeypatch.setattr(strict_checks, "check_plan", lambda args: None)  # its host reads: no device here
    kc.plan(script.rp, script.prefix, script.extend, table, verify_capacity=64, out=(script.vp, script.wp), strict=True)
    assert len(packs) == 7  # strict checks every call


def test_new_objects_and_in_place_changes_take_the_checked_path(dev, script, monkeypatch):
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "verify_launch")
    script.verify()
    script.verify()
    assert len(packs) == 1
    script.canary = kc.allocate_canary_buffer(NUM_SLOTS, like=script.rp)  # another buffer: its address
    moved = launches(dev, script.verify)
    assert len(packs) == 2 and moved == checked(monkeypatch, lambda: launches(dev, script.verify))
    script.vp = kc.VerifyPlan(**script.vp.arrays())  # a new record of the same arrays
    script.verify()
    assert len(packs) == 4  # the checked call above, then this one
    script.verify()
    assert len(packs) == 4
    script.verify(kernel_kind=1)  # another value
    assert len(packs) == 5

    buf = script.canary
    buf.shape = (NUM_SLOTS * 2, 2)  # reshaped in place: the same object and address
    got = outcome(script.verify)
    assert got is not None and got[0] is ValueError and got == checked(monkeypatch, lambda: outcome(script.verify))
    buf.shape = (NUM_SLOTS, 4)  # back as remembered: replayed again
    script.verify(kernel_kind=1)
    assert len(packs) == 5


def test_bad_values_after_a_replayed_call_get_the_checked_errors(dev, script, monkeypatch):
    for bad in ({"kernel_kind": 64}, {"kernel_kind": True}, {"kernel_kind": -1}, {"check_holes": 1},
                {"real_kv_hash_mode": 7}):
        script.verify()
        script.verify()
        got = outcome(lambda: script.verify(**bad))
        assert got == checked(monkeypatch, lambda: outcome(lambda: script.verify(**bad))), bad
    script.write()
    script.write()
    script.pos.shape = (1, script.pos.shape[0])  # a per-step array reshaped in place
    got = outcome(script.write)
    assert got is not None and got[0] is ValueError and "positions" in got[1]
    assert got == checked(monkeypatch, lambda: outcome(script.write))


def test_strict_a_side_stream_and_full_validation_always_check(dev, script, monkeypatch):
    from kvcanary_cupy import strict as strict_checks
    from kvcanary_cupy.backends.cuda import ops

    monkeypatch.setattr(strict_checks, "check_write", lambda args: None)  # its host reads: no device here
    packs = counting(monkeypatch, ops, "write_launch")
    script.write()
    script.write()
    assert len(packs) == 1
    script.write(strict=True)
    side = dev.cupy.cuda.Stream()
    dev.timeline.clear()
    script.write(stream=side)
    assert len(packs) == 3
    assert [e[0] for e in dev.timeline][:2] == ["record", "wait"]  # the fork, every call
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    script.write()
    script.write()
    assert len(packs) == 5
    monkeypatch.delenv(FULL_VALIDATION_ENV)
    script.write()
    script.write()
    assert len(packs) == 5  # the call remembered before the variable is still unchanged: replayed


def test_a_copied_per_step_input_is_never_replayed(dev, script, monkeypatch):
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "write_launch")
    copies = []
    # the fake device allocates nothing: stand in for the copy contiguous_input makes of a strided input
    monkeypatch.setattr(canary, "contiguous_input", lambda view, key, xp: (copies.append(key), view)[1])
    wide = dev.asarray(np.repeat(dev.to_numpy(script.pos), 2))
    script.pos = wide[::2]  # strided: the checked path writes from a copy
    script.write()
    script.write()
    assert len(packs) == 2 and canary._WRITE._entry is None


def test_numpy_calls_stay_on_the_numpy_path():
    for memo in (canary._VERIFY, canary._WRITE, plan_cache._PLAN):
        memo.clear()
    s = Script(np.asarray, None)
    for _ in range(2):
        s.plan()
        s.verify()
        s.write()
    assert canary._VERIFY._entry is None and canary._WRITE._entry is None and plan_cache._PLAN._entry is None


def test_the_memo_keeps_no_array_alive(dev):
    script = Script(dev.asarray, dev.asarray(np.zeros(1, np.int32)))  # not the fixture's: pytest keeps that alive
    script.plan()
    script.verify()
    script.write()
    assert None not in (canary._VERIFY._entry, canary._WRITE._entry, plan_cache._PLAN._entry)
    refs = [weakref.ref(x) for x in (script.canary, script.ids, script.vp.verify_slot_indices, script.log.ring,
                                     script.wp.write_offsets, script.rtt, script.prefix)]
    del script
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


def test_on_the_device_replayed_steps_leave_the_bytes_of_checked_ones(gpu_ab, monkeypatch):
    """A script's loop on a GPU (the per-step arrays refilled in place, so verify and write replay)
    leaves the canary, plans and log bytes that the same loop leaves with every call checked."""

    def run():
        s = Script(gpu_ab.asarray, gpu_ab.like)
        for seed in range(4):
            ids = _step_arrays(_table(), seed)[0]
            s.ids[...] = gpu_ab.asarray(ids)
            s.prefix[...] = gpu_ab.asarray(PREFIX + seed)  # the plan reads the new values
            s.plan()
            s.verify()
            s.write()
        gpu_ab.synchronize()
        ring = sorted(map(bytes, gpu_ab.to_numpy(s.log.ring)))  # concurrent threads take ring rows in any order
        arrays = [s.canary, *s.wp.arrays().values(), *(a for k, a in s.log.arrays().items() if k != "ring")]
        return [gpu_ab.to_numpy(a).tobytes() for a in arrays] + ring, s

    replayed, s = run()
    assert canary._WRITE.get(*canary.call_parts(
        (s.wp, s.log), (s.canary, s.ids, s.pos, s.loc, None, None, None, True, 0, (), kc.RealKvHashMode.NONE, 0))) is not None
    assert checked(monkeypatch, lambda: run()[0]) == replayed
