"""CanarySession: a toy engine loop on every backend (NumPy, CPU torch, CuPy, CUDA torch), checked
against hand-computed expectations and, byte for byte, against the NumPy session."""

import logging

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.session import violations
from conftest import get_backend_or_skip
from session_engine import ToyEngine, token_id

NUMPY = get_backend_or_skip("numpy")
CHAIN, POSITION, REAL_KV, TOKEN = 1, 2, 4, 32
HEAD, TAIL, SWEEP = 0, 2, 4  # HEAD_K_FULL, TAIL_K_FULL, SWEEP_K_FULL

# Pool rows 1 (A) and 2 (B) run every step; others join and skip steps.
SCHEDULE = [[1, 2], [1, 2, 3], [2, 1, 3, 4], [1, 2, 4], [3, 1, 2], [1, 2, 5, 4], [2, 1], [1, 2, 3], [1, 2]]
FAULT_STEP = 4  # req_to_token[A, 2] := B's slot at position 4 (a stale table entry)


def sync(ab):
    """Wait for the whole device (the session's side stream too), so 'one step late' is exact."""
    if ab.is_gpu:
        import cupy

        cupy.cuda.Device().synchronize()


def make_session(ab, engine, **kw):
    kw.setdefault("max_batch_size", engine.bs)
    return kc.CanarySession(engine.num_slots, like=ab.like, **kw)


def run_step(session, ab, arrays, table, *, before_post=None, **pre_kw):
    a = {k: ab.asarray(v) for k, v in arrays.items()}
    session.pre_forward(a["rp"], a["prefix"], a["extend"], ab.asarray(table), a["ids"], a["pos"], a["loc"], **pre_kw)
    if before_post is not None:
        before_post()
    session.post_forward()
    sync(ab)
    session.end_step()


def run_fault_loop(ab, on_violation):
    """The schedule with the stale table entry from FAULT_STEP; returns session, errors, expectations."""
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation=on_violation)
    raised = []
    for step, rows in enumerate(SCHEDULE):
        arrays = engine.step(rows)
        if step == FAULT_STEP:
            bad, successor, prev = int(engine.rtt[2, 4]), int(engine.rtt[1, 3]), int(engine.rtt[1, 1])
            engine.rtt[1, 2] = bad
            fault_batch_row = rows.index(1)
        try:
            run_step(session, ab, arrays, engine.rtt)
        except kc.CanaryViolationError as exc:
            raised.append((step, exc))
    session.check()
    expected = {
        (tag, bad, 4, CHAIN | POSITION): dict(expected_position=2, prev_slot_idx=prev) for tag in (HEAD, TAIL)
    } | {(tag, successor, 3, CHAIN): dict(expected_position=3, prev_slot_idx=bad) for tag in (HEAD, TAIL)}
    return session, raised, expected, fault_batch_row


