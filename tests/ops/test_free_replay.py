"""kc.plan, kc.verify, kc.write and kc.plan_and_verify replay their last CUDA call (kvcanary_cupy/last_call.py).

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

    def plan_and_verify(self, **kw):
        kc.plan_and_verify(self.rp, self.prefix, self.extend, self.rtt, self.canary, log=self.log, verify_capacity=64,
                           out=(self.vp, self.wp), **kw)


MEMOS = (canary._VERIFY, canary._WRITE, plan_cache._PLAN, plan_cache._PLAN_VERIFY)


@pytest.fixture(params=[False, True], ids=["cupy-launch", "overlapped"])
def dev(request):
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    for memo in MEMOS:
        memo.clear()
    with fake_device(overlap=request.param) as d:
        yield d
    for memo in MEMOS:
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
    _full_validation_checks_every_call(monkeypatch, script.write, packs)


def _full_validation_checks_every_call(monkeypatch, call, packs):
    """Calls under KVCANARY_FULL_VALIDATION=1 each pack (check); after it, the call remembered
    before the variable, still unchanged, is replayed."""
    before = len(packs)
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    call()
    call()
    assert len(packs) == before + 2
    monkeypatch.delenv(FULL_VALIDATION_ENV)
    call()
    call()
    assert len(packs) == before + 2


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
    for memo in MEMOS:
        memo.clear()
    s = Script(np.asarray, None)
    for _ in range(2):
        s.plan()
        s.verify()
        s.write()
        s.plan_and_verify()
    assert [memo._entry for memo in MEMOS] == [None] * len(MEMOS)


def test_the_memo_keeps_no_array_alive(dev):
    script = Script(dev.asarray, dev.asarray(np.zeros(1, np.int32)))  # not the fixture's: pytest keeps that alive
    script.plan()
    script.verify()
    script.write()
    script.plan_and_verify()  # into a WritePlan the plan left clean: remembered at once
    assert None not in [memo._entry for memo in MEMOS]
    refs = [weakref.ref(x) for x in (script.canary, script.ids, script.vp.verify_slot_indices, script.log.ring,
                                     script.wp.write_offsets, script.rtt, script.prefix)]
    del script
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


def _device_calls(dev, fn):
    dev.timeline.clear()
    got = launches(dev, fn)
    return got, [e for e in dev.timeline if e[0] != "launch"]


def test_a_replayed_plan_and_verify_issues_the_checked_launches(dev, script, monkeypatch):
    """The fused launch on the same stream, and no other device call (plan_and_verify leaves no
    overflow note); a WritePlan not known clean is checked again (clear_whole_capacity set)."""
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "plan_verify_launch")
    want = checked(monkeypatch, lambda: _device_calls(dev, script.plan_and_verify))
    assert len(want[0]) == 1 and want[0][0][0].startswith("kvcanary::plan_verify") and want[1] == [] and len(packs) == 1
    first, second, third = (_device_calls(dev, script.plan_and_verify) for _ in range(3))
    assert first == second == third == want and len(packs) == 2  # packed once, then replayed
    side = dev.cupy.cuda.Stream()
    with side:
        want_side = checked(monkeypatch, lambda: _device_calls(dev, script.plan_and_verify))
        assert want_side[0][0][4] == side.name and _device_calls(dev, script.plan_and_verify) == want_side
    assert len(packs) == 3
    script.wp.__dict__.pop("_kvcanary_clean")  # as a bound planner's or an engine's plan leaves it
    dirty = _device_calls(dev, script.plan_and_verify)
    assert len(packs) == 4 and dirty[0] != want[0]
    assert _device_calls(dev, script.plan_and_verify) == want and len(packs) == 5  # clean again: checked once
    assert _device_calls(dev, script.plan_and_verify) == want and len(packs) == 5


def test_plan_and_verify_replay_is_its_own(dev, script, monkeypatch):
    """plan's memo and plan_and_verify's do not mix: each replays its own launches, in turn."""
    from kvcanary_cupy.backends.cuda import ops

    fused, plans = counting(monkeypatch, ops, "plan_verify_launch"), counting(monkeypatch, ops, "plan_params")
    for _ in range(3):
        script.plan()
        script.plan_and_verify()
    # the fixture's plan was remembered: only plan_and_verify's first call packs (its plan record inside its own)
    assert len(fused) == 1 and len(plans) == 1


@pytest.mark.parametrize("change", ["canary", "log", "table", "kernel_kind", "check_holes", "check_expected_tokens",
                                    "real_kv_hash_mode", "verify_capacity", "reshaped", "dtype", "resized"])
def test_plan_and_verify_is_checked_again_after_any_change(dev, script, monkeypatch, change):
    """A change of object, value, shape, strides or dtype takes the checked path: its launches or its error."""
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "plan_verify_launch")
    script.plan_and_verify()
    script.plan_and_verify()
    assert len(packs) == 1
    kw = {}
    if change == "canary":
        script.canary = kc.allocate_canary_buffer(NUM_SLOTS, like=script.rp)
    elif change == "log":
        script.log = kc.ViolationLog.allocate(64, like=script.rp)
    elif change == "table":
        script.rtt = dev.asarray(dev.to_numpy(script.rtt))
    elif change == "kernel_kind":
        kw = {"kernel_kind": 1}
    elif change == "check_holes":
        kw = {"check_holes": True}
    elif change == "check_expected_tokens":
        kw = {"check_expected_tokens": True}
    elif change == "real_kv_hash_mode":
        kw = {"real_kv_hash_mode": kc.RealKvHashMode.PARTIAL}  # without sources: the same launch, checked again
    elif change == "verify_capacity":
        kw = {"verify_capacity": 65}  # refused: out[0] holds 64 (a batch past one launch stores its entries)
        monkeypatch.setattr(ops, "plan_verify_stores_entries", lambda bs: True)
    elif change == "reshaped":
        script.prefix.shape = (1, 3)  # in place: the same object and address
    elif change == "dtype":
        script.prefix = dev.asarray(dev.to_numpy(script.prefix).astype(np.int32))
    elif change == "resized":
        script.canary.shape = (NUM_SLOTS * 2, 2)  # in place: 2 fields a slot

    def call():
        if change == "verify_capacity":
            kc.plan_and_verify(script.rp, script.prefix, script.extend, script.rtt, script.canary, log=script.log,
                               out=(script.vp, script.wp), **kw)
        else:
            script.plan_and_verify(**kw)

    got = outcome(lambda: launches(dev, call))
    want = checked(monkeypatch, lambda: outcome(lambda: launches(dev, call)))
    assert got == want
    assert (got is None) == (change not in ("verify_capacity", "reshaped", "dtype", "resized")), got
    if got is None:  # launched: checked (then again with the variable set), remembered and replayed
        assert len(packs) == 3
        assert launches(dev, call) == checked(monkeypatch, lambda: launches(dev, call)) and len(packs) == 4
        call()
        assert len(packs) == 4
    else:
        assert got[0] in (TypeError, ValueError) and len(packs) == 1


def test_plan_and_verify_with_strict_or_full_validation_always_checks(dev, script, monkeypatch):
    from kvcanary_cupy import strict as strict_checks
    from kvcanary_cupy.backends.cuda import ops

    monkeypatch.setattr(strict_checks, "check_plan", lambda args, **kw: None)  # its host reads: no device here
    packs = counting(monkeypatch, ops, "plan_verify_launch")
    script.plan_and_verify()
    script.plan_and_verify(strict=True)
    script.plan_and_verify(strict=True)
    assert len(packs) == 3
    _full_validation_checks_every_call(monkeypatch, script.plan_and_verify, packs)


def test_a_plan_and_verify_past_one_launch_replays_its_plan_and_verify(dev, script, monkeypatch):
    """A batch too large for the fused launch takes plan + verify through out[0]'s entries: both replayed."""
    from kvcanary_cupy.backends.cuda import ops

    monkeypatch.setattr(ops, "plan_verify_stores_entries", lambda bs: True)
    packs = counting(monkeypatch, ops, "verify_launch")
    want = checked(monkeypatch, lambda: launches(dev, script.plan_and_verify))
    assert want[-1][0].startswith("kvcanary::canary_verify") and len(want) >= 2
    assert launches(dev, script.plan_and_verify) == launches(dev, script.plan_and_verify) == want
    assert len(packs) == 2


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
    assert canary._WRITE.recall(
        (s.wp, s.log, s.canary, s.ids, s.pos, s.loc, None, None, None, True, 0, (), kc.RealKvHashMode.NONE, 0)) is not None
    assert checked(monkeypatch, lambda: run()[0]) == replayed


