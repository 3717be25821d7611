"""The canary session of each simulated pool, and the one place that touches its buffers.

:func:`make_session` builds the :class:`~kvcanary_cupy.CanarySession` of a pool and
:class:`Sightings` reads what it reports; :func:`canary_buffers` is the one place that reaches
into a session for its HEAD and TAIL buffers (moving canary rows with KV pages, transferring them
between pools, a late write).
"""

from __future__ import annotations

import numpy as np

from ..constants import RealKvHashMode
from ..interop import allocate
from ..ops import move_pages
from ..session import CanarySession

#: Host us of one eager op of each kind on the bound path, on the H200 (docs/benchmarks.md, the
#: latest ``kvcanary bench --sections host`` and ``bench_session.py`` figures with CuPy arrays, W3):
#: what the canary's host time per simulated step is held against (target: within 2x the sum over
#: the step's ops).  ``launch``: one more kernel of a call (a coverage check, a move or a copy of one
#: buffer), an overlapped launch's cost; ``stage``: the staging of end_step or of a sweep, end_step's
#: figure when nothing happened.
BOUND_HOST_US = {"plan": 8.6, "verify": 5.1, "write": 7.7, "launch": 6.5, "stage": 17.0}


def call_ops(session, call: str) -> tuple:
    """The library ops (kinds of :data:`BOUND_HOST_US`) one canary call of the simulator makes on
    ``session``: ``pre_forward``, ``post_forward``, ``end_step``, ``sweep``, ``move`` (a block's
    rows, both buffers) or ``copy`` (a transfer's rows, both buffers)."""
    cov = session.coverage
    lost, deep = cov.lost is not None, cov.deep is not None
    if call == "pre_forward":
        return ("plan", "verify", "write") + ("launch",) * lost
    if call == "post_forward":
        return ("verify", "write") + ("launch",) * (lost + deep + bool(cov.deep_check_slots))
    if call == "end_step":
        return ("stage",)
    if call == "sweep":
        return ("plan", "verify", "stage")
    if call in ("move", "copy"):
        return ("launch",) * len(canary_buffers(session))
    raise ValueError(f"call must be one of pre_forward, post_forward, end_step, sweep, move, copy; got {call!r}")


def make_session(num_slots: int, *, max_batch_size: int, verify_capacity: int, like, real_kv_sources, coverage=None):
    """The session of one KV pool: HEAD (chain only) and TAIL (real-KV fingerprints of every byte
    of ``real_kv_sources``) buffers, with the expected-token check on and ``coverage``'s options
    (CanarySession's deep_kv_sources, ...).  Its violations are read through :class:`Sightings`, so
    its policy only records them."""
    return CanarySession(num_slots, max_batch_size=max_batch_size, verify_capacity=verify_capacity, like=like,
                         on_violation="ignore", real_kv_sources=tuple(real_kv_sources),
                         real_kv_hash_mode=RealKvHashMode.ALL, check_expected_tokens=True, **(coverage or {}))


class Sightings:
    """The violations a session saw since the last :meth:`take`, those seen before included.

    A session reports a distinct violation (launch tag, slot, stored position, reasons) once and
    then only counts its repeats; but the same bad record met again in a later fault episode (a
    page reused at the same position) is that episode's detection, so the simulator takes every
    distinct violation whose count grew."""

    def __init__(self, session):
        self.session = session
        self._rows_read = 0
        self._repeats: list = []  # per distinct violation, in the report's (first-seen) order

    def take(self) -> list:
        rows_read = self.session.stats["rows_read"]
        if rows_read == self._rows_read:
            return []
        self._rows_read = rows_read
        violations = self.session.report().violations
        seen = [v for i, v in enumerate(violations) if i >= len(self._repeats) or v.repeats > self._repeats[i]]
        self._repeats = [v.repeats for v in violations]
        return seen


def canary_buffers(session) -> tuple:
    """``(head, tail)`` canary buffers of a session (``int64 [num_slots, 4]``)."""
    return session.head_canary, session.tail_canary


def allocate_move_workspace(session, max_pages: int, page_size: int, *, like):
    """The staging area of :func:`move_canary_pages` for up to ``max_pages`` pages of the session's
    widest buffer, allocated once (so that a move allocates nothing and could be captured in a CUDA graph)."""
    fields = max(buf.shape[1] for buf in canary_buffers(session))
    return allocate((max_pages * page_size, fields), np.int64, like=like, fill=0)


def move_canary_pages(session, src_pages, dst_pages, *, page_size: int, workspace) -> None:
    """Move the canary rows of KV pages with the pages (``kc.move_pages``), in both buffers: the
    pages' old places are zeroed, so a table still naming them fails verify."""
    for buf in canary_buffers(session):
        move_pages(buf, src_pages, dst_pages, page_size=page_size, workspace=workspace)


def copy_canary_rows(src_session, dst_session, src_slots, dst_slots) -> None:
    """A KV transfer between pools carries the canary rows of both buffers (as SGLang's transfer
    lists do: the canary buffers are spliced around the KV layers).  Plain indexing: ``kc.copy_pages``
    would do the same through its free function's checks, several times the host time (2026-12-03,
    docs/benchmarks.md)."""
    for src, dst in zip(canary_buffers(src_session), canary_buffers(dst_session)):
        dst[dst_slots] = src[src_slots]
