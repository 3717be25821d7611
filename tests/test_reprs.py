"""Reprs of the planner, the launchers, the plans, the log and the session; a report's to_html."""

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import i64, linear_rtt


def _where(ab) -> str:
    return {"numpy": "numpy", "torch_cpu": "torch", "cupy": "cupy on cuda:0", "torch_cuda": "torch on cuda:0"}[ab.name]


def test_fresh_plans_show_capacity_and_counters_never_entries(ab):
    vp = kc.VerifyPlan.allocate(8, like=ab.like)
    wp = kc.WritePlan.allocate(4, like=ab.like)
    assert repr(vp) == (f"<VerifyPlan verify_capacity=8 on {_where(ab)}: verify_num_valid=0, enable=1, "
                        "out_of_range_count=0 (nothing planned: no valid entries)>")
    assert repr(wp) == f"<WritePlan write_req_capacity=4 on {_where(ab)}: write_num_valid_reqs=0 (nothing planned: no valid entries)>"
    assert "array" not in repr(vp) and "tensor" not in repr(vp)


def test_planned_plans_show_valid_counts(ab):
    planner = kc.CanaryPlanner(kc.CanaryCapacities(16, 2), like=ab.like)
    vp, wp = planner.plan(ab.asarray(i64([2])), ab.asarray(i64([7])), ab.asarray(i64([1])), ab.asarray(linear_rtt(4, 16)))
    assert repr(vp) == f"<VerifyPlan verify_capacity=16 on {_where(ab)}: verify_num_valid=7, enable=1, out_of_range_count=0>"
    assert repr(wp) == f"<WritePlan write_req_capacity=2 on {_where(ab)}: write_num_valid_reqs=1>"


def test_planner_and_plan_launcher_reprs(ab, monkeypatch):
    planner = kc.CanaryPlanner(kc.CanaryCapacities(64, 4), like=ab.like)
    assert repr(planner) == f"<CanaryPlanner verify_capacity=64, write_req_capacity=4 on {_where(ab)}; plan launcher bound>"
    assert repr(planner._launcher) == (
        f"<PlanLauncher verify_capacity=64, write_req_capacity=4 on {_where(ab)}, swa_window_size=0, "
        "full_to_swa_index_mapping=none, kv_token_id_vs_position_offset=0; bound (common-case calls skip the free "
        "function's checks)>")
    lut = ab.asarray(np.arange(8, dtype=np.int64))
    swa = kc.CanaryPlanner(kc.CanaryCapacities(64, 4), like=ab.like, swa_window_size=3, full_to_swa_index_mapping=lut)
    assert ", swa_window_size=3; " in repr(swa)
    assert ", full_to_swa_index_mapping=8, " in repr(swa._launcher)
    monkeypatch.setenv("KVCANARY_FULL_VALIDATION", "1")
    assert repr(kc.CanaryPlanner(kc.CanaryCapacities(64, 4), like=ab.like)).endswith(
        "; plan launcher not bound (every plan takes kc.plan)>")


def test_verify_and_write_launcher_reprs(ab, monkeypatch):
    bufs = [kc.allocate_canary_buffer(32, like=ab.like) for _ in range(2)]
    log = kc.ViolationLog.allocate(8, like=ab.like)
    vp, wp = kc.VerifyPlan.allocate(64, like=ab.like), kc.WritePlan.allocate(4, like=ab.like)
    verify = kc.VerifyLauncher(bufs[0], vp, log=log, kernel_kind=kc.CanaryLaunchTag.TAIL_K_FULL, check_expected_token=True)
    assert repr(verify) == (
        f"<VerifyLauncher canary_buf [32x4] on {_where(ab)}, verify_capacity=64, kernel_kind=TAIL_K_FULL (2), "
        "real_kv_sources=0, real_kv_hash_mode=NONE, check_expected_tokens=True, check_holes=False; bound (common-case calls skip the free "
        "function's checks)>")
    write = kc.WriteLauncher(bufs, wp, log=log, kernel_kind=(0, 2))
    assert repr(write).startswith(
        f"<WriteLauncher canary_buf [32x4, 32x4] on {_where(ab)}, write_req_capacity=4, "
        "kernel_kind=HEAD_K_FULL (0), TAIL_K_FULL (2), real_kv_sources=0, real_kv_hash_mode=NONE, "
        "chain_position_assert=True; bound")
    monkeypatch.setenv("KVCANARY_FULL_VALIDATION", "1")
    assert repr(kc.VerifyLauncher(bufs[0], vp, log=log)).endswith(
        "; not bound (KVCANARY_FULL_VALIDATION is set): every call takes the free function>")


def test_log_and_session_reprs(ab):
    assert repr(kc.ViolationLog.allocate(16, like=ab.like)) == f"<ViolationLog ring_capacity=16 num_kinds=12 on {_where(ab)}>"
    session = kc.CanarySession(64, max_batch_size=4, like=ab.like, ring_capacity=32, on_violation="log")
    assert repr(session) == (f"CanarySession(num_slots=64, on={_where(ab)}, max_batch_size=4, verify_capacity=192, "
                             "ring_capacity=32, on_violation='log', steps=0, violations=0, distinct=0)")


@pytest.mark.parametrize("value", [-1, 0])
def test_ring_capacity_below_one_says_positive(value):
    with pytest.raises(ValueError, match=f"ring_capacity must be positive, got {value}$"):
        kc.CanarySession(16, max_batch_size=2, ring_capacity=value)


def test_to_html_is_what_jupyter_shows():
    rows = np.zeros((2, 8), np.int64)
    rows[0] = [2, 17, 4, 9, -1, 5, 6, int(kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]
    log = kc.ViolationLog.allocate(4)
    log.ring[:2] = rows
    log.write_index[0] = 2
    log.violation_counters[2] = 2
    report = log.read()
    assert report.to_html() == report._repr_html_()
    assert report.to_html().startswith(f'<div class="kvcanary-report"><p>{report.summary()}</p><table>')
    assert len(re.findall(r"<tr>", report.to_html())) == 3
    empty = kc.ViolationLog.allocate(4).read()
    assert empty.to_html() == f'<div class="kvcanary-report"><p>{empty.summary()}</p><p>No violations.</p></div>'