def test_on_the_device_replayed_plan_and_verify_steps_leave_the_bytes_of_checked_ones(gpu_ab, monkeypatch):
    """The fused step (plan_and_verify + write) in a loop on a GPU: replayed, the bytes of checked calls."""

    remembered = []

    def run():
        s = Script(gpu_ab.asarray, gpu_ab.like)
        for seed in range(4):
            s.ids[...] = gpu_ab.asarray(_step_arrays(_table(), seed)[0])
            s.prefix[...] = gpu_ab.asarray(PREFIX + seed)
            s.plan_and_verify(check_expected_tokens=False)
            s.write()
        remembered.append(plan_cache._PLAN_VERIFY._entry is not None)  # while its objects live (their death drops it)
        gpu_ab.synchronize()
        ring = sorted(map(bytes, gpu_ab.to_numpy(s.log.ring)))
        arrays = [s.canary, *s.wp.arrays().values(), s.vp.verify_num_valid, s.vp.enable, s.vp.out_of_range_count,
                  *(a for k, a in s.log.arrays().items() if k != "ring")]
        return [gpu_ab.to_numpy(a).tobytes() for a in arrays] + ring

    replayed = run()
    assert checked(monkeypatch, run) == replayed
    assert remembered[0]  # the first run's calls were remembered (so replayed) while its objects lived