@pytest.mark.parametrize("policy", ["raise", "log", "ignore", "callable"])
def test_persistent_fault_is_reported_once_with_a_growing_repeat_count(ab, policy, caplog):
    received = []
    caplog.set_level(logging.WARNING, logger="kvcanary_cupy")
    session, raised, expected, batch_row = run_fault_loop(ab, received.append if policy == "callable" else policy)
    repeats = len(SCHEDULE) - FAULT_STEP  # A runs every step
    report = session.report()
    assert {v.key for v in report.violations} == set(expected)
    for v in report.violations:
        assert (v.expected_position, v.prev_slot_idx) == tuple(expected[v.key].values())
        assert (v.batch_rows, v.repeats, v.first_step, v.last_step) == ((batch_row,), repeats, FAULT_STEP, len(SCHEDULE) - 1)
        assert v.stored_token == (token_id(2, 4) if v.position == 4 else token_id(1, 3))
    stats = session.stats
    assert (stats["violations"], stats["rows_read"], stats["dropped_rows"]) == (4 * repeats, 4 * repeats, 0)
    assert stats["distinct_violations"] == 4 and stats["steps"] == len(SCHEDULE) and stats["pending_steps"] == 0
    assert stats["violations_by_tag"] == {"HEAD_K_FULL": 2 * repeats, "TAIL_K_FULL": 2 * repeats}
    assert stats["violations_by_reason"] == {"verify_chain_hash": 4 * repeats, "verify_position": 2 * repeats}

    logged = [r.getMessage() for r in caplog.records if r.name == "kvcanary_cupy"]
    if policy == "raise":  # one step late, once
        ((step, exc),) = raised
        assert step == FAULT_STEP + 1 and isinstance(exc, RuntimeError)
        assert {v.key for v in exc.report.violations} == set(expected)
        assert str(exc).splitlines()[1:5] == [v.format() for v in exc.report.violations]
    else:
        assert raised == []
    if policy == "log":
        assert sorted(logged) == sorted(v.format() for v in report.violations)  # 4 < LOG_SUMMARY_AT: no summary
        assert all(r.levelno == logging.WARNING for r in caplog.records)
    else:
        assert logged == []
    if policy == "callable":
        (got,) = received
        assert [v.key for v in got.violations] == [v.key for v in report.violations]
        assert got.total_violations == 4  # the session's totals when it was handled: the fault step's rows


def test_every_backend_reports_what_numpy_reports(ab):
    got, *_ = run_fault_loop(ab, "ignore")
    want, *_ = run_fault_loop(NUMPY, "ignore")
    assert got.report().to_dicts() == want.report().to_dicts()
    assert got.report().to_json() == want.report().to_json()
    assert got.stats == want.stats


def test_clean_loop_reports_nothing_and_counts_entries(ab):
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation="raise")
    entries = 0
    for rows in SCHEDULE:
        arrays = engine.step(rows)
        entries += int(arrays["prefix"].sum())
        run_step(session, ab, arrays, engine.rtt)
    session.check()
    assert session.report().violations == ()
    s = session.stats
    assert (s["steps"], s["verified_entries"], s["violations"], s["health_failures"]) == (len(SCHEDULE), entries, 0, 0)
    assert s["violations_by_tag"] == {} and s["verify_skipped_steps"] == 0
    report = session.report()
    runs = report.kernel_run_counters
    assert runs[HEAD] == runs[TAIL] == 2 * len(SCHEDULE) and runs.sum() == 4 * len(SCHEDULE)  # verify + write each


def test_a_slot_read_by_two_batch_rows_names_both(ab):
    """Batch row 2 re-reads row 1's sequence (extend 0, as a shared prefix would): both are named."""
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation="ignore")
    steps = 5
    for step in range(steps):
        arrays = engine.step([1, 2])
        arrays["rp"][2], arrays["prefix"][2] = 1, arrays["prefix"][0]
        if step == 2:
            bad, successor = int(engine.rtt[2, 4]), int(engine.rtt[1, 3])
            engine.rtt[1, 2] = bad
        run_step(session, ab, arrays, engine.rtt)
    session.check()
    report = session.report()
    assert {v.key for v in report.violations} == {(t, bad, 4, CHAIN | POSITION) for t in (HEAD, TAIL)} | {
        (t, successor, 3, CHAIN) for t in (HEAD, TAIL)}
    assert all(v.batch_rows == (0, 2) and v.repeats == 2 * (steps - 2) for v in report.violations)


