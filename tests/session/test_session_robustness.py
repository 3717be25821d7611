"""CanarySession under misuse, interrupts, floods and a reader thread: nothing hidden, nothing lost,
no broken session (issue 28, items 1-5 and 17)."""

import sys
import threading
import warnings

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.session import violations
from conftest import get_backend_or_skip
from session_engine import ToyEngine
from test_session import HEAD, REAL_KV, SWEEP, TAIL, make_session, run_step, sync

NUMPY = get_backend_or_skip("numpy")


def _flood(session):
    def flood():  # every TAIL record's real-KV hash is wrong
        session.tail_canary[:, 3] = 1
    return flood


def _fault_run(ab, session, steps=8, *, before_end=None):
    """Rows 1 and 2 decode; from step 2 row 1's table names row 2's slot at position 2 (HEAD and TAIL
    both see it).  ``before_end(step)`` runs before each end_step."""
    engine = ToyEngine()
    for step in range(steps):
        arrays = {k: ab.asarray(v) for k, v in engine.step([1, 2]).items()}
        if step == 2:
            engine.rtt[1, 2] = engine.rtt[2, 4]
        session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], ab.asarray(engine.rtt), arrays["ids"],
                            arrays["pos"], arrays["loc"])
        session.post_forward()
        sync(ab)
        while session.stats["steps"] == step:  # an end_step interrupted before staging left the step open: again
            try:
                if before_end is not None:
                    before_end(step)
                session.end_step()
            except _Injected:
                pass
    while True:
        try:
            session.check()
            return session
        except _Injected:
            continue


class _Injected(Exception):
    pass


def _summary(session):
    r = session.report()
    s = session.stats
    return ([(v.key, v.repeats, v.first_step, v.last_step, v.batch_rows) for v in r.violations],
            {k: s[k] for k in ("steps", "violations", "rows_read", "dropped_rows", "distinct_violations",
                               "violations_by_reason", "violations_by_tag", "verified_entries", "health_failures")})


# -- item 3: misuse is a usage error, not corruption ----------------------------------------------


def test_pre_forward_twice_is_a_usage_error_not_a_violation(ab):
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation="raise")
    a = {k: ab.asarray(v) for k, v in engine.step([1, 2]).items()}
    args = (a["rp"], a["prefix"], a["extend"], ab.asarray(engine.rtt), a["ids"], a["pos"], a["loc"])
    session.pre_forward(*args)
    with pytest.raises(kc.CanaryUsageError, match=r"pre_forward\(\) twice.*pre_forward\(\), post_forward\(\), end_step\(\)"):
        session.pre_forward(*args)
    session.post_forward()
    with pytest.raises(kc.CanaryUsageError, match=r"post_forward\(\) needs a pre_forward"):
        session.post_forward()
    sync(ab)
    session.end_step()
    for _ in range(3):  # the refused calls launched nothing: the loop goes on clean
        run_step(session, ab, engine.step([1, 2]), engine.rtt)
    session.check()
    assert session.report().violations == () and session.stats["violations"] == 0
    assert issubclass(kc.CanaryUsageError, RuntimeError)


def test_end_step_inside_the_violation_callback_is_refused(ab):
    refused = []

    def policy(report):
        for call in (session.end_step, session.check):
            try:
                call()
            except kc.CanaryUsageError as exc:
                refused.append(str(exc))

    engine = ToyEngine()
    session = make_session(ab, engine, on_violation=policy)
    _fault_run(ab, session)
    assert refused and all("on_violation" in m for m in refused)
    s = session.stats
    assert (s["steps"], s["health_failures"]) == (8, 0)  # no step counted that never ran


# -- item 5: transactional staging and decoding ----------------------------------------------------


def test_an_interrupted_staging_leaks_no_record(ab, monkeypatch):
    want = _summary(_fault_run(ab, make_session(ab, ToyEngine(), on_violation="ignore")))
    session = make_session(ab, ToyEngine(), on_violation="ignore")
    stage = session._transport.stage
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) % 2:  # every other staging raises before it launches (more than STAGED_RECORDS times)
            raise _Injected("interrupt")
        return stage(*args)

    monkeypatch.setattr(session._transport, "stage", interrupted)
    got = _summary(_fault_run(ab, session, steps=8))
    assert len(calls) >= 2 * 8
    assert got == want
    assert len(session._free) == kc.session.STAGED_RECORDS and not session._pending


def test_an_interrupted_decoding_keeps_counts_exact(ab, monkeypatch):
    want = _summary(_fault_run(ab, make_session(ab, ToyEngine(), on_violation="ignore")))
    session = make_session(ab, ToyEngine(), on_violation="ignore")
    attribute = violations._attribute
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) in (2, 4):  # within a record, after its first row was decoded
            raise _Injected("interrupt")
        return attribute(*args)

    monkeypatch.setattr(violations, "_attribute", interrupted)
    got = _summary(_fault_run(ab, session))
    assert len(calls) > 4
    assert got == want
    assert sum(v.repeats for v in session.report().violations) == session.stats["rows_read"]


