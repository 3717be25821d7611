"""CanarySession.end_step on a fake CuPy device: the staging kernels launch through parameters bound
in the constructor (nothing allocated, packed or looked up per call), and the staged records form a
fixed ring: a host running ahead of the device waits for the oldest copy only when every record is
in flight, counts it, and never reads or restages a record before its copy event has completed.
The staging itself runs as its NumPy reference on the fake device, so the records carry real logs
and the reports are compared with a NumPy session fed the same logs."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import session as session_module

pytest.importorskip("cupy")
from kvcanary_cupy.devtools.fake_cupy import fake_device, host_view  # noqa: E402

HEAD, TAIL = kc.CanaryLaunchTag.HEAD_K_FULL, kc.CanaryLaunchTag.TAIL_K_FULL
WRITE_POSITION = kc.FailReason.WRITE_POSITION_MISMATCH.value
NUM_SLOTS = 64


def _host(x):
    """A writable NumPy view of a session array (NumPy, or a fake CuPy array's host memory)."""
    return x if isinstance(x, np.ndarray) else host_view(x.data.ptr, x.dtype, x.size).reshape(x.shape)


class _StepLog:
    """What a step's kernels would leave behind, written straight into a session's log and plan:
    the HEAD and TAIL kernels ran, ``k`` verify entries were planned and, when ``violation``, one
    distinct write violation (slot k + 1, position k) was logged by the TAIL write."""

    def __init__(self, session):
        log, vp = session.log, session.planner.verify_plan
        self.ring, self.write_index = _host(log.ring), _host(log.write_index)
        self.violations, self.runs = _host(log.violation_counters), _host(log.kernel_run_counters)
        self.enable, self.num_valid = _host(vp.enable), _host(vp.verify_num_valid)

    def __call__(self, k: int, violation: bool = True) -> None:
        self.runs[[HEAD, TAIL]] += 1
        self.enable[0], self.num_valid[0] = 1, k
        if violation:
            self.ring[self.write_index[0]] = [TAIL, k + 1, k, 100 + k, 7, 0, k + 5, WRITE_POSITION]
            self.write_index[0] += 1
            self.violations[TAIL] += 1


def _session(like):
    return kc.CanarySession(NUM_SLOTS, max_batch_size=4, verify_capacity=32, like=like, on_violation="ignore",
                            overlap_head_write=False)


def _numpy_run(steps: int):
    session = _session(None)
    log = _StepLog(session)
    for k in range(steps):
        log(k)
        session.end_step()
    session.check()
    return session


def _copy_events(session) -> set:
    return {record.event.name for record in session._records}


def _restaged_early(timeline, copy_events) -> list:
    """Copy events recorded again before the host saw the previous copy complete (a query answering
    "done" or a sync of that event or of the side stream it was recorded on)."""
    in_flight, early = {}, []
    for op, what, where in timeline:
        if op == "record" and what in copy_events:
            if in_flight.get(what):
                early.append(what)
            in_flight[what] = where
        elif (op == "query" and where == "done") or (op == "sync" and what in in_flight):
            in_flight.pop(what, None)
        elif op == "sync":  # a stream: every copy recorded on it has completed
            in_flight = {e: s for e, s in in_flight.items() if s != what}
    return early


def test_end_step_launches_the_bound_staging_and_creates_nothing():
    """Every end_step launches session_stage and session_attribute with the parameters packed in the
    constructor (only the stamp and the record's address change) and creates no array, event,
    stream, parameter record or kernel handle."""
    from kvcanary_cupy.backends.cuda import abi, compile as cuda_compile, ops as cuda_ops

    # The counting patches wrap the fake device's own patches, so they must be undone inside its
    # block: undone after it, they would restore the fake (cupy.cuda.Stream...) for later tests.
    with fake_device() as dev, pytest.MonkeyPatch.context() as monkeypatch:
        dev.emulate_session_staging()
        session = _session(dev.asarray(np.zeros(1, np.int32)))
        log = _StepLog(session)
        records = {r.staging for r in session._free}
        created = []

        def counting(module, name):
            fn = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, **k: (created.append(name), fn(*a, **k))[1])

        import cupy
        import cupyx

        for module, names in ((np, ("zeros", "empty", "full", "array", "ascontiguousarray")),
                              (cupy, ("empty", "full", "zeros", "asarray")), (cupyx, ("empty_pinned",)),
                              (cupy.cuda, ("Event", "Stream")), (cuda_ops, ("kernel_arguments", "get_function")),
                              (cuda_compile, ("get_function",))):
            for name in names:
                counting(module, name)
        dev.launches.clear()
        steps = 3 * session_module.STAGED_RECORDS
        for k in range(steps):
            log(k, violation=False)
            session.end_step()
        assert created == []  # nothing per call (the emulated staging creates nothing with an empty ring)

    log_ptrs = {k: v.data.ptr for k, v in session.log.arrays().items()}
    plan_ptrs = {k: v.data.ptr for k, v in session.planner.verify_plan.arrays().items()}
    assert [(launch.name, launch.grid, launch.block) for launch in dev.launches] == [
        ("kvcanary::session_stage", (1,), (256,)), ("kvcanary::session_attribute", (2 * dev.SM_COUNT,), (256,))] * steps
    used = set()
    for k, (stage, attribute) in enumerate(zip(dev.launches[::2], dev.launches[1::2])):
        assert attribute.args == stage.args[:1]  # the same SessionStage
        s = np.frombuffer(stage.args[0], abi.SESSION_STAGE)[0]
        assert int(np.frombuffer(stage.args[1], np.int64)[0]) == k + 1  # the stamp
        assert {f: int(s[f]) for f in ("ring", "write_index", "violation_counters", "kernel_run_counters")} == {
            f: log_ptrs[f] for f in ("ring", "write_index", "violation_counters", "kernel_run_counters")}
        assert (int(s["slots"]), int(s["enable"])) == (plan_ptrs["verify_slot_indices"], plan_ptrs["enable"])
        assert (int(s["marks"]), int(s["num_slots"]), int(s["ring_capacity"])) == (
            session._marks.data.ptr, NUM_SLOTS, session.log.capacity)
        assert int(s["staging"]) in records
        used.add(int(s["staging"]))
    assert len(used) == 2  # the device keeps up: the pending step's record and the one handled in turn
    stats = session.stats
    assert (stats["steps"], stats["pending_steps"], stats["health_failures"], stats["staging_waits"]) == (steps, 1, 0, 0)
    assert stats["verified_entries"] == sum(range(steps - 1))  # every step but the last, handled one step late