def test_many_new_violations_log_a_summary_and_past_the_cap_are_counted(monkeypatch, caplog):
    monkeypatch.setattr(violations, "MAX_DISTINCT_VIOLATIONS", 6)
    caplog.set_level(logging.WARNING, logger="kvcanary_cupy")
    engine = ToyEngine()
    session = make_session(NUMPY, engine, ring_capacity=8, on_violation="log")

    def flood():
        session.tail_canary[:, 3] = 1

    with pytest.warns(kc.CanaryCoverageWarning, match="MAX_DISTINCT_VIOLATIONS=6"):
        for step in range(3):
            arrays = engine.step([1, 2])
            arrays["rp"][2], arrays["prefix"][2] = 1, arrays["prefix"][0]  # row 1's prefix is read twice
            run_step(session, NUMPY, arrays, engine.rtt, before_post=flood if step == 1 else None)
        session.check()
    s = session.stats
    # Steps 1 and 2: 6 + 6 + 6 prefix entries fail (row 1 twice, row 2; the records stay flooded). The ring
    # keeps the first 8 rows, 8 keys, each step. Step 1: the 7th and 8th key evict the 1st and 2nd (each read
    # once), all 8 reach the policy. Step 2: the 6 kept keys repeat; the 1st and 2nd are new again and evict
    # the 3rd and 4th (read twice each).
    assert (s["violations"], s["rows_read"], s["dropped_rows"]) == (36, 16, 20)
    assert (s["distinct_violations"], s["evicted_violations"], s["untracked_rows"]) == (6, 4, 1 + 1 + 2 + 2)
    assert sum(v.repeats for v in session.report().violations) == 16 - 6
    # the 8 marked slots are read by 6 * 2 + 2 = 14 entries; 8 are kept
    assert s["unattributed_entries"] == 2 * (14 - 8)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 8 + 1 + 2  # 8 new violations and the summary, then the 2 evicted ones seen again
    assert logged[8].startswith("kv_canary summary: 8 violations listed, 18 counted, 8 read, 10 dropped; ")
    assert logged[9:] == logged[:2]


def test_one_step_late(ab):
    """A step's violations are handled by the next end_step, never by its own."""
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation="ignore")
    for step, rows in enumerate(SCHEDULE[: FAULT_STEP + 2]):
        arrays = engine.step(rows)
        if step == FAULT_STEP:
            engine.rtt[1, 2] = engine.rtt[2, 4]
        run_step(session, ab, arrays, engine.rtt)
        assert session.stats["pending_steps"] == 1
        found = {v.first_step for v in session.report().violations}
        assert found == (set() if step <= FAULT_STEP else {FAULT_STEP})


def test_flood_fills_the_ring_every_step_and_loses_nothing_from_the_totals(ab):
    engine = ToyEngine(max_len=64)
    session = make_session(ab, engine, ring_capacity=8, on_violation="ignore")

    def flood():  # every record's real-KV hash is wrong
        session.tail_canary[:, 3] = 1

    total = rows_read = 0
    for step in range(40):
        arrays = engine.step([1, 2, 3])
        run_step(session, ab, arrays, engine.rtt, before_post=flood)
        n = int(arrays["prefix"].sum())  # every TAIL verify entry fails
        total += n
        rows_read += min(n, 8)
    session.check()
    s = session.stats
    assert (s["violations"], s["rows_read"], s["dropped_rows"]) == (total, rows_read, total - rows_read)
    assert s["violations_by_tag"] == {"TAIL_K_FULL": total}
    assert s["violations_by_reason"] == {"verify_real_kv_hash": rows_read}
    report = session.report()
    assert (report.total_violations, report.dropped, report.rows_read) == (total, total - rows_read, rows_read)
    assert sum(v.repeats for v in report.violations) == rows_read
    assert all(v.key[0] == TAIL and v.fail_reason_bits == REAL_KV and v.batch_rows for v in report.violations)
    assert total > 40 * 8 * 4  # the ring really overflowed every step


def test_capacity_overflow_warns_once_and_is_counted(ab):
    engine = ToyEngine()
    session = make_session(ab, engine, verify_capacity=20, on_violation="raise")
    skipped = verified = 0
    with pytest.warns(kc.CanaryCapacityWarning, match="verify_capacity=20") as caught:
        for rows in SCHEDULE:
            arrays = engine.step(rows)
            n = int(arrays["prefix"].sum())
            skipped += n > 20
            verified += n if n <= 20 else 0
            run_step(session, ab, arrays, engine.rtt)
        session.check()
    assert len([w for w in caught if issubclass(w.category, kc.CanaryCapacityWarning)]) == 1
    assert skipped >= 3
    assert (session.stats["verify_skipped_steps"], session.stats["verified_entries"]) == (skipped, verified)


