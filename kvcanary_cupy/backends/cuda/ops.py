"""The canary on the GPU: each op's launches, built from the backend's views; the one face both
the free functions (through :func:`kvcanary_cupy.backends.get_backend`) and the bound launchers
(:mod:`kvcanary_cupy.binding`) use.

Every launch goes on CuPy's current stream (the front door makes that torch's current stream when
torch tensors are involved), allocates nothing, reads nothing back and has a grid fixed by
host-known shapes (:mod:`.configs`), so a whole step can be captured in a CUDA graph and replayed
with new batch contents.  Plan, write, verify and the session's staging take their parameters as
one record per kernel (:mod:`.params`), which a bound launcher packs once and patches per call; a
``*_launch`` function returns that record with its kernel and grid without launching it.
"""

from __future__ import annotations

import numpy as np

from ...args import (VERIFY_ENTRY_FIELDS, VERIFY_INPUT_FIELDS, CopyArgs, MoveArgs, PlanArgs, PlanVerifyArgs, ScatterArgs, StageArgs,
                     VerifyArgs, WriteArgs, stage_rings)
from ...interop import import_cupy
from .abi import PLAN_PARAMS, PLAN_VERIFY_PARAMS, STAGE_PARAMS, THREADS, VERIFY_PARAMS, VERIFY_THREADS, WRITE_PARAMS
from .compile import get_function, kernel_name
from .configs import (attribute_grid, move_config, narrow_layout, persistent_config, plan_kernels, plan_verify_kernel,
                      plan_verify_stores_entries, policy, scatter_config, table_fields, uses_scan_state, view_layout,
                      write_config, write_kernel)
from . import device as cuda_device
from .launch import BoundLaunch, launch_record
from .params import (KernelLaunch, ParamSlots, has_real_kv, kernel_arguments, length, log_struct, ptr, row_stride,
                     targets_struct)

# What get_backend's callers take (the Backend protocol of kvcanary_cupy.backends), then what the
# bound launchers bind with.
__all__ = ["move", "plan", "plan_verify", "plan_verify_stores_entries", "prepare_stage", "scatter", "verify", "write",
           "BoundLaunch", "BoundStage", "ParamSlots", "get_function", "has_real_kv", "narrow_layout", "plan_kernels", "plan_params",
           "plan_launches", "plan_verify_launch", "plan_verify_launches", "table_fields", "verify_launch", "write_kernel", "write_launch"]


def _launch(family: str, name: str, config, args: tuple) -> None:
    """A plain launch through CuPy, its arguments by value (move and scatter take no record)."""
    get_function(family, name)((config.grid,), (config.block,), args, shared_mem=config.shared_mem)


def plan_params(a: PlanArgs) -> np.ndarray:
    """The plan kernels' parameters; per-step arrays that are None (a bound planner) are left 0."""
    t, o = a.table, a.out
    p = np.zeros(1, PLAN_PARAMS)
    ins, outs = p["inputs"], p["outputs"]
    for key, arr in (("req_pool_indices", a.req_pool_indices), ("prefix_lens", a.prefix_lens),
                     ("extend_seq_lens", a.extend_seq_lens), ("lut", a.swa_lut),
                     ("pool", a.expected_token_pool), ("valid_lens", a.expected_token_valid_lens)):
        ins[key] = ptr(arr)
    ins["bs"] = length(a.prefix_lens)
    if t is not None:
        ins["table"], ins["kv_indptr"], ins["virtual_to_physical"] = ptr(t.entries), ptr(t.kv_indptr), ptr(t.virtual_to_physical)
        ins["table_rows"] = t.entries.shape[0]
        cols, stride = (t.entries.shape[1], row_stride(t.entries)) if t.entries.ndim == 2 else (0, 0)
        for key, value in table_fields(t.page_size, t.null_block, int(cols), int(stride), t.entries.dtype == np.int64,
                                       t.kv_indptr is not None and t.kv_indptr.dtype == np.int64,
                                       length(t.virtual_to_physical)):
            ins[key] = value
    ins["window"], ins["token_offset"] = a.swa_window_size, a.token_offset
    ins["lut_len"] = length(a.swa_lut)
    if a.expected_token_pool is not None:
        ins["pool_stride"], ins["pool_cols"] = row_stride(a.expected_token_pool), a.expected_token_pool.shape[1]
    for key, arr in o._asdict().items():
        outs[key] = ptr(arr)
    outs["verify_capacity"] = o.verify_slot_indices.shape[0]
    outs["write_req_capacity"] = o.write_seed_slot_indices.shape[0]
    outs["clear_whole_capacity"] = a.clear_whole_capacity
    if a.scan_state is not None and uses_scan_state():
        outs["scan_state"] = a.scan_state.data.ptr
    outs["scan_state_min_rows"] = policy().plan_scan_state_min_rows
    return p