def test_host_running_ahead_waits_for_the_oldest_copy_and_loses_no_record():
    """With the device stalled (no copy completes), end_step returns at once while a record is free;
    past STAGED_RECORDS stagings in flight each end_step waits for the oldest copy (a sync of that
    copy's event, counted in stats) and handles it.  No copy event is recorded again before the host
    saw its copy complete, and the reports equal a NumPy session's fed the same logs."""
    n = session_module.STAGED_RECORDS
    ahead = 5
    with fake_device() as dev:
        dev.emulate_session_staging()
        session = _session(dev.asarray(np.zeros(1, np.int32)))
        log = _StepLog(session)
        copy_events = _copy_events(session)
        dev.hold_events = True
        dev.timeline.clear()
        for k in range(n + ahead):
            log(k)
            before = len(dev.timeline)
            session.end_step()
            syncs = [what for op, what, _ in dev.timeline[before:] if op == "sync"]
            stats = session.stats
            if k < n:  # a free record: no wait, nothing handled (nothing completed)
                assert syncs == [] and stats["pending_steps"] == k + 1 and session.report().violations == ()
            else:  # waited for the copy of step k - n alone, and handled it
                assert len(syncs) == 1 and syncs[0] in copy_events
                assert stats["pending_steps"] == n
                assert {v.first_step for v in session.report().violations} == set(range(k - n + 1))
            assert stats["staging_waits"] == max(0, k - n + 1)
        dev.hold_events = False
        session.check()
        assert _restaged_early(dev.timeline, copy_events) == []

    want = _numpy_run(n + ahead)
    assert session.report().to_dicts() == want.report().to_dicts()
    got_stats = session.stats
    assert got_stats.pop("staging_waits") == ahead and want.stats.pop("staging_waits") == 0
    assert got_stats == {k: v for k, v in want.stats.items() if k != "staging_waits"}
    assert [(v.first_step, v.slot_idx, v.position) for v in session.report().violations] == [
        (k, k + 1, k) for k in range(n + ahead)]