@pytest.mark.parametrize("policy", ["raise", "log"])
def test_health_error_when_a_step_ran_no_canary_kernel(ab, policy, caplog):
    caplog.set_level(logging.ERROR, logger="kvcanary_cupy")
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation=policy)
    raised = []

    def attempt(call):
        sync(ab)
        try:
            call()
        except kc.CanaryHealthError as exc:
            raised.append(str(exc))

    run_step(session, ab, engine.step([1, 2]), engine.rtt)
    attempt(session.end_step)  # step 1: a graph that lost the canary, nothing ran
    a = {k: ab.asarray(v) for k, v in engine.step([1, 2]).items()}
    session.pre_forward(a["rp"], a["prefix"], a["extend"], ab.asarray(engine.rtt), a["ids"], a["pos"], a["loc"])
    attempt(session.end_step)  # step 2: post_forward missing, the TAIL tag did not run; handles step 1
    attempt(session.check)  # handles step 2
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    messages = raised if policy == "raise" else logged
    assert (raised if policy == "log" else logged) == []
    assert len(messages) == 2
    assert "['HEAD_K_FULL', 'TAIL_K_FULL'] in step 1" in messages[0] and "['TAIL_K_FULL'] in step 2" in messages[1]
    assert session.stats["health_failures"] == 2


def test_sweep_finds_a_cached_sequence_no_request_reads(ab):
    engine = ToyEngine()
    cached = {}
    source = lambda: (ab.asarray(np.array([3, 4], np.int64)), ab.asarray(engine.lens[[3, 4]]), ab.asarray(engine.rtt))
    session = make_session(ab, engine, on_violation="ignore", sweep_every=2, sweep_source=source)
    for step, rows in enumerate([[1, 3, 4], [1, 3, 4], [1, 2], [1, 2], [1, 2], [1, 2]]):
        arrays = engine.step(rows)
        if step == 2:  # rows 3 and 4 finished; their slots stay cached.  A stray write hits row 4's newest.
            cached["slot"] = int(engine.rtt[4, 6])
            session.tail_canary[cached["slot"], 1] = 99
        run_step(session, ab, arrays, engine.rtt)
    session.sweep(*source())
    session.check()
    (v,) = session.report().violations
    assert v.key == (SWEEP, cached["slot"], 99, POSITION)
    assert (v.batch_rows, v.expected_position, v.prev_slot_idx) == ((1,), 6, None)  # sequence 1 of the sweep
    assert (v.first_step, v.repeats) == (3, 3)  # sweeps after steps 3 and 5, then the explicit one
    assert session.stats["sweeps"] == 4


def test_sweep_plan_grows_and_keeps_counting_out_of_range_inputs(ab):
    engine = ToyEngine()
    session = make_session(ab, engine, on_violation="raise")
    run_step(session, ab, engine.step([1, 2]), engine.rtt)  # both rows prefill 6 tokens
    a = lambda v: ab.asarray(np.asarray(v, np.int64))
    session.sweep(a([1, 99]), a([6, 3]), ab.asarray(engine.rtt))  # pool row 99 does not exist: skipped, counted
    many = [1, 2] * 40
    session.sweep(a(many), a(engine.lens[many]), ab.asarray(engine.rtt))  # 80 sequences: the plan grows
    with pytest.warns(kc.CanaryCoverageWarning, match="1 plan inputs or kernel items were out of range"):
        assert session.check() == 1
    assert session._sweep_planner.capacities.write_req_capacity == 128
    s = session.stats
    assert (s["sweeps"], s["out_of_range_skipped"], s["violations"], s["verified_entries"]) == (2, 1, 0, 6 + 80 * 6)


