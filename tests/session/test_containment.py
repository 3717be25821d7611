"""A session names every read of a violating slot (every step, repeats included, with the engine's
row labels) and says what to contain: report.victims() and report.poisoned_pages(page_size)."""

import sys

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason, Reader
from kvcanary_cupy.session import violations as session_violations
from canary_builders import a64

HOLE, POSITION, CHAIN = (FailReason.VERIFY_TABLE_HOLE.value, FailReason.VERIFY_POSITION_MISMATCH.value,
                         FailReason.VERIFY_CHAIN_HASH_MISMATCH.value)


def _step(session, ab, rows, prefix, extend, rtt, slots, labels=None):
    """One step: ``rows`` pool rows, ``slots`` the write slots of the step's new tokens (in order)."""
    n = len(slots)
    positions = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)]).astype(np.int64)
    session.pre_forward(a64(ab, rows), a64(ab, prefix), a64(ab, extend), ab.asarray(rtt), a64(ab, 100 + positions),
                        a64(ab, positions), a64(ab, slots), row_labels=labels)
    assert len(positions) == n
    session.post_forward()
    session.end_step()


def _hole_case(ab, **options):
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore", **options)
    rtt = np.zeros((4, 16), np.int32)
    rtt[1, :5] = [5, 6, 7, 8, 9]
    _step(session, ab, [1], [0], [4], rtt, [5, 6, 7, 8])
    rtt[1, 2] = 0  # the table entry of position 2 cleared too early
    _step(session, ab, [1], [4], [1], rtt, [9], labels=["req-a"])
    session.check()
    return session


def test_a_zeroed_entry_is_reported_with_its_request_and_position(ab):
    report = _hole_case(ab).report()
    got = [(v.launch_tag, v.slot_idx, v.position, v.fail_reason_bits, v.batch_rows, v.readers) for v in report.violations]
    assert got == [(tag, 0, 2, HOLE, (0,), (Reader(1, 0, "req-a", False),)) for tag in ("HEAD_K_FULL", "TAIL_K_FULL")]
    v = report.violations[0]
    assert (v.is_hole, v.expected_position, v.expected_aux, v.stored_token, v.expected_chain_hash) == (True, 2, 2, -1, None)
    assert v.format().endswith("stored_chain_hash=0x0000000000000000 entry=2")
    assert report.rows_by_reason() == {"verify_table_hole": 2}
    assert _hole_case(ab, check_holes=False).report().violations == ()  # SGLang's rule: unseen


def _shared_prefix_case(ab):
    """Rows 1 and 2 share the prefix slots 5-8; slot 6's records are corrupted (position 99) after
    step 0; step 1 runs both requests ("a", "b"), step 2 only "b"."""
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore")
    rtt = np.zeros((4, 16), np.int32)
    rtt[1, :6] = [5, 6, 7, 8, 9, 12]
    rtt[2, :6] = [5, 6, 7, 8, 10, 11]
    _step(session, ab, [1], [0], [4], rtt, [5, 6, 7, 8])
    for buf in (session.head_canary, session.tail_canary):
        buf[6, 1] = 99
    _step(session, ab, [1, 2], [4, 4], [1, 1], rtt, [9, 10], labels=["a", "b"])
    _step(session, ab, [2], [5], [1], rtt, [11], labels=["b"])
    session.check()
    return session


def test_every_read_of_a_violating_slot_is_named(ab):
    session = _shared_prefix_case(ab)
    report = session.report()
    by_key = {(v.launch_tag, v.slot_idx, v.fail_reason_bits): v for v in report.violations}
    assert set(by_key) == {(t, s, b) for t in ("HEAD_K_FULL", "TAIL_K_FULL") for s, b in ((6, POSITION), (7, CHAIN))}
    want = (Reader(1, 0, "a"), Reader(1, 1, "b"), Reader(2, 0, "b"))
    for (tag, slot, bits), v in by_key.items():
        assert v.readers == want, (tag, slot)
        assert (v.batch_rows, v.repeats, v.first_step, v.last_step, v.readers_dropped) == ((0, 1), 3, 1, 2, 0)
    assert session.stats["dropped_readers"] == 0