# -- item 17: a second thread reads report() and stats ---------------------------------------------


def test_report_and_stats_from_a_second_thread_while_the_loop_runs():
    engine = ToyEngine(max_len=64)
    session = make_session(NUMPY, engine, ring_capacity=64, on_violation="ignore")
    flood, stop, errors = _flood(session), threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                r, s = session.report(), session.stats
                assert len(r.violations) <= s["distinct_violations"] or True
                repr(session)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(50):  # new keys every step: the prefixes grow
            run_step(session, NUMPY, engine.step([1, 2, 3, 4]), engine.rtt, before_post=flood)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert errors == []
    session.check()
    assert sum(v.repeats for v in session.report().violations) == session.stats["rows_read"]


# -- item 1: a full distinct table still reports new faults ----------------------------------------


def test_a_new_fault_after_the_distinct_table_filled_still_reaches_the_policy(ab, monkeypatch):
    monkeypatch.setattr(violations, "MAX_DISTINCT_VIOLATIONS", 20)
    received = []
    engine = ToyEngine(max_len=64)
    session = make_session(ab, engine, ring_capacity=64, on_violation=received.append)
    flood = _flood(session)
    with pytest.warns(kc.CanaryCoverageWarning, match="MAX_DISTINCT_VIOLATIONS=20") as caught:
        for step in range(8):  # a noisy TAIL bug: every cached record, new keys every step
            run_step(session, ab, engine.step([1, 2]), engine.rtt, before_post=flood)
        assert session.stats["distinct_violations"] == 20
        arrays = engine.step([1, 2])
        session.head_canary[engine.rtt[2, 1], 0] += 1  # a new HEAD fault: row 2's record at position 1 changed,
        run_step(session, ab, arrays, engine.rtt, before_post=flood)
        session.check()
    assert len([w for w in caught if issubclass(w.category, kc.CanaryCoverageWarning)]) == 1
    new_head = [v for r in received for v in r.violations if v.kernel_kind == HEAD]
    # which its successor's chain check sees
    assert [(v.slot_idx, v.position, v.fail_reason_bits, v.first_step) for v in new_head] == [(int(engine.rtt[2, 2]), 2, 1, 8)]
    assert any(v.kernel_kind == HEAD for v in session.report().violations)
    s = session.stats
    assert s["distinct_violations"] == 20
    # every row read is in the report's repeats or counted as evicted
    assert sum(v.repeats for v in session.report().violations) + s["untracked_rows"] == s["rows_read"]
    # an evicted key seen again is new again: every insertion past the 20th evicted one
    assert s["evicted_violations"] == sum(len(r.violations) for r in received) - 20 > 0


# -- item 4: a canary smaller than the pool ---------------------------------------------------------