def test_a_remembered_object_that_dies_drops_the_entry(dev):
    """The memos compare objects by id; an id is reused once its object is gone, so the death of any
    remembered object drops the entry at once (the validation cache keeps views of the long-lived
    arrays on the plans: the records and the per-step arrays are what can die here)."""
    s = Script(dev.asarray, dev.asarray(np.zeros(1, np.int32)))
    s.plan()
    s.verify()
    s.write()
    s.plan_and_verify()
    assert None not in [memo._entry for memo in MEMOS]
    s.ids = dev.asarray(dev.to_numpy(s.ids))  # the remembered per-step array is gone
    gc.collect()
    assert canary._WRITE._entry is None and None not in [canary._VERIFY._entry, plan_cache._PLAN._entry]
    s.log = kc.ViolationLog(**s.log.arrays())  # another record of the same arrays: the remembered one is gone
    gc.collect()
    assert canary._VERIFY._entry is None and plan_cache._PLAN_VERIFY._entry is None
    assert plan_cache._PLAN._entry is not None  # the plan never saw the log
    table = kc.ReqToToken(s.rtt)
    kc.plan(s.rp, s.prefix, s.extend, table, verify_capacity=64, out=(s.vp, s.wp))
    assert plan_cache._PLAN._entry is not None
    del table  # the remembered table record is gone
    gc.collect()
    assert plan_cache._PLAN._entry is None
    s.verify()
    assert canary._VERIFY._entry is not None


@pytest.mark.parametrize("bad", [{"check_expected_tokens": 1}, {"check_expected_token": 1},
                                 {"check_expected_tokens": True, "check_expected_token": False},
                                 {"verify_plan": None}, {"verify_plan": "wp"}, {"kernel_kind": np.int64(64)}])
def test_the_checks_skipped_by_a_replay_still_run_on_any_other_value(dev, script, monkeypatch, bad):
    """verify (and plan_and_verify) replay before their bool-keyword and type checks: a call with
    another value of either spelling, or another plan object, is checked and gets the checked error."""
    kw = dict(bad)
    plan = kw.pop("verify_plan", script.vp)
    plan = script.wp if plan == "wp" else plan
    call = lambda: kc.verify(script.canary, plan, log=script.log, **kw)  # noqa: E731
    for _ in range(2):
        script.verify()
    got = outcome(call)
    assert got is not None and got[0] in (TypeError, ValueError) and got == checked(monkeypatch, lambda: outcome(call))
    if "verify_plan" not in bad:
        fused = lambda: script.plan_and_verify(**kw)  # noqa: E731
        for _ in range(2):
            script.plan_and_verify()
        got = outcome(fused)
        assert got is not None and got == checked(monkeypatch, lambda: outcome(fused))


