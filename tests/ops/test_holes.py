"""Holes in a table (VERIFY_TABLE_HOLE): a position a step reads whose table entry addresses the
padding slot is a violation when ``check_holes`` is on, on every table kind, through plan + verify,
the fused plan_and_verify and the bound VerifyLauncher; SGLang's six reasons keep their bytes."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import FailReason
from canary_builders import a64, canary, host, make_log, make_verify_plan, ring_rows, stamp_chain

HOLE = FailReason.VERIFY_TABLE_HOLE.value


def hole_row(kind, position, entry, slot=0, expected_token=-1):
    """docs/format.md's hole row: slot, expected position, stored token -1, expected token, stored chain 0,
    the entry index, VERIFY_TABLE_HOLE."""
    return (kind, slot, position, -1, expected_token, 0, entry, HOLE)


def test_the_bit_and_its_label():
    assert HOLE == 1 << 16 and FailReason.label(HOLE) == "verify_table_hole"
    assert not HOLE & sum(kc.DigestFailReason)  # clear of the transfer digest's bits
    # SGLang's six bits are unchanged
    assert [m.value for m in FailReason][:6] == [1, 2, 4, 8, 16, 32]


def test_a_padding_entry_is_a_hole_only_when_asked(ab):
    buf = canary(16)
    stamp_chain(buf, [3, 4, 5], [11, 12, 13], [0, 1, 2])
    # entries: position 0 slot 3, position 1 zeroed (slot 0), position 2 slot 5 (its predecessor is unknown: 0)
    slots, positions, prevs = [3, 0, 5], [0, 1, 2], [-1, 3, 0]
    for check in (False, True):
        log = make_log(ab)
        kc.verify(ab.asarray(buf), make_verify_plan(ab, slots, positions, prevs), log=log, kernel_kind=2, check_holes=check)
        lg = host(ab, log)
        assert ring_rows(lg) == ([hole_row(2, 1, 1)] if check else [])
        assert int(lg["violation_counters"][2]) == int(check)
        assert int(lg["slot_run_counters"][2]) == 3 and int(lg["out_of_range_counters"][2]) == 0


def test_holes_leave_the_other_rows_as_they_were(ab):
    buf = canary(16)
    stamp_chain(buf, [1, 2, 3], [7, 8, 9], [0, 1, 2])
    buf[2, 1] = 5  # slot 2's position is wrong
    slots, positions, prevs, tokens = [1, 0, 2, 3, 0], [0, 1, 1, 2, 9], [-1, 1, 1, 2, 0], [7, 70, 8, 9, 90]
    rows = {}
    for check in (False, True):
        log = make_log(ab)
        kc.verify(ab.asarray(buf), make_verify_plan(ab, slots, positions, prevs, tokens=tokens), log=log,
                  check_expected_tokens=True, check_holes=check)
        rows[check] = ring_rows(host(ab, log))
    # slot 2's position, then slot 3's chain (its predecessor's record changed)
    assert [(r[1], r[7]) for r in rows[False]] == [(2, FailReason.VERIFY_POSITION_MISMATCH.value),
                                                    (3, FailReason.VERIFY_CHAIN_HASH_MISMATCH.value)]
    assert rows[True] == sorted(rows[False] + [hole_row(0, 1, 1, expected_token=70), hole_row(0, 9, 4, expected_token=90)])


def test_an_overflowed_or_disabled_plan_logs_no_hole(ab):
    log = make_log(ab)
    kc.verify(ab.asarray(canary(8)), make_verify_plan(ab, [0, 0], [0, 1], [-1, 0], enable=0), log=log, check_holes=True)
    assert ring_rows(host(ab, log)) == []


def _tables():
    """One request (pool row 1 / batch row 0) of 6 tokens, page size 2 where paged, whose position 3
    addresses the padding slot, in each table kind; and its slots."""
    slots = [10, 11, 0, 0, 14, 15]  # the page of positions 2-3 zeroed: position 2 is a hole too
    rtt = np.zeros((2, 8), np.int32)
    rtt[1, :6] = slots
    v2p = np.array([0, 5, -1, 7, 0, 0, 0, 0, 0], np.int64)  # virtual page 2 unbound
    virtual = np.zeros((2, 8), np.int32)
    virtual[1, :6] = [2, 3, 4, 5, 6, 7]  # virtual pages 1, 2, 3 -> physical 5, unbound, 7
    return {
        "req_to_token": (kc.ReqToToken(rtt), [1]),
        "virtual_pages": (kc.ReqToToken(virtual, virtual_to_physical=v2p, page_size=2), [1]),
        "block": (kc.BlockTable(np.array([[0, 0, 0, 0], [5, 0, 7, 0]], np.int32), 2), [1]),
        "block_null_9": (kc.BlockTable(np.array([[9, 9, 9, 9], [5, 9, 7, 9]], np.int32), 2, null_block=9), [1]),
        "paged_kv": (kc.PagedKvIndices(np.array([0, 3], np.int32), np.array([5, 0, 7], np.int32), 2), None),
    }, slots


@pytest.mark.parametrize("kind", ["req_to_token", "virtual_pages", "block", "block_null_9", "paged_kv"])
def test_every_table_kind_reports_its_holes(ab, kind):
    tables, slots = _tables()
    table, rp = tables[kind]
    table = table.with_arrays(lambda x, _: None if x is None else ab.asarray(x))
    buf = canary(32)
    real = [s for s in slots if s]
    # the request's records as written (positions 0, 1, 4, 5; 2 and 3 were never stored)
    stamp_chain(buf, real[:2], [1, 2], [0, 1])
    stamp_chain(buf, real[2:], [5, 6], [4, 5], start_hash=int(buf[real[1], 2]) ^ 1)  # any chain: 4 follows a hole
    rp_arr = None if rp is None else a64(ab, rp)
    for fused in (False, True):
        log = make_log(ab)
        if fused:
            kc.plan_and_verify(rp_arr, a64(ab, [6]), a64(ab, [0]), table, ab.asarray(buf), log=log, verify_capacity=16,
                               kernel_kind=0, check_holes=True)
        else:
            vp, _ = kc.plan(rp_arr, a64(ab, [6]), a64(ab, [0]), table, verify_capacity=16)
            kc.verify(ab.asarray(buf), vp, log=log, kernel_kind=0, check_holes=True)
        rows = ring_rows(host(ab, log))
        holes = [r for r in rows if r[7] == HOLE]
        if kind == "paged_kv":  # a CSR table has no null block: page 0 is slots 0 and 1, of which only 0 is padding
            assert holes == [hole_row(0, 2, 2)], fused
            # slot 1 holds no record of position 3, and is position 4's predecessor
            assert [r[1] for r in rows if r[7] != HOLE] == [1, 14], fused
            continue
        assert holes == [hole_row(0, 2, 2), hole_row(0, 3, 3)], (kind, fused)
        # position 4's chain check is skipped (its predecessor is unknown), so nothing else fires
        assert rows == holes, (kind, fused)


def test_sliding_window_positions_outside_the_window_stay_null(ab):
    # SWA: positions 0-3 evicted (LUT 0), window 2 of a prefix of 6 reads positions 4 and 5
    rtt = np.zeros((2, 8), np.int32)
    rtt[1, :6] = [1, 2, 3, 4, 5, 6]
    lut = np.array([0, 0, 0, 0, 0, 9, 10, 0], np.int64)
    buf = canary(16)
    stamp_chain(buf, [9, 10], [5, 6], [4, 5])  # the window head's predecessor is evicted (0): its chain is unchecked
    log = make_log(ab)
    vp, _ = kc.plan(a64(ab, [1]), a64(ab, [6]), a64(ab, [0]), ab.asarray(rtt), verify_capacity=8, swa_window_size=2,
                    full_to_swa_index_mapping=ab.asarray(lut))
    kc.verify(ab.asarray(buf), vp, log=log, kernel_kind=6, check_holes=True)
    assert ring_rows(host(ab, log)) == []
    # a zeroed LUT entry inside the window is a hole
    lut[6] = 0
    log = make_log(ab)
    vp, _ = kc.plan(a64(ab, [1]), a64(ab, [6]), a64(ab, [0]), ab.asarray(rtt), verify_capacity=8, swa_window_size=2,
                    full_to_swa_index_mapping=ab.asarray(lut))
    kc.verify(ab.asarray(buf), vp, log=log, kernel_kind=6, check_holes=True)
    assert ring_rows(host(ab, log)) == [hole_row(6, 5, 1)]


def test_the_bound_launcher_checks_holes_as_verify_does(ab):
    planner = kc.CanaryPlanner(kc.CanaryCapacities(verify_capacity=16, write_req_capacity=2), like=ab.like)
    buf = ab.asarray(canary(16))
    logs = {}
    for check in (False, True):
        logs[check] = make_log(ab)
        launcher = kc.VerifyLauncher(buf, planner.verify_plan, log=logs[check], kernel_kind=3, check_holes=check)
        assert f"check_holes={check}" in repr(launcher)
        rtt = np.zeros((2, 4), np.int32)
        rtt[1, :3] = [4, 0, 6]
        planner.plan(a64(ab, [1]), a64(ab, [3]), a64(ab, [0]), ab.asarray(rtt))
        launcher()
    assert [r for r in ring_rows(host(ab, logs[True])) if r[7] == HOLE] == [hole_row(3, 1, 1)]
    assert not [r for r in ring_rows(host(ab, logs[False])) if r[7] == HOLE]


def test_check_holes_must_be_a_bool():
    with pytest.raises(TypeError, match="check_holes must be a bool, got int"):
        kc.verify(canary(4), kc.VerifyPlan.allocate(1), log=kc.ViolationLog.allocate(4), check_holes=1)


def test_the_bench_times_the_hole_check_off_and_on(tmp_path):
    import json

    from kvcanary_cupy.devtools import bench

    out = tmp_path / "b.json"
    assert bench.main(["--backend", "numpy", "--workloads", "W3", "--sections", "holes", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r.get("section") == "holes"]
    assert [(r["workload"], r["op"]) for r in rows] == [("W3", op) for op in ("verify", "verify[bound]", "plan_and_verify")]
    assert all(r["off"] > 0 and r["on"] > 0 and abs(r["ratio"] - r["on"] / r["off"]) < 0.01 * r["ratio"] for r in rows)


@pytest.mark.gpu
def test_a_captured_session_reports_holes_as_the_numpy_one_does():
    """pre_forward/post_forward captured once in a CuPy graph, replayed over steps whose table gets
    a zeroed entry: the same holes, readers and counts as an eager NumPy session."""
    from conftest import get_backend_or_skip
    from session_engine import ToyEngine

    ab = get_backend_or_skip("cupy")
    import cupy

    kc.warmup()
    engine, steps = ToyEngine(), []
    for step, rows in enumerate([[1, 2], [1, 2, 3], [2, 1, 3], [1, 2, 3], [3, 1, 2]]):
        arrays = engine.step(rows)
        if step == 2:
            engine.rtt[1, 1] = 0  # row 1's position 1 cleared too early
        steps.append((arrays, engine.rtt.copy()))
    reference = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, on_violation="ignore")
    for a, table in steps:
        reference.pre_forward(a["rp"], a["prefix"], a["extend"], table, a["ids"], a["pos"], a["loc"])
        reference.post_forward()
        reference.end_step()
    reference.check()
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        bufs = {k: ab.asarray(v) for k, v in steps[0][0].items()}
        table = ab.asarray(steps[0][1])
        stream.synchronize()
        stream.begin_capture()
        session.pre_forward(bufs["rp"], bufs["prefix"], bufs["extend"], table, bufs["ids"], bufs["pos"], bufs["loc"])
        session.post_forward()
        graph = stream.end_capture()
        for arrays, rtt in steps:
            for k, v in arrays.items():
                bufs[k][...] = ab.asarray(v)
            table[...] = ab.asarray(rtt)
            graph.launch(stream)
            stream.synchronize()
            session.end_step()
        session.check()
    want = reference.report()
    assert any(v.is_hole for v in want.violations)
    assert session.report().to_dicts() == want.to_dicts()
