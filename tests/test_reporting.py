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


# -- exports: dicts, JSON, JSON lines, pandas, HTML, summary ------------------------------------------

import dataclasses
import json
import sys

import pytest

from kvcanary_cupy import reporting

VERIFY_V = Violation(2, 17, 4, 204, -1, 0xFEDCBA9876543210, 0x0123456789ABCDEF, 1 | 2, expected_position=2,
                     prev_slot_idx=34, batch_rows=(3, 0), repeats=5, first_step=4, last_step=8)
WRITE_V = Violation(0, 9, 7, 11, 12, 5, 6, 8 | 16, batch_rows=[], first_step=1, last_step=1)


def _hand_report():
    counters = np.zeros(12, np.int64)
    counters[0], counters[2] = 3, 5
    return ViolationReport(violations=(VERIFY_V, WRITE_V), total_violations=8, ring_capacity=16,
                           violation_counters=counters, slot_run_counters=np.arange(12),
                           kernel_run_counters=np.full(12, 7), out_of_range_counters=np.zeros(12, np.int64),
                           rows_read=6, steps=9)


def test_session_fields_keep_the_sglang_line():
    assert VERIFY_V.format() == Violation(*[getattr(VERIFY_V, f) for f in (
        "kernel_kind", "slot_idx", "position", "stored_token", "expected_token", "stored_chain_hash", "expected_aux",
        "fail_reason_bits")]).format()
    assert WRITE_V.expected_position == 6 and WRITE_V.batch_rows == () and WRITE_V.expected_chain_hash is None
    assert VERIFY_V.key == (2, 17, 4, 3) and VERIFY_V.expected_chain_hash == 0x0123456789ABCDEF
    assert VERIFY_V.reason_words == "chain hash mismatch, position mismatch"


def test_dicts_json_and_json_lines_round_trip():
    report = _hand_report()
    d = report.to_dicts()[0]
    assert list(d)[:4] == ["launch_tag", "reasons", "kernel_kind", "slot_idx"]
    assert (d["launch_tag"], d["reasons"], d["batch_rows"], d["stored_chain_hash"]) == (
        "TAIL_K_FULL", ["verify_chain_hash", "verify_position"], [3, 0], 0xFEDCBA9876543210)
    doc = json.loads(report.to_json())
    assert doc["schema"] == "kvcanary-cupy/violation-report/1"
    assert {k: doc[k] for k in ("total_violations", "rows_read", "dropped", "ring_capacity", "steps")} == dict(
        total_violations=8, rows_read=6, dropped=2, ring_capacity=16, steps=9)
    assert doc["violation_counters"][:3] == [3, 0, 5] and doc["violations"] == report.to_dicts()
    back = ViolationReport.from_json(report.to_json(indent=2))
    assert back.violations == report.violations and (back.total_violations, back.dropped, back.steps) == (8, 2, 9)
    np.testing.assert_array_equal(back.slot_run_counters, report.slot_run_counters)
    lines = report.to_json(lines=True).splitlines()
    assert [Violation.from_dict(json.loads(line)) for line in lines] == list(report.violations)
    with pytest.raises(ValueError, match="not a kvcanary-cupy/violation-report/1 document"):
        ViolationReport.from_json('{"schema": "other"}')


def test_to_pandas_has_a_column_per_field(monkeypatch):
    pytest.importorskip("pandas")
    frame = _hand_report().to_pandas()
    assert list(frame.columns) == ["launch_tag", "reasons"] + [f.name for f in dataclasses.fields(Violation)]
    assert frame["slot_idx"].tolist() == [17, 9] and frame["repeats"].tolist() == [5, 1]
    assert int(frame["stored_chain_hash"][0]) == 0xFEDCBA9876543210
    assert frame["batch_rows"][0] == [3, 0]
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with pytest.raises(ImportError, match=r"pip install kvcanary-cupy\[pandas\]"):
        _hand_report().to_pandas()