def test_a_canary_smaller_than_the_pool_warns_once_and_check_counts_the_unverified(ab):
    engine = ToyEngine()  # slots up to 511
    session = kc.CanarySession(8, max_batch_size=engine.bs, like=ab.like, on_violation="raise")
    with pytest.warns(kc.CanaryCoverageWarning, match="out of range") as caught:
        for _ in range(4):
            run_step(session, ab, engine.step([1, 2]), engine.rtt)
        unverified = session.check()
    assert len([w for w in caught if issubclass(w.category, kc.CanaryCoverageWarning)]) == 1
    assert unverified == session.stats["out_of_range_skipped"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_session(ab, ToyEngine()).check() == 0  # a covering canary: nothing unverified, no warning


def test_an_overflowed_free_plan_says_how_many_entries_it_needed(ab):
    rp, prefix, extend = [1, 2, 3], [5, 0, 9], [1, 4, 1]  # 14 verify entries
    rtt = ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    args = [ab.asarray(np.asarray(x, np.int64)) for x in (rp, prefix, extend)]
    for cap, enable in ((13, 0), (14, 1)):
        vp, wp = kc.plan(*args, rtt, verify_capacity=cap)
        assert (int(ab.to_numpy(vp.enable)[0]), wp.verify_entries_needed()) == (enable, 14)


def test_an_overflowed_free_plan_warns_once_per_record(ab):
    """Host memory warns at the call; a GPU plan never syncs, so the next free plan into the same
    record reads the copy the first one queued.  Once per record; a plan that fits never warns."""
    rtt = ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    args = [ab.asarray(np.asarray(x, np.int64)) for x in ([1, 2, 3], [5, 0, 9], [1, 4, 1])]  # 14 entries
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fits = kc.plan(*args, rtt, verify_capacity=14)
        kc.plan(*args, rtt, verify_capacity=14, out=fits)
        out = kc.plan(*args, rtt, verify_capacity=13)
        ab.synchronize()
        for _ in range(3):
            kc.plan(*args, rtt, verify_capacity=13, out=out)
            ab.synchronize()
    overflow = [w for w in caught if issubclass(w.category, kc.CanaryCapacityWarning)]
    assert len(overflow) == 1, [str(w.message) for w in caught]
    assert "verify_capacity=13" in str(overflow[0].message) and overflow[0].filename == __file__
    assert out[1].verify_entries_needed() == 14


# -- item 2: one launch group's flood cannot hide another's rows -----------------------------------


def _head_flood(ab):
    """A flood of HEAD chain failures every step (more than the 8 rows of a share) and one TAIL
    record's real-KV fingerprint wrong, which the TAIL verify (in the same steps) and a sweep see."""
    engine = ToyEngine()
    session = make_session(ab, engine, ring_capacity=8, on_violation="ignore")
    run_step(session, ab, engine.step([1, 2]), engine.rtt)  # both rows prefill 6 tokens
    bad = int(engine.rtt[1, 5])

    def tail_fault():
        session.tail_canary[bad, 3] = 12345

    for _ in range(3):
        session.head_canary[:, 3] += 1  # every HEAD record changes: its successor's chain check fails
        run_step(session, ab, engine.step([1, 2]), engine.rtt, before_post=tail_fault)
        session.sweep(ab.asarray(np.array([1], np.int64)), ab.asarray(engine.lens[[1]]), ab.asarray(engine.rtt))
    session.check()
    return session, bad


def test_a_head_flood_does_not_hide_tail_or_sweep_violations(ab):
    session, bad = _head_flood(ab)
    s, violations = session.stats, session.report().violations
    assert s["violations_by_tag"]["HEAD_K_FULL"] > 3 * 8 and s["dropped_rows"] > 0  # HEAD overflowed its share
    assert {(v.kernel_kind, v.slot_idx, v.position, v.fail_reason_bits) for v in violations if v.kernel_kind != HEAD} == {
        (TAIL, bad, 5, REAL_KV), (SWEEP, bad, 5, REAL_KV)}
    assert s["violations_by_tag"]["TAIL_K_FULL"] == s["violations_by_tag"]["SWEEP_K_FULL"] == 3
    want, _ = _head_flood(NUMPY)
    assert session.report().to_json() == want.report().to_json() and s == want.stats


def test_staging_of_a_split_ring_matches_the_numpy_reference(ab):
    """A ring of 64 rows in 4 shares of 16 with their own ticket counters (one past its share): the
    record holds each share's rows in share order, every counter is reset."""
    from test_session import _current_stream, _stage_case

    tickets = [20, 0, 5, 16]
    got, layout, stage = _stage_case(ab, attribution_capacity=1000, write_index=tickets)
    want, _, want_stage = _stage_case(NUMPY, attribution_capacity=1000, write_index=tickets)
    ring = want["ring"].copy()
    stage(3, _current_stream(ab))
    want_stage(3, None)
    g, w = ab.to_numpy(got["staging"]), want["staging"]
    rows = np.concatenate([ring[0:16], ring[32:37], ring[48:64]])
    assert int(w[0]) == len(rows) == 37
    np.testing.assert_array_equal(w[layout.ring : layout.ring + rows.size], rows.reshape(-1))
    a = layout.attribution
    np.testing.assert_array_equal(g[:a], w[:a])
    np.testing.assert_array_equal(ab.to_numpy(got["marks"]), want["marks"])
    assert ab.to_numpy(got["write_index"]).tolist() == want["write_index"].tolist() == [0, 0, 0, 0]
    kept = int(w[2])
    assert kept > 5 and int(g[2]) == kept
    records = lambda s: sorted(map(tuple, s[a : a + 6 * kept].reshape(kept, 6).tolist()))  # GPU threads: any order
    assert records(g) == records(w)


def test_staging_refuses_rings_that_do_not_share_the_ring_evenly(ab):
    from test_session import _stage_case

    for tickets in ([1, 2, 3], [0] * 9):  # 64 rows in 3 shares; 9 shares (at most 8)
        with pytest.raises(ValueError, match="equal share of the ring"):
            _stage_case(ab, attribution_capacity=8, write_index=tickets)


# -- issue 28 item 11: sweep names the caller's argument ---------------------------------------------


def test_sweep_names_seq_lens_in_its_errors(ab):
    session = kc.CanarySession(64, max_batch_size=4, on_violation="ignore", like=ab.like)
    rtt = ab.asarray(np.arange(64, dtype=np.int32).reshape(4, 16))
    rp = ab.asarray(np.array([1], np.int64))
    with pytest.raises(TypeError, match=r"^kv-canary: seq_lens must have dtype int64, got int32") as info:
        session.sweep(rp, ab.asarray(np.array([3], np.int32)), rtt)
    assert "prefix_lens" not in str(info.value) and info.value.__context__ is None
    with pytest.raises(ValueError, match=r"^kv-canary: seq_lens must be 1-D"):
        session.sweep(rp, ab.asarray(np.array([[3]], np.int64)), rtt)
    session.sweep(rp, ab.asarray(np.array([3], np.int64)), rtt)  # a good sweep still runs
    assert session.stats["sweeps"] == 1