def test_expected_token_check_catches_a_rewritten_newest_record(ab):
    """The newest record rewritten with the right chain and a wrong token: only the token check sees it."""
    found = {}
    for check in (False, True):
        engine = ToyEngine()
        session = make_session(ab, engine, on_violation="ignore", check_expected_tokens=check)
        for step in range(5):
            arrays = engine.step([1, 2])
            valid = np.where(arrays["rp"] != 0, arrays["prefix"], 0)
            run_step(session, ab, arrays, engine.rtt, expected_tokens=ab.asarray(engine.expected_tokens()),
                     expected_tokens_valid_lens=ab.asarray(valid))
            if step == 1:  # after the step: row 1's newest record now holds another token
                slot = int(engine.rtt[1, engine.lens[1] - 1])
                for buf in (session.head_canary, session.tail_canary):
                    buf[slot, 0] = 7
        session.check()
        found[check] = {v.key: v for v in session.report().violations}
    assert found[False] == {}
    position = 6  # prefill 6, decode 1: the newest position after step 1
    assert set(found[True]) == {(HEAD, slot, position, TOKEN), (TAIL, slot, position, TOKEN)}
    for v in found[True].values():
        assert (v.stored_token, v.expected_token, v.expected_position, v.repeats) == (7, token_id(1, position), position, 3)


def test_swa_session_uses_swa_tags(ab):
    engine = ToyEngine()
    lut = ab.asarray(np.arange(engine.num_slots, dtype=np.int64))
    session = make_session(ab, engine, on_violation="ignore", swa_window_size=4, full_to_swa_index_mapping=lut)
    for step, rows in enumerate(SCHEDULE[:6]):
        arrays = engine.step(rows)
        if step == FAULT_STEP:
            engine.rtt[1, engine.lens[1] - 3] = engine.rtt[2, 4]  # inside the window of 4
        run_step(session, ab, arrays, engine.rtt)
    session.check()
    tags = {v.launch_tag for v in session.report().violations}
    assert tags == {"HEAD_K_SWA", "TAIL_K_SWA"}


# -- argument checks ---------------------------------------------------------------------------------


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="on_violation must be one of"):
        kc.CanarySession(16, max_batch_size=2, on_violation="warn")
    with pytest.raises(ValueError, match="ring_capacity must be positive"):
        kc.CanarySession(16, max_batch_size=2, ring_capacity=0)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        kc.CanarySession(0, max_batch_size=2)
    with pytest.raises(TypeError, match="max_batch_size must be an int"):
        kc.CanarySession(16, max_batch_size=2.0)
    with pytest.raises(ValueError, match="needs full_to_swa_index_mapping"):
        kc.CanarySession(16, max_batch_size=2, swa_window_size=4)
    with pytest.raises(ValueError, match="sweep_every > 0 needs sweep_source"):
        kc.CanarySession(16, max_batch_size=2, sweep_every=3)
    with pytest.raises(ValueError, match="real_kv_hash_mode must be a RealKvHashMode"):
        kc.CanarySession(16, max_batch_size=2, real_kv_hash_mode=7)
    with pytest.raises(TypeError, match="like must be a NumPy array"):
        kc.CanarySession(16, max_batch_size=2, like=[1])


def test_default_verify_capacity_is_a_multiple_of_num_slots():
    session = kc.CanarySession(100, max_batch_size=4)
    assert session.planner.capacities.verify_capacity == kc.session.VERIFY_HEADROOM * 100 == 300
    assert kc.CanarySession(100, max_batch_size=4, verify_capacity=7).planner.capacities.verify_capacity == 7