def test_summary_and_html(monkeypatch):
    report = _hand_report()
    assert report.summary() == (
        "kv_canary summary: 2 violations listed, 8 counted, 6 read, 2 dropped; by reason: verify_chain_hash=5 "
        "verify_position=5 write_token=1 write_position=1; by tag: HEAD_K_FULL=3 TAIL_K_FULL=5")
    assert repr(report) == f"<ViolationReport {report.summary()}>"
    monkeypatch.setitem(reporting.REASON_WORDS, kc.FailReason.WRITE_TOKEN_MISMATCH, "<b>token</b> & co")
    page = report._repr_html_()
    assert "&lt;b&gt;token&lt;/b&gt; &amp; co" in page and "<b>" not in page
    assert page.count("<tr>") == 3  # header + 2 rows
    row = page.split("<tr>")[2]
    for cell in ("TAIL_K_FULL", "chain hash mismatch, position mismatch", "<td>17</td>", "<td>2</td>", "not checked",
                 "0xfedcba9876543210", "0x0123456789abcdef", "<td>3, 0</td>", "<td>34</td>", "<td>5</td>"):
        assert cell in row, cell
    empty = ViolationReport((), 0, 4, *(np.zeros(12, np.int64),) * 4)
    assert "No violations." in empty._repr_html_()


def test_violation_defaults_are_set_when_it_is_made():
    """Made here, not at import, so that a mutant of __post_init__ is live while it runs."""
    write = Violation(1, 9, 7, 11, 12, 5, 6, 16, batch_rows=[2, 0])
    verify = Violation(1, 9, 7, 11, 12, 5, 6, 1)
    assert (write.expected_position, write.batch_rows) == (6, (2, 0))
    assert (verify.expected_position, verify.batch_rows) == (None, ())
    assert Violation(1, 9, 7, 11, 12, 5, 6, 16, expected_position=3).expected_position == 3


def test_summary_counts_rows_per_reason_across_rows():
    rows = (Violation(0, 1, 0, 5, -1, 1, 2, 1 | 2, repeats=2), Violation(0, 2, 0, 5, -1, 1, 2, 1))
    counters = np.zeros(12, np.int64)
    counters[0] = 3
    report = ViolationReport(rows, 3, 8, counters, *(np.zeros(12, np.int64),) * 3)
    assert report.rows_by_reason() == {"verify_chain_hash": 3, "verify_position": 2}
    empty = ViolationReport((), 0, 4, *(np.zeros(12, np.int64),) * 4)
    assert empty.summary() == "kv_canary summary: 0 violations listed, 0 counted, 0 read, 0 dropped; by reason: -; by tag: -"


def test_json_and_pandas_edges(monkeypatch):
    report = _hand_report()
    back = ViolationReport.from_json(report.to_json())
    assert (back.ring_capacity, back.rows_read) == (16, 6)
    with pytest.raises(ValueError, match=r"^kv-canary: not a kvcanary-cupy/violation-report/1 document \(schema='other'\)$"):
        ViolationReport.from_json('{"schema": "other"}')
    if "pandas" in sys.modules or pytest.importorskip("pandas"):
        empty = ViolationReport((), 0, 4, *(np.zeros(12, np.int64),) * 4)
        assert list(empty.to_pandas().columns) == ["launch_tag", "reasons"] + [f.name for f in dataclasses.fields(Violation)]
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"^kv-canary: ViolationReport.to_pandas needs pandas: pip install kvcanary-cupy\[pandas\]$"):
        report.to_pandas()


