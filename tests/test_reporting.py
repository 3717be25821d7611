"""ViolationLog.read(): decoded violation rows, their one-line format, dropped rows and counters."""

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryLaunchTag, Violation, ViolationReport
from canary_builders import ANCHOR_H, a64, canary, make_log, make_verify_plan, make_write_plan


def test_verify_row_is_decoded(ab):
    log = make_log(ab)
    buf = ab.asarray(canary(16, {5: (33, 0, ANCHOR_H)}))
    kc.verify(buf, make_verify_plan(ab, [5], [99], [-1]), log=log, kernel_kind=CanaryLaunchTag.HEAD_K_FULL)
    report = log.read()
    assert isinstance(report, ViolationReport)
    assert report.violations == (Violation(0, 5, 0, 33, -1, ANCHOR_H, ANCHOR_H, 2),)
    v = report.violations[0]
    assert not v.is_write and v.reasons == "verify_position"
    assert v.format() == (
        "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_position slot_idx=5 position=0 "
        "stored_token=33 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
        "expected_chain_hash=0xde7fae23a9a1b716")
    assert (report.total_violations, report.ring_capacity, report.dropped) == (1, 1024, 0)
    assert report.kernel_run_counters.tolist() == [1] + [0] * 11
    assert report.slot_run_counters.tolist() == [1] + [0] * 11


def test_write_row_is_decoded(ab):
    log = make_log(ab)
    buf = ab.asarray(canary(8))
    kc.write(buf, make_write_plan(ab, [0, 1], [-1]), a64(ab, [42]), a64(ab, [0]), a64(ab, [3]), log=log,
             kernel_kind=CanaryLaunchTag.TAIL_K_SWA, expected_input_tokens=a64(ab, [99]),
             expected_input_positions=a64(ab, [0]))
    (v,) = log.read().violations
    assert v == Violation(8, 3, 0, 42, 99, ANCHOR_H, 0, 8)
    assert v.is_write and v.reasons == "write_token"
    assert v.format() == (
        "kv_canary violation: launch_tag=TAIL_K_SWA fail_reason=write_token slot_idx=3 position=0 "
        "stored_token=42 expected_token=99 stored_chain_hash=0xde7fae23a9a1b716 expected_position=0")


def test_row_decoding_signedness():
    write_row = Violation.from_row(np.array([2, 1, 5, 7, 7, -1, -3, 16], np.int64))
    assert (write_row.stored_chain_hash, write_row.expected_aux) == (2**64 - 1, -3)  # a position stays signed
    verify_row = Violation.from_row([4, 1, 5, 7, -1, -1, -2, 1 | 2])
    assert (verify_row.stored_chain_hash, verify_row.expected_aux) == (2**64 - 1, 2**64 - 2)
    assert verify_row.reasons == "verify_chain_hash+verify_position"
    assert "launch_tag=SWEEP_K_FULL" in verify_row.format()
    assert "stored_chain_hash=0xffffffffffffffff expected_chain_hash=0xfffffffffffffffe" in verify_row.format()
    assert "launch_tag=KIND_12" in Violation.from_row([12, 1, 0, 0, 0, 0, 0, 1]).format()
    assert "fail_reason=none" in Violation.from_row([0] * 8).format()


def test_dropped_rows_and_summary(ab):
    log = make_log(ab, capacity=4)
    kc.verify(ab.asarray(canary(16)), make_verify_plan(ab, list(range(1, 11)), [3] * 10, [-1] * 10), log=log,
              kernel_kind=3)
    report = log.read()
    assert (report.total_violations, len(report.violations), report.dropped) == (10, 4, 6)
    assert sorted(v.slot_idx for v in report.violations) == sorted(set(v.slot_idx for v in report.violations))
    assert all(v.kernel_kind == 3 and v.fail_reason_bits == 1 | 2 for v in report.violations)
    assert str(report).splitlines()[-1] == "total_violations=10 shown=4 dropped=6 out_of_range_skipped=0"
    assert len(str(report).splitlines()) == 5


def test_report_is_a_snapshot(ab):
    log = make_log(ab)
    kc.verify(ab.asarray(canary(16)), make_verify_plan(ab, [99], [0], [-1]), log=log, kernel_kind=1)
    report = log.read()
    assert report.out_of_range_counters.tolist() == [0, 1] + [0] * 10
    assert report.format().splitlines() == ["total_violations=0 shown=0 dropped=0 out_of_range_skipped=1"]
    log.reset()
    assert report.out_of_range_counters.tolist() == [0, 1] + [0] * 10  # a copy, not a view
    assert report.kernel_run_counters.tolist() == [0, 1] + [0] * 10