def test_step_calls_reject_bad_order_and_arguments_before_writing(ab):
    engine = ToyEngine()
    session = make_session(ab, engine, max_batch_size=2)
    with pytest.raises(RuntimeError, match="post_forward\\(\\) needs a pre_forward"):
        session.post_forward()
    arrays = {k: ab.asarray(v) for k, v in engine.step([1, 2, 3]).items()}
    table = ab.asarray(engine.rtt)
    with pytest.raises(ValueError, match="bs=8 .* exceeds the session's max_batch_size=2"):
        session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], table, arrays["ids"], arrays["pos"], arrays["loc"])
    session = make_session(ab, engine)
    with pytest.raises(ValueError, match="positions length must be len\\(input_ids\\)=64, got 63"):
        session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], table, arrays["ids"], arrays["pos"][:63], arrays["loc"])
    with pytest.raises(TypeError, match=r"out_cache_loc must have dtype int32 or int64, got (torch\.)?float32$"):  # int32: tests/test_int32_step_inputs.py
        session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], table, arrays["ids"], arrays["pos"],
                            ab.asarray(np.zeros(64, np.float32)))
    assert int(ab.to_numpy(session.log.kernel_run_counters).sum()) == 0  # nothing ran
    session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], table, arrays["ids"], arrays["pos"], arrays["loc"])
    with pytest.raises(RuntimeError, match="sweep\\(\\) between pre_forward\\(\\) and end_step\\(\\)"):
        session.sweep(arrays["rp"], arrays["prefix"], table)


# -- the staging kernels against the NumPy reference ------------------------------------------------


def _stage_case(ab, *, attribution_capacity, seed=0, write_index=None):
    """A log with verify and write rows, a plan whose entries read some of their slots, and a staging."""
    from kvcanary_cupy.args import LogViews, StageArgs, StageLayout
    from kvcanary_cupy.backends import get_backend
    from kvcanary_cupy.interop import backend_view, placement_of

    rng = np.random.default_rng(seed)
    num_slots, ring_cap, kinds, vcap, wcap = 300, 64, 12, 500, 16
    n = 50
    ring = np.zeros((ring_cap, 8), np.int64)
    ring[:n] = rng.integers(-5, 1000, (n, 8))
    ring[:n, 1] = rng.integers(-3, num_slots + 3, n)  # some slots out of range (never marked)
    ring[:n, 7] = rng.choice([1, 2, 3, 4, 32, 8, 16, 24], n)  # write rows (8, 16, 24) are not attributed
    write_index = np.array([n + 7] if write_index is None else write_index, np.int32)
    log = dict(ring=ring, write_index=write_index, violation_counters=rng.integers(0, 99, kinds),
               slot_run_counters=rng.integers(0, 99, kinds), kernel_run_counters=rng.integers(0, 99, kinds),
               out_of_range_counters=rng.integers(0, 99, kinds))
    bs, active = 9, 420
    offsets = np.zeros(wcap + 1, np.int64)
    offsets[1 : bs + 1] = np.sort(rng.integers(0, active + 1, bs))
    offsets[bs] = active
    plan = dict(verify_slot_indices=rng.integers(-2, num_slots + 2, vcap), verify_expected_tokens=rng.integers(-1, 50, vcap),
                verify_expected_positions=rng.integers(0, 90, vcap), verify_prev_slot_indices=rng.integers(-1, num_slots, vcap),
                verify_num_valid=np.array([active], np.int32), enable=np.array([1], np.int32),
                plan_out_of_range_count=np.array([5], np.int64), verify_offsets=offsets,
                write_num_valid_reqs=np.array([bs], np.int32))
    marks = rng.integers(0, 3, num_slots)  # stale stamps from earlier stagings
    layout = StageLayout(kinds, ring_cap, attribution_capacity)
    native = {k: ab.asarray(v) for k, v in (log | plan | dict(marks=marks)).items()}
    native["staging"] = ab.asarray(np.full(layout.size, -9, np.int64))
    views = {k: backend_view(v, k, writable=True) for k, v in native.items()}
    args = StageArgs(log=LogViews(**{k: views[k] for k in log}), **{k: views[k] for k in plan}, marks=views["marks"],
                     staging=views["staging"], layout=layout)
    stage = get_backend(placement_of(native["staging"], "staging").backend).prepare_stage(args)
    return native, layout, stage


