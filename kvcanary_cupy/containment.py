"""What a report says to contain: the requests that read bad KV and the pages it poisons.

:meth:`ViolationReport.victims` and :meth:`ViolationReport.poisoned_pages` are defined here and
return columns of NumPy arrays (``frame=True``: a pandas DataFrame).  An engine aborts the
requests of :func:`victims` (their ``row_label`` is the request id it gave ``pre_forward``) and
evicts the cached blocks holding a page of :func:`poisoned_pages` (and, as their KV was computed
from it, the cached blocks below them).  docs/guide.md ("Containment") says how.
"""

from __future__ import annotations

import numpy as np

from .constants import FailReason

#: victims()'s columns: one row per read of a violating slot (``Violation.readers``).
VICTIM_COLUMNS = ("violation", "step", "batch_row", "row_label", "sweep", "launch_tag", "slot_idx", "position", "reasons")
#: poisoned_pages()'s columns: one row per slot a violation poisons.
PAGE_COLUMNS = ("violation", "slot_idx", "page", "predecessor", "launch_tag", "reasons")

_DTYPES = {"violation": np.int64, "step": np.int64, "batch_row": np.int64, "row_label": object, "sweep": bool,
           "launch_tag": object, "slot_idx": np.int64, "position": np.int64, "reasons": object, "page": np.int64,
           "predecessor": bool}


def _columns(names, rows: list, frame: bool, what: str):
    cols = {k: np.array([r[i] for r in rows], dtype=_DTYPES[k]) for i, k in enumerate(names)}
    if not frame:
        return cols
    try:
        import pandas
    except ImportError as exc:
        raise ImportError(f"kv-canary: ViolationReport.{what}(frame=True) needs pandas: "
                          "pip install kvcanary-cupy[pandas]") from exc
    return pandas.DataFrame(cols, columns=list(names))


def _violations(report) -> tuple:
    """A report's violations, or the violations themselves (a sequence of Violation)."""
    return tuple(report.violations if hasattr(report, "violations") else report)


def victims(report, *, frame: bool = False):
    """Every read of a violating slot the report (or a sequence of its violations) names: one row
    per ``Violation.readers`` entry.

    Columns (:data:`VICTIM_COLUMNS`): ``violation`` (index into ``report.violations``), ``step``,
    ``batch_row``, ``row_label`` (the engine's label of that row, None where it gave none),
    ``sweep`` (a sweep read it: ``batch_row`` is the swept sequence), then the violation's
    ``launch_tag``, ``slot_idx``, ``position`` and ``reasons``.  The requests to abort are the
    distinct ``row_label`` (or ``(step, batch_row)``) of the rows with ``sweep`` False.  A session
    keeps at most ``MAX_READERS`` reads per violation; ``Violation.readers_dropped`` counts the rest.
    """
    rows = [(i, r.step, r.batch_row, r.row_label, r.sweep, v.launch_tag, v.slot_idx, v.position, v.reasons)
            for i, v in enumerate(_violations(report)) for r in v.readers]
    return _columns(VICTIM_COLUMNS, rows, frame, "victims")


def poisoned_pages(report, page_size: int, *, frame: bool = False):
    """The slots (and their pages of ``page_size`` slots) whose KV the report's violations poison.

    A violation poisons its slot; a chain mismatch also poisons its predecessor's slot
    (``predecessor`` True), since the check cannot tell which of the two records is wrong.  A
    hole poisons no slot (it addresses the padding slot: its readers are the victims).  Columns
    (:data:`PAGE_COLUMNS`): ``violation``, ``slot_idx``, ``page`` (``slot_idx // page_size``),
    ``predecessor``, ``launch_tag``, ``reasons``.  Evict the cached blocks holding these pages.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"kv-canary: poisoned_pages page_size must be an int >= 1, got {page_size!r}")
    rows = []
    for i, v in enumerate(_violations(report)):
        if v.is_hole:
            continue
        rows.append((i, v.slot_idx, v.slot_idx // page_size, False, v.launch_tag, v.reasons))
        prev = v.prev_slot_idx
        if v.fail_reason_bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH and prev is not None and prev > 0:
            rows.append((i, prev, prev // page_size, True, v.launch_tag, v.reasons))
    return _columns(PAGE_COLUMNS, rows, frame, "poisoned_pages")