def test_either_spelling_of_check_expected_tokens_replays_as_checked(dev, script, monkeypatch):
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "verify_launch")
    for kw in ({"check_expected_tokens": True}, {"check_expected_token": True},
               {"check_expected_tokens": True, "check_expected_token": True}, {}):
        want = checked(monkeypatch, lambda: launches(dev, lambda: script.verify(**kw)))
        before = len(packs)
        assert launches(dev, lambda: script.verify(**kw)) == want and len(packs) == before + 1  # a new spelling: checked
        assert launches(dev, lambda: script.verify(**kw)) == want and len(packs) == before + 1  # then replayed


def test_a_sequence_of_buffers_replays_until_it_changes_in_place(dev, script, monkeypatch):
    """A list of buffers (and of launch kinds) is compared item by item: the same list object with
    another buffer or kind in it is checked again."""
    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "verify_launch")
    other = kc.allocate_canary_buffer(NUM_SLOTS, like=script.rp)
    bufs, kinds = [script.canary, other], [0, 1]
    run = lambda: launches(dev, lambda: kc.verify(bufs, script.vp, log=script.log, kernel_kind=kinds))  # noqa: E731
    want = checked(monkeypatch, run)
    assert run() == run() == want and len(packs) == 2
    third = kc.allocate_canary_buffer(NUM_SLOTS, like=script.rp)
    bufs[1] = third  # in place: the same list object
    assert run() == checked(monkeypatch, run) and len(packs) == 4
    assert run() != want and len(packs) == 4  # the new list content, replayed
    kinds[1] = True  # a bool is no launch kind: the checked error
    got = outcome(run)
    assert got is not None and got == checked(monkeypatch, lambda: outcome(run))
    kinds[1] = 1
    bufs.append(other)
    got = outcome(run)
    assert got == checked(monkeypatch, lambda: outcome(run))


@pytest.mark.parametrize("full", [False, True], ids=["replayed", "checked"])
def test_a_replayed_plan_warns_of_an_overflow_at_its_caller(dev, script, monkeypatch, full):
    """The overflow note of a replayed plan reads the copy the last call queued, as the checked
    path does; the warning points at the caller of kc.plan."""
    import ctypes
    import warnings

    from kvcanary_cupy.backends.cuda import ops

    packs = counting(monkeypatch, ops, "plan_params")
    if full:
        monkeypatch.setenv(FULL_VALIDATION_ENV, "1")
    script.plan()  # its note queues a copy of enable (1)
    ctypes.memmove(script.vp.enable.data.ptr, np.zeros(1, np.int32).ctypes.data, 4)  # the plan overflowed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        script.plan()  # reads 1, queues a copy of 0
        assert caught == []
        kc.plan(script.rp, script.prefix, script.extend, script.rtt, verify_capacity=64, out=(script.vp, script.wp))
    assert [w.category for w in caught] == [kc.CanaryCapacityWarning] and caught[0].filename == __file__
    assert len(packs) == (3 if full else 0)  # replayed, or checked every call


def test_a_cupy_arrays_memory_and_dtype_are_its_own_for_life(dev):
    """Why the memos re-read only a cupy.ndarray's shape and strides at each call: its data (address
    and device) and dtype cannot be assigned, and calling __init__ again does not redo them.  Should
    a CuPy release change that, this fails, and last_call.LastOpCall must stamp them again."""
    x = dev.asarray(np.zeros((4, 4), np.int64))
    other = dev.asarray(np.zeros(8, np.int32))
    data, dtype, ptr = x.data, x.dtype, x.data.ptr
    for name, value in (("data", other.data), ("dtype", np.dtype(np.int32)), ("strides", (4,))):
        with pytest.raises(AttributeError):
            setattr(x, name, value)
    with pytest.raises(AttributeError):
        x.data.ptr = other.data.ptr
    try:
        x.__init__((8,), np.int32, memptr=other.data)
    except Exception:  # noqa: BLE001 - refused is as good as ignored
        pass
    assert x.data is data and x.dtype == dtype and x.data.ptr == ptr and x.shape == (4, 4)
    x.shape = (16,)  # what can change in place, and what the memos compare
    assert x.data.ptr == ptr and x.strides == (8,)


