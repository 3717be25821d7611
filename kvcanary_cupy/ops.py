"""The public operations: plan, write, verify, plan_and_verify, scatter_req_token_ids and move_pages.

Each one validates every argument (shapes, dtypes, devices, capacities: no device sync), views
the caller's arrays without copying, picks the backend from the arrays' device (NumPy on the
CPU, CUDA kernels through CuPy on the GPU) and launches on the caller's stream.  A rejected
call changes nothing.  ``strict=True`` adds host-side checks of the values (a device sync).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from . import interop
from . import strict as strict_checks
from .args import (
    CanaryTarget,
    LogViews,
    MoveArgs,
    PlanArgs,
    PlanOutputs,
    PlanVerifyArgs,
    ScatterArgs,
    SourceView,
    VERIFY_ENTRY_FIELDS,
    VerifyArgs,
    WriteArgs,
)
from .backends import get_backend
from .constants import CANARY_FIELDS_PER_SLOT, CANARY_SLOT_BYTES, MAX_CANARY_BUFFERS, RealKvHashMode
from .errors import CanaryCapacityWarning, fail, public_api
from .interop import (
    Array,
    array_module,
    backend_view,
    byte_rows_view,
    check_aligned,
    common_placement,
    import_cupy,
    is_torch_tensor,
    launch_stream,
    refuse_during_capture,
    side_stream,
)
from .plans import (RealKvSource, VerifyPlan, ViolationLog, WritePlan, check_num_sources, is_clean,
                    mark_clean, scan_state)
from .tables import ReqToToken, TableKind, as_table, table_view
from .validation import (
    I32,
    I64,
    INT32_MAX,
    bool_keyword,
    check_1d,
    check_2d_rows,
    check_contiguous_output,
    check_count,
    check_disjoint,
    check_dtype,
    check_int,
    check_int64,
    check_integer_dtype,
    contiguous_input,
    require,
)



def _check_type(obj, name: str, cls) -> None:
    if not isinstance(obj, cls):
        fail(TypeError, f"{name} must be a {cls.__name__}, got {type(obj).__name__}; allocate one with {cls.__name__}.allocate(...)")


def _record_arrays(prefix: str, record) -> dict:
    named = {f"{prefix}.{k}": v for k, v in record.arrays().items()}
    for name, arr in named.items():
        require(arr, name)
    return named


def _record_views(prefix: str, record, *, writable: bool) -> dict:
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


def _plan_views(prefix: str, record, capacity=None, *, writable: bool, xp=None) -> dict:
    """Views of a VerifyPlan's or WritePlan's arrays, each checked against the record's field
    table (plans.py) for ``capacity`` (default: the length of the record's capacity field).
    Read-only views that are not contiguous are copied with ``xp``."""
    views = _record_views(prefix, record, writable=writable)
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


def _log_views(log: ViolationLog) -> LogViews:
    v = _record_views("log", log, writable=True)
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


def _canary_view(canary_buf, name: str, *, written: bool):
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


def _kernel_kind(kernel_kind, log: ViolationLog, name: str) -> int:
    kind = check_int(kernel_kind, name)
    if not 0 <= kind < log.num_kinds:
        fail(ValueError, f"{name} must be in [0, {log.num_kinds}) (the log's num_kinds), got {kind}")
    return kind


def _hash_mode(mode) -> int:
    try:
        return int(RealKvHashMode(mode))
    except (ValueError, TypeError):
        fail(ValueError, f"real_kv_hash_mode must be a RealKvHashMode (NONE, PARTIAL or ALL), got {mode!r}")


class _Buffer(NamedTuple):
    """One canary buffer of a write or verify call, with the argument names it is reported under."""

    name: str  # canary_buf, or canary_buf[i] for a sequence of buffers
    sources_name: str  # real_kv_sources, or real_kv_sources[i]
    buffer: object
    kind: int
    sources: tuple  # of RealKvSource


def _buffers(canary_buf, kernel_kind, real_kv_sources, log) -> list:
    """The canary buffers of a call: one buffer with its kind and sources, or a sequence of up to
    MAX_CANARY_BUFFERS buffers with a sequence of as many kinds and (unless empty) of as many
    per-buffer source tuples."""
    if not isinstance(canary_buf, (list, tuple)):
        require(canary_buf, "canary_buf")
        return [_Buffer("canary_buf", "real_kv_sources", canary_buf, _kernel_kind(kernel_kind, log, "kernel_kind"),
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
    return [_Buffer(f"canary_buf[{i}]", f"real_kv_sources[{i}]", canary_buf[i],
                    _kernel_kind(kernel_kind[i], log, f"kernel_kind[{i}]"), check_num_sources(sources[i]))
            for i in range(n)]


def _launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode):
    """The checks write and verify share: ``(buffers, mode, their arrays by name)``."""
    mode = _hash_mode(real_kv_hash_mode)
    _check_type(log, "log", ViolationLog)
    buffers = _buffers(canary_buf, kernel_kind, real_kv_sources, log)
    named = {}
    for b in buffers:
        named[b.name] = b.buffer
        named.update({f"{b.sources_name}[{i}].tensor": s.tensor for i, s in enumerate(b.sources)})
    named.update(_record_arrays("log", log))
    return buffers, mode, named


def _targets(buffers: list, mode: int, *, written: bool) -> tuple:
    """Views of the canary buffers and their sources; buffers written together must not overlap."""
    targets = []
    for b in buffers:
        canary = _canary_view(b.buffer, b.name, written=written)
        if targets and canary.shape[0] != targets[0].canary.shape[0]:
            fail(ValueError, f"{b.name} has {canary.shape[0]} slots but {buffers[0].name} has {targets[0].canary.shape[0]}; "
                             "the canary buffers of one call share its plan and need the same num_slots")
        targets.append(CanaryTarget(canary, b.kind, _source_views(b, mode, canary.shape[0])))
    if written:
        check_disjoint({b.name: t.canary for t, b in zip(targets, buffers)},
                       "each canary buffer written by one call needs its own memory")
    return tuple(targets)


def _source_views(buffer: _Buffer, mode: int, num_slots: int) -> tuple:
    """Byte views of a buffer's real-KV sources; none when the mode is NONE (they are never read)."""
    if mode == RealKvHashMode.NONE:
        return ()
    views = []
    for i, src in enumerate(buffer.sources):
        name = f"{buffer.sources_name}[{i}].tensor"
        data = byte_rows_view(src.tensor, name)
        check_aligned(data, name, 16, "real KV is read 16 bytes at a time")
        if data.shape[0] * src.page_size < num_slots:
            fail(
                ValueError,
                f"{name} has {data.shape[0]} rows x page_size={src.page_size} = {data.shape[0] * src.page_size} "
                f"slots but {buffer.name} has {num_slots}; every canary slot needs its real-KV bytes",
            )
        views.append(SourceView(data, src.page_size, src.num_bytes_per_token, src.read_bytes))
    return tuple(views)


def _lut_view(view, xp):
    check_1d(view, "full_to_swa_index_mapping", I64, min_length=1)
    return contiguous_input(view, "full_to_swa_index_mapping", xp)


def _write_setup(canary_buf, write_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode, chain_position_assert,
                 step_arrays: dict):
    """A write's checks that need no view; returns ``(placement, context, long-lived arrays by name)``.

    ``step_arrays`` (the per-step token arrays by name) only join the placement.
    """
    buffers, mode, named = _launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode)
    _check_type(write_plan, "write_plan", WritePlan)
    flag = chain_position_assert
    flag_is_array = not isinstance(flag, (bool, np.bool_))
    if flag_is_array and not hasattr(flag, "shape"):
        fail(TypeError, f"chain_position_assert must be a bool or a one-element int32 array, got {type(flag).__name__} {flag!r}")
    named.update(_record_arrays("write_plan", write_plan))
    named["chain_position_assert"] = flag if flag_is_array else None
    return common_placement({**named, **step_arrays}), (buffers, mode), named