def test_html_table_cell_by_cell(monkeypatch):
    """The exact table: headers (to_pandas's columns), every cell (a dash where a value does not apply),
    the reasons' words as their cell's title, the overflow row."""
    import re

    report = _hand_report()
    page = report.to_html()
    columns = ["launch_tag", "reasons"] + [f.name for f in dataclasses.fields(Violation)]
    assert page.startswith(f'<div class="kvcanary-report"><p>{report.summary()}</p><table><thead><tr><th>launch_tag</th>')
    assert page.endswith("</tr></tbody></table></div>")
    assert re.findall(r"<th>(.*?)</th>", page) == columns == list(report.to_dicts()[0])
    assert re.fullmatch(r'<div class="kvcanary-report"><p>[^<]*</p><table><thead><tr>(<th>[^<]*</th>){22}</tr></thead>'
                        r'<tbody>(<tr>(<td( title="[^"<]*")?>[^<]*</td>){22}</tr>){2}</tbody></table></div>', page)
    rows = [re.findall(r"<td(?: title=\"[^\"]*\")?>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", page)[1:]]
    assert rows == [
        ["TAIL_K_FULL", "verify_chain_hash, verify_position", "2", "17", "4", "204", "not checked",
         "0xfedcba9876543210", "0x0123456789abcdef", "3", "2", "34", "3, 0", "5", "4", "8", "&ndash;", "0",
         "&ndash;", "&ndash;", "&ndash;", "&ndash;"],
        ["HEAD_K_FULL", "write_token, write_position", "0", "9", "7", "11", "12",
         "0x0000000000000005", "6", "24", "6", "&ndash;", "&ndash;", "1", "1", "1", "&ndash;", "0",
         "&ndash;", "&ndash;", "&ndash;", "&ndash;"],
    ]
    assert re.findall(r'<td title="([^"]*)">', page) == [
        "chain hash mismatch, position mismatch",
        "written token is not the expected input, written position is not the expected one"]
    checked = ViolationReport((Violation(0, 1, 0, 5, 5, 1, 2, 32), Violation(0, 2, 0, 5, -1, 1, 2, 8)), 2, 4,
                              *(np.zeros(12, np.int64),) * 4)
    assert [re.findall(r"<td(?: title=\"[^\"]*\")?>(.*?)</td>", r)[6] for r in re.findall(r"<tr>(.*?)</tr>", checked.to_html())[1:]] == [
        "5", "-1"]  # "not checked" only for a verify row without an expected token
    monkeypatch.setattr(reporting, "HTML_MAX_ROWS", 1)
    page = report.to_html()
    assert page.count("<tr>") == 3 and '<tr><td colspan="22">&hellip; 1 more (see to_pandas())</td></tr>' in page
    monkeypatch.setattr(reporting, "HTML_MAX_ROWS", 2)
    assert "more (see to_pandas())" not in report.to_html()
    empty = ViolationReport((), 0, 4, *(np.zeros(12, np.int64),) * 4)
    assert empty.to_html() == f'<div class="kvcanary-report"><p>{empty.summary()}</p><p>No violations.</p></div>'
    assert report._repr_html_() == report.to_html()


def test_report_of_a_negative_write_index(ab):
    """A write_index the kernels never produce (negative) decodes no rows, not the ring's tail."""
    log = make_log(ab, capacity=4)
    kc.verify(ab.asarray(canary(16)), make_verify_plan(ab, [1, 2, 3], [3] * 3, [-1] * 3), log=log, kernel_kind=2)
    for index, shown in ((-3, 0), (-1, 0), (0, 0), (2, 2), (3, 3)):
        log.write_index[...] = index
        report = log.read()
        assert (len(report.violations), report.total_violations, report.dropped) == (shown, 3, 3 - shown)
        assert len({v.slot_idx for v in report.violations} & {1, 2, 3}) == shown


def test_report_keeps_every_stored_row_and_the_per_kind_totals(ab):
    log = make_log(ab, capacity=16)
    kc.verify(ab.asarray(canary(16)), make_verify_plan(ab, list(range(1, 11)), [3] * 10, [-1] * 10), log=log,
              kernel_kind=5)
    kc.verify(ab.asarray(canary(16)), make_verify_plan(ab, [1, 2], [3] * 2, [-1] * 2), log=log, kernel_kind=1)
    report = log.read()
    assert (len(report.violations), report.total_violations, report.dropped) == (12, 12, 0)
    assert report.violation_counters.tolist() == [0, 2, 0, 0, 0, 10] + [0] * 6
    log.reset()
    assert report.violation_counters.tolist() == [0, 2, 0, 0, 0, 10] + [0] * 6  # a copy, not a view


def _with(v: Violation, **changes) -> Violation:
    return dataclasses.replace(v, **changes)


