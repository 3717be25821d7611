"""The report side of many ranks, in one process: ViolationReport.merge, the rank/device fields and
replica mismatches through JSON, and the session's argument checks for process_group."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import ReplicaMismatch, Violation, ViolationReport


def _report(rank, violations, total, steps, counters):
    vs = tuple(Violation(*row, rank=rank, device=f"GPU-{rank}") for row in violations)
    c = np.asarray(counters, np.int64)
    return ViolationReport(vs, total, 8, c, c * 10, c * 100, c * 0, rows_read=len(vs), steps=steps)


def test_merge_concatenates_violations_and_adds_totals_and_counters():
    a = _report(0, [[2, 17, 4, 9, -1, 5, 6, 1]], 3, 10, [0, 0, 3] + [0] * 9)
    b = _report(1, [[0, 9, 7, 11, 12, 5, 6, 24], [2, 18, 5, 9, -1, 5, 6, 1]], 5, 12, [1, 0, 4] + [0] * 9)
    m = ViolationReport.merge(a, b)
    assert [(v.rank, v.slot_idx) for v in m.violations] == [(0, 17), (1, 9), (1, 18)]
    assert (m.total_violations, m.rows_read, m.ring_capacity, m.steps, m.dropped) == (8, 3, 16, 12, 5)
    assert m.violation_counters.tolist() == [1, 0, 7] + [0] * 9
    assert m.kernel_run_counters.tolist() == [100, 0, 700] + [0] * 9
    assert m.counts_by_tag() == {"HEAD_K_FULL": 1, "TAIL_K_FULL": 7}
    assert ViolationReport.merge(a) == a


def test_merge_refuses_what_it_cannot_add():
    a = _report(0, [], 0, 1, [0] * 12)
    with pytest.raises(ValueError, match=r"^kv-canary: ViolationReport.merge needs at least one report$"):
        ViolationReport.merge()
    with pytest.raises(TypeError, match=r"^kv-canary: ViolationReport.merge: reports\[1\] must be a ViolationReport, got dict$"):
        ViolationReport.merge(a, {})
    short = _report(0, [], 0, 1, [0] * 4)
    with pytest.raises(ValueError, match=r"reports\[1\] has 4 launch kinds, reports\[0\] has 12"):
        ViolationReport.merge(a, short)


def test_rank_device_ranks_and_mismatches_survive_json_and_print():
    m = ReplicaMismatch(slot_idx=37, rank=1, other_rank=0, real_kv_hash=2**64 - 5, other_real_kv_hash=7, step=3)
    report = _report(1, [[2, 17, 4, 9, -1, 5, 6, 1]], 1, 4, [0, 0, 1] + [0] * 9)
    report = ViolationReport(report.violations, 1, 8, *(getattr(report, k) for k in (
        "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters")),
        rows_read=1, steps=4, ranks=[0, 1], replica_mismatches=(m,))
    back = ViolationReport.from_json(report.to_json())
    assert back == report and back.replica_mismatches == (m,) and back.ranks == (0, 1)
    assert back.violations[0].rank == 1 and back.violations[0].device == "GPU-1"
    assert m.to_dict() == {"kind": "replicated_kv_mismatch", "slot_idx": 37, "rank": 1, "other_rank": 0,
                           "real_kv_hash": 2**64 - 5, "other_real_kv_hash": 7, "step": 3}
    assert m.format() == ("kv_canary replicated_kv_mismatch: slot_idx=37 rank=1 real_kv_hash=0xfffffffffffffffb "
                          "other_rank=0 other_real_kv_hash=0x0000000000000007 step=3")
    assert report.violations[0].format().endswith(" rank=1 device=GPU-1")
    assert report.summary().endswith("; ranks with new violations: [0, 1]; 1 replicated_kv_mismatch")
    assert report.format().splitlines()[1] == m.format()
    assert "rank=" not in Violation(2, 17, 4, 9, -1, 5, 6, 1).format()  # a single-process line is as before


def test_json_checks_the_new_keys():
    base = _report(0, [[2, 17, 4, 9, -1, 5, 6, 1]], 1, 4, [0, 0, 1] + [0] * 9)
    text = base.to_json()
    with pytest.raises(TypeError, match=r"^kv-canary: report JSON violations\[0\].device must be a string or null, got int$"):
        ViolationReport.from_json(text.replace('"device": "GPU-0"', '"device": 3'))
    with pytest.raises(ValueError, match=r"^kv-canary: report JSON violations\[0\].rank must be in \[0, 2147483647\], got -1$"):
        ViolationReport.from_json(text.replace('"rank": 0', '"rank": -1'))
    with pytest.raises(ValueError, match=r"^kv-canary: report JSON replica_mismatches\[0\] lacks other_rank"):
        ViolationReport.from_json(text.replace('"replica_mismatches": []', '"replica_mismatches": [{"slot_idx": 1, '
                                               '"rank": 0, "real_kv_hash": 1, "other_real_kv_hash": 2, "step": 0}]'))
    old = text.replace(', "ranks": [], "replica_mismatches": []', "")  # a document from before these keys
    assert ViolationReport.from_json(old) == base


def test_session_argument_errors_for_many_ranks():
    with pytest.raises(ValueError, match=r"^kv-canary: replicated_kv and reduce_every apply to a session with a process_group"):
        kc.CanarySession(16, max_batch_size=2, replicated_kv=True)
    with pytest.raises(ValueError, match=r"^kv-canary: reduce_every must be positive, got 0$"):
        kc.CanarySession(16, max_batch_size=2, reduce_every=0)
    with pytest.raises(TypeError, match=r"^kv-canary: replicated_kv must be a bool, got int$"):
        kc.CanarySession(16, max_batch_size=2, replicated_kv=1)
    session = kc.CanarySession(16, max_batch_size=2)
    assert session.distributed is None
    with pytest.raises(kc.CanaryUsageError, match=r"^kv-canary: gather_report\(\) needs a session built with a process_group$"):
        session.gather_report()
    pytest.importorskip("torch.distributed")
    with pytest.raises(TypeError, match=r"^kv-canary: process_group must be a torch.distributed ProcessGroup "
                                        r"\(dist.new_group\(...\)\), got str$"):
        kc.CanarySession(16, max_batch_size=2, process_group="gloo")


def test_table_shapes_of_every_table_kind():
    from kvcanary_cupy.distributed import table_shape

    rtt = np.zeros((9, 64), np.int32)
    assert table_shape(rtt) == (9, 64)
    assert table_shape(kc.ReqToToken(rtt)) == (9, 64)
    assert table_shape(kc.BlockTable(np.zeros((4, 3), np.int32), 16)) == (4, 3)
    assert table_shape(kc.PagedKvIndices(np.zeros(3, np.int32), np.zeros(5, np.int32), 16)) == (0, 0)


def test_a_mismatch_names_each_odd_rank_against_the_lowest_rank_of_the_majority():
    from types import SimpleNamespace

    from kvcanary_cupy.distributed import RankReducer, _Contribution

    reducer = SimpleNamespace(stats={"replica_mismatches": 0, "replicated_slots_compared": 0}, _seen_mismatches={})
    c = _Contribution({}, [], {}, step=7, offset=100, slots=3)
    # slot 100: all agree; slot 101: rank 0 is the odd one out of 4; slot 102: ranks 0+1 against 2+3 (a tie: rank 0's value)
    hashes = np.array([[5, -1, 9], [5, 8, 9], [5, 8, -2**63], [5, 8, -2**63]], np.int64)
    found = RankReducer._mismatches(reducer, hashes, c)
    assert found == (ReplicaMismatch(101, 0, 1, 2**64 - 1, 8, 7), ReplicaMismatch(102, 2, 0, 2**63, 9, 7),
                     ReplicaMismatch(102, 3, 0, 2**63, 9, 7))
    assert RankReducer._mismatches(reducer, hashes, c) == ()  # each is reported once
    assert reducer.stats == {"replica_mismatches": 3, "replicated_slots_compared": 6}
