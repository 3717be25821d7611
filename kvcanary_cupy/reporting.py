"""Decoding a violation log on the host: what went wrong, where, and how much was dropped.

A :class:`ViolationReport` comes from :meth:`ViolationLog.read` (one entry per ring row) or from
:meth:`CanarySession.report` (one entry per distinct violation, with its repeat count and the
batch rows that read the slot).  It exports to dicts, JSON, JSON lines, pandas and HTML; the
JSON schema is documented in ``docs/guide.md`` ("Report schema") and produced by
:meth:`Violation.to_dict` alone.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .constants import FailReason
from .errors import fail
from .interop import to_numpy
from .validation import INT32_MAX
from .violation import REASON_WORDS  # noqa: F401  (it lived here before violation.py)
from .violation import REPLICATED_KV_MISMATCH, Reader, ReplicaMismatch, Violation, reason_members, reason_name, tag_name

if TYPE_CHECKING:
    from .log import ViolationLog

REPORT_SCHEMA = "kvcanary-cupy/violation-report/1"
HTML_MAX_ROWS = 200


_FIELDS = tuple(f.name for f in fields(Violation))
_COLUMNS = ("launch_tag", "reasons", *_FIELDS)  # the keys of Violation.to_dict, in order


def _html_cell(v: Violation, key: str, value) -> str:
    """One ``<td>`` of :meth:`ViolationReport.to_html`: ``value`` (``v.to_dict()[key]``) for reading."""
    title = ""
    if key == "reasons":
        value = ", ".join(value) or "none"
        title = f' title="{html.escape(v.reason_words)}"'
    elif key == "stored_chain_hash" or (key == "expected_aux" and v.expected_chain_hash is not None):
        value = f"{value:#018x}"
    elif key == "expected_token" and value == -1 and not v.is_write:
        value = "not checked"
    elif key in ("batch_rows", "request_ids"):
        value = ", ".join(map(str, value)) or None
    elif key == "readers":
        value = ", ".join(f"{'sweep ' if r['sweep'] else ''}{r['step']}:{r['batch_row']}"
                          + ("" if r["row_label"] is None else f" ({r['row_label']})") for r in value) or None
    return f"<td{title}>{'&ndash;' if value is None else html.escape(str(value))}</td>"


_COUNTERS = ("violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters")

# to_pandas's dtype per column, whatever the values (so pd.concat of reports keeps them exact):
# hashes unsigned 64-bit, optional ints nullable; expected_aux holds signed positions (write rows)
# and unsigned hashes (verify rows), which no fixed-width dtype holds both of, so Python ints.
PANDAS_DTYPES = {
    "launch_tag": object, "reasons": object, "kernel_kind": "int64", "slot_idx": "int64", "position": "int64",
    "stored_token": "int64", "expected_token": "int64", "stored_chain_hash": "uint64", "expected_aux": object,
    "fail_reason_bits": "int64", "expected_position": "Int64", "prev_slot_idx": "Int64", "batch_rows": object,
    "repeats": "int64", "first_step": "Int64", "last_step": "Int64", "readers": object, "readers_dropped": "int64",
    "rank": "Int64", "device": object, "request_ids": object, "finding": object,
}

_I64_RANGE, _U64_RANGE = (-(2**63), 2**63 - 1), (0, 2**64 - 1)
_KNOWN_BITS = sum(m.value for m in FailReason)
# from_json's range per record key (None: optional); expected_aux: either a position or a hash.
_RECORD_RANGES = {
    "kernel_kind": (0, INT32_MAX), "slot_idx": _I64_RANGE, "position": _I64_RANGE, "stored_token": _I64_RANGE,
    "expected_token": _I64_RANGE, "stored_chain_hash": _U64_RANGE, "expected_aux": (-(2**63), 2**64 - 1),
    "fail_reason_bits": (0, _KNOWN_BITS), "expected_position": _I64_RANGE, "prev_slot_idx": _I64_RANGE,
    "repeats": (1, _I64_RANGE[1]), "first_step": (0, _I64_RANGE[1]), "last_step": (0, _I64_RANGE[1]),
    "readers_dropped": (0, _I64_RANGE[1]),
    "rank": (0, INT32_MAX),
}
_OPTIONAL = frozenset(("expected_position", "prev_slot_idx", "first_step", "last_step", "rank"))


def _json_int(value, name: str, lo: int, hi: int, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        fail(TypeError, f"report JSON {name} must be an int{' or null' if optional else ''}, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        fail(ValueError, f"report JSON {name} must be in [{lo}, {hi}], got {value}")
    return value


def _json_record(d, where: str) -> Violation:
    if not isinstance(d, dict):
        fail(TypeError, f"report JSON {where} must be an object, got {type(d).__name__}")
    missing = [k for k in _FIELDS[:8] if k not in d]
    if missing:
        fail(ValueError, f"report JSON {where} lacks {', '.join(missing)}")
    for key, (lo, hi) in _RECORD_RANGES.items():
        if key in d:
            _json_int(d[key], f"{where}.{key}", lo, hi, optional=key in _OPTIONAL)
    if d["fail_reason_bits"] & ~_KNOWN_BITS:
        fail(ValueError, f"report JSON {where}.fail_reason_bits has bits no FailReason names: {d['fail_reason_bits']:#x}")
    if not isinstance(d.get("device"), (str, type(None))):
        fail(TypeError, f"report JSON {where}.device must be a string or null, got {type(d['device']).__name__}")
    rows = d.get("batch_rows", [])
    if not isinstance(rows, list):
        fail(TypeError, f"report JSON {where}.batch_rows must be a list of int, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        _json_int(r, f"{where}.batch_rows[{i}]", 0, _I64_RANGE[1])
    readers = d.get("readers", [])
    if not isinstance(readers, list):
        fail(TypeError, f"report JSON {where}.readers must be a list of objects, got {type(readers).__name__}")
    for i, r in enumerate(readers):
        at = f"{where}.readers[{i}]"
        if not isinstance(r, dict) or set(r) != set(Reader._fields):
            fail(ValueError, f"report JSON {at} must be an object with keys {', '.join(Reader._fields)}, got {r!r}")
        _json_int(r["step"], f"{at}.step", 0, _I64_RANGE[1])
        _json_int(r["batch_row"], f"{at}.batch_row", -1, _I64_RANGE[1])
        if not (r["row_label"] is None or isinstance(r["row_label"], str)
                or (isinstance(r["row_label"], int) and not isinstance(r["row_label"], bool))):
            fail(TypeError, f"report JSON {at}.row_label must be an int, a str or null, got {r['row_label']!r}")
        if not isinstance(r["sweep"], bool):
            fail(TypeError, f"report JSON {at}.sweep must be a bool, got {r['sweep']!r}")
    ids = d.get("request_ids", [])
    if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
        fail(TypeError, f"report JSON {where}.request_ids must be a list of str, got {ids!r}")
    finding = d.get("finding")
    if finding is not None and not isinstance(finding, str):
        fail(TypeError, f"report JSON {where}.finding must be a str or null, got {type(finding).__name__}")
    return Violation.from_dict(d)


_MISMATCH_RANGES = {"slot_idx": _I64_RANGE, "rank": (0, INT32_MAX), "other_rank": (0, INT32_MAX),
                    "real_kv_hash": _U64_RANGE, "other_real_kv_hash": _U64_RANGE, "step": (0, _I64_RANGE[1])}


def _json_mismatch(d, where: str) -> ReplicaMismatch:
    if not isinstance(d, dict):
        fail(TypeError, f"report JSON {where} must be an object, got {type(d).__name__}")
    missing = [k for k in _MISMATCH_RANGES if k not in d]
    if missing:
        fail(ValueError, f"report JSON {where} lacks {', '.join(missing)}")
    return ReplicaMismatch(**{k: _json_int(d[k], f"{where}.{k}", lo, hi) for k, (lo, hi) in _MISMATCH_RANGES.items()})


@dataclass(frozen=True, repr=False)
class ViolationReport:
    """A host snapshot of a :class:`~kvcanary_cupy.ViolationLog` or of a session's violations.

    From :meth:`ViolationLog.read` (one entry per ring row) or :meth:`CanarySession.report` (one
    entry per distinct violation).  ``str()`` prints one line per violation and a total;
    ``repr()`` the :meth:`summary`; Jupyter shows :meth:`to_html`.

    Parameters
    ----------
    violations : tuple of Violation
        Ring order for a log, first-seen order for a session.
    total_violations : int
        Every violation counted, the ones the full ring dropped included.
    ring_capacity : int
        The log's ring rows.
    violation_counters, slot_run_counters, kernel_run_counters, out_of_range_counters : int64 arrays [num_kinds]
        The log's exact counters per launch kind (see :class:`ViolationLog`).
    rows_read : int, optional
        Ring rows decoded (a log: ``len(violations)``; a session: over all its steps).
    steps : int, optional
        A session's steps so far.
    ranks : tuple of int
        A session with a ``process_group``: the ranks whose new violations (or replicated-KV
        mismatches) the verdict that produced this report covers; empty otherwise.
    replica_mismatches : tuple of ReplicaMismatch
        The ``replicated_kv_mismatch`` violations (sessions built with ``replicated_kv=True``).

    Examples
    --------
    >>> report = kc.ViolationLog.allocate(16).read()
    >>> report.total_violations, report.dropped, report.to_dicts()
    (0, 0, [])
    """

    violations: tuple  # of Violation: ring order for a log, first-seen order for a session
    total_violations: int  # sum of violation_counters: every violation, the dropped ones included
    ring_capacity: int
    violation_counters: np.ndarray  # [num_kinds] int64, exact per launch kind
    slot_run_counters: np.ndarray
    kernel_run_counters: np.ndarray
    out_of_range_counters: np.ndarray
    rows_read: int | None = None  # ring rows decoded (a log: len(violations); a session: over all steps)
    steps: int | None = None  # a session's steps so far
    ranks: tuple = ()  # a distributed verdict's ranks with new violations
    replica_mismatches: tuple = ()  # of ReplicaMismatch

    def __post_init__(self):
        if self.rows_read is None:
            object.__setattr__(self, "rows_read", len(self.violations))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "replica_mismatches", tuple(self.replica_mismatches))

    @classmethod
    def merge(cls, *reports: "ViolationReport") -> "ViolationReport":
        """One report of several ranks' (or logs') reports, e.g. :meth:`CanarySession.gather_report`'s.

        Violations and mismatches are concatenated in the order given (each violation keeps its
        ``rank``); totals, ``rows_read`` and ring capacities add up; the counters add up per
        launch kind (every report must have the same number of kinds); ``steps`` is the largest
        given; ``ranks`` is the sorted union.

        Raises
        ------
        TypeError, ValueError
            No report, something that is not a ViolationReport, or counters of different kinds.
        """
        if not reports:
            fail(ValueError, "ViolationReport.merge needs at least one report")
        for i, r in enumerate(reports):
            if not isinstance(r, ViolationReport):
                fail(TypeError, f"ViolationReport.merge: reports[{i}] must be a ViolationReport, got {type(r).__name__}")
            if len(r.violation_counters) != len(reports[0].violation_counters):
                fail(ValueError, f"ViolationReport.merge: reports[{i}] has {len(r.violation_counters)} launch kinds, "
                                 f"reports[0] has {len(reports[0].violation_counters)}")
        steps = [r.steps for r in reports if r.steps is not None]
        mismatches = {m: None for r in reports for m in r.replica_mismatches}  # every rank finds the same ones
        return cls(violations=tuple(v for r in reports for v in r.violations),
                   total_violations=sum(r.total_violations for r in reports),
                   ring_capacity=sum(r.ring_capacity for r in reports),
                   **{k: np.sum([getattr(r, k) for r in reports], axis=0, dtype=np.int64) for k in _COUNTERS},
                   rows_read=sum(r.rows_read for r in reports), steps=max(steps) if steps else None,
                   ranks=sorted({k for r in reports for k in r.ranks}), replica_mismatches=tuple(mismatches))

    def __eq__(self, other) -> bool:
        """Equal fields, the counter arrays compared value by value."""
        if not isinstance(other, ViolationReport):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k)) if k in _COUNTERS else getattr(self, k) == getattr(other, k)
                   for k in (f.name for f in fields(self)))

    __hash__ = None  # the counters are arrays

    @classmethod
    def from_log(cls, log: "ViolationLog") -> "ViolationReport":
        """:meth:`ViolationLog.read`: copy ``log`` to the host (a sync) and decode its ring rows."""
        ring = to_numpy(log.ring)
        kept = min(max(int(to_numpy(log.write_index)[0]), 0), ring.shape[0])
        counters = to_numpy(log.violation_counters).copy()
        return cls(
            violations=tuple(Violation.from_row(r) for r in ring[:kept]),
            total_violations=int(counters.sum()),
            ring_capacity=ring.shape[0],
            violation_counters=counters,
            slot_run_counters=to_numpy(log.slot_run_counters).copy(),
            kernel_run_counters=to_numpy(log.kernel_run_counters).copy(),
            out_of_range_counters=to_numpy(log.out_of_range_counters).copy(),
        )

    @property
    def dropped(self) -> int:
        """Violations counted but never read, because the ring was full when they happened."""
        return max(self.total_violations - self.rows_read, 0)

    def format(self) -> str:
        """Every violation's :meth:`Violation.format` line, then a totals line."""
        lines = [v.format() for v in self.violations] + [m.format() for m in self.replica_mismatches]
        lines.append(
            f"total_violations={self.total_violations} shown={len(self.violations)} dropped={self.dropped} "
            f"out_of_range_skipped={int(self.out_of_range_counters.sum())}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"<ViolationReport {self.summary()}>"

    # -- summaries and exports ------------------------------------------------------------------

    def rows_by_reason(self) -> dict:
        """Ring rows read per fail reason (a row with two reasons counts under both)."""
        out = {}
        for v in self.violations:
            for m in reason_members(v.fail_reason_bits):
                out[reason_name(m)] = out.get(reason_name(m), 0) + v.repeats
        return out

    def counts_by_tag(self) -> dict:
        """Every violation per launch tag (exact, the dropped ones included); nonzero tags only."""
        return {tag_name(k): int(n) for k, n in enumerate(self.violation_counters) if n}

    def summary(self) -> str:
        """One line: how many, read and dropped, then rows by reason and violations by tag."""
        by_reason = " ".join(f"{k}={n}" for k, n in self.rows_by_reason().items()) or "-"
        by_tag = " ".join(f"{k}={n}" for k, n in self.counts_by_tag().items()) or "-"
        ranks = f"; ranks with new violations: {list(self.ranks)}" if self.ranks else ""
        mismatches = f"; {len(self.replica_mismatches)} {REPLICATED_KV_MISMATCH}" if self.replica_mismatches else ""
        return (f"kv_canary summary: {len(self.violations)} violations listed, {self.total_violations} counted, "
                f"{self.rows_read} read, {self.dropped} dropped; by reason: {by_reason}; by tag: {by_tag}{ranks}{mismatches}")

    def to_dicts(self) -> list:
        """One :meth:`Violation.to_dict` per violation."""
        return [v.to_dict() for v in self.violations]

    def to_json(self, *, lines: bool = False, indent: int | None = None) -> str:
        """The report as one JSON document, or (``lines=True``) one JSON object per violation per line.

        ``indent`` is :func:`json.dumps`'s (the document form only).

        Document keys: ``schema`` (``"kvcanary-cupy/violation-report/1"``), ``total_violations``,
        ``rows_read``, ``dropped``, ``ring_capacity``, ``steps``, the four counter lists (indexed by
        kernel kind) and ``violations`` (the :meth:`to_dicts` records).  Hashes are unsigned
        64-bit integers.
        """
        if lines:
            return "".join(json.dumps(d) + "\n" for d in self.to_dicts())
        doc = {
            "schema": REPORT_SCHEMA,
            "total_violations": self.total_violations,
            "rows_read": self.rows_read,
            "dropped": self.dropped,
            "ring_capacity": self.ring_capacity,
            "steps": self.steps,
            "violation_counters": [int(x) for x in self.violation_counters],
            "slot_run_counters": [int(x) for x in self.slot_run_counters],
            "kernel_run_counters": [int(x) for x in self.kernel_run_counters],
            "out_of_range_counters": [int(x) for x in self.out_of_range_counters],
            "violations": self.to_dicts(),
            "ranks": list(self.ranks),
            "replica_mismatches": [m.to_dict() for m in self.replica_mismatches],
        }
        return json.dumps(doc, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "ViolationReport":
        """Inverse of :meth:`to_json`: ``text`` is the document form (ValueError for another schema);
        every key's type and range is checked (a TypeError or ValueError naming the key)."""
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA:
            schema = doc.get("schema") if isinstance(doc, dict) else None
            raise ValueError(f"kv-canary: not a {REPORT_SCHEMA} document (schema={schema!r})")
        missing = [k for k in ("total_violations", "ring_capacity", "rows_read", "steps", *_COUNTERS, "violations") if k not in doc]
        if missing:
            fail(ValueError, f"report JSON lacks {', '.join(missing)}")
        top = _I64_RANGE[1]
        counters = {}
        for key in _COUNTERS:
            values = doc[key]
            if not isinstance(values, list):
                fail(TypeError, f"report JSON {key} must be a list of int, got {type(values).__name__}")
            counters[key] = np.asarray([_json_int(x, f"{key}[{i}]", 0, top) for i, x in enumerate(values)], np.int64)
            if len(values) != len(doc["violation_counters"]):
                fail(ValueError, f"report JSON {key} has {len(values)} kinds but violation_counters has {len(doc['violation_counters'])}")
        if not isinstance(doc["violations"], list):
            fail(TypeError, f"report JSON violations must be a list of records, got {type(doc['violations']).__name__}")
        ranks = doc.get("ranks", [])
        mismatches = doc.get("replica_mismatches", [])
        for key, value in (("ranks", ranks), ("replica_mismatches", mismatches)):
            if not isinstance(value, list):
                fail(TypeError, f"report JSON {key} must be a list, got {type(value).__name__}")
        return cls(violations=tuple(_json_record(d, f"violations[{i}]") for i, d in enumerate(doc["violations"])),
                   ranks=[_json_int(r, f"ranks[{i}]", 0, INT32_MAX) for i, r in enumerate(ranks)],
                   replica_mismatches=tuple(_json_mismatch(d, f"replica_mismatches[{i}]") for i, d in enumerate(mismatches)),
                   total_violations=_json_int(doc["total_violations"], "total_violations", 0, top),
                   ring_capacity=_json_int(doc["ring_capacity"], "ring_capacity", 1, 2**31 - 1),
                   rows_read=_json_int(doc["rows_read"], "rows_read", 0, top),
                   steps=_json_int(doc["steps"], "steps", 0, top, optional=True), **counters)

    def to_pandas(self):
        """A ``pandas.DataFrame``, one row per violation, columns named as :meth:`to_dict`'s keys,
        each of the one dtype :data:`PANDAS_DTYPES` gives it whatever the values."""
        try:
            import pandas
        except ImportError as exc:
            raise ImportError("kv-canary: ViolationReport.to_pandas needs pandas: "
                              "pip install kvcanary-cupy[pandas]") from exc
        columns = list(_COLUMNS)
        data = {c: [d[c] for d in self.to_dicts()] for c in columns}
        return pandas.DataFrame({c: pandas.Series(data[c], dtype=PANDAS_DTYPES[c]) for c in columns}, columns=columns)

    def victims(self, *, frame: bool = False):
        """Every read of a violating slot, per violation and step (:func:`kvcanary_cupy.containment.victims`).

        Parameters
        ----------
        frame : bool
            False: a dict of NumPy columns; True: a pandas DataFrame (ImportError without pandas).
        """
        from .containment import victims

        return victims(self, frame=frame)

    def poisoned_pages(self, page_size: int, *, frame: bool = False):
        """The slots and pages the violations poison (:func:`kvcanary_cupy.containment.poisoned_pages`).

        Parameters
        ----------
        page_size : int
            Slots per page (block) of the engine's KV pool, ``>= 1``.
        frame : bool
            False: a dict of NumPy columns; True: a pandas DataFrame (ImportError without pandas).
        """
        from .containment import poisoned_pages

        return poisoned_pages(self, page_size, frame=frame)

    def _repr_html_(self) -> str:
        """What Jupyter shows: :meth:`to_html`."""
        return self.to_html()

    def to_html(self) -> str:
        """The report as an HTML fragment: the :meth:`summary` line, then a table of at most
        ``HTML_MAX_ROWS`` violations, or "No violations.".

        The columns are :meth:`to_pandas`'s (the :meth:`Violation.to_dict` keys), the values
        shown for reading: hashes in hex, ``reasons`` joined (their words as the cell's title),
        "not checked" for a verify row without an expected token, a dash where a value does not
        apply; every value HTML-escaped.
        """
        body = []
        for v in self.violations[:HTML_MAX_ROWS]:
            cells = "".join(_html_cell(v, key, value) for key, value in v.to_dict().items())
            body.append(f"<tr>{cells}</tr>")
        more = len(self.violations) - HTML_MAX_ROWS
        if more > 0:
            body.append(f'<tr><td colspan="{len(_COLUMNS)}">&hellip; {more} more (see to_pandas())</td></tr>')
        table = ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in _COLUMNS) + "</tr></thead><tbody>"
                 + "".join(body) + "</tbody></table>") if self.violations else "<p>No violations.</p>"
        return f'<div class="kvcanary-report"><p>{html.escape(self.summary())}</p>{table}</div>'