def _write_bound_args(write_plan, log, chain_position_assert, context, xp) -> WriteArgs:
    """Checked views of a write's long-lived buffers; the per-step token fields are None."""
    buffers, mode = context
    targets = _targets(buffers, mode, written=True)
    plan_v = _plan_views("write_plan", write_plan, writable=False, xp=xp)
    flag = chain_position_assert
    if isinstance(flag, (bool, np.bool_)):
        flag = bool(flag)
    else:
        flag = backend_view(flag, "chain_position_assert")
        check_1d(flag, "chain_position_assert", I32, 1)
    return WriteArgs(
        targets=targets,
        write_offsets=plan_v["write_offsets"],
        write_seed_slot_indices=plan_v["write_seed_slot_indices"],
        write_num_valid_reqs=plan_v["write_num_valid_reqs"],
        input_ids=None,
        positions=None,
        out_cache_loc=None,
        expected_input_tokens=None,
        expected_input_positions=None,
        chain_position_assert=flag,
        real_kv_hash_mode=mode,
        log=_log_views(log),
    )


def _verify_setup(canary_buf, verify_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode, check_expected_token,
                  plan_arrays=None, check_holes=False):
    """A verify's checks that need no view; returns ``(placement, context, arrays by name)``.

    ``verify_plan`` is None for plan_and_verify, whose plan's arrays (``plan_arrays``) join the placement."""
    buffers, mode, named = _launch_context(canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode)
    if verify_plan is not None:
        _check_type(verify_plan, "verify_plan", VerifyPlan)
        named.update(_record_arrays("verify_plan", verify_plan))
    if not isinstance(check_expected_token, (bool, np.bool_)):
        fail(TypeError, f"check_expected_token must be a bool, got {type(check_expected_token).__name__}")
    if not isinstance(check_holes, (bool, np.bool_)):
        fail(TypeError, f"check_holes must be a bool, got {type(check_holes).__name__}")
    named.update(plan_arrays or {})
    return common_placement(named), (buffers, mode), named


def _verify_args(verify_plan, log, check_expected_token, context, xp, check_holes=False) -> VerifyArgs:
    buffers, mode = context
    targets = _targets(buffers, mode, written=False)
    pv = _plan_views("verify_plan", verify_plan, writable=False, xp=xp)
    return VerifyArgs(
        targets=targets,
        **{k: pv[k] for k in VerifyArgs._fields if k in pv},
        check_expected_token=bool(check_expected_token),
        check_holes=bool(check_holes),
        real_kv_hash_mode=mode,
        log=_log_views(log),
    )


# ----------------------------------------------------------------------------------------------


class _PlanCall(NamedTuple):
    """A plan's arguments after the checks that need no view."""

    table: object  # ReqToToken, BlockTable or PagedKvIndices
    batch_rows: bool  # the table's rows are the batch rows (PagedKvIndices)
    window: int
    offset: int
    verify_capacity: int
    named: dict  # every input array by argument name (None where not given)