def _plan_kernels(a: PlanArgs) -> tuple:
    return plan_kernels(view_layout(a.table), a.prefix_lens.shape[0], a.out.verify_slot_indices.shape[0],
                        a.swa_lut is not None, a.expected_token_pool is not None)


def plan(a: PlanArgs) -> None:
    launch = BoundLaunch(plan_params(a), cuda_device.current_id())
    for family, name, config in _plan_kernels(a):
        launch(get_function(family, name).kernel, (config.grid,), (config.block,), config.shared_mem)


def plan_launches(a: PlanArgs) -> list:
    """The plan's launches, as :func:`plan` makes them, each a :class:`KernelLaunch` of one shared record."""
    params = plan_params(a)
    return [KernelLaunch(family, name, config, params) for family, name, config in _plan_kernels(a)]


def input_widths(input_ids, positions, out_cache_loc) -> int:
    """The kernel's ``input_widths`` bits: which of the three per-token inputs are int64 (a bound
    launcher's unset ones, None, count as int64, its fast path's only dtype)."""
    return sum(1 << k for k, x in enumerate((input_ids, positions, out_cache_loc)) if x is None or x.dtype == np.int64)


def write_launch(a: WriteArgs) -> KernelLaunch:
    """canary_write's launch; per-step arrays that are None (a bound launcher) are left 0."""
    flag = a.chain_position_assert
    cap = a.write_seed_slot_indices.shape[0]
    p = np.zeros(1, WRITE_PARAMS)
    ins = p["inputs"]
    for key, arr in (("write_offsets", a.write_offsets), ("seeds", a.write_seed_slot_indices),
                     ("write_num_valid_reqs", a.write_num_valid_reqs), ("input_ids", a.input_ids),
                     ("positions", a.positions), ("out_cache_loc", a.out_cache_loc),
                     ("expected_tokens", a.expected_input_tokens), ("expected_positions", a.expected_input_positions),
                     ("pos_assert_flag", None if isinstance(flag, bool) else flag), ("write_waves", a.write_waves)):
        ins[key] = ptr(arr)
    ins["write_req_capacity"], ins["num_tokens"] = cap, length(a.input_ids)
    ins["pos_assert_value"] = int(flag) if isinstance(flag, bool) else 0
    ins["input_widths"] = input_widths(a.input_ids, a.positions, a.out_cache_loc)
    ins["wave"] = a.wave
    p["targets"], p["log"] = targets_struct(a.targets, a.real_kv_hash_mode), log_struct(a.log)
    name = write_kernel(len(a.targets), a.expected_input_tokens is not None, has_real_kv(a.targets, a.real_kv_hash_mode))
    return KernelLaunch("write", name, write_config(name, cap, len(a.targets)), p)


def write(a: WriteArgs) -> None:
    launch_record(write_launch(a))


def verify_launch(a: VerifyArgs) -> KernelLaunch:
    p = np.zeros(1, VERIFY_PARAMS)
    p["targets"], p["log"] = targets_struct(a.targets, a.real_kv_hash_mode), log_struct(a.log)
    for key in VERIFY_INPUT_FIELDS:
        p[key] = ptr(getattr(a, key))
    p["verify_capacity"] = a.verify_slot_indices.shape[0]
    p["check_holes"] = int(a.check_holes)
    name = kernel_name("canary_verify", len(a.targets), a.check_expected_token, has_real_kv(a.targets, a.real_kv_hash_mode))
    return KernelLaunch("verify", name, persistent_config("verify", name, VERIFY_THREADS), p)