def test_to_pandas_dtypes_do_not_depend_on_the_values_and_survive_concat():
    """Issue 28 #14: small hashes gave int64, big ones uint64 or object, and concat float64."""
    pandas = pytest.importorskip("pandas")
    big = dataclasses.replace(_hand_report(), violations=(_with(VERIFY_V, stored_chain_hash=18446744073709539271),))
    small = dataclasses.replace(_hand_report(), violations=(_with(WRITE_V, stored_chain_hash=5, expected_aux=-3),))
    empty = dataclasses.replace(_hand_report(), violations=())
    frames = [r.to_pandas() for r in (big, small, empty)]
    for frame in frames:
        assert {c: str(t) for c, t in frame.dtypes.items()} == {c: str(np.dtype(t)) if t is object else t
                                                                for c, t in reporting.PANDAS_DTYPES.items()}
    both = pandas.concat(frames, ignore_index=True)
    assert {c: str(t) for c, t in both.dtypes.items()} == {c: str(t) for c, t in frames[0].dtypes.items()}
    assert [int(x) for x in both["stored_chain_hash"]] == [18446744073709539271, 5]
    assert both["expected_aux"].tolist() == [0x0123456789ABCDEF, -3]
    assert both["first_step"].tolist() == [4, 1] and both["prev_slot_idx"].isna().tolist() == [False, True]


def test_equal_reports_compare_equal_and_differ_when_any_field_differs():
    a, b = _hand_report(), _hand_report()
    assert a == b and not (a != b)
    assert ViolationReport.from_json(a.to_json()) == a
    counters = a.slot_run_counters.copy()
    counters[3] += 1
    for changed in (dataclasses.replace(a, slot_run_counters=counters), dataclasses.replace(a, steps=10),
                    dataclasses.replace(a, violations=a.violations[:1])):
        assert a != changed and not (a == changed)
    assert a != "report"


@pytest.mark.parametrize("path, value, exc, match", [
    (("violations", 0, "slot_idx"), "17", TypeError, r"violations\[0\]\.slot_idx must be an int, got str '17'"),
    (("ring_capacity",), -1, ValueError, r"ring_capacity must be in \[1, 2147483647\], got -1"),
    (("violations", 1, "fail_reason_bits"), 2**70, ValueError, r"violations\[1\]\.fail_reason_bits must be in \[0, 71743\]"),
    (("violations", 1, "fail_reason_bits"), 2**17, ValueError, r"violations\[1\]\.fail_reason_bits must be in \[0, 71743\], got 131072"),
    (("violations", 1, "fail_reason_bits"), 64, ValueError, r"violations\[1\]\.fail_reason_bits has bits no FailReason names: 0x40"),
    (("violations", 1, "fail_reason_bits"), 8192, ValueError, r"violations\[1\]\.fail_reason_bits has bits no FailReason names: 0x2000"),
    (("violations", 0, "stored_chain_hash"), 2**64, ValueError, r"violations\[0\]\.stored_chain_hash must be in \[0, 18446744073709551615\]"),
    (("violations", 0, "batch_rows"), [1, "x"], TypeError, r"violations\[0\]\.batch_rows\[1\] must be an int"),
    (("violations", 0, "first_step"), True, TypeError, r"violations\[0\]\.first_step must be an int or null, got bool"),
    (("violations", 0), 3, TypeError, r"violations\[0\] must be an object, got int"),
    (("slot_run_counters", 2), -5, ValueError, r"slot_run_counters\[2\] must be in \[0, 9223372036854775807\], got -5"),
    (("steps",), 1.5, TypeError, "steps must be an int or null, got float 1.5"),
    (("total_violations",), None, TypeError, "total_violations must be an int, got NoneType"),
])
def test_from_json_checks_every_key_by_name(path, value, exc, match):
    doc = json.loads(_hand_report().to_json())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(exc, match="^kv-canary: report JSON " + match):
        ViolationReport.from_json(json.dumps(doc))


def test_from_json_refuses_missing_keys_and_ragged_counters():
    doc = json.loads(_hand_report().to_json())
    del doc["violations"][0]["position"]
    with pytest.raises(ValueError, match=r"report JSON violations\[0\] lacks position"):
        ViolationReport.from_json(json.dumps(doc))
    doc = json.loads(_hand_report().to_json())
    doc["kernel_run_counters"] = doc["kernel_run_counters"][:3]
    with pytest.raises(ValueError, match="kernel_run_counters has 3 kinds but violation_counters has 12"):
        ViolationReport.from_json(json.dumps(doc))