def _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
               full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
               kv_token_id_vs_position_offset, out, op: str) -> _PlanCall:
    """The checks of plan (and plan_and_verify, named ``op`` in messages) that need no view."""
    require(prefix_lens, "prefix_lens")
    require(extend_seq_lens, "extend_seq_lens")
    table = as_table(table)
    batch_rows = table.kind == TableKind.PAGED_KV  # the table's rows are the batch rows
    if batch_rows and req_pool_indices is not None:
        fail(ValueError, "req_pool_indices must be None with a PagedKvIndices table: its rows are the batch rows "
                         "(request r owns kv_indices[kv_indptr[r]:kv_indptr[r+1]])")
    if not batch_rows and req_pool_indices is None:
        fail(ValueError, f"req_pool_indices is required with a {type(table).__name__} table (only a PagedKvIndices "
                         "table, whose rows are the batch rows, takes None)")
    window = check_int64(swa_window_size, "swa_window_size", minimum=0)
    lut = full_to_swa_index_mapping
    if window > 0 and lut is None and isinstance(table, ReqToToken):
        fail(ValueError, f"{op} requires full_to_swa_index_mapping when swa_window_size > 0; pass the full->SWA slot LUT (int64)")
    pool, lens = req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    if pool is not None and lens is None:
        fail(ValueError, f"{op} requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")
    if pool is None and lens is not None:
        fail(ValueError, "req_to_verify_expected_tokens_valid_lens was given without req_to_verify_expected_tokens; pass both or neither")
    offset = check_int64(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    vcap = check_count(verify_capacity, "verify_capacity")
    named = {
        "req_pool_indices": req_pool_indices,
        "prefix_lens": prefix_lens,
        "extend_seq_lens": extend_seq_lens,
        **table.arrays(),
        "full_to_swa_index_mapping": lut,
        "req_to_verify_expected_tokens": pool,
        "req_to_verify_expected_tokens_valid_lens": lens,
    }
    if out is not None:
        if not (isinstance(out, tuple) and len(out) == 2):
            fail(TypeError, f"out must be a (VerifyPlan, WritePlan) tuple, got {type(out).__name__}")
        _check_type(out[0], "out[0]", VerifyPlan)
        _check_type(out[1], "out[1]", WritePlan)
        named.update(_record_arrays("out[0]", out[0]))
        named.update(_record_arrays("out[1]", out[1]))
    return _PlanCall(table, batch_rows, window, offset, vcap, named)


def _plan_args(c: _PlanCall, write_req_capacity, out, placement, xp, entry_capacity, op: str, why_entries: str = "") -> tuple:
    """``(PlanArgs, VerifyPlan, WritePlan)``, every view checked; inside ``launch_stream(placement)``.

    ``entry_capacity(bs)`` is the number of verify entries out[0] must hold (and an allocated
    VerifyPlan gets); None: any (plan_and_verify stores none), and one of capacity 0 is allocated.
    ``why_entries`` ends the message of a mismatch.
    """
    named, table = c.named, c.table
    v = {k: backend_view(a, k) for k, a in named.items() if not k.startswith("out")}
    first = "prefix_lens" if c.batch_rows else "req_pool_indices"
    bs = v[first].shape[0] if v[first].ndim == 1 else -1
    for key in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        if v[key] is not None:
            check_1d(v[key], key, I64, bs, length_name=f"bs (len({first}))")
            v[key] = contiguous_input(v[key], key, xp)
    tv = table_view(table, v, bs, xp)
    if v["full_to_swa_index_mapping"] is not None:
        v["full_to_swa_index_mapping"] = _lut_view(v["full_to_swa_index_mapping"], xp)
    if v["req_to_verify_expected_tokens"] is not None:
        check_2d_rows(v["req_to_verify_expected_tokens"], "req_to_verify_expected_tokens", I32)
        if v["req_to_verify_expected_tokens"].shape[0] < tv.pool_rows:
            fail(ValueError, f"req_to_verify_expected_tokens must have at least {tv.pool_rows_why}, got {v['req_to_verify_expected_tokens'].shape[0]}")
        key = "req_to_verify_expected_tokens_valid_lens"
        check_1d(v[key], key, I64, bs, length_name=f"bs (len({first}))")
        v[key] = contiguous_input(v[key], key, xp)

    entries = entry_capacity(bs)
    if out is None:
        wcap = bs if write_req_capacity is None else check_count(write_req_capacity, "write_req_capacity")
    else:
        wcap = out[1].capacity if write_req_capacity is None else check_count(write_req_capacity, "write_req_capacity")
        if entries is not None and out[0].capacity != entries:
            fail(ValueError, f"{op} verify_capacity={entries} does not match out[0].verify_slot_indices.shape[0]={out[0].capacity}"
                             + why_entries)
        if out[1].capacity != wcap:
            fail(ValueError, f"{op} write_req_capacity={wcap} does not match out[1].write_seed_slot_indices.shape[0]={out[1].capacity}")
    if bs > wcap:
        fail(ValueError, f"bs={bs} exceeds write_req_capacity={wcap}; size the WritePlan for the largest batch "
                         "(CanaryCapacities.from_engine(max_running_requests=...) for a CanaryPlanner)")

    if out is None:
        refuse_during_capture(placement, f"{op} with out=None allocates its VerifyPlan and WritePlan",
                              "pass out=(VerifyPlan, WritePlan) allocated before capturing (a CanaryPlanner holds such a pair)")
        like = named[next(iter(table.arrays()))]
        vp, wp = VerifyPlan.allocate(entries or 0, like=like), WritePlan.allocate(wcap, like=like)
    else:
        vp, wp = out
    ov = _plan_views("out[0]", vp, writable=True) | _plan_views("out[1]", wp, wcap, writable=True)
    args = PlanArgs(
        req_pool_indices=v["req_pool_indices"],
        prefix_lens=v["prefix_lens"],
        extend_seq_lens=v["extend_seq_lens"],
        table=tv,
        swa_window_size=c.window,
        swa_lut=v["full_to_swa_index_mapping"],
        expected_token_pool=v["req_to_verify_expected_tokens"],
        expected_token_valid_lens=v["req_to_verify_expected_tokens_valid_lens"],
        token_offset=c.offset,
        clear_whole_capacity=not is_clean(wp),
        out=PlanOutputs(**ov),
        scan_state=backend_view(scan_state(wp), "out[1]'s scan state", writable=True),
    )
    return args, vp, wp


@public_api
def plan(
    req_pool_indices: Array | None,
    prefix_lens: Array,
    extend_seq_lens: Array,
    table: Any,
    *,
    verify_capacity: int,
    write_req_capacity: int | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Array | None = None,
    req_to_verify_expected_tokens: Array | None = None,
    req_to_verify_expected_tokens_valid_lens: Array | None = None,
    kv_token_id_vs_position_offset: int = 0,
    out: tuple[VerifyPlan, WritePlan] | None = None,
    strict: bool = False,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step: the verify entries of every slot the step reads and the write metadata.

    Request r reads positions ``[0, prefix_lens[r])`` (a sliding window's last
    ``swa_window_size`` of them): each becomes one verify entry (its slot, expected position,
    predecessor slot and expected token).  It writes ``extend_seq_lens[r]`` new tokens, chained
    from its seed (the slot of its last prefix token, or -1 = the chain anchor).  Out-of-range
    values (a pool row past the table, a prefix past the row, ...) are skipped and counted in the
    VerifyPlan's ``out_of_range_count``; nothing is read out of bounds.

    Parameters
    ----------
    req_pool_indices : int64 array [bs], or None
        Each batch row's row of ``table`` (in a ``req_to_token``, pool row 0 is a CUDA-graph
        padding request: nothing planned).  None with a :class:`PagedKvIndices` table, whose rows
        are the batch rows.
    prefix_lens : int64 array [bs]
        Tokens already cached per request: positions ``[0, prefix_lens[r])`` are read (verified).
    extend_seq_lens : int64 array [bs]
        New tokens per request this step: the write of request r covers the flat tokens
        ``[write_offsets[r], write_offsets[r+1])``, chained from its last prefix slot.
    table : ReqToToken, BlockTable, PagedKvIndices or int32 array [R, L]
        The engine's own slot table (a bare 2-D int32 array means ``ReqToToken(array)``).
    verify_capacity : int
        The most verify entries one step may plan, ``>= 0``.  A step with more skips its whole
        verify (``enable`` = 0), never part of it; :meth:`CanaryPlanner.verify_overflowed` says
        so.  ``CanaryCapacities.from_engine`` sizes it at 3 x the KV pool (radix sharing lets a
        batch's summed prefixes exceed the pool).
    write_req_capacity : int, optional
        The most requests one step may hold (the batch limit), ``>= 0``.  None: the batch size
        (``out=None``) or ``out[1]``'s capacity.
    swa_window_size : int
        0 for a full-attention group; ``> 0`` for a sliding-window group, which reads only
        positions ``[max(prefix - window, 0), prefix)`` and records SWA launch tags.
    full_to_swa_index_mapping : int64 array [lut_len >= 1], optional
        The full -> SWA slot LUT applied to the table's slots; required when
        ``swa_window_size > 0`` with a :class:`ReqToToken` table.  Values past the end clamp to
        the last entry (counted as out of range).
    req_to_verify_expected_tokens : int32 array [>= R, C], optional
        The expected-token pool: the token each pool row (each batch row with a
        :class:`PagedKvIndices`) must hold at each position (see :func:`scatter_req_token_ids`).
        Planned into ``verify_expected_tokens``; -1 where there is no truth.
    req_to_verify_expected_tokens_valid_lens : int64 array [bs], optional
        How many positions of each batch row's pool row are valid; given if and only if the
        pool is.
    kv_token_id_vs_position_offset : int
        Position ``p``'s expected token is the pool's column ``p + offset``.
    out : (VerifyPlan, WritePlan), optional
        Plans to fill in place (capacities ``verify_capacity`` and ``write_req_capacity``), as a
        :class:`CanaryPlanner` holds; required inside a CUDA graph capture.  None allocates new
        ones in the framework and on the device of ``table``.
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.

    Returns
    -------
    (VerifyPlan, WritePlan)
        ``out`` when given.  The VerifyPlan's first ``verify_num_valid`` entries are valid (the
        rest unspecified); the WritePlan holds -1 / 0 past the batch.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.
        ``bs > write_req_capacity`` is one of them.

    Examples
    --------
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)  # pool row r: slots 16r ... 16r+15
    >>> vp, wp = kc.plan(np.array([2]), np.array([7]), np.array([1]), req_to_token, verify_capacity=32)
    >>> int(vp.verify_num_valid[0]), vp.verify_slot_indices[:3].tolist(), wp.write_seed_slot_indices.tolist()
    (7, [32, 33, 34], [38])
    """
    c = _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
                   full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                   kv_token_id_vs_position_offset, out, "plan")
    placement = common_placement(c.named)
    with launch_stream(placement):
        args, vp, wp = _plan_args(c, write_req_capacity, out, placement, array_module(placement),
                                  lambda bs: c.verify_capacity, "plan")
        if strict:
            strict_checks.check_plan(args)
        get_backend(placement.backend).plan(args)
        mark_clean(wp)
        _note_overflow(vp, args.out.enable, placement, c.verify_capacity)
    return vp, wp


def _note_overflow(vp: VerifyPlan, enable, placement, verify_capacity: int) -> None:
    """Warn once per VerifyPlan record when a free plan into it overflowed ``verify_capacity``.

    Host memory is read at once.  A GPU plan never syncs: an eager call queues a copy of ``enable``
    into pinned memory behind an event, which the next free plan into the same record reads if
    the event has completed.  Nothing is allocated or queued while capturing."""
    state = vp.__dict__
    if state.get("_kvcanary_overflow_warned"):
        return
    if placement.backend == "numpy":
        overflowed = int(enable[0]) == 0
    else:
        if interop.is_capturing(placement):  # an event query would invalidate the capture
            return
        pending = state.get("_kvcanary_overflow_copy")
        overflowed = pending is not None and pending[1].done and int(pending[0][0]) == 0
        if not overflowed:
            cupy = import_cupy()
            if pending is None:
                import cupyx

                pending = (cupyx.empty_pinned((1,), dtype=np.int32), cupy.cuda.Event(disable_timing=True))
                state["_kvcanary_overflow_copy"] = pending
            stream, runtime = cupy.cuda.get_current_stream(), cupy.cuda.runtime
            runtime.memcpyAsync(pending[0].ctypes.data, enable.data.ptr, 4, runtime.memcpyDeviceToHost, stream.ptr)
            pending[1].record(stream)
    if overflowed:
        state["_kvcanary_overflow_warned"] = True
        warnings.warn(f"kv-canary: a free plan overflowed verify_capacity={verify_capacity}: its verify is skipped "
                      "(enable == 0); WritePlan.verify_entries_needed() says how many entries it asked for",
                      CanaryCapacityWarning, stacklevel=4)  # the caller of plan, past public_api's wrapper


@public_api
def plan_and_verify(
    req_pool_indices: Array | None,
    prefix_lens: Array,
    extend_seq_lens: Array,
    table: Any,
    canary_buf: Array,
    *,
    log: ViolationLog,
    verify_capacity: int,
    write_req_capacity: int | None = None,
    kernel_kind: int = 0,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    check_expected_tokens: bool = False,
    check_expected_token: bool | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Array | None = None,
    req_to_verify_expected_tokens: Array | None = None,
    req_to_verify_expected_tokens_valid_lens: Array | None = None,
    kv_token_id_vs_position_offset: int = 0,
    out: tuple[VerifyPlan, WritePlan] | None = None,
    strict: bool = False,
    check_holes: bool = False,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step and verify the slots it reads, in one launch: the fused decode step.

    Equals ``vp, wp = plan(...); verify(canary_buf, vp, ...)`` with the same arguments in every
    observable byte (the WritePlan, the VerifyPlan's ``verify_num_valid``, ``enable`` and
    ``out_of_range_count``, the log's ring rows as a multiset and its counters), except that the
    verify entries are checked as they are planned and never stored: out[0]'s entry arrays are
    left as they are, so out[0] may be a ``VerifyPlan.allocate(0)``.  More than
    ``verify_capacity`` entries skip the verify (``enable`` = 0), as in :func:`plan`.  A GPU batch
    of more than 4,096 requests (two plan launches) takes plan + verify through
    out[0]'s arrays, which must then hold ``verify_capacity`` entries.  One canary buffer.

    Parameters
    ----------
    req_pool_indices : int64 array [bs], or None
        Each batch row's row of ``table`` (in a ``req_to_token``, pool row 0 is a CUDA-graph
        padding request: nothing planned).  None with a :class:`PagedKvIndices` table, whose rows
        are the batch rows.
    prefix_lens : int64 array [bs]
        Tokens already cached per request: positions ``[0, prefix_lens[r])`` are read (verified).
    extend_seq_lens : int64 array [bs]
        New tokens per request this step: the write of request r covers the flat tokens
        ``[write_offsets[r], write_offsets[r+1])``, chained from its last prefix slot.
    table : ReqToToken, BlockTable, PagedKvIndices or int32 array [R, L]
        The engine's own slot table (a bare 2-D int32 array means ``ReqToToken(array)``).
    canary_buf : array
        One canary buffer: int64 ``[num_slots, 4]`` or uint8 ``[num_slots, S]`` (as :func:`verify`).
    log, kernel_kind, real_kv_sources, real_kv_hash_mode, check_expected_tokens, check_expected_token, check_holes
        As for :func:`verify` (one buffer: one kind, one tuple of sources).
    verify_capacity : int
        The most verify entries one step may plan, ``>= 0``.  A step with more skips its whole
        verify (``enable`` = 0), never part of it; :meth:`CanaryPlanner.verify_overflowed` says
        so.  ``CanaryCapacities.from_engine`` sizes it at 3 x the KV pool (radix sharing lets a
        batch's summed prefixes exceed the pool).
    write_req_capacity : int, optional
        The most requests one step may hold (the batch limit), ``>= 0``.  None: the batch size
        (``out=None``) or ``out[1]``'s capacity.
    swa_window_size : int
        0 for a full-attention group; ``> 0`` for a sliding-window group, which reads only
        positions ``[max(prefix - window, 0), prefix)`` and records SWA launch tags.
    full_to_swa_index_mapping : int64 array [lut_len >= 1], optional
        The full -> SWA slot LUT applied to the table's slots; required when
        ``swa_window_size > 0`` with a :class:`ReqToToken` table.  Values past the end clamp to
        the last entry (counted as out of range).
    req_to_verify_expected_tokens : int32 array [>= R, C], optional
        The expected-token pool: the token each pool row (each batch row with a
        :class:`PagedKvIndices`) must hold at each position (see :func:`scatter_req_token_ids`).
        Planned into ``verify_expected_tokens``; -1 where there is no truth.
    req_to_verify_expected_tokens_valid_lens : int64 array [bs], optional
        How many positions of each batch row's pool row are valid; given if and only if the
        pool is.
    kv_token_id_vs_position_offset : int
        Position ``p``'s expected token is the pool's column ``p + offset``.
    out : (VerifyPlan, WritePlan), optional
        As for :func:`plan`; out[0] may have capacity 0 (its entries are not stored).
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.

    Returns
    -------
    (VerifyPlan, WritePlan)
        ``out`` when given; then :func:`write` with the WritePlan completes the step (stream
        order puts it after the verify's reads).

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan_and_verify(np.array([1]), np.array([0]), np.array([3]), req_to_token, canary,
    ...                             log=log, verify_capacity=0)
    >>> kc.write(canary, wp, np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]), log=log)
    """
    check_expected_token = bool_keyword(check_expected_tokens, "check_expected_tokens", check_expected_token,
                                        "check_expected_token")
    c = _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
                   full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                   kv_token_id_vs_position_offset, out, "plan_and_verify")
    if isinstance(canary_buf, (list, tuple)):
        fail(TypeError, "plan_and_verify verifies one canary buffer, got a sequence; verify several with kc.plan + kc.verify")
    placement, context, named = _verify_setup(canary_buf, None, log, kernel_kind, real_kv_sources, real_kv_hash_mode,
                                              check_expected_token, c.named, check_holes)
    xp = array_module(placement)
    with launch_stream(placement):
        backend = get_backend(placement.backend)

        def entry_capacity(bs):  # only a GPU batch past one plan launch stores its entries
            return c.verify_capacity if backend.plan_verify_stores_entries(bs) else None

        args, vp, wp = _plan_args(c, write_req_capacity, out, placement, xp, entry_capacity, "plan_and_verify",
                                  "; a batch too large for one plan launch on this GPU takes plan + verify through "
                                  "out[0]'s entry arrays, which must hold verify_capacity entries")
        targets = _targets(context[0], context[1], written=False)
        verify_args = VerifyArgs(targets=targets, **dict.fromkeys(VERIFY_ENTRY_FIELDS),
                                 verify_num_valid=args.out.verify_num_valid, enable=args.out.enable,
                                 check_expected_token=bool(check_expected_token), check_holes=bool(check_holes),
                                 real_kv_hash_mode=context[1], log=_log_views(log))
        if strict:
            strict_checks.check_plan(args, verify_capacity=c.verify_capacity)
        backend.plan_verify(PlanVerifyArgs(args, verify_args, c.verify_capacity))
        mark_clean(wp)
    return vp, wp