@pytest.mark.parametrize("attribution_capacity", [64, 5])
def test_staging_matches_the_numpy_reference(ab, attribution_capacity):
    got, layout, stage = _stage_case(ab, attribution_capacity=attribution_capacity)
    want, _, want_stage = _stage_case(NUMPY, attribution_capacity=attribution_capacity)
    every, every_layout, every_stage = _stage_case(NUMPY, attribution_capacity=1000)
    stage(3, _current_stream(ab))
    want_stage(3, None)
    every_stage(3, None)
    g, w = ab.to_numpy(got["staging"]), want["staging"]
    a = layout.attribution
    np.testing.assert_array_equal(g[:a], w[:a])  # header, counters, ring rows (and the untouched rest)
    np.testing.assert_array_equal(ab.to_numpy(got["marks"]), want["marks"])
    assert int(ab.to_numpy(got["write_index"])[0]) == 0 == int(want["write_index"][0])
    matches = int(w[2])
    assert matches == int(g[2]) == int(every["staging"][2]) > 5
    kept = min(matches, attribution_capacity)
    records = lambda s, at, n: set(map(tuple, s[at : at + 6 * n].reshape(n, 6).tolist()))
    all_matches = records(every["staging"], every_layout.attribution, matches)
    assert len(all_matches) == matches  # one record per entry
    got_records = records(g, a, kept)
    assert len(got_records) == kept and got_records <= all_matches  # the GPU keeps any `kept` of them
    if kept == matches:
        assert got_records == records(w, a, kept)
    # an independent check of every record: the entry reads a slot marked by this staging
    marks, offsets = want["marks"], want["verify_offsets"]
    for slot, batch_row, entry, expected_pos, prev, expected_tok in all_matches:
        assert marks[slot] == 3 and want["verify_slot_indices"][entry] == slot
        assert offsets[batch_row] <= entry < offsets[batch_row + 1]
        assert (expected_pos, prev, expected_tok) == (want["verify_expected_positions"][entry],
                                                      want["verify_prev_slot_indices"][entry],
                                                      want["verify_expected_tokens"][entry])
    verify_rows = w[layout.ring : layout.ring + 8 * 50].reshape(50, 8)
    verify_rows = verify_rows[(verify_rows[:, 7] & 24) == 0]
    in_range = {s for s in verify_rows[:, 1].tolist() if 0 < s < 300}  # (slot 0: only hole rows name it)
    active = want["verify_slot_indices"][:420]
    assert matches == int(np.isin(active, list(in_range)).sum())


def _current_stream(ab):
    if not ab.is_gpu:
        return None
    import cupy

    return cupy.cuda.get_current_stream()


def test_staging_into_a_record_of_the_ring_matches_the_numpy_reference(ab):
    """A session stages each step into a record of its ring, named per call (a device address on a
    GPU): the bytes there are the reference's, and the bound record is left alone."""
    from kvcanary_cupy.interop import backend_view

    got, layout, stage = _stage_case(ab, attribution_capacity=1000)  # room for every match
    want, _, want_stage = _stage_case(NUMPY, attribution_capacity=1000)
    record = ab.asarray(np.full(layout.size, -7, np.int64))
    view = backend_view(record, "record", writable=True)
    stage(3, _current_stream(ab), view.data.ptr if ab.is_gpu else view)
    want_stage(3, None)
    written = layout.ring + 8 * int(want["staging"][0])  # header, counters, the ring rows read
    np.testing.assert_array_equal(ab.to_numpy(record)[:written], want["staging"][:written])
    a, kept = layout.attribution, int(want["staging"][2])
    assert kept > 5 and int(ab.to_numpy(record)[2]) == kept
    rows = lambda s: sorted(map(tuple, s[a : a + 6 * kept].reshape(kept, 6).tolist()))  # GPU threads: any order
    assert rows(ab.to_numpy(record)) == rows(want["staging"])
    assert (ab.to_numpy(got["staging"]) == -9).all()
