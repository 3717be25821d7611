"""Parameter packing: a kernel's parameter record filled from the backend's views, its fields
patched in place per call (:class:`ParamSlots`) and handed to a launch by address.

Scalars are NumPy scalars of the exact C parameter type; the structs of ``canary_common.cuh`` are
one-element NumPy structured arrays (:mod:`.abi`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ...args import LogViews
from ...constants import REAL_KV_PARTIAL_BYTES, RealKvHashMode
from .abi import CANARY_TARGETS, LAUNCH_LOG
from .configs import LaunchConfig


def ptr(x) -> int:
    return 0 if x is None else x.data.ptr


def length(x) -> int:
    return 0 if x is None else x.shape[0]


def row_stride(x) -> np.int64:
    return np.int64(x.strides[0] // x.dtype.itemsize)


def targets_struct(targets: tuple, mode: int) -> np.ndarray:
    """CanaryTargets: each buffer, its real-KV sources (none when the mode is NONE) and its kind."""
    s = np.zeros(1, CANARY_TARGETS)
    for b, target in enumerate(targets):
        canary, c = target.canary, s["canary"][0, b]
        fields = canary.shape[1]
        c["data"], c["num_slots"], c["fields"] = canary.data.ptr, canary.shape[0], fields
        c["vec"] = int(fields % 2 == 0 and canary.data.ptr % 16 == 0)
        s["kind"][0, b] = target.kernel_kind
        if mode == RealKvHashMode.NONE:
            continue
        src = s["sources"][0, b]
        for i, view in enumerate(target.sources):
            src["data"][i] = view.data.data.ptr
            src["row_stride"][i] = view.data.strides[0]
            src["slot_offset"][i] = view.slot_offset
            src["page_size"][i] = view.page_size
            src["token_stride"][i], src["byte_offset"][i] = view.stride, view.byte_offset
            src["piece_bytes"][i], src["unit"][i] = view.piece_bytes or view.num_bytes_per_token, view.unit
            for level, (count, stride) in enumerate(view.levels):
                src["piece_count"][i, level], src["piece_stride"][i, level] = count, stride
            src["nbytes"][i] = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else view.read_bytes
        src["num_sources"] = len(target.sources)
    return s


def log_struct(log: LogViews) -> np.ndarray:
    s = np.zeros(1, LAUNCH_LOG)
    for key in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        s[key] = getattr(log, key).data.ptr
    s["capacity"] = log.ring.shape[0]
    return s


def has_real_kv(targets: tuple, mode: int) -> bool:
    return mode != RealKvHashMode.NONE and any(t.sources for t in targets)



class ParamSlots:
    """Named scalar fields of one parameter record, as ``(memoryview, index)`` pairs to write in
    place (a memoryview item write is the cheapest way to patch a field per call)."""

    def __init__(self, params: np.ndarray):
        self.params = params
        self._views = {np.dtype(t): memoryview(params.view(t)) for t in ("u8", "i8", "i4")}

    def __call__(self, path: str) -> tuple:
        """The slot of the field ``path`` ("inputs.bs", "verify_capacity")."""
        offset, dtype = 0, self.params.dtype
        for name in path.split("."):
            dtype, at = dtype.fields[name][:2]
            offset += at
        assert offset % dtype.itemsize == 0, path
        return self._views[dtype], offset // dtype.itemsize


@functools.lru_cache(maxsize=None)
def _field_offsets(params: np.dtype) -> tuple:
    return tuple(params.fields[name][1] for name in params.names)


def _by_address():
    """CuPy's argument holder for "the value at this address" (what it builds for every one-element
    NumPy array it is given), or None where this CuPy version does not expose it."""
    try:
        from cupy.cuda import function
    except ImportError:  # pragma: no cover - this module is only used with CuPy
        return None
    return getattr(function, "CPointer", None)


_CPointer = _by_address()


def kernel_arguments(params: np.ndarray) -> tuple:
    """The launch arguments of a parameter record: each field, passed by value.

    CuPy reads a one-element NumPy argument through ``__array_interface__`` (microseconds per
    argument); handing it the field addresses instead skips that.  ``params`` must outlive the
    launch call (the driver copies the values when the kernel is launched or captured).
    """
    if _CPointer is None:
        return tuple(params[name] for name in params.dtype.names)
    return tuple(_CPointer(address) for address in record_addresses(params))


def record_addresses(params: np.ndarray) -> tuple:
    """The host address of each field of a parameter record: where a launch reads argument i."""
    base = params.ctypes.data
    return tuple(base + offset for offset in _field_offsets(params.dtype))


class KernelLaunch(NamedTuple):
    family: str
    name: str
    config: LaunchConfig
    params: np.ndarray  # one record of the kernel's parameter dtype