def verify(a: VerifyArgs) -> None:
    launch_record(verify_launch(a))


def plan_verify_launch(a: PlanVerifyArgs) -> KernelLaunch:
    """plan_verify's launch; per-step arrays that are None (a bound launcher) are left 0."""
    p = np.zeros(1, PLAN_VERIFY_PARAMS)
    plan_record = plan_params(a.plan)
    p["inputs"], p["outputs"] = plan_record["inputs"], plan_record["outputs"]
    p["outputs"]["verify_capacity"] = a.verify_capacity
    v = a.verify
    p["targets"], p["log"] = targets_struct(v.targets, v.real_kv_hash_mode), log_struct(v.log)
    p["check_holes"] = int(v.check_holes)
    # Without a pool every expected token is -1 (unchecked): the token check would find nothing.
    has_pool = a.plan.expected_token_pool is not None
    family, name, config = plan_verify_kernel(view_layout(a.plan.table), length(a.plan.prefix_lens), a.verify_capacity,
                                              a.plan.swa_lut is not None, has_pool, v.check_expected_token and has_pool,
                                              has_real_kv(v.targets, v.real_kv_hash_mode))
    return KernelLaunch(family, name, config, p)


def plan_verify_launches(a: PlanVerifyArgs) -> list:
    """plan_verify's launches, in order, each a :class:`KernelLaunch`: the fused one, or past
    PLAN_FUSED_MAX_ROWS the plan's then a verify of the entries it stored in plan.out's arrays
    (the front door checked that they hold verify_capacity entries)."""
    if not plan_verify_stores_entries(a.plan.prefix_lens.shape[0]):
        return [plan_verify_launch(a)]
    out = a.plan.out
    return [*plan_launches(a.plan), verify_launch(a.verify._replace(**{k: getattr(out, k) for k in VERIFY_ENTRY_FIELDS}))]


def plan_verify(a: PlanVerifyArgs) -> None:
    for launch in plan_verify_launches(a):
        launch_record(launch)


def move(a: MoveArgs) -> None:
    n = a.src_pages.shape[0]
    num_pages = a.canary.shape[0] // a.page_size
    # No whole page: every pair is skipped; one element per pair still counts its ids.
    page_elems = a.page_size * a.canary.shape[1] if num_pages else 1
    if n == 0:
        return
    config = move_config(n, page_elems)
    pairs = (np.int64(num_pages), np.int64(page_elems), a.src_pages, a.dst_pages,
             np.int32(a.src_pages.dtype == np.int64), np.int64(n))
    # Three launches: every moved row is staged before any source is cleared, and every source is
    # cleared before any destination is written (sources and destinations may overlap).
    _launch("move", kernel_name("move_gather"), config, (a.canary, *pairs, a.workspace, a.out_of_range_count))
    _launch("move", kernel_name("move_clear"), config, (a.canary, *pairs))
    _launch("move", kernel_name("move_scatter"), config, (a.canary, *pairs, a.workspace))


def copy(a: CopyArgs) -> None:
    n = a.src_pages.shape[0]
    if n == 0:
        return
    src_pages, dst_pages = a.src_canary.shape[0] // a.page_size, a.dst_canary.shape[0] // a.page_size
    # No whole page in either buffer: every pair is skipped; one element per pair still counts its ids.
    page_elems = a.page_size * a.src_canary.shape[1] if src_pages and dst_pages else 1
    config = move_config(n, page_elems)
    pairs = (np.int64(src_pages), np.int64(dst_pages), np.int64(page_elems), a.src_pages, a.dst_pages,
             np.int32(a.src_pages.dtype == np.int64), np.int64(n))
    # Two launches: every copied page is staged before any destination is written.
    _launch("move", kernel_name("copy_gather"), config, (a.src_canary, *pairs, a.workspace, a.out_of_range_count))
    _launch("move", kernel_name("copy_scatter"), config, (a.dst_canary, *pairs, a.workspace))