def test_the_op_memo_stamps_a_torch_tensor_whole_and_scalars_by_type():
    """LastOpCall on its own (CPU tensors: the memo reads metadata only): any in-place change of a
    tensor's address, shape, strides, dtype or requires_grad misses, as does an equal scalar of
    another type; putting the tensor back as it was hits again; its death drops the entry."""
    torch = pytest.importorskip("torch")
    from kvcanary_cupy.last_call import LastOpCall

    memo = LastOpCall()
    t = torch.zeros(8, dtype=torch.float32)
    args = lambda *extra: (None, None, t, 0, (), *extra)  # noqa: E731 - no records: two None record positions
    memo.commit(memo.pending(args()), "kept")
    assert memo.recall(args()) == "kept"
    assert memo.recall((None, None, t, False, ())) is None and memo.recall((None, None, t, 0, [])) is None
    assert memo.recall((None, None, t.clone(), 0, ())) is None
    sources = []  # an empty list, filled in place after the call
    memo.commit(memo.pending((None, None, t, 0, sources)), "kept")
    assert memo.recall((None, None, t, 0, sources)) == "kept" and memo.recall((None, None, t, 0, [])) == "kept"
    sources.append(1)
    assert memo.recall((None, None, t, 0, sources)) is None
    changes = [lambda: t.resize_(16), lambda: t.unsqueeze_(0), lambda: t.requires_grad_(),
               lambda: setattr(t, "data", torch.zeros(8, dtype=torch.float32)),
               lambda: setattr(t, "data", torch.zeros(8, dtype=torch.int32)),
               lambda: t.set_(torch.zeros(8, dtype=torch.float32))]
    for change in changes:
        t = torch.zeros(8, dtype=torch.float32)
        memo.commit(memo.pending(args()), "kept")
        change()
        assert memo.recall(args()) is None, change
    t = torch.zeros(8, dtype=torch.float32)
    memo.commit(memo.pending(args()), "kept")
    t.unsqueeze_(0)
    assert memo.recall(args()) is None
    t.squeeze_(0)  # back in place: the same storage, address and strides
    assert memo.recall(args()) == "kept"
    t = None
    gc.collect()
    assert memo._entry is None
    assert memo.pending((None, None, np.zeros(3), 0)) is None  # a NumPy array launches nothing: never remembered
    assert memo.pending((None, None, torch.zeros(4, 2).t(), 0)) is None  # not contiguous: launched on a copy


def test_per_step_arrays_new_at_each_call_launch_plainly_after_a_while(dev, script, monkeypatch):
    """An engine's batch tensors are new objects each step: no call is ever replayed, so after two
    remembered calls go unreplayed the checked calls stop packing for runs that double up to
    MAX_PLAIN_RUN (the same launches, byte for byte); once the arrays come back unchanged, the
    memo packs again within one run and replays."""
    from kvcanary_cupy.backends.cuda import launch as cuda_launch, ops
    from kvcanary_cupy.last_call import MAX_PLAIN_RUN

    packed = counting(monkeypatch, cuda_launch, "PackedLaunches")
    checks = counting(monkeypatch, ops, "write_launch")
    host = [dev.to_numpy(a) for a in (script.ids, script.pos, script.loc)]
    for step in range(40):
        script.ids, script.pos, script.loc = (dev.asarray(a) for a in host)
        if step % 9 == 0:  # a plain or a packed call, both the checked call's launches
            assert launches(dev, script.write) == checked(monkeypatch, lambda: launches(dev, script.write))
        else:
            script.write()
    assert 40 <= len(checks) and 5 <= len(packed) <= 8  # packed at steps 0, 1, 2, 5, 10, 19, 36: 7
    before = len(checks)
    for _ in range(MAX_PLAIN_RUN + 3):
        script.write()
    assert len(checks) - before <= MAX_PLAIN_RUN + 1  # one run at most, then packed once and replayed
    now = len(checks)
    script.write()
    script.write()
    assert len(checks) == now
