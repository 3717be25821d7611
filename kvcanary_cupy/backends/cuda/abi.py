"""Every C mirror of the GPU side: the structs the kernels take by value, each kernel's parameter
record, the kernels' compile-time constants and the driver structs of an overlapped launch.

Editing a ``.cu`` struct or constant means editing its mirror here; tests/cuda/test_kernels_compile.py
checks each one against the kernel sources (sizes, widths and offsets through devtools/abi_check.py,
constants by reading them out of the sources).  The mirrors the NumPy reference shares live below
the backends: the format in :mod:`kvcanary_cupy.constants`, :class:`~kvcanary_cupy.tables.TableKind`,
the staged record in :mod:`kvcanary_cupy.args`, ``SCAN_STATE_TILES`` in :mod:`kvcanary_cupy.plans`.
"""

from __future__ import annotations

import ctypes
import enum

import numpy as np

from ...args import VERIFY_INPUT_FIELDS
from ...constants import MAX_CANARY_BUFFERS, MAX_PIECE_LEVELS, MAX_REAL_KV_SOURCES
from ...plans import VERIFY_PLAN_FIELDS, WRITE_PLAN_FIELDS
from ...tables import TableKind

# The NumPy mirrors of the structs the kernels take by value; devtools/abi_check.py (KERNEL_STRUCTS)
# checks each one's size, widths and offsets against its C struct.
CANARY_BUFFER = np.dtype([("data", "u8"), ("num_slots", "i8"), ("fields", "i4"), ("vec", "i4")], align=True)
_S = MAX_REAL_KV_SOURCES
REAL_KV_SOURCES = np.dtype(
    [("data", "u8", _S), ("row_stride", "i8", _S), ("slot_offset", "i8", _S), ("token_stride", "i8", _S), ("byte_offset", "i8", _S),
     ("piece_stride", "i8", (_S, MAX_PIECE_LEVELS)), ("piece_count", "i4", (_S, MAX_PIECE_LEVELS)),
     ("page_size", "i4", _S), ("nbytes", "i4", _S), ("piece_bytes", "i4", _S), ("unit", "i4", _S), ("num_sources", "i4")],
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
                         "expected_tokens", "expected_positions", "pos_assert_flag", "write_waves")]
    + [("write_req_capacity", "i8"), ("num_tokens", "i8"), ("pos_assert_value", "i4"), ("input_widths", "i4"),
       ("wave", "i4")],
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


# ----------------------------------------------------------------------------------------------
# Kernel parameter records (field i = parameter i).  The free functions fill a fresh record per
# call; a bound launcher fills one at bind time and then rewrites only the fields of the per-step
# arrays (params.ParamSlots).

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

STAGE_PARAMS = _param_record(("s", SESSION_STAGE), ("stamp", "i8"))  # session_stage's; session_attribute takes s alone

# kernels/coverage.cu takes plain parameters: one record per kernel, field i = parameter i.
DEEP_WRITE_PARAMS = _param_record(("table", "u8"), ("num_sources", "i4"), ("slots", "u8"), ("num_tokens", "i8"),
                                  ("canary", "u8"), ("num_slots", "i8"), ("fields", "i4"))
DEEP_CHECK_PARAMS = _param_record(("table", "u8"), ("num_sources", "i4"), ("canary", "u8"), ("num_slots", "i8"),
                                  ("fields", "i4"), ("per_step", "i8"), ("state", "u8"), ("log", LAUNCH_LOG), ("kind", "i4"))
LOST_SNAPSHOT_PARAMS = _param_record(("table", "u8"), ("num_sources", "i4"), ("slots", "u8"), ("num_tokens", "i8"),
                                     ("num_slots", "i8"), ("pre", "u8"))
LOST_CHECK_PARAMS = _param_record(("table", "u8"), ("num_sources", "i4"), ("slots", "u8"), ("num_tokens", "i8"),
                                  ("unchecked", "i8"), ("pre", "u8"), ("head", "u8"), ("head_fields", "i4"), ("tail", "u8"),
                                  ("tail_fields", "i4"), ("num_slots", "i8"), ("log", LAUNCH_LOG), ("kind", "i4"))
#: Each coverage kernel's record, by kernel name.
COVERAGE_PARAMS = {"deep_write": DEEP_WRITE_PARAMS, "deep_check": DEEP_CHECK_PARAMS, "lost_snapshot": LOST_SNAPSHOT_PARAMS,
                   "lost_check": LOST_CHECK_PARAMS}

# ----------------------------------------------------------------------------------------------
# The kernels' compile-time constants.

PLAN_THREADS = 512  # kPlanThreads in plan.cu: plan_small, plan_fused, plan_offsets and plan_verify blocks
PLAN_SMALL_MAX_ROWS = 32  # kPlanSmallRows in plan.cu: a batch of up to this many requests takes plan_small
PLAN_VERIFY_BLOCKS_PER_SM = 2  # kPlanVerifyBlocksPerSm in step.cu: plan_verify's launch bounds
THREADS = 256  # plan_entries and scatter blocks
VERIFY_THREADS = 256  # kVerifyThreads in verify.cu
WRITE_THREADS = 128  # kWriteThreads in write.cu
SCATTER_MAX_GROUP_ROWS = 32  # kScatterMaxGroupRows in scatter.cu
SCAN_ROWS_PER_LANE = 9  # kScanRowsPerLane in kernels/plan.cu: the most rows a lane sums in a pass of a long scan

TABLE_NARROW = 4  # kTableNarrow in kernels/plan.cu


class TableLayout(enum.IntEnum):
    """The table layouts the plan kernels are instantiated for (kTable in kernels/plan.cu): each
    table kind's general layout, of its :class:`~kvcanary_cupy.tables.TableKind` value, and the
    narrow layout (TABLE_NARROW added) of a block or page table with int32 ids, a power-of-two
    page size and rows of at most 2**31 - 1 tokens, which ``configs.table_layout`` picks."""

    REQ_TO_TOKEN = TableKind.REQ_TO_TOKEN
    VIRTUAL_PAGES = TableKind.VIRTUAL_PAGES
    BLOCK = TableKind.BLOCK
    PAGED_KV = TableKind.PAGED_KV
    BLOCK_NARROW = TableKind.BLOCK | TABLE_NARROW
    PAGED_KV_NARROW = TableKind.PAGED_KV | TABLE_NARROW


def plan_verify_one_block(layout: int, has_lut: bool, has_pool: bool, check_token: bool, real_kv: bool) -> bool:
    """Whether plan_verify's variant is bounded to one block per SM (kPlanVerifyBlocks in
    step.cu): the wide block table with every option on needs more than 64 registers a thread."""
    return layout == TableLayout.BLOCK and has_lut and has_pool and check_token and real_kv


# ----------------------------------------------------------------------------------------------
# cuda.h: what an overlapped launch hands cuLaunchKernelEx.

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)


class CuLaunchAttribute(ctypes.Structure):
    """cuda.h's ``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value union (of which
    this attribute reads the first int)."""

    _fields_ = [("id", ctypes.c_uint), ("_pad", ctypes.c_ubyte * 4), ("value", ctypes.c_int), ("_rest", ctypes.c_ubyte * 60)]


class CuLaunchConfig(ctypes.Structure):
    """cuda.h's ``CUlaunchConfig`` (ctypes pads ``hStream`` to its 8-byte alignment, as C does)."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CuLaunchAttribute)), ("numAttrs", ctypes.c_uint)]