def scatter(a: ScatterArgs) -> None:
    bs = a.req_pool_indices.shape[0]
    if bs == 0:
        return
    rows, cols = a.pool_out.shape
    config, group_rows = scatter_config(bs)
    _launch("scatter", kernel_name("scatter_req_token_ids"), config, (
        a.flat_in, np.int64(a.flat_in.shape[0]), a.offsets, a.req_pool_indices, np.int64(bs), a.pool_out, np.int64(rows),
        np.int64(cols), row_stride(a.pool_out), np.int64(group_rows), a.out_of_range_count,
    ))


_ONE_BLOCK, _STAGE_BLOCK = (1,), (THREADS,)


class BoundStage:
    """The session's staging of one plan (kernels/session.cu) with its parameters packed once:
    ``stage(stamp, stream, staging=None)`` launches session_stage (one block) then
    session_attribute on ``stream`` (None: CuPy's current one), into the device record at address
    ``staging`` (None: the one it was bound with).  Per call only the stamp and the record's
    address are written into the packed parameters; the launch arguments are their addresses,
    built once.  Launch on the bound device."""

    def __init__(self, a: StageArgs):
        params = np.zeros(1, STAGE_PARAMS)
        s = params["s"]
        for key, arr in (("ring", a.log.ring), ("write_index", a.log.write_index),
                         ("violation_counters", a.log.violation_counters), ("slot_run_counters", a.log.slot_run_counters),
                         ("kernel_run_counters", a.log.kernel_run_counters),
                         ("out_of_range_counters", a.log.out_of_range_counters), ("slots", a.verify_slot_indices),
                         ("expected_tokens", a.verify_expected_tokens), ("expected_positions", a.verify_expected_positions),
                         ("prev_slots", a.verify_prev_slot_indices), ("verify_num_valid", a.verify_num_valid),
                         ("enable", a.enable), ("plan_out_of_range", a.plan_out_of_range_count),
                         ("verify_offsets", a.verify_offsets), ("write_num_valid_reqs", a.write_num_valid_reqs),
                         ("marks", a.marks), ("staging", a.staging)):
            s[key] = ptr(arr)
        s["num_slots"], s["ring_capacity"] = a.marks.shape[0], a.log.ring.shape[0]
        s["verify_capacity"], s["write_req_capacity"] = a.verify_slot_indices.shape[0], a.verify_offsets.shape[0] - 1
        s["attribution_capacity"], s["num_kinds"] = a.layout.attribution_capacity, a.layout.num_kinds
        s["num_rings"] = stage_rings(a.log)[0]
        device = a.staging.device.id
        with import_cupy().cuda.Device(device):
            self._stage_fn = get_function("session", kernel_name("session_stage")).kernel
            self._attribute_fn = get_function("session", kernel_name("session_attribute")).kernel
            self._grid = (attribute_grid(device),)
        self._params = params  # the launch arguments point into it
        self._stage_arguments = kernel_arguments(params)
        self._attribute_arguments = self._stage_arguments[:1]  # the same SessionStage, by address
        slots = ParamSlots(params)
        self._stamp, self._staging = slots("stamp"), slots("s.staging")

    def __call__(self, stamp: int, stream=None, staging: int | None = None) -> None:
        view, index = self._stamp
        view[index] = stamp
        if staging is not None:
            view, index = self._staging
            view[index] = staging
        self._stage_fn(_ONE_BLOCK, _STAGE_BLOCK, self._stage_arguments, stream=stream)
        self._attribute_fn(self._grid, _STAGE_BLOCK, self._attribute_arguments, stream=stream)


def prepare_stage(a: StageArgs) -> BoundStage:
    """``stage(stamp, stream, staging=None)``: session_stage then session_attribute (:class:`BoundStage`)."""
    return BoundStage(a)
