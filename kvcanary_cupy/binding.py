"""The bound road's contract with the front door: the checks and views of a call's long-lived
arguments (canary buffers, plans, the log, real-KV sources, the SWA LUT).

The free functions (:mod:`kvcanary_cupy.ops`) run these on every call; a bound launcher
(:mod:`kvcanary_cupy.launchers`, :mod:`kvcanary_cupy.plan_launcher`) runs the same ones once, when
it binds, so both refuse the same arguments with the same messages.  ``*_setup`` makes the checks
that need no view and finds the placement; ``*_args`` views and checks the buffers inside
``launch_stream(placement)``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .args import CanaryTarget, LogViews, SourceView, SourceViews, VerifyArgs, WriteArgs
from .constants import CANARY_FIELDS_PER_SLOT, CANARY_SLOT_BYTES, MAX_CANARY_BUFFERS, RealKvHashMode
from .errors import fail
from .interop import backend_view, byte_rows_view, check_aligned, common_placement, is_torch_tensor
from .log import ViolationLog
from .plans import RealKvSource, VerifyPlan, WritePlan, check_num_sources
from .validation import (I32, I64, INT32_MAX, check_1d, check_contiguous_output, check_count, check_disjoint, check_int,
                         contiguous_input, require)




def check_type(obj, name: str, cls) -> None:
    if not isinstance(obj, cls):
        fail(TypeError, f"{name} must be a {cls.__name__}, got {type(obj).__name__}; allocate one with {cls.__name__}.allocate(...)")


def record_arrays(prefix: str, record) -> dict:
    named = {f"{prefix}.{k}": v for k, v in record.arrays().items()}
    for name, arr in named.items():
        require(arr, name)
    return named


def record_views(prefix: str, record, *, writable: bool) -> dict:
    """NumPy/CuPy views of a record's arrays.

    Records are long-lived (allocated once, reused every step), so the DLPack view of each of
    their torch tensors (about 20 us on a GPU) is made once and kept on the record, as long as
    the tensor's address, dtype, shape and strides stay the same.
    """
    cache = record.__dict__.setdefault("_kvcanary_views", {})
    views = {}
    for key, arr in record.arrays().items():
        name = f"{prefix}.{key}"
        if is_torch_tensor(arr) and not (writable and arr.requires_grad):
            stamp = (arr.data_ptr(), arr.dtype, tuple(arr.shape), tuple(arr.stride()), str(arr.device))
            hit = cache.get(key)
            if hit is None or hit[0] != stamp:
                hit = cache[key] = (stamp, backend_view(arr, name))
            view = hit[1]
        else:
            view = backend_view(arr, name, writable=writable)
        if writable:
            check_contiguous_output(view, name)
        views[key] = view
    return views


def plan_views(prefix: str, record, capacity=None, *, writable: bool, xp=None) -> dict:
    """Views of a VerifyPlan's or WritePlan's arrays, each checked against the record's field
    table (plans.py) for ``capacity`` (default: the length of the record's capacity field).
    Read-only views that are not contiguous are copied with ``xp``."""
    views = record_views(prefix, record, writable=writable)
    cls = type(record)
    if capacity is None:
        key = cls.CAPACITY_FIELD
        check_1d(views[key], f"{prefix}.{key}", I64)
        capacity = views[key].shape[0]
    for f in cls.FIELDS:
        name = f"{prefix}.{f.name}"
        check_1d(views[f.name], name, f.dtype, f.length(capacity), length_name=f.length_name(cls.CAPACITY_NAME))
        if not writable:
            views[f.name] = contiguous_input(views[f.name], name, xp)
    return views


def log_views(log: ViolationLog) -> LogViews:
    v = record_views("log", log, writable=True)
    check_1d(v["write_index"], "log.write_index", I32, 1)
    kinds = v["kernel_run_counters"].shape[0]
    for key in ("violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        check_1d(v[key], f"log.{key}", I64, kinds, length_name="num_kinds")
    ring = v["ring"]
    if ring.dtype != np.int64 or ring.ndim != 2 or ring.shape[1] != 8:
        fail(ValueError, f"log.ring must be int64 [capacity, 8], got {ring.dtype} {tuple(ring.shape)}")
    if ring.shape[0] > INT32_MAX:
        fail(ValueError, f"log.ring capacity must be at most {INT32_MAX}, got {ring.shape[0]}")
    views, seen = tuple(v.values()), log.__dict__.get("_kvcanary_disjoint", ())
    if len(seen) != len(views) or any(a is not b for a, b in zip(seen, views)):  # else the same views: checked
        check_disjoint({f"log.{k}": a for k, a in v.items()}, "each array of a ViolationLog needs its own memory")
        log.__dict__["_kvcanary_disjoint"] = views
    return LogViews(**v)


def canary_view(canary_buf, name: str, *, written: bool):
    """The canary buffer as ``int64 [num_slots, fields]`` (docs/format.md §1)."""
    view = backend_view(canary_buf, name, writable=written)
    if written:
        check_contiguous_output(view, name)
    elif not view.flags.c_contiguous:
        fail(ValueError, f"{name} must be contiguous, got strides {tuple(view.strides)} for shape {tuple(view.shape)}")
    if view.ndim != 2:
        fail(ValueError, f"{name} must be 2-D, got shape {tuple(view.shape)}")
    if view.dtype == np.uint8:
        stride = view.shape[1]
        if stride < CANARY_SLOT_BYTES or stride % 8:
            fail(ValueError, f"{name} slot stride must hold at least 4 int64 fields (>= 32 bytes, a multiple of 8), got {stride} bytes")
        view = view.view(np.int64)
    elif view.dtype == np.int64:
        if view.shape[1] < CANARY_FIELDS_PER_SLOT:
            fail(ValueError, f"{name} slot stride must hold at least 4 int64 fields, got {view.shape[1]}")
    else:
        fail(TypeError, f"{name} must be int64 [num_slots, 4] or uint8 [num_slots, >=32], got dtype {view.dtype}")
    if view.shape[1] > INT32_MAX:
        fail(ValueError, f"{name} slot stride must be at most {INT32_MAX} int64 fields (the kernels take it as int32), got {view.shape[1]}")
    check_aligned(view, name, 8, "its slots are read as int64 fields")
    if view.shape[0] < 1:
        fail(ValueError, f"{name} must have at least 1 slot (slot 0 is the padding slot), got 0")
    return view


def check_launch_tag(kernel_kind, log: ViolationLog, name: str) -> int:
    kind = check_int(kernel_kind, name)
    if not 0 <= kind < log.num_kinds:
        fail(ValueError, f"{name} must be in [0, {log.num_kinds}) (the log's num_kinds), got {kind}")
    return kind


def check_hash_mode(mode) -> int:
    try:
        return int(RealKvHashMode(mode))
    except (ValueError, TypeError):
        fail(ValueError, f"real_kv_hash_mode must be a RealKvHashMode (NONE, PARTIAL or ALL), got {mode!r}")


class CanaryBuffer(NamedTuple):
    """One canary buffer of a write or verify call, with the argument names it is reported under."""

    name: str  # canary_buf, or canary_buf[i] for a sequence of buffers
    sources_name: str  # real_kv_sources, or real_kv_sources[i]
    buffer: object
    tag: int  # its launch tag (the call's kernel_kind)
    sources: tuple  # of RealKvSource


def canary_buffers(canary_buf, kernel_kind, real_kv_sources, log) -> list:
    """The canary buffers of a call: one buffer with its kind and sources, or a sequence of up to
    MAX_CANARY_BUFFERS buffers with a sequence of as many kinds and (unless empty) of as many
    per-buffer source tuples."""
    if not isinstance(canary_buf, (list, tuple)):
        require(canary_buf, "canary_buf")
        return [CanaryBuffer("canary_buf", "real_kv_sources", canary_buf, check_launch_tag(kernel_kind, log, "kernel_kind"),
                        check_num_sources(real_kv_sources))]
    n = len(canary_buf)
    if not 1 <= n <= MAX_CANARY_BUFFERS:
        fail(ValueError, f"canary_buf must be one buffer or a sequence of 1 to {MAX_CANARY_BUFFERS} buffers, got {n}")
    for i, b in enumerate(canary_buf):
        require(b, f"canary_buf[{i}]")
    if not isinstance(kernel_kind, (list, tuple)) or len(kernel_kind) != n:
        fail(ValueError, f"kernel_kind must be a sequence of {n} launch kinds (one per buffer of canary_buf), got {kernel_kind!r}")
    sources = tuple(real_kv_sources)
    if not sources:
        sources = ((),) * n
    elif len(sources) != n or any(isinstance(s, RealKvSource) for s in sources):
        fail(ValueError, f"real_kv_sources must be empty or a sequence of {n} tuples of RealKvSource (one per buffer of "
                         f"canary_buf), got {len(sources)} items")
    return [CanaryBuffer(f"canary_buf[{i}]", f"real_kv_sources[{i}]", canary_buf[i],
                    check_launch_tag(kernel_kind[i], log, f"kernel_kind[{i}]"), check_num_sources(sources[i]))
            for i in range(n)]


class LaunchContext(NamedTuple):
    """What a write's or verify's checks that need no view found: its canary buffers and hash mode."""

    buffers: list  # of CanaryBuffer
    mode: int  # RealKvHashMode


def launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode):
    """The checks write and verify share: ``(buffers, mode, their arrays by name)``."""
    mode = check_hash_mode(real_kv_hash_mode)
    check_type(log, "log", ViolationLog)
    buffers = canary_buffers(canary_buf, kernel_kind, real_kv_sources, log)
    named = {}
    for b in buffers:
        named[b.name] = b.buffer
        named.update({f"{b.sources_name}[{i}].tensor": s.tensor for i, s in enumerate(b.sources)})
    named.update(record_arrays("log", log))
    return buffers, mode, named


def targets(buffers: list, mode: int, *, written: bool) -> tuple:
    """Views of the canary buffers and their sources; buffers written together must not overlap."""
    targets = []
    for b in buffers:
        canary = canary_view(b.buffer, b.name, written=written)
        if targets and canary.shape[0] != targets[0].canary.shape[0]:
            fail(ValueError, f"{b.name} has {canary.shape[0]} slots but {buffers[0].name} has {targets[0].canary.shape[0]}; "
                             "the canary buffers of one call share its plan and need the same num_slots")
        targets.append(CanaryTarget(canary, b.tag, source_views(b, mode, canary.shape[0])))
    if written:
        check_disjoint({b.name: t.canary for t, b in zip(targets, buffers)},
                       "each canary buffer written by one call needs its own memory")
    return tuple(targets)


def source_views(buffer: CanaryBuffer, mode: int, num_slots: int) -> tuple:
    """Byte views of a buffer's real-KV sources; none when the mode is NONE (they are never read)."""
    if mode == RealKvHashMode.NONE:
        return ()
    views = []
    for i, src in enumerate(buffer.sources):
        name = f"{buffer.sources_name}[{i}].tensor"
        data = byte_rows_view(src.tensor, name)
        unit = min(8, src.stream_piece & -src.stream_piece) if src.is_strided else 16
        check_aligned(data, name, unit, f"real KV is read {unit} bytes at a time")
        if data.shape[0] * src.page_size + src.slot_offset < num_slots:
            fail(
                ValueError,
                f"{name} has {data.shape[0]} rows x page_size={src.page_size} = {data.shape[0] * src.page_size} "
                f"slots" + (f" from slot_offset={src.slot_offset}" if src.slot_offset else "")
                + f" but {buffer.name} has {num_slots}; every canary slot needs its real-KV bytes",
            )
        token_stride = src.num_bytes_per_token if src.token_stride is None else src.token_stride
        views.append(SourceView(data, src.page_size, src.num_bytes_per_token, src.read_bytes, token_stride,
                                src.byte_offset, src.stream_piece, src.levels, unit, src.slot_offset))
    return SourceViews(views)


def lut_view(view, xp):
    check_1d(view, "full_to_swa_index_mapping", I64, min_length=1)
    return contiguous_input(view, "full_to_swa_index_mapping", xp)


def write_setup(canary_buf, write_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode, chain_position_assert,
                 step_arrays: dict, write_waves=None, wave=0):
    """A write's checks that need no view; returns ``(placement, context, long-lived arrays by name)``.

    ``step_arrays`` (the per-step token arrays by name) only join the placement.
    """
    check_wave(write_waves, wave)
    buffers, mode, named = launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode)
    check_type(write_plan, "write_plan", WritePlan)
    flag = chain_position_assert
    flag_is_array = not isinstance(flag, (bool, np.bool_))
    if flag_is_array and not hasattr(flag, "shape"):
        fail(TypeError, f"chain_position_assert must be a bool or a one-element int32 array, got {type(flag).__name__} {flag!r}")
    named.update(record_arrays("write_plan", write_plan))
    named["chain_position_assert"] = flag if flag_is_array else None
    named["write_waves"] = write_waves
    return common_placement({**named, **step_arrays}), LaunchContext(buffers, mode), named


