"""The canary on the GPU: launches the CUDA kernels of ``kernels/`` through CuPy.

Every launch goes on CuPy's current stream (the front door makes that torch's current stream
when torch tensors are involved), allocates nothing, reads nothing back and has a grid fixed by
host-known shapes, so a whole step can be captured in a CUDA graph and replayed with new batch
contents.  On sm_90 and later the parameter-record launches overlap the work before them
(:mod:`.cuda.launch`).  Scalars are passed as NumPy scalars of the exact C parameter type; the
structs of ``canary_common.cuh`` are passed by value as one-element NumPy structured arrays.  Plan, write,
verify and the session's staging take their parameters as one record per kernel (field i =
parameter i, passed by its address), which a bound launcher (:mod:`kvcanary_cupy.launchers`,
:class:`BoundStage`) packs once and patches per call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..args import (VERIFY_ENTRY_FIELDS, VERIFY_INPUT_FIELDS, LogViews, MoveArgs, PlanArgs, PlanVerifyArgs, ScatterArgs, StageArgs,
                    TableView, VerifyArgs, WriteArgs, stage_rings)
from ..constants import MAX_CANARY_BUFFERS, REAL_KV_PARTIAL_BYTES, RealKvHashMode
from .. import jit
from ..interop import import_cupy
from ..jit import get_function, kernel_name, plan_family, step_family
from ..plans import SCAN_STATE_TILES, VERIFY_PLAN_FIELDS, WRITE_PLAN_FIELDS
from ..tables import TableKind
from ..validation import INT32_MAX, INT32_MIN
from .cuda import device as cuda_device
from .cuda import launch as launch_overlap

# The NumPy mirrors of the structs the kernels take by value; devtools/abi_check.py (KERNEL_STRUCTS)
# checks each one's size, widths and offsets against its C struct.
CANARY_BUFFER = np.dtype([("data", "u8"), ("num_slots", "i8"), ("fields", "i4"), ("vec", "i4")], align=True)
REAL_KV_SOURCES = np.dtype(
    [("data", "u8", 4), ("row_stride", "i8", 4), ("page_size", "i4", 4), ("num_bytes_per_token", "i4", 4),
     ("nbytes", "i4", 4), ("num_sources", "i4")],
    align=True,
)
CANARY_TARGETS = np.dtype(
    [("canary", CANARY_BUFFER, MAX_CANARY_BUFFERS), ("sources", REAL_KV_SOURCES, MAX_CANARY_BUFFERS),
     ("kind", "i4", MAX_CANARY_BUFFERS)],
    align=True,
)
LAUNCH_LOG = np.dtype(
    [("ring", "u8"), ("write_index", "u8"), ("violation_counters", "u8"), ("slot_run_counters", "u8"),
     ("kernel_run_counters", "u8"), ("out_of_range_counters", "u8"), ("capacity", "i4")],
    align=True,
)
WRITE_INPUTS = np.dtype(
    [(k, "u8") for k in ("write_offsets", "seeds", "write_num_valid_reqs", "input_ids", "positions", "out_cache_loc",
                         "expected_tokens", "expected_positions", "pos_assert_flag")]
    + [("write_req_capacity", "i8"), ("num_tokens", "i8"), ("pos_assert_value", "i4")],
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
    + [("verify_capacity", "i8"), ("write_req_capacity", "i8"), ("clear_whole_capacity", "i4"), ("scan_state", "u8"),
       ("scan_state_min_rows", "i8")],
    align=True,
)
SESSION_STAGE = np.dtype(
    [(k, "u8") for k in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters",
                         "out_of_range_counters", "slots", "expected_tokens", "expected_positions", "prev_slots",
                         "verify_num_valid", "enable", "plan_out_of_range", "verify_offsets", "write_num_valid_reqs",
                         "marks", "staging")]
    + [(k, "i8") for k in ("num_slots", "ring_capacity", "verify_capacity", "write_req_capacity",
                           "attribution_capacity", "num_kinds", "num_rings")],
    align=True,
)


class LaunchConfig(NamedTuple):
    grid: int
    block: int
    shared_mem: int = 0  # dynamic shared memory, bytes


PLAN_THREADS = 512  # kPlanThreads in plan.cu: plan_small, plan_fused, plan_offsets and plan_verify blocks
PLAN_SMALL_MAX_ROWS = 32  # kPlanSmallRows in plan.cu: a batch of up to this many requests takes plan_small
PLAN_FUSED_MAX_ROWS = 4096  # ... else up to this many plan in one launch (plan_fused)
# A two-launch plan of at least this many requests has its blocks exchange their shares' totals
# through the WritePlan's scan state instead of each reading every row before its share: on the
# H200 the latter costs about 0.5 us per 1,000 requests (3.7 us at 256, 5.9 at 4,500, 12.0 at
# 20,000), the state a flat 4.4-4.8 us up to 20,000.
PLAN_SCAN_STATE_MIN_ROWS = 2_000
PLAN_VERIFY_BLOCKS_PER_SM = 2  # kPlanVerifyBlocksPerSm in step.cu: plan_verify's launch bounds
# plan_verify runs up to PLAN_VERIFY_BLOCKS_PER_SM blocks per SM when its verify capacity holds at
# least this many entries per request: its check is latency-bound and gains from the warps, but
# every block scans every row, which extra blocks repeat.  On the H200, with 2,048 entries a
# request, two blocks per SM took 0.79-0.89x the time of one at 256-3,072 requests; with 136, 1.03-1.20x.
PLAN_VERIFY_PACKED_MIN_ENTRIES_PER_ROW = 1024
PLAN_SCAN_RESERVED_SMEM = 2048  # bytes of a scan block's shared memory kept for its static arrays
THREADS = 256  # plan_entries and scatter blocks
VERIFY_THREADS = 256  # kVerifyThreads in verify.cu
WRITE_THREADS = 128  # kWriteThreads in write.cu
WRITE_SCHEDULERS_PER_SM = 4  # warp schedulers of an SM (sm_80, sm_90)
BLOCKS_PER_SM = 8  # scatter groups and page moves (not persistent grids)
SCATTER_MAX_GROUP_ROWS = 32  # kScatterMaxGroupRows in scatter.cu
ATTRIBUTE_BLOCKS_PER_SM = 2  # the attribution grid: small, since it usually exits at once


@functools.lru_cache(maxsize=None)
def resident_blocks_per_sm(device_id: int, family: str, name: str, block: int) -> int:
    """Blocks of ``block`` threads of one compiled kernel that one SM holds at once (CUDA's
    occupancy calculator over its registers and shared memory), cached per device and kernel."""
    return max(1, cuda_device.max_active_blocks_per_sm(get_function(family, name), block))


def persistent_config(family: str, name: str, block: int = THREADS) -> LaunchConfig:
    """A grid of as many blocks as are resident at once, so it runs in one wave (a larger grid
    leaves its last blocks to start after the first ones finish); the kernels loop over a count
    read on the device."""
    device = cuda_device.current_id()
    return LaunchConfig(cuda_device.sm_count(device) * resident_blocks_per_sm(device, family, name, block), block)


@functools.lru_cache(maxsize=None)
def plan_scan_max_rows(device_id: int) -> int:
    """The most rows one scan tile holds: a block's opt-in shared memory, less the static arrays,
    at a verify and a write offset (int64) per row plus their ends."""
    return (cuda_device.shared_mem_optin(device_id) - PLAN_SCAN_RESERVED_SMEM) // 16 - 1


def plan_scan_config(rows: int, blocks: int | None = None) -> LaunchConfig:
    """``blocks`` (default: one per SM) of PLAN_THREADS, with the scan's shared arrays for ``rows``
    rows as dynamic shared memory (the kernel reads its tile size from it).  Past 48 KiB this
    relies on the kernel's opt-in, made as it was loaded (jit.LARGE_SHARED_MEM_KERNELS)."""
    return LaunchConfig(blocks or cuda_device.sm_count(cuda_device.current_id()), PLAN_THREADS, (rows + 1) * 16)