@public_api
def write(
    canary_buf: Array | Sequence[Array],
    write_plan: WritePlan,
    input_ids: Array,
    positions: Array,
    out_cache_loc: Array,
    *,
    log: ViolationLog,
    kernel_kind: int | Sequence[int] = 0,
    real_kv_sources: Sequence[Any] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    expected_input_tokens: Array | None = None,
    expected_input_positions: Array | None = None,
    chain_position_assert: bool = True,
    strict: bool = False,
    stream: Any = None,
) -> None:
    """Write fresh canary records for the step's new tokens, chained along each request.

    Slot ``out_cache_loc[i]`` gets ``(input_ids[i], positions[i], running_hash, real_kv_hash)``
    and the running hash of its request advances by :func:`mix3`.  A negative (or out-of-range)
    slot is skipped without advancing the chain.  Several buffers (``canary_buf`` a sequence) are
    written by one launch; each gets the bytes, rows and counters a call of its own would give it.

    Parameters
    ----------
    canary_buf : array or sequence of arrays
        The canary buffer: int64 ``[num_slots, 4]`` (:func:`allocate_canary_buffer`), or uint8
        ``[num_slots, S]`` with ``S >= 32`` and ``S % 8 == 0``; contiguous, 8-byte aligned.  Slot
        0 is the padding slot.  A sequence of up to ``MAX_CANARY_BUFFERS`` buffers of equal
        ``num_slots`` (the K and V halves, say) shares one launch; they must not overlap.
    write_plan : WritePlan
        The step's write metadata, from :func:`plan` (or a :class:`CanaryPlanner`).
    input_ids, positions, out_cache_loc : int64 arrays [T]
        The step's new tokens, their positions and their KV slots, flat over the batch (request r
        owns ``[write_offsets[r], write_offsets[r+1])``; T may include padded tokens).
    log : ViolationLog
        Where violations go (its ring) and what is counted (its counters, per ``kernel_kind``).
    kernel_kind : int or CanaryLaunchTag, or a sequence of them
        The launch tag recorded in each violation row and counter index, ``0 <= kind <
        log.num_kinds``; one per buffer when ``canary_buf`` is a sequence.
    real_kv_sources : sequence of RealKvSource, or a sequence of such sequences
        Up to ``MAX_REAL_KV_SOURCES`` views of the live KV pools whose bytes are fingerprinted
        into ``real_kv_hash`` (one tuple per buffer when ``canary_buf`` is a sequence, or empty).
    real_kv_hash_mode : RealKvHashMode
        ``NONE`` (no fingerprint: 0), ``PARTIAL`` (the first 16 bytes of each slot) or ``ALL``
        (``read_bytes`` bytes of each slot).
    expected_input_tokens, expected_input_positions : int64 arrays [T], optional
        A second copy of the tokens and positions (given together): a written token or position
        that differs logs a ``WRITE_TOKEN_MISMATCH`` / ``WRITE_POSITION_MISMATCH`` row.
    chain_position_assert : bool
        Log a ``WRITE_POSITION_MISMATCH`` row where a seeded request's positions do not rise by 1.
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.
    stream : cupy.cuda.Stream or torch.cuda.Stream, optional
        Run the write there, after everything queued so far on the caller's current stream, so
        a long prefill chain overlaps what the caller queues next; call :func:`join_stream`
        before anything reads the canary buffers or the log, and keep the arguments alive and
        unchanged until then.  Capture-safe (join before the capture ends).  GPU only.

    Returns
    -------
    None
        The buffers and ``log`` are written in place.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan(np.array([1]), np.array([0]), np.array([3]), req_to_token, verify_capacity=0)
    >>> kc.write(canary, wp, np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]), log=log)
    >>> canary[17, :2].tolist()  # (token, position)
    [6, 1]
    """
    for key, arr in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
        require(arr, key)
    if (expected_input_tokens is None) != (expected_input_positions is None):
        fail(ValueError, "expected_input_tokens and expected_input_positions enable the write-input assert together; pass both or neither")
    tokens = {
        "input_ids": input_ids,
        "positions": positions,
        "out_cache_loc": out_cache_loc,
        "expected_input_tokens": expected_input_tokens,
        "expected_input_positions": expected_input_positions,
    }
    placement, context, _ = _write_setup(canary_buf, write_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode,
                                         chain_position_assert, tokens)
    xp = array_module(placement)

    with launch_stream(placement):
        args = _write_bound_args(write_plan, log, chain_position_assert, context, xp)
        views = {}
        for key, arr in tokens.items():
            if arr is not None:
                view = backend_view(arr, key)
                check_1d(view, key, I64, views["input_ids"].shape[0] if views else None, length_name="len(input_ids)")
                views[key] = view
        # On a side stream, strided inputs are copied there too: the copies' memory then returns to
        # the side stream's pool, so nothing queued on the caller's stream reuses it before the write.
        with side_stream(stream, placement):
            args = args._replace(**{key: contiguous_input(view, key, xp) for key, view in views.items()})
            if strict:
                strict_checks.check_write(args)
            get_backend(placement.backend).write(args)