def check_wave(write_waves, wave) -> int:
    """A write's ``wave`` (a non-negative int32), which selects requests only with ``write_waves``."""
    wave = check_count(wave, "wave")
    if write_waves is None and wave != 0:
        fail(ValueError, f"wave={wave} selects the requests whose write_waves entry is {wave}; pass write_waves "
                         "(None writes every request of the plan)")
    return wave


def write_bound_args(write_plan, log, chain_position_assert, context, xp, write_waves=None, wave=0) -> WriteArgs:
    """Checked views of a write's long-lived buffers; the per-step token fields are None."""
    mode = context.mode
    canaries = targets(context.buffers, mode, written=True)
    plan_v = plan_views("write_plan", write_plan, writable=False, xp=xp)
    flag = chain_position_assert
    if isinstance(flag, (bool, np.bool_)):
        flag = bool(flag)
    else:
        flag = backend_view(flag, "chain_position_assert")
        check_1d(flag, "chain_position_assert", I32, 1)
    waves = None
    if write_waves is not None:
        waves = backend_view(write_waves, "write_waves")
        check_1d(waves, "write_waves", I32, plan_v["write_seed_slot_indices"].shape[0], length_name="write_req_capacity")
        waves = contiguous_input(waves, "write_waves", xp)
    return WriteArgs(
        targets=canaries,
        write_offsets=plan_v["write_offsets"],
        write_seed_slot_indices=plan_v["write_seed_slot_indices"],
        write_num_valid_reqs=plan_v["write_num_valid_reqs"],
        input_ids=None,
        positions=None,
        out_cache_loc=None,
        expected_input_tokens=None,
        expected_input_positions=None,
        chain_position_assert=flag,
        write_waves=waves,
        wave=int(wave),  # checked by write_setup
        real_kv_hash_mode=mode,
        log=log_views(log),
    )