def plan_one_launch_blocks(verify_capacity: int, spare: int = 0, per_sm: int = 1) -> int:
    """Blocks of a one-launch plan: enough for a warp per 32 entries of the verify capacity, plus
    ``spare`` (plan_small's last block writes the per-request outputs beside the expansion), at
    least one and at most ``per_sm`` per SM (as many as an SM holds at once: one wave).  The
    expansion gives each warp at least 32 entries, so more blocks would only repeat the scan (and
    add to the launch)."""
    per_block = PLAN_THREADS  # 32 entries for each of its PLAN_THREADS // 32 warps
    return max(1, min(per_sm * cuda_device.sm_count(cuda_device.current_id()), -(-verify_capacity // per_block) + spare))


def write_config(name: str, write_req_capacity: int, num_buffers: int) -> LaunchConfig:
    """Per canary buffer, a warp per request up to one per SM scheduler (a prefill's requests
    each get a warp of their own), then a warp per 32 requests (a lane each), at most the
    resident warps; each buffer has warps of its own (write.cu)."""
    full = persistent_config("write", name, WRITE_THREADS)
    warps_per_block = WRITE_THREADS // 32
    spread = cuda_device.sm_count(cuda_device.current_id()) * WRITE_SCHEDULERS_PER_SM
    per_buffer = min(write_req_capacity, max(-(-write_req_capacity // 32), spread))
    warps = max(num_buffers, min(max(1, per_buffer) * num_buffers, full.grid * warps_per_block))
    return LaunchConfig(-(-warps // warps_per_block), WRITE_THREADS)


def _ptr(x) -> int:
    return 0 if x is None else x.data.ptr


def _len(x) -> int:
    return 0 if x is None else x.shape[0]


def _row_stride(x) -> np.int64:
    return np.int64(x.strides[0] // x.dtype.itemsize)


def _targets_struct(targets: tuple, mode: int) -> np.ndarray:
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
            src["page_size"][i] = view.page_size
            src["num_bytes_per_token"][i] = view.num_bytes_per_token
            src["nbytes"][i] = REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else view.read_bytes
        src["num_sources"] = len(target.sources)
    return s


def _log_struct(log: LogViews) -> np.ndarray:
    s = np.zeros(1, LAUNCH_LOG)
    for key in ("ring", "write_index", "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        s[key] = getattr(log, key).data.ptr
    s["capacity"] = log.ring.shape[0]
    return s


def has_real_kv(targets: tuple, mode: int) -> bool:
    return mode != RealKvHashMode.NONE and any(t.sources for t in targets)


def _launch(family: str, name: str, config: LaunchConfig, args: tuple) -> None:
    get_function(family, name)((config.grid,), (config.block,), args, shared_mem=config.shared_mem)


# ----------------------------------------------------------------------------------------------
# Kernel parameter records.  The free functions fill a fresh record per call; a bound launcher
# fills one at bind time and then rewrites only the fields of the per-step arrays, found by name
# with :class:`ParamSlots`.

def _param_record(*fields) -> np.dtype:
    return np.dtype(list(fields), align=True)


PLAN_PARAMS = _param_record(("inputs", PLAN_INPUTS), ("outputs", PLAN_OUTPUTS))
WRITE_PARAMS = _param_record(("targets", CANARY_TARGETS), ("inputs", WRITE_INPUTS), ("log", LAUNCH_LOG))
VERIFY_PARAMS = _param_record(
    ("targets", CANARY_TARGETS), *((k, "u8") for k in VERIFY_INPUT_FIELDS), ("verify_capacity", "i8"), ("log", LAUNCH_LOG),
    ("check_holes", "i4"),
)
PLAN_VERIFY_PARAMS = _param_record(("inputs", PLAN_INPUTS), ("outputs", PLAN_OUTPUTS), ("targets", CANARY_TARGETS),
                                   ("log", LAUNCH_LOG), ("check_holes", "i4"))


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


def _launch_record(launch: KernelLaunch) -> None:
    """Launch a parameter record's kernel on CuPy's current stream: overlapping the work before it
    where the device allows (:mod:`.cuda.launch`), else through CuPy."""
    if not launch_overlap.enabled(cuda_device.current_id()):
        _launch(launch.family, launch.name, launch.config, kernel_arguments(launch.params))
        return
    c = launch.config
    function = get_function(launch.family, launch.name).kernel.ptr
    overlapped = launch_overlap.OverlappedLaunch(function, c.grid, c.block, c.shared_mem, record_addresses(launch.params))
    overlapped(import_cupy().cuda.get_current_stream().ptr)


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


@functools.lru_cache(maxsize=256)
def table_fields(page_size: int, null_block: int, cols: int, stride: int, entries_int64: bool, kv_indptr_int64: bool,
                 num_virtual_pages: int) -> tuple:
    """The PLAN_INPUTS fields a table sets besides its addresses and row count, as ``(name, value)``
    pairs (a bound planner writes them again only when they change)."""
    shift, magic, magic_shift = page_division(page_size)
    return (("table_cols", cols), ("table_stride", stride), ("page_size", page_size), ("page_shift", shift),
            ("page_magic", magic), ("page_magic_shift", magic_shift), ("page_id_limit", INT64_MAX // page_size),
            ("null_block", null_block), ("num_virtual_pages", num_virtual_pages), ("table_is_int64", int(entries_int64)),
            ("kv_indptr_is_int64", int(kv_indptr_int64)))


def narrow_layout(kind: int, page_size: int, null_block: int, entries_int64: bool, kv_indptr_int64: bool) -> tuple[int, int]:
    """``(max_row_tokens, layout)``: a table of ``kind`` plans through its narrow layout
    (jit.TableLayout) when its rows hold at most max_row_tokens tokens: 2**31 - 1 for a block table
    of int32 ids with a power-of-two block size and an int32 null block, or a page table of int32
    kv_indptr and kv_indices with a power-of-two page size; -1 (never) for any other table."""
    if entries_int64 or page_size & (page_size - 1):
        return -1, kind
    if kind == TableKind.BLOCK and INT32_MIN <= null_block <= INT32_MAX or kind == TableKind.PAGED_KV and not kv_indptr_int64:
        return INT32_MAX, jit.TableLayout(kind | jit.TABLE_NARROW)
    return -1, kind


def table_layout(kind: int, row_tokens: int, page_size: int, null_block: int, entries_int64: bool,
                 kv_indptr_int64: bool) -> int:
    """The layout the plan kernels read a table of ``kind`` in (jit.TableLayout, kTable): its
    :func:`narrow_layout` when ``row_tokens``, which bounds every row's length in tokens (a block
    table's width, a page table's kv_indices length, times the page size), is within its limit;
    else the kind's general one.  (A bound planner keeps narrow_layout per table shape.)"""
    max_row_tokens, narrow = narrow_layout(kind, page_size, null_block, entries_int64, kv_indptr_int64)
    return narrow if row_tokens <= max_row_tokens else kind


def view_layout(t: TableView) -> int:
    """:func:`table_layout` of a table's views."""
    return table_layout(t.kind, t.row_tokens, t.page_size, t.null_block, t.entries.dtype == np.int64,
                        t.kv_indptr is not None and t.kv_indptr.dtype == np.int64)


def plan_params(a: PlanArgs) -> np.ndarray:
    """The plan kernels' parameters; per-step arrays that are None (a bound planner) are left 0."""
    t, o = a.table, a.out
    p = np.zeros(1, PLAN_PARAMS)
    ins, outs = p["inputs"], p["outputs"]
    for key, arr in (("req_pool_indices", a.req_pool_indices), ("prefix_lens", a.prefix_lens),
                     ("extend_seq_lens", a.extend_seq_lens), ("lut", a.swa_lut),
                     ("pool", a.expected_token_pool), ("valid_lens", a.expected_token_valid_lens)):
        ins[key] = _ptr(arr)
    ins["bs"] = _len(a.prefix_lens)
    if t is not None:
        ins["table"], ins["kv_indptr"], ins["virtual_to_physical"] = _ptr(t.entries), _ptr(t.kv_indptr), _ptr(t.virtual_to_physical)
        ins["table_rows"] = t.entries.shape[0]
        cols, stride = (t.entries.shape[1], _row_stride(t.entries)) if t.entries.ndim == 2 else (0, 0)
        for key, value in table_fields(t.page_size, t.null_block, int(cols), int(stride), t.entries.dtype == np.int64,
                                       t.kv_indptr is not None and t.kv_indptr.dtype == np.int64,
                                       _len(t.virtual_to_physical)):
            ins[key] = value
    ins["window"], ins["token_offset"] = a.swa_window_size, a.token_offset
    ins["lut_len"] = _len(a.swa_lut)
    if a.expected_token_pool is not None:
        ins["pool_stride"], ins["pool_cols"] = _row_stride(a.expected_token_pool), a.expected_token_pool.shape[1]
    for key, arr in o._asdict().items():
        outs[key] = _ptr(arr)
    outs["verify_capacity"] = o.verify_slot_indices.shape[0]
    outs["write_req_capacity"] = o.write_seed_slot_indices.shape[0]
    outs["clear_whole_capacity"] = a.clear_whole_capacity
    if a.scan_state is not None and cuda_device.sm_count(cuda_device.current_id()) <= SCAN_STATE_TILES:  # a tile per plan_offsets block
        outs["scan_state"] = a.scan_state.data.ptr
    outs["scan_state_min_rows"] = PLAN_SCAN_STATE_MIN_ROWS
    return p


def plan_fused_scan_rows(bs: int) -> int:
    """plan_fused's kScanRows for ``bs`` requests: past 64 rows a warp (its 16 warps' shares of the
    batch) the scan's blocked passes, a lane summing up to jit.SCAN_ROWS_PER_LANE consecutive rows
    under one warp scan (H200, 4,096 requests: 12.6 -> 11.9 us); up to that the kernel with the
    strided passes alone (the SASS plan_fused had before the blocked passes): with those compiled
    in, W1's 256 requests measured 8.1 against 7.96 us."""
    return jit.SCAN_ROWS_PER_LANE if bs > PLAN_THREADS // 32 * 64 else 1


def plan_kernels(layout: int, bs: int, verify_capacity: int, has_lut: bool, has_pool: bool) -> tuple:
    """``(family, kernel name, LaunchConfig)`` of each launch of a plan of ``bs`` requests through a
    table of ``layout`` (:func:`table_layout`; a TableKind is its general layout), in order."""
    family, template_args = plan_family(layout), (int(layout), has_lut, has_pool)
    if bs <= PLAN_SMALL_MAX_ROWS:
        name = kernel_name("plan_small", *template_args)
        return ((family, name, LaunchConfig(plan_one_launch_blocks(verify_capacity, spare=int(verify_capacity > 0)), PLAN_THREADS)),)
    if bs <= PLAN_FUSED_MAX_ROWS:
        name = kernel_name("plan_fused", *template_args, plan_fused_scan_rows(bs))
        return ((family, name, plan_scan_config(bs, plan_one_launch_blocks(verify_capacity))),)
    name = kernel_name("plan_offsets", *template_args)
    device = cuda_device.current_id()
    tile_rows = min(-(-bs // cuda_device.sm_count(device)), plan_scan_max_rows(device))
    offsets = (family, name, plan_scan_config(tile_rows))
    if verify_capacity == 0:  # a zero-capacity plan expands nothing
        return (offsets,)
    name = kernel_name("plan_entries", *template_args)
    return offsets, (family, name, persistent_config(family, name))


def plan(a: PlanArgs) -> None:
    params = plan_params(a)
    for family, name, config in plan_kernels(view_layout(a.table), a.prefix_lens.shape[0], a.out.verify_slot_indices.shape[0],
                                             a.swa_lut is not None, a.expected_token_pool is not None):
        _launch_record(KernelLaunch(family, name, config, params))


def write_kernel(num_targets: int, input_assert: bool, real_kv: bool) -> str:
    return kernel_name("canary_write", num_targets, input_assert, real_kv)


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
                     ("pos_assert_flag", None if isinstance(flag, bool) else flag)):
        ins[key] = _ptr(arr)
    ins["write_req_capacity"], ins["num_tokens"] = cap, _len(a.input_ids)
    ins["pos_assert_value"] = int(flag) if isinstance(flag, bool) else 0
    p["targets"], p["log"] = _targets_struct(a.targets, a.real_kv_hash_mode), _log_struct(a.log)
    name = write_kernel(len(a.targets), a.expected_input_tokens is not None, has_real_kv(a.targets, a.real_kv_hash_mode))
    return KernelLaunch("write", name, write_config(name, cap, len(a.targets)), p)


def write(a: WriteArgs) -> None:
    _launch_record(write_launch(a))


def verify_launch(a: VerifyArgs) -> KernelLaunch:
    p = np.zeros(1, VERIFY_PARAMS)
    p["targets"], p["log"] = _targets_struct(a.targets, a.real_kv_hash_mode), _log_struct(a.log)
    for key in VERIFY_INPUT_FIELDS:
        p[key] = _ptr(getattr(a, key))
    p["verify_capacity"] = a.verify_slot_indices.shape[0]
    p["check_holes"] = int(a.check_holes)
    name = kernel_name("canary_verify", len(a.targets), a.check_expected_token, has_real_kv(a.targets, a.real_kv_hash_mode))
    return KernelLaunch("verify", name, persistent_config("verify", name, VERIFY_THREADS), p)


def verify(a: VerifyArgs) -> None:
    _launch_record(verify_launch(a))


def plan_verify_stores_entries(bs: int) -> bool:
    """Whether plan_and_verify of ``bs`` requests stores its verify entries: a batch past one plan
    launch (PLAN_FUSED_MAX_ROWS) takes plan + verify through the VerifyPlan's entry arrays; a
    smaller one plans and verifies in one launch (plan_verify) and stores none."""
    return bs > PLAN_FUSED_MAX_ROWS


def plan_verify_blocks_per_sm(bs: int, verify_capacity: int) -> int:
    """plan_verify's most blocks per SM for ``bs`` requests and ``verify_capacity`` entries
    (PLAN_VERIFY_PACKED_MIN_ENTRIES_PER_ROW)."""
    return PLAN_VERIFY_BLOCKS_PER_SM if verify_capacity >= PLAN_VERIFY_PACKED_MIN_ENTRIES_PER_ROW * max(bs, 1) else 1


def plan_verify_kernel(layout: int, bs: int, verify_capacity: int, has_lut: bool, has_pool: bool, check_token: bool,
                       real_kv: bool) -> tuple:
    """``(family, kernel name, LaunchConfig)`` of the fused plan + verify of ``bs`` requests through
    a table of ``layout`` (a batch that does not :func:`plan_verify_stores_entries`): plan_fused's
    configuration (its scan and expansion, with a grid sized by the verify capacity), up to
    :func:`plan_verify_blocks_per_sm` blocks per SM."""
    family = step_family(layout)
    name = kernel_name("plan_verify", int(layout), has_lut, has_pool, check_token, real_kv)
    blocks = plan_one_launch_blocks(verify_capacity, per_sm=plan_verify_blocks_per_sm(bs, verify_capacity))
    return family, name, plan_scan_config(bs, blocks)


def plan_verify_launch(a: PlanVerifyArgs) -> KernelLaunch:
    """plan_verify's launch; per-step arrays that are None (a bound launcher) are left 0."""
    p = np.zeros(1, PLAN_VERIFY_PARAMS)
    plan_record = plan_params(a.plan)
    p["inputs"], p["outputs"] = plan_record["inputs"], plan_record["outputs"]
    p["outputs"]["verify_capacity"] = a.verify_capacity
    v = a.verify
    p["targets"], p["log"] = _targets_struct(v.targets, v.real_kv_hash_mode), _log_struct(v.log)
    p["check_holes"] = int(v.check_holes)
    # Without a pool every expected token is -1 (unchecked): the token check would find nothing.
    has_pool = a.plan.expected_token_pool is not None
    family, name, config = plan_verify_kernel(view_layout(a.plan.table), _len(a.plan.prefix_lens), a.verify_capacity,
                                              a.plan.swa_lut is not None, has_pool, v.check_expected_token and has_pool,
                                              has_real_kv(v.targets, v.real_kv_hash_mode))
    return KernelLaunch(family, name, config, p)


def plan_verify(a: PlanVerifyArgs) -> None:
    if not plan_verify_stores_entries(a.plan.prefix_lens.shape[0]):
        _launch_record(plan_verify_launch(a))
        return
    # Past PLAN_FUSED_MAX_ROWS the plan takes two launches: plan + verify, the entries stored in
    # plan.out's arrays (the front door checked that they hold verify_capacity entries).
    out = a.plan.out
    plan(a.plan)
    verify(a.verify._replace(**{k: getattr(out, k) for k in VERIFY_ENTRY_FIELDS}))


def scatter_config(bs: int) -> tuple[LaunchConfig, int]:
    """``(launch, rows per group)``: a group per block while the batch fits the device, then
    groups of up to SCATTER_MAX_GROUP_ROWS rows so one scan of the later rows serves many."""
    blocks = cuda_device.sm_count(cuda_device.current_id()) * BLOCKS_PER_SM
    group_rows = max(1, min(SCATTER_MAX_GROUP_ROWS, -(-bs // blocks)))
    return LaunchConfig(max(1, min(blocks, -(-bs // group_rows))), THREADS), group_rows


def move(a: MoveArgs) -> None:
    n = a.src_pages.shape[0]
    num_pages = a.canary.shape[0] // a.page_size
    # No whole page: every pair is skipped; one element per pair still counts its ids.
    page_elems = a.page_size * a.canary.shape[1] if num_pages else 1
    if n == 0:
        return
    config = LaunchConfig(min(-(-n * page_elems // THREADS), cuda_device.sm_count(cuda_device.current_id()) * BLOCKS_PER_SM), THREADS)
    pairs = (np.int64(num_pages), np.int64(page_elems), a.src_pages, a.dst_pages,
             np.int32(a.src_pages.dtype == np.int64), np.int64(n))
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
        a.flat_in, np.int64(a.flat_in.shape[0]), a.offsets, a.req_pool_indices, np.int64(bs), a.pool_out, np.int64(rows),
        np.int64(cols), _row_stride(a.pool_out), np.int64(group_rows), a.out_of_range_count,
    ))


STAGE_PARAMS = _param_record(("s", SESSION_STAGE), ("stamp", "i8"))  # session_stage's; session_attribute takes s alone
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
            s[key] = _ptr(arr)
        s["num_slots"], s["ring_capacity"] = a.marks.shape[0], a.log.ring.shape[0]
        s["verify_capacity"], s["write_req_capacity"] = a.verify_slot_indices.shape[0], a.verify_offsets.shape[0] - 1
        s["attribution_capacity"], s["num_kinds"] = a.layout.attribution_capacity, a.layout.num_kinds
        s["num_rings"] = stage_rings(a.log)[0]
        device = a.staging.device.id
        with import_cupy().cuda.Device(device):
            self._stage_fn = get_function("session", kernel_name("session_stage")).kernel
            self._attribute_fn = get_function("session", kernel_name("session_attribute")).kernel
            self._grid = (cuda_device.sm_count(device) * ATTRIBUTE_BLOCKS_PER_SM,)
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