@public_api
def verify(
    canary_buf: Array | Sequence[Array],
    verify_plan: VerifyPlan,
    *,
    log: ViolationLog,
    kernel_kind: int | Sequence[int] = 0,
    real_kv_sources: Sequence[Any] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    check_expected_tokens: bool = False,
    check_expected_token: bool | None = None,
    strict: bool = False,
    check_holes: bool = False,
) -> None:
    """Verify the canary records of every planned slot; violations go to ``log``'s ring.

    Each of the first ``verify_num_valid`` entries is checked: the stored position against the
    expected one, the stored prev_hash against :func:`mix3` of the predecessor's record (the
    anchor hash for a chain head; skipped when the predecessor is unknown), the real-KV
    fingerprint (with sources) and, with ``check_expected_tokens``, the stored token.  Each failing
    slot logs one row whose ``fail_reason_bits`` OR the :class:`FailReason` bits.  A plan that
    overflowed (``enable`` = 0) verifies nothing.

    Parameters
    ----------
    canary_buf : array or sequence of arrays
        The canary buffer: int64 ``[num_slots, 4]`` (:func:`allocate_canary_buffer`), or uint8
        ``[num_slots, S]`` with ``S >= 32`` and ``S % 8 == 0``; contiguous, 8-byte aligned.  Slot
        0 is the padding slot.  A sequence of up to ``MAX_CANARY_BUFFERS`` buffers of equal
        ``num_slots`` (the K and V halves, say) shares one launch; they must not overlap.
        The entries are read once for all of them.
    verify_plan : VerifyPlan
        The step's verify entries, from :func:`plan` (or a :class:`CanaryPlanner`).
    log : ViolationLog
        Where violations go (its ring) and what is counted (its counters, per ``kernel_kind``).
    kernel_kind : int or CanaryLaunchTag, or a sequence of them
        The launch tag recorded in each violation row and counter index, ``0 <= kind <
        log.num_kinds``; one per buffer when ``canary_buf`` is a sequence.
    real_kv_sources : sequence of RealKvSource, or a sequence of such sequences
        Up to ``MAX_REAL_KV_SOURCES`` views of the live KV pools whose bytes are fingerprinted
        into ``real_kv_hash`` (one tuple per buffer when ``canary_buf`` is a sequence, or empty).
    real_kv_hash_mode : RealKvHashMode
        ``NONE`` (no fingerprint: 0), ``PARTIAL`` (the first 16 bytes of each slot) or ``ALL``
        (``read_bytes`` bytes of each slot).
    check_expected_tokens : bool
        Also compare each stored token with the entry's expected token (where it is not -1),
        logging ``VERIFY_TOKEN_MISMATCH``.  Needs ``req_to_verify_expected_tokens`` at plan time.
    check_expected_token : bool, optional
        The older spelling of ``check_expected_tokens``, still accepted (pass one of them).
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.
    check_holes : bool
        False (SGLang's rule): an entry whose slot is the padding slot is skipped.  True: it is a
        hole (a position the step reads whose table entry is zeroed or the null block) and logs
        a ``VERIFY_TABLE_HOLE`` row (docs/format.md, "Holes").  Out-of-window positions of a
        sliding-window group are never planned, so they are never holes.

    Returns
    -------
    None
        ``log`` is written in place; read it with :meth:`ViolationLog.read`.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan(np.array([1]), np.array([2]), np.array([0]), req_to_token, verify_capacity=8)
    >>> kc.verify(canary, vp, log=log)  # slots 16 and 17 were never written: two violations
    >>> log.read().total_violations
    2
    """
    _check_type(verify_plan, "verify_plan", VerifyPlan)  # None would mean plan_and_verify's call below
    check_expected_token = bool_keyword(check_expected_tokens, "check_expected_tokens", check_expected_token,
                                        "check_expected_token")
    placement, context, _ = _verify_setup(canary_buf, verify_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode,
                                          check_expected_token, check_holes=check_holes)
    with launch_stream(placement):
        args = _verify_args(verify_plan, log, check_expected_token, context, array_module(placement), check_holes)
        if strict:
            strict_checks.check_verify(args)
        get_backend(placement.backend).verify(args)