def verify_setup(canary_buf, verify_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode, check_expected_token,
                  plan_arrays=None, check_holes=False):
    """A verify's checks that need no view; returns ``(placement, context, arrays by name)``.

    ``verify_plan`` is None for plan_and_verify, whose plan's arrays (``plan_arrays``) join the placement."""
    buffers, mode, named = launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode)
    if verify_plan is not None:
        check_type(verify_plan, "verify_plan", VerifyPlan)
        named.update(record_arrays("verify_plan", verify_plan))
    if not isinstance(check_expected_token, (bool, np.bool_)):
        fail(TypeError, f"check_expected_token must be a bool, got {type(check_expected_token).__name__}")
    if not isinstance(check_holes, (bool, np.bool_)):
        fail(TypeError, f"check_holes must be a bool, got {type(check_holes).__name__}")
    named.update(plan_arrays or {})
    return common_placement(named), LaunchContext(buffers, mode), named


def verify_args(verify_plan, log, check_expected_token, context, xp, check_holes=False) -> VerifyArgs:
    mode = context.mode
    canaries = targets(context.buffers, mode, written=False)
    pv = plan_views("verify_plan", verify_plan, writable=False, xp=xp)
    return VerifyArgs(
        targets=canaries,
        **{k: pv[k] for k in VerifyArgs._fields if k in pv},
        check_expected_token=bool(check_expected_token),
        check_holes=bool(check_holes),
        real_kv_hash_mode=mode,
        log=log_views(log),
    )