def test_readers_are_bounded_and_the_overflow_counted(ab, monkeypatch):
    monkeypatch.setattr(session_violations, "MAX_READERS", 2)
    session = _shared_prefix_case(ab)
    report = session.report()
    # the newest two are kept: the reads still running are the ones an engine acts on
    assert all(v.readers == (Reader(1, 1, "b"), Reader(2, 0, "b")) and v.readers_dropped == 1 for v in report.violations)
    assert session.stats["dropped_readers"] == len(report.violations) == 4


def test_victims_and_poisoned_pages(ab):
    report = _shared_prefix_case(ab).report()
    victims = report.victims()
    assert list(victims) == list(kc.containment.VICTIM_COLUMNS)
    order = np.lexsort((victims["batch_row"], victims["step"], victims["slot_idx"], victims["launch_tag"]))
    rows = [tuple(victims[k][i].item() if hasattr(victims[k][i], "item") else victims[k][i]
                  for k in ("launch_tag", "slot_idx", "step", "batch_row", "row_label", "sweep")) for i in order]
    reads = [(1, 0, "a"), (1, 1, "b"), (2, 0, "b")]
    assert rows == [(t, s, *r, False) for t in ("HEAD_K_FULL", "TAIL_K_FULL") for s in (6, 7) for r in reads]
    assert sorted(set(victims["row_label"])) == ["a", "b"]  # the requests to abort
    pages = report.poisoned_pages(4)
    got = sorted(zip(pages["slot_idx"].tolist(), pages["page"].tolist(), pages["predecessor"].tolist(), pages["launch_tag"]))
    # slot 6 (its position), slot 7 (its chain) and, for the chain mismatch, slot 7's predecessor 6
    assert got == sorted((s, 1, p, t) for t in ("HEAD_K_FULL", "TAIL_K_FULL") for s, p in ((6, False), (7, False), (6, True)))
    assert set(report.poisoned_pages(2)["page"].tolist()) == {3}
    with pytest.raises(ValueError, match=r"^kv-canary: poisoned_pages page_size must be an int >= 1, got 0$"):
        report.poisoned_pages(0)


def test_a_hole_poisons_no_page_but_names_its_reader(ab):
    report = _hole_case(ab).report()
    assert report.poisoned_pages(4)["slot_idx"].tolist() == []
    assert report.victims()["row_label"].tolist() == ["req-a", "req-a"]


def test_victims_as_dataframes_and_without_pandas(monkeypatch):
    from conftest import get_backend_or_skip

    report = _shared_prefix_case(get_backend_or_skip("numpy")).report()
    pandas = pytest.importorskip("pandas")
    frame = report.victims(frame=True)
    assert isinstance(frame, pandas.DataFrame) and list(frame.columns) == list(kc.containment.VICTIM_COLUMNS)
    assert len(frame) == 12 and set(frame["row_label"]) == {"a", "b"}
    assert list(report.poisoned_pages(4, frame=True).columns) == list(kc.containment.PAGE_COLUMNS)
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"^kv-canary: ViolationReport.victims\(frame=True\) needs pandas: "):
        report.victims(frame=True)
    assert len(report.victims()["step"]) == 12  # the arrays need no pandas


def test_readers_survive_json():
    from conftest import get_backend_or_skip

    report = _shared_prefix_case(get_backend_or_skip("numpy")).report()
    back = kc.ViolationReport.from_json(report.to_json())
    assert back.violations == report.violations
    assert report.to_dicts()[0]["readers"][0] == {"step": 1, "batch_row": 0, "row_label": "a", "sweep": False}
    bad = report.to_json().replace('"row_label": "a"', '"row_label": 1.5', 1)
    with pytest.raises(TypeError, match=r"readers\[0\]\.row_label must be an int, a str or null, got 1.5"):
        kc.ViolationReport.from_json(bad)