def test_records_complete_out_of_order_are_still_handled_oldest_first():
    """A later copy that completes first waits for the earlier ones: steps are handled in order,
    each one step late or later, never before its own copy completed."""
    with fake_device() as dev:
        dev.emulate_session_staging()
        session = _session(dev.asarray(np.zeros(1, np.int32)))
        log = _StepLog(session)
        dev.hold_events = True
        for k in range(3):
            log(k)
            session.end_step()
        first, second, third = session._pending
        third.event.pending = second.event.pending = False  # steps 1 and 2 done, step 0 not yet
        log(3)
        session.end_step()
        assert session.stats["pending_steps"] == 4 and session.report().violations == ()
        first.event.pending = False
        log(4)
        session.end_step()  # steps 0 to 2 handled, in order; 3 (held) and 4 (this one) pending
        assert [v.first_step for v in session.report().violations] == [0, 1, 2]
        assert session.stats["pending_steps"] == 2
        dev.hold_events = False
        session.check()
    assert [v.first_step for v in session.report().violations] == [0, 1, 2, 3, 4]


def test_capture_refused_before_anything_is_queued():
    with fake_device() as dev:
        session = _session(dev.asarray(np.zeros(1, np.int32)))
        dev.timeline.clear()
        dev.capture_queries = 0  # the allocations' own, above
        dev.current[-1].capturing = True
        for call in (session.end_step, session.check):
            with pytest.raises(RuntimeError, match=r"\(\) must run outside CUDA graph capture"):
                call()
        assert dev.timeline == [] and dev.capture_queries == 2
        dev.current[-1].capturing = False
        session.end_step()
        assert session.stats["steps"] == 1


def test_numpy_session_stages_into_its_ring_without_copies():
    """On the CPU a staging writes the record the host reads (no copy), and a record is free again
    once handled: the NumPy session cycles through its records and never waits."""
    session = _session(None)
    log = _StepLog(session)
    seen = set()
    for k in range(3 * session_module.STAGED_RECORDS):
        log(k)
        session.end_step()
        (record,) = session._pending
        assert record.target is record.host
        seen.add(id(record.host))
    assert len(seen) == 2  # two records alternate: the pending step's and the one handled this call
    session.check()
    assert session.stats["staging_waits"] == 0 and len(session.report().violations) == 3 * session_module.STAGED_RECORDS


def test_a_sweep_with_every_record_in_flight_waits_like_a_step():
    """A sweep's staging takes a record of the same ring: its first sweep (whose staging is bound
    then) finds them all in flight, waits for the oldest and is handled with the steps, in order."""
    n = session_module.STAGED_RECORDS
    with fake_device() as dev:
        dev.emulate_session_staging()
        session = _session(dev.asarray(np.zeros(1, np.int32)))
        log = _StepLog(session)
        dev.hold_events = True
        for k in range(n):
            log(k)
            session.end_step()
        table = dev.asarray(np.zeros((4, 16), np.int32))
        session.sweep(dev.asarray(np.array([1], np.int64)), dev.asarray(np.array([3], np.int64)), table)
        stats = session.stats
        assert (stats["staging_waits"], stats["sweeps"], stats["pending_steps"]) == (1, 1, n - 1)
        assert [v.first_step for v in session.report().violations] == [0]
        dev.hold_events = False
        session.check()
        assert [v.first_step for v in session.report().violations] == list(range(n))
        assert session.stats["pending_steps"] == 0
