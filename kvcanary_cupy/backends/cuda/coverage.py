"""Coverage past the record on the GPU: the launches of ``kernels/coverage.cu``.

Each kernel takes one parameter record (``abi.COVERAGE_PARAMS``, field i = parameter i);
``*_launch`` fills it from the session's buffers as a :class:`~.params.KernelLaunch`, which
:class:`kvcanary_cupy.coverage.KvCoverage` packs once when the session binds and then patches per
step (the slots' address and count, and the grid they size).  Each launch allocates nothing and
reads nothing back (capture-safe); its grid is fixed by host-known sizes.  ``table`` is the int64
source table of :func:`source_table`.
"""

from __future__ import annotations

import numpy as np

from ...args import LogViews
from ...interop import allocate, backend_view
from . import device as cuda_device
from .abi import COVERAGE_PARAMS
from .compile import kernel_name
from .configs import BLOCKS_PER_SM, LaunchConfig
from .params import KernelLaunch, length, log_struct, ptr

COVERAGE_THREADS = 256  # kCoverageThreads in coverage.cu
WARPS = COVERAGE_THREADS // 32  # the kernels that take a slot per warp


def grid_cap(device_id: int) -> int:
    """The most blocks a coverage launch on ``device_id`` takes (its grid-stride loops do the rest)."""
    return cuda_device.sm_count(device_id) * BLOCKS_PER_SM


def grid(items: int, per_block: int, cap: int) -> int:
    return max(1, min(-(-items // per_block), cap))


def source_table(rows: np.ndarray, like, name: str):
    """The device copy of a source table (``int64 [n, SOURCE_FIELDS]``), made once at construction."""
    table = backend_view(allocate(rows.shape, np.int64, like=like, fill=0), f"{name} table", writable=True)
    cuda_device.copy_from_host(table, rows)
    return table


def _launch(kernel: str, grid_size: int, values: tuple) -> KernelLaunch:
    params = np.zeros(1, COVERAGE_PARAMS[kernel])
    for name, value in zip(params.dtype.names, values):
        params[name] = value
    return KernelLaunch("coverage", kernel_name(kernel), LaunchConfig(grid_size, COVERAGE_THREADS), params)


# Each ``slots`` below is the write's slots (int64, contiguous) or None (a bound launch's per-step
# field, 0 until the step writes it); ``cap`` is grid_cap of the device launched on.

def deep_write_launch(table, num_sources: int, slots, canary, cap: int) -> KernelLaunch:
    n = length(slots)
    return _launch("deep_write", grid(n, WARPS, cap),
                   (ptr(table), num_sources, ptr(slots), n, ptr(canary), canary.shape[0], canary.shape[1]))


def deep_check_launch(table, num_sources: int, canary, state, per_step: int, log: LogViews, kind: int,
                      cap: int) -> KernelLaunch:
    return _launch("deep_check", grid(per_step, WARPS, cap), (ptr(table), num_sources, ptr(canary), canary.shape[0],
                                                               canary.shape[1], per_step, ptr(state), log_struct(log), kind))


def lost_snapshot_launch(table, num_sources: int, slots, num_slots: int, pre, cap: int) -> KernelLaunch:
    n = length(slots)
    return _launch("lost_snapshot", grid(n * num_sources, COVERAGE_THREADS, cap),
                   (ptr(table), num_sources, ptr(slots), n, num_slots, ptr(pre)))


def lost_check_launch(table, num_sources: int, slots, capacity: int, pre, head, tail, log: LogViews, kind: int,
                      cap: int) -> KernelLaunch:
    """``capacity`` tokens are checked (the snapshot's); the rest are counted as out of range."""
    total = length(slots)
    n = min(total, capacity)
    return _launch("lost_check", grid(n, WARPS, cap), (ptr(table), num_sources, ptr(slots), n, total - n, ptr(pre),
                                                        ptr(head), head.shape[1], ptr(tail), tail.shape[1], tail.shape[0],
                                                        log_struct(log), kind))