def test_sweep_readers_carry_their_labels(ab):
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore")
    rtt = np.zeros((4, 16), np.int32)
    rtt[1, :4] = [5, 6, 7, 8]
    _step(session, ab, [1], [0], [4], rtt, [5, 6, 7, 8])
    session.tail_canary[8, 1] = 42  # the last record: no successor's chain breaks
    session.sweep(a64(ab, [1]), a64(ab, [4]), ab.asarray(rtt), row_labels=[1234])
    session.check()
    (v,) = session.report().violations
    assert (v.launch_tag, v.slot_idx, v.readers) == ("SWEEP_K_FULL", 8, (Reader(0, 0, 1234, True),))


def test_row_labels_are_checked(ab):
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, on_violation="ignore")
    rtt = np.zeros((4, 16), np.int32)
    args = (a64(ab, [1]), a64(ab, [0]), a64(ab, [1]), ab.asarray(rtt), a64(ab, [1]), a64(ab, [0]), a64(ab, [5]))
    with pytest.raises(ValueError, match=r"^kv-canary: row_labels must name every batch row: 1 rows \(len\(prefix_lens\)\), got 0 labels$"):
        session.pre_forward(*args, row_labels=[])
    with pytest.raises(TypeError, match=r"^kv-canary: row_labels must be ints or strs, got float 1.5$"):
        session.pre_forward(*args, row_labels=[1.5])
    with pytest.raises(TypeError, match=r"^kv-canary: row_labels must be a sequence of int or str"):
        session.pre_forward(*args, row_labels="a")
    with pytest.raises(TypeError, match=r"^kv-canary: row_labels must be ints or strs, got bool True$"):
        session.pre_forward(*args, row_labels=[True])


def test_row_labels_plain_and_numpy():
    """Plain ints and strs are taken as they are (the first n); NumPy integers become Python ints."""
    from kvcanary_cupy.session.sweep import _checked_labels

    assert _checked_labels([3, "a", 9], 2) == (3, "a") and _checked_labels((), 0) == ()
    got = _checked_labels([np.int64(4), 5, "x"], 3)
    assert got == (4, 5, "x") and type(got[0]) is int
    with pytest.raises(TypeError, match=r"got bool False$"):
        _checked_labels([1, False], 2)


def test_the_simulated_engine_contains_a_hole_from_the_report_alone():
    """A zeroed block-table entry: the hole's reader is named by its request id, aborted by the
    engine's reaction to the report, and nothing else is touched (no fault knowledge is used)."""
    from kvcanary_cupy.sim.engine import Engine, EngineConfig
    from kvcanary_cupy.sim.tables import NULL_BLOCK

    engine = Engine(EngineConfig(), seed=3, addressing="vllm", xp=np)
    for _ in range(12):
        engine.step()
        assert engine.take_violations() == []
    pool = engine.pools["prefill"]
    victim = next(r for r in pool.running if engine.exclusive_blocks(pool, r) and r.total_len - r.computed >= 2)
    victim.blocks[engine.exclusive_blocks(pool, victim)[0]] = NULL_BLOCK
    others = {r.rid for p in engine.pools.values() for r in p.running} - {victim.rid}
    engine.step()
    reported = engine.take_violations()
    assert reported and all(v.is_hole and v.slot_idx == 0 for _, v in reported)
    assert {r.row_label for _, v in reported for r in v.readers} == {victim.rid}
    aborted, evicted = engine.contain(reported)
    assert aborted == {victim.rid} and evicted == set() and not victim.alive
    assert others <= {r.rid for p in engine.pools.values() for r in p.running}  # nobody else
    engine.step()
    assert engine.take_violations() == []
