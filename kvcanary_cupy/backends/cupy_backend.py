"""The canary on the GPU: launches the CUDA kernels of ``kernels/`` through CuPy.

Every launch goes on CuPy's current stream (the front door makes that torch's current stream
when torch tensors are involved), allocates nothing, reads nothing back and has a grid fixed by
host-known shapes, so a whole step can be captured in a CUDA graph and replayed with new batch
contents.  Scalars are passed as NumPy scalars of the exact C parameter type; the structs of
``canary_common.cuh`` are passed by value as one-element NumPy structured arrays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..constants import REAL_KV_PARTIAL_BYTES, RealKvHashMode
from ..interop import import_cupy
from ..jit import get_function, kernel_name, plan_family
from ..plans import VERIFY_PLAN_FIELDS, WRITE_PLAN_FIELDS
from . import LogViews, MoveArgs, PlanArgs, ScatterArgs, StageArgs, VerifyArgs, WriteArgs

I64, I32 = np.int64, np.int32

CANARY_BUFFER = np.dtype([("data", "u8"), ("num_slots", "i8"), ("fields", "i4"), ("vec", "i4")], align=True)
REAL_KV_SOURCES = np.dtype(
    [("data", "u8", 4), ("row_stride", "i8", 4), ("page_size", "i4", 4), ("num_bytes_per_token", "i4", 4),
     ("nbytes", "i4", 4), ("num_sources", "i4")],
    align=True,
)
# One dtype per kernel struct, its field names the C member names (kernels/plan.cu).
PLAN_INPUTS = np.dtype(
    [(k, "u8") for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "table", "kv_indptr", "virtual_to_physical",
                         "lut", "pool", "valid_lens")]
    + [(k, "i8") for k in ("bs", "table_rows", "table_cols", "table_stride", "page_size", "page_shift")]
    + [("page_magic", "u8")]
    + [(k, "i8") for k in ("page_magic_shift", "page_id_limit", "null_block", "num_virtual_pages", "window", "lut_len",
                           "pool_stride", "pool_cols", "token_offset")]
    + [(k, "i4") for k in ("table_is_int64", "kv_indptr_is_int64")],
    align=True,
)
PLAN_OUTPUTS = np.dtype(
    [(f.name, "u8") for f in VERIFY_PLAN_FIELDS + WRITE_PLAN_FIELDS]
    + [("verify_capacity", "i8"), ("write_req_capacity", "i8"), ("clear_whole_capacity", "i4")],
    align=True,
)
LAUNCH_LOG = np.dtype(
    [("ring", "u8"), ("write_index", "u8"), ("violation_counters", "u8"), ("slot_run_counters", "u8"), ("kernel_run_counters", "u8"),
     ("out_of_range_counters", "u8"), ("capacity", "i4"), ("kind", "i4")],
    align=True,
)
SESSION_STAGE = np.dtype(
    [(k, "u8") for k in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters",
                         "out_of_range_counters", "slots", "expected_tokens", "expected_positions", "prev_slots",
                         "verify_num_valid", "enable", "plan_out_of_range", "verify_offsets", "write_num_valid_reqs",
                         "marks", "staging")]
    + [(k, "i8") for k in ("num_slots", "ring_capacity", "verify_capacity", "write_req_capacity",
                           "attribution_capacity", "num_kinds")],
    align=True,
)
assert (CANARY_BUFFER.itemsize, REAL_KV_SOURCES.itemsize, LAUNCH_LOG.itemsize) == (24, 120, 56)
assert SESSION_STAGE.itemsize == 184


class LaunchConfig(NamedTuple):
    grid: int
    block: int


PLAN_ITEMS_PER_THREAD = 4  # kPlanItemsPerThread in plan.cu
PLAN_MAX_THREADS = 1024  # kPlanMaxThreads
FUSED_PLAN_MAX_BS = 2048  # kFusedMaxBs: up to this batch size the plan is one launch
BLOCKS_PER_SM = 8
THREADS = 256
WRITE_WARPS_PER_BLOCK = 4
WRITE_WARPS_PER_SM = 32
SCATTER_MAX_GROUP_ROWS = 32  # kScatterMaxGroupRows in scatter.cu
ATTRIBUTE_BLOCKS_PER_SM = 2  # the attribution grid: small, since it usually exits at once


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return import_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"]


def _device_id() -> int:
    return import_cupy().cuda.Device().id


def plan_offsets_config(bs: int) -> LaunchConfig:
    """One block, as many threads as the batch needs (tiles loop past 1024 threads)."""
    threads = -(-bs // PLAN_ITEMS_PER_THREAD)
    return LaunchConfig(1, min(PLAN_MAX_THREADS, max(32, -(-threads // 32) * 32)))


def plan_fused_config() -> LaunchConfig:
    """A block per SM: each scans the (small) batch, then all expand the entries."""
    return LaunchConfig(_sm_count(_device_id()), PLAN_MAX_THREADS)


def persistent_config() -> LaunchConfig:
    """A fixed grid that fills the device: the kernels loop over a count read on the device."""
    return LaunchConfig(_sm_count(_device_id()) * BLOCKS_PER_SM, THREADS)


def write_config(write_req_capacity: int) -> LaunchConfig:
    """One warp per request, bounded by the SM count (never sized to an idle capacity)."""
    warps = max(1, min(write_req_capacity, _sm_count(_device_id()) * WRITE_WARPS_PER_SM))
    return LaunchConfig(-(-warps // WRITE_WARPS_PER_BLOCK), 32 * WRITE_WARPS_PER_BLOCK)


def _ptr(x) -> int:
    return 0 if x is None else x.data.ptr


def _row_stride(x) -> I64:
    return I64(x.strides[0] // x.dtype.itemsize)


def _canary_struct(canary) -> np.ndarray:
    s = np.zeros(1, CANARY_BUFFER)
    fields = canary.shape[1]
    s["data"], s["num_slots"], s["fields"] = canary.data.ptr, canary.shape[0], fields
    s["vec"] = int(fields % 2 == 0 and canary.data.ptr % 16 == 0)
    return s


def _sources_struct(sources: tuple, mode: int) -> np.ndarray:
    s = np.zeros(1, REAL_KV_SOURCES)
    if mode == RealKvHashMode.NONE:
        return s
    for i, src in enumerate(sources):
        s["data"][0, i] = src.data.data.ptr
        s["row_stride"][0, i] = src.data.strides[0]
        s["page_size"][0, i] = src.page_size
        s["num_bytes_per_token"][0, i] = src.num_bytes_per_token
        s["nbytes"][0, i] = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else src.read_bytes
    s["num_sources"] = len(sources)
    return s


def _log_struct(log: LogViews, kind: int) -> np.ndarray:
    s = np.zeros(1, LAUNCH_LOG)
    for key in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        s[key] = getattr(log, key).data.ptr
    s["capacity"], s["kind"] = log.ring.shape[0], kind
    return s


def _launch(family: str, name: str, config: LaunchConfig, args: tuple) -> None:
    get_function(family, name)((config.grid,), (config.block,), args)


INT64_MAX = 2**63 - 1
POSITION_BITS = 62  # positions and virtual token ids divided by the page size are below 2**62


def page_division(page_size: int) -> tuple[int, int, int]:
    """``(shift, magic, magic_shift)`` dividing a value in ``[0, 2**62)`` by ``page_size`` on the
    device without a division: ``value >> shift`` for a power of two (``shift >= 0``), else
    ``umulhi(value, magic) >> magic_shift`` with ``magic = ceil(2**(62 + l) / page_size)``,
    ``l = ceil(log2(page_size))`` (Granlund and Montgomery, 1994: exact for dividends below 2**62)."""
    if page_size & (page_size - 1) == 0:
        return page_size.bit_length() - 1, 0, 0
    bits = page_size.bit_length()  # page_size is no power of two: ceil(log2(page_size)), >= 2
    return -1, -(-(1 << (POSITION_BITS + bits)) // page_size), POSITION_BITS + bits - 64


def _plan_structs(a: PlanArgs):
    t, o = a.table, a.out
    ins = np.zeros(1, PLAN_INPUTS)
    for key, arr in (("req_pool_indices", a.req_pool_indices), ("prefix_lens", a.prefix_lens),
                     ("extend_seq_lens", a.extend_seq_lens), ("table", t.entries), ("kv_indptr", t.kv_indptr),
                     ("virtual_to_physical", t.virtual_to_physical), ("lut", a.swa_lut),
                     ("pool", a.expected_token_pool), ("valid_lens", a.expected_token_valid_lens)):
        ins[key] = _ptr(arr)
    ins["bs"] = a.prefix_lens.shape[0]
    ins["table_rows"] = t.entries.shape[0]
    if t.entries.ndim == 2:
        ins["table_cols"], ins["table_stride"] = t.entries.shape[1], _row_stride(t.entries)
    ins["page_size"], ins["null_block"] = t.page_size, t.null_block
    ins["page_shift"], ins["page_magic"], ins["page_magic_shift"] = page_division(t.page_size)
    ins["page_id_limit"] = INT64_MAX // t.page_size
    ins["num_virtual_pages"] = 0 if t.virtual_to_physical is None else t.virtual_to_physical.shape[0]
    ins["window"], ins["token_offset"] = a.swa_window_size, a.token_offset
    ins["lut_len"] = 0 if a.swa_lut is None else a.swa_lut.shape[0]
    if a.expected_token_pool is not None:
        ins["pool_stride"], ins["pool_cols"] = _row_stride(a.expected_token_pool), a.expected_token_pool.shape[1]
    ins["table_is_int64"] = t.entries.dtype == np.int64
    ins["kv_indptr_is_int64"] = t.kv_indptr is not None and t.kv_indptr.dtype == np.int64
    outs = np.zeros(1, PLAN_OUTPUTS)
    for key, arr in o._asdict().items():
        outs[key] = _ptr(arr)
    outs["verify_capacity"] = o.verify_slot_indices.shape[0]
    outs["write_req_capacity"] = o.write_seed_slot_indices.shape[0]
    outs["clear_whole_capacity"] = a.clear_whole_capacity
    template_args = (int(t.kind), a.swa_lut is not None, a.expected_token_pool is not None)
    return template_args, (ins, outs)


def plan(a: PlanArgs) -> None:
    template_args, args = _plan_structs(a)
    family = plan_family(a.table.kind)
    bs = a.prefix_lens.shape[0]
    if bs <= FUSED_PLAN_MAX_BS:
        _launch(family, kernel_name("plan_fused", *template_args), plan_fused_config(), args)
        return
    _launch(family, kernel_name("plan_offsets", *template_args), plan_offsets_config(bs), args)
    if a.out.verify_slot_indices.shape[0] > 0:  # a zero-capacity plan expands nothing
        _launch(family, kernel_name("plan_entries", *template_args), persistent_config(), args)


def write(a: WriteArgs) -> None:
    input_assert = a.expected_input_tokens is not None
    has_real_kv = a.real_kv_hash_mode != RealKvHashMode.NONE and len(a.sources) > 0
    flag = a.chain_position_assert
    flag_ptr, flag_value = (None, I32(flag)) if isinstance(flag, bool) else (flag, I32(0))
    cap = a.write_seed_slot_indices.shape[0]
    _launch("write", kernel_name("canary_write", input_assert, has_real_kv), write_config(cap), (
        _canary_struct(a.canary), a.write_offsets, a.write_seed_slot_indices, a.write_num_valid_reqs, I64(cap),
        a.input_ids, a.positions, a.out_cache_loc, I64(a.input_ids.shape[0]), a.expected_input_tokens,
        a.expected_input_positions, flag_ptr, flag_value, _sources_struct(a.sources, a.real_kv_hash_mode),
        _log_struct(a.log, a.kernel_kind),
    ))


def verify(a: VerifyArgs) -> None:
    has_real_kv = a.real_kv_hash_mode != RealKvHashMode.NONE and len(a.sources) > 0
    _launch("verify", kernel_name("canary_verify", a.check_expected_token, has_real_kv), persistent_config(), (
        _canary_struct(a.canary), a.verify_slot_indices, a.verify_expected_tokens, a.verify_expected_positions,
        a.verify_prev_slot_indices, a.verify_num_valid, a.enable, I64(a.verify_slot_indices.shape[0]),
        _sources_struct(a.sources, a.real_kv_hash_mode), _log_struct(a.log, a.kernel_kind),
    ))


def scatter_config(bs: int) -> tuple[LaunchConfig, int]:
    """``(launch, rows per group)``: a group per block while the batch fits the device, then
    groups of up to SCATTER_MAX_GROUP_ROWS rows so one scan of the later rows serves many."""
    blocks = _sm_count(_device_id()) * BLOCKS_PER_SM
    group_rows = max(1, min(SCATTER_MAX_GROUP_ROWS, -(-bs // blocks)))
    return LaunchConfig(max(1, min(blocks, -(-bs // group_rows))), THREADS), group_rows


def move(a: MoveArgs) -> None:
    n = a.src_pages.shape[0]
    page_elems = a.page_size * a.canary.shape[1]
    if n == 0:
        return
    config = LaunchConfig(min(-(-n * page_elems // THREADS), _sm_count(_device_id()) * BLOCKS_PER_SM), THREADS)
    pairs = (I64(a.canary.shape[0] // a.page_size), I64(page_elems), a.src_pages, a.dst_pages,
             I32(a.src_pages.dtype == np.int64), I64(n))
    # Three launches: every moved row is staged before any source is cleared, and every source is
    # cleared before any destination is written (sources and destinations may overlap).
    _launch("move", kernel_name("move_gather"), config, (a.canary, *pairs, a.workspace, a.out_of_range_count))
    _launch("move", kernel_name("move_clear"), config, (a.canary, *pairs))
    _launch("move", kernel_name("move_scatter"), config, (a.canary, *pairs, a.workspace))


def scatter(a: ScatterArgs) -> None:
    bs = a.req_pool_indices.shape[0]
    if bs == 0:
        return
    rows, cols = a.pool_out.shape
    config, group_rows = scatter_config(bs)
    _launch("scatter", kernel_name("scatter_req_token_ids"), config, (
        a.flat_in, I64(a.flat_in.shape[0]), a.offsets, a.req_pool_indices, I64(bs), a.pool_out, I64(rows),
        I64(cols), _row_stride(a.pool_out), I64(group_rows), a.out_of_range_count,
    ))


def prepare_stage(a: StageArgs):
    """``stage(stamp, stream)``: session_stage (one block) then session_attribute on ``stream``.

    The argument struct is packed once: every address is fixed for the life of a session.
    """
    cupy = import_cupy()
    s = np.zeros(1, SESSION_STAGE)
    for key, arr in (("ring", a.log.ring), ("write_index", a.log.write_index),
                     ("violation_counters", a.log.violation_counters), ("slot_run_counters", a.log.slot_run_counters),
                     ("kernel_run_counters", a.log.kernel_run_counters),
                     ("out_of_range_counters", a.log.out_of_range_counters), ("slots", a.verify_slot_indices),
                     ("expected_tokens", a.verify_expected_tokens), ("expected_positions", a.verify_expected_positions),
                     ("prev_slots", a.verify_prev_slot_indices), ("verify_num_valid", a.verify_num_valid),
                     ("enable", a.enable), ("plan_out_of_range", a.plan_out_of_range_count),
                     ("verify_offsets", a.verify_offsets), ("write_num_valid_reqs", a.write_num_valid_reqs),
                     ("marks", a.marks), ("staging", a.staging)):
        s[key] = _ptr(arr)
    s["num_slots"], s["ring_capacity"] = a.marks.shape[0], a.log.ring.shape[0]
    s["verify_capacity"], s["write_req_capacity"] = a.verify_slot_indices.shape[0], a.verify_offsets.shape[0] - 1
    s["attribution_capacity"], s["num_kinds"] = a.layout.attribution_capacity, a.layout.num_kinds
    with cupy.cuda.Device(a.staging.device.id):
        stage_fn = get_function("session", kernel_name("session_stage"))
        attribute_fn = get_function("session", kernel_name("session_attribute"))
        grid = (_sm_count(a.staging.device.id) * ATTRIBUTE_BLOCKS_PER_SM,)
    block = (THREADS,)

    def stage(stamp: int, stream) -> None:
        stage_fn((1,), block, (s, I64(stamp)), stream=stream)
        attribute_fn(grid, block, (s,), stream=stream)

    return stage