@public_api
def move_pages(canary_buf: Array, src_pages: Array, dst_pages: Array, *, page_size: int = 1,
               workspace: Array | None = None, out_of_range_count: Array | None = None, strict: bool = False) -> Array:
    """Move the canary rows of KV pages with the pages (compaction, defragmentation, cell moves).

    Page ``p`` is canary rows ``[p * page_size, (p + 1) * page_size)``.  The result equals
    ``rows = canary[src_slots].copy(); canary[src_slots] = 0; canary[dst_slots] = rows`` over whole
    pages, so a table that still points at a page's old place fails verify, and permutations
    (sources and destinations overlapping) move correctly.  Repeated destination pages are a
    caller bug: which source lands there then depends on GPU thread timing (the NumPy backend
    takes the last).

    Parameters
    ----------
    canary_buf : array
        One canary buffer (int64 ``[num_slots, 4]`` or uint8 ``[num_slots, S]``), moved in place.
    src_pages, dst_pages : int32 or int64 arrays [n] (one dtype)
        Pair i moves page ``src_pages[i]`` to page ``dst_pages[i]``.  A pair with a page id
        outside ``[0, num_slots // page_size)`` is skipped.
    page_size : int
        Canary rows per page, ``>= 1``.
    workspace : int64 array, optional
        The GPU's staging area for the moved rows: contiguous, at least ``n * page_size`` rows of
        the canary's width (``kc.allocate_canary_buffer(max_pages * page_size, like=canary_buf)``
        fits).  Pass one allocated once to stay capture-safe; without it each GPU call allocates
        one, which is refused inside a CUDA graph capture.  Unused on the CPU.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range page ids.
    strict : bool
        Raise a ValueError on the first out-of-range page id instead (a device sync).

    Returns
    -------
    array
        ``canary_buf``.

    Raises
    ------
    TypeError, ValueError
        A bad argument, before anything is moved; the message names it.

    Examples
    --------
    >>> canary = kc.allocate_canary_buffer(8)
    >>> canary[2:4] = 7
    >>> _ = kc.move_pages(canary, np.array([1]), np.array([3]), page_size=2)
    >>> canary[:, 0].tolist()
    [0, 0, 0, 0, 0, 0, 7, 7]
    """
    size = check_int(page_size, "page_size", minimum=1)
    for key, arr in (("canary_buf", canary_buf), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        require(arr, key)
    named = {
        "canary_buf": canary_buf,
        "src_pages": src_pages,
        "dst_pages": dst_pages,
        "workspace": workspace,
        "out_of_range_count": out_of_range_count,
    }
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        canary = _canary_view(canary_buf, "canary_buf", written=True)
        v = {k: backend_view(named[k], k, writable=k in ("workspace", "out_of_range_count"))
             for k in ("src_pages", "dst_pages", "workspace", "out_of_range_count")}
        check_integer_dtype(v["src_pages"], "src_pages")
        check_1d(v["src_pages"], "src_pages", v["src_pages"].dtype)
        check_1d(v["dst_pages"], "dst_pages", v["src_pages"].dtype, v["src_pages"].shape[0], length_name="len(src_pages)")
        for key in ("src_pages", "dst_pages"):
            v[key] = contiguous_input(v[key], key, xp)
        # Nothing is staged when the canary holds no whole page (every pair is then skipped).
        need = v["src_pages"].shape[0] * size * canary.shape[1] if canary.shape[0] >= size else 0
        if workspace is not None:
            check_dtype(v["workspace"], "workspace", I64)
            check_contiguous_output(v["workspace"], "workspace")
            if v["workspace"].size < need:
                fail(ValueError, f"workspace must hold at least len(src_pages) x page_size x {canary.shape[1]} int64 fields "
                                 f"= {need} values, got {v['workspace'].size}")
        elif placement.backend == "cupy" and need:
            refuse_during_capture(placement, "move_pages would allocate its staging area (no workspace= was given)",
                                  "pass workspace= allocated before capturing")
            v["workspace"] = xp.empty(need, I64)
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = MoveArgs(canary, v["src_pages"], v["dst_pages"], size, v["workspace"], v["out_of_range_count"])
        if strict:
            strict_checks.check_move(args)
        get_backend(placement.backend).move(args)
    return canary_buf


@public_api
def scatter_req_token_ids(flat_in: Array, offsets: Array, req_pool_indices: Array, pool_out: Array, *,
                          out_of_range_count: Array | None = None, strict: bool = False) -> Array:
    """Fill the expected-token pool: ``pool_out[rp, :n] = flat_in[start:start+n]`` per request.

    For batch row r, ``rp = req_pool_indices[r]``, ``start = offsets[r]`` and ``n =
    min(offsets[r+1] - offsets[r], pool_out.shape[1])``; rows not addressed are untouched.  Batch
    rows sharing a pool row: for each column, the largest batch row writing it wins.  The pool is
    what :func:`plan` takes as ``req_to_verify_expected_tokens``.

    Parameters
    ----------
    flat_in : int64 array [N]
        Every request's tokens, concatenated.
    offsets : int64 array [bs + 1]
        Request r's tokens are ``flat_in[offsets[r]:offsets[r+1]]``.
    req_pool_indices : int64 array [bs]
        The pool row each request fills.
    pool_out : int32 array [R, C]
        The pool, rows contiguous; written in place.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range values (a pool row outside ``[0, R)``, a negative
        length, a source range outside ``flat_in``).
    strict : bool
        Raise a ValueError on the first out-of-range value instead (a device sync).

    Returns
    -------
    array
        ``pool_out``.

    Raises
    ------
    TypeError, ValueError
        A bad dtype or shape (``offsets`` not ``bs + 1`` long, ...), before anything is written.

    Examples
    --------
    >>> pool = np.zeros((3, 4), np.int32)
    >>> _ = kc.scatter_req_token_ids(np.array([5, 6, 7]), np.array([0, 2, 3]), np.array([2, 1]), pool)
    >>> pool.tolist()
    [[0, 0, 0, 0], [7, 0, 0, 0], [5, 6, 0, 0]]
    """
    for key, arr in (("flat_in", flat_in), ("offsets", offsets), ("req_pool_indices", req_pool_indices), ("pool_out", pool_out)):
        require(arr, key)
    named = {
        "flat_in": flat_in,
        "offsets": offsets,
        "req_pool_indices": req_pool_indices,
        "pool_out": pool_out,
        "out_of_range_count": out_of_range_count,
    }
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        v = {k: backend_view(a, k, writable=k in ("pool_out", "out_of_range_count")) for k, a in named.items()}
        for key in ("flat_in", "offsets", "req_pool_indices"):
            if v[key].dtype != np.int64:
                fail(TypeError, f"scatter_req_token_ids {key} must be int64, got {v[key].dtype}")
            if v[key].ndim != 1:
                fail(ValueError, f"scatter_req_token_ids {key} must be 1-D, got shape {tuple(v[key].shape)}")
            v[key] = contiguous_input(v[key], key, xp)
        if v["pool_out"].dtype != np.int32:
            fail(TypeError, f"scatter_req_token_ids pool_out must be int32, got {v['pool_out'].dtype}")
        check_2d_rows(v["pool_out"], "scatter_req_token_ids pool_out", I32)
        bs = v["req_pool_indices"].shape[0]
        if v["offsets"].shape[0] != bs + 1:
            fail(ValueError, f"scatter_req_token_ids offsets length {v['offsets'].shape[0]} != bs+1 ({bs + 1})")
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = ScatterArgs(**v)
        if strict:
            strict_checks.check_scatter(args)
        get_backend(placement.backend).scatter(args)
    return pool_out
