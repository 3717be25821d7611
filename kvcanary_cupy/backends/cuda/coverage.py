"""Coverage past the record on the GPU: launches ``kernels/coverage.cu`` through CuPy.

Each launch allocates nothing and reads nothing back (capture-safe); its grid is fixed by
host-known sizes.  ``table`` is the int64 source table :class:`kvcanary_cupy.coverage.CoverageSources` packs.
"""

from __future__ import annotations

import numpy as np

from ...args import LogViews
from . import device as cuda_device
from .compile import get_function, kernel_name
from .configs import BLOCKS_PER_SM
from .params import log_struct

COVERAGE_THREADS = 256  # kCoverageThreads in coverage.cu
_WARPS = COVERAGE_THREADS // 32


def _grid(items: int, per_block: int) -> int:
    cap = cuda_device.sm_count(cuda_device.current_id()) * BLOCKS_PER_SM
    return max(1, min(-(-items // per_block), cap))


def _launch(name: str, grid: int, args: tuple) -> None:
    get_function("coverage", kernel_name(name))((grid,), (COVERAGE_THREADS,), args)


def deep_write(table, num_sources: int, slots, canary) -> None:
    n = slots.shape[0]
    if n == 0:
        return
    _launch("deep_write", _grid(n, _WARPS), (table, np.int32(num_sources), slots, np.int64(n), canary,
                                              np.int64(canary.shape[0]), np.int32(canary.shape[1])))


def pack_log(log: LogViews) -> np.ndarray:
    """The launch record of a log's views, packed once by the caller that keeps the log (a session's
    coverage): packing it on every call cost host time inside the step."""
    return log_struct(log)


def _log(log) -> np.ndarray:
    return log if isinstance(log, np.ndarray) else log_struct(log)


def deep_check(table, num_sources: int, canary, state, per_step: int, log, kind: int) -> None:
    """``log``: the log's views, or their record from :func:`pack_log`."""
    _launch("deep_check", _grid(per_step, _WARPS), (table, np.int32(num_sources), canary, np.int64(canary.shape[0]),
                                                     np.int32(canary.shape[1]), np.int64(per_step), state,
                                                     _log(log), np.int32(kind)))


def lost_snapshot(table, num_sources: int, slots, num_slots: int, pre) -> None:
    n = slots.shape[0]
    if n == 0:
        return
    _launch("lost_snapshot", _grid(n * num_sources, COVERAGE_THREADS),
            (table, np.int32(num_sources), slots, np.int64(n), np.int64(num_slots), pre))


def lost_check(table, num_sources: int, slots, capacity: int, pre, head, tail, log, kind: int) -> None:
    """``log``: as for :func:`deep_check`."""
    total = slots.shape[0]
    n = min(total, capacity)
    if total == 0:
        return
    _launch("lost_check", _grid(n, _WARPS), (table, np.int32(num_sources), slots, np.int64(n), np.int64(total - n), pre,
                                              head, np.int32(head.shape[1]), tail, np.int32(tail.shape[1]),
                                              np.int64(tail.shape[0]), _log(log), np.int32(kind)))
