"""The canary session of each simulated pool, and the one place that touches its buffers.

:func:`make_session` builds the :class:`~kvcanary_cupy.CanarySession` of a pool;
:func:`canary_buffers` is the one place that reaches into a session for its HEAD and TAIL
buffers (moving canary rows with KV pages, transferring them between pools, a late write).
"""

from __future__ import annotations

from ..constants import RealKvHashMode
from ..session import CanarySession


def make_session(num_slots: int, *, max_batch_size: int, verify_capacity: int, like, real_kv_sources, on_violation):
    """The session of one KV pool: HEAD (chain only) and TAIL (real-KV fingerprints of every byte
    of ``real_kv_sources``) buffers, with the expected-token check on."""
    return CanarySession(num_slots, max_batch_size=max_batch_size, verify_capacity=verify_capacity, like=like,
                         on_violation=on_violation, real_kv_sources=tuple(real_kv_sources),
                         real_kv_hash_mode=RealKvHashMode.ALL, check_expected_tokens=True)


def canary_buffers(session) -> tuple:
    """``(head, tail)`` canary buffers of a session (``int64 [num_slots, 4]``)."""
    return session.head_canary, session.tail_canary


def move_canary_rows(session, src_slots, dst_slots) -> None:
    """Move canary rows with KV pages: ``rows = buf[src]; buf[src] = 0; buf[dst] = rows``, on both
    buffers (what ``kc.move_pages`` will do once it exists)."""
    for buf in canary_buffers(session):
        rows = buf[src_slots].copy()
        buf[src_slots] = 0
        buf[dst_slots] = rows


def copy_canary_rows(src_session, dst_session, src_slots, dst_slots) -> None:
    """A KV transfer between pools carries the canary rows of both buffers (as SGLang's transfer
    lists do: the canary buffers are spliced around the KV layers)."""
    for src, dst in zip(canary_buffers(src_session), canary_buffers(dst_session)):
        dst[dst_slots] = src[src_slots]
