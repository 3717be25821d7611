"""Coverage past the record on the CPU: the reference ``kernels/coverage.cu`` matches byte for byte.

``sources`` is a tuple of ``(SourceView, nbytes)``: each source and the bytes of its stream that
are folded (docs/format.md sections 3 and 9).
"""

from __future__ import annotations

import numpy as np

from ..args import LogViews
from ..constants import FailReason
from ..validation import I64
from .numpy_backend import _as_i64, _rows, append_rows, fold_rows, strip_hashes

DEEP_FIELD = 4


def source_hashes(sources: tuple, slots: np.ndarray) -> np.ndarray:
    """uint64 ``[len(slots), len(sources)]``: the fold of each source's stream of each slot."""
    return strip_hashes(sources, slots).T


def deep_fold(sources: tuple, slots: np.ndarray) -> np.ndarray:
    """uint64 deep fingerprints: the per-source hashes folded in order, 0 stored as 1."""
    acc = fold_rows(strip_hashes(sources, slots))
    return np.where(acc == 0, np.uint64(1), acc)


def _valid(slots, num_slots: int) -> np.ndarray:
    return (slots > 0) & (slots < num_slots)


def deep_write(sources: tuple, slots, canary: np.ndarray) -> None:
    slots = np.asarray(slots, I64)
    slots = slots[_valid(slots, canary.shape[0])]
    canary[slots, DEEP_FIELD] = _as_i64(deep_fold(sources, slots))


def deep_check(sources: tuple, canary: np.ndarray, state: np.ndarray, per_step: int, log: LogViews, kind: int) -> None:
    """Slots ``1 + (state[0] + k) % (num_slots - 1)``, ``k < per_step``, with a deep fingerprint,
    re-fingerprinted; a changed one logs a row; ``state[0]`` advances by ``per_step``."""
    ring = canary.shape[0] - 1
    start = int(state[0])
    slots = 1 + (start + np.arange(per_step, dtype=I64)) % ring
    stored = canary[slots, DEEP_FIELD]
    slots, stored = slots[stored != 0], stored[stored != 0]
    now = _as_i64(deep_fold(sources, slots))
    hit = now != stored
    s = slots[hit]
    append_rows(log, kind, _rows(kind, s, canary[s, 1], canary[s, 0], -1, stored[hit], now[hit],
                                 FailReason.VERIFY_DEEP_KV_MISMATCH.value))
    state[0] = (start + per_step) % ring


def lost_snapshot(sources: tuple, slots, num_slots: int, pre: np.ndarray) -> None:
    slots = np.asarray(slots, I64)
    n = slots.shape[0]
    out = np.zeros((n, len(sources)), np.uint64)
    valid = _valid(slots, num_slots)
    out[valid] = source_hashes(sources, slots[valid])
    pre[: n * len(sources)] = _as_i64(out.reshape(-1))


def lost_check(sources: tuple, slots, capacity: int, pre: np.ndarray, head: np.ndarray, tail: np.ndarray, log: LogViews,
               kind: int) -> None:
    """The first ``capacity`` tokens are checked; the others are counted as out of range."""
    slots = np.asarray(slots, I64)
    log.out_of_range_counters[kind] += max(slots.shape[0] - capacity, 0)
    slots = slots[:capacity]
    n, num_sources = slots.shape[0], len(sources)
    idx = np.nonzero(_valid(slots, tail.shape[0]))[0]
    s = slots[idx]
    h, t = head[s], tail[s]
    differ = (h[:, :3] != t[:, :3]).any(axis=1)
    idx, s, h, t = idx[differ], s[differ], h[differ], t[differ]
    unchanged = _as_i64(source_hashes(sources, s)) == pre[: n * num_sources].reshape(n, num_sources)[idx]
    hit = unchanged.any(axis=1)
    first = np.argmax(unchanged, axis=1)
    append_rows(log, kind, _rows(kind, s[hit], h[hit, 1], t[hit, 0], h[hit, 0], t[hit, 2], first[hit],
                                 FailReason.WRITE_KV_NOT_STORED.value))
