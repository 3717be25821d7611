"""The records a backend takes: validated, normalised views of one call's arguments.

The front door (:mod:`kvcanary_cupy.ops`) checks every argument, turns each array into a NumPy
or CuPy view of the caller's memory and hands one of these records to the backend picked by the
arrays' device (:func:`kvcanary_cupy.backends.get_backend`).  They sit below the user records
(:mod:`kvcanary_cupy.tables` builds a :class:`TableView`), so nothing here imports a backend.

Views have the dtypes and shapes the records name; 1-D arrays are contiguous; the 2-D tables
(``req_to_token``, ``block_table``, ``expected_token_pool``) have a unit inner stride and any row stride;
each target's ``canary`` is an ``int64 [num_slots, fields_per_row]`` C-contiguous view
(fields_per_row >= 4), and the targets of one write or verify have the same num_slots.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from .plans import VERIFY_PLAN_FIELDS, WRITE_PLAN_FIELDS


# One view per field of VerifyPlan then WritePlan, named as the fields (plans.py holds the table).
PlanOutputs = NamedTuple("PlanOutputs", [(f.name, Any) for f in VERIFY_PLAN_FIELDS + WRITE_PLAN_FIELDS])
# The VerifyPlan's per-entry arrays (the rest are its counters).
VERIFY_ENTRY_FIELDS = tuple(f.name for f in VERIFY_PLAN_FIELDS if f.per_request == 0)
# The VerifyPlan's arrays a verify (and a staging) reads: all but the plan's own out-of-range counter.
VERIFY_INPUT_FIELDS = tuple(f.name for f in VERIFY_PLAN_FIELDS if f.name != "out_of_range_count")


class TableView(NamedTuple):
    """A validated engine table (kvcanary_cupy.tables) as views."""

    kind: int  # tables.TableKind
    entries: Any  # req_to_token [R, L] int32 / block_table [R, W] (unit inner stride), or kv_indices [nnz]
    kv_indptr: Optional[Any]  # [bs+1], PAGED_KV only
    virtual_to_physical: Optional[Any]  # [M] int64, VIRTUAL_PAGES only
    page_size: int  # tokens per block / page; 1 for a plain req_to_token
    null_block: int  # BLOCK: the id that addresses the padding slot 0
    pool_rows: int  # expected-token pool rows the plan may index
    pool_rows_why: str  # "<where pool_rows comes from>=<n> rows (why)", for messages
    row_tokens: int  # bounds every row's length in tokens (the width, or kv_indices' length, x page_size)


class PlanArgs(NamedTuple):
    req_pool_indices: Optional[Any]  # [bs] int64; None with a PAGED_KV table (rows are batch rows)
    prefix_lens: Any  # [bs] int64
    extend_seq_lens: Any  # [bs] int64
    table: TableView
    swa_window_size: int  # 0 = FULL group
    swa_lut: Optional[Any]  # [lut_len > 0] int64 or None
    expected_token_pool: Optional[Any]  # [PR >= table.pool_rows, PC] int32 or None
    expected_token_valid_lens: Optional[Any]  # [bs] int64, given iff the pool is
    token_offset: int  # kv_token_id_vs_position_offset
    clear_whole_capacity: bool  # out's WritePlan is not known to be clean past write_num_valid_reqs
    out: PlanOutputs
    scan_state: Optional[Any] = None  # out's WritePlan's scan state (plans.scan_state), if it has one


class LogViews(NamedTuple):
    ring: Any  # [ring_cap, 8] int64
    write_index: Any  # [1] int32
    violation_counters: Any  # [K] int64
    slot_run_counters: Any  # [K] int64
    kernel_run_counters: Any  # [K] int64
    out_of_range_counters: Any  # [K] int64


class SourceView(NamedTuple):
    """One real-KV source as bytes: ``data`` is ``uint8 [rows, row_bytes]`` with any row stride.

    A slot's stream of bytes starts ``byte_offset + (s % page_size) * token_stride`` bytes into
    row ``s // page_size``; it is pieces of ``piece_bytes`` bytes at the ``levels``' strides
    (two ``(count, stride)`` pairs, outer first; a contiguous source has one piece).  ``unit``:
    16 for a contiguous source read 16 bytes at a time, else the bytes of each load (1 to 8)."""

    data: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    token_stride: int | None = None  # None: num_bytes_per_token
    byte_offset: int = 0
    piece_bytes: int | None = None  # None: num_bytes_per_token
    levels: tuple = ((1, 0), (1, 0))
    unit: int = 16
    slot_offset: int = 0  # canary slot s reads pool slot s - slot_offset (none below it)

    @property
    def stride(self) -> int:
        return self.num_bytes_per_token if self.token_stride is None else self.token_stride

    def stream_offsets(self, nbytes: int):
        """Byte offsets, from a slot's first byte, of the first ``nbytes`` bytes of its stream."""
        b = np.arange(nbytes, dtype=np.int64)
        piece, within = np.divmod(b, self.piece_bytes or self.num_bytes_per_token)
        (_, s0), (n1, s1) = self.levels
        i0, i1 = np.divmod(piece, n1)
        return i0 * s0 + i1 * s1 + within


class SourceViews(tuple):
    """The :class:`SourceView` tuple of a canary buffer, as :func:`~kvcanary_cupy.binding.source_views`
    makes it: a tuple that the NumPy backend may keep derived views of the same arrays on (``words``),
    so a bound launcher's sources are viewed once, and live no longer than the views they hold."""


class CanaryTarget(NamedTuple):
    """One canary buffer of a write or verify launch, the kind its rows and counters go to, and
    its real-KV sources (several buffers of one launch share the plan and have equal num_slots)."""

    canary: Any  # [N, F] int64
    kernel_kind: int
    sources: tuple  # of SourceView; empty when the mode is NONE


class WriteArgs(NamedTuple):
    targets: tuple  # of CanaryTarget, 1 to MAX_CANARY_BUFFERS
    write_offsets: Any  # [wcap+1] int64
    write_seed_slot_indices: Any  # [wcap] int64
    write_num_valid_reqs: Any  # [1] int32
    input_ids: Any  # [T] int64
    positions: Any  # [T] int64
    out_cache_loc: Any  # [T] int64
    expected_input_tokens: Optional[Any]  # [T] int64 or None (input assert off)
    expected_input_positions: Optional[Any]  # [T] int64 or None
    chain_position_assert: Any  # bool, or [1] int32 array (non-zero = on)
    write_waves: Optional[Any]  # [wcap] int32: each request's write wave, or None (every request is written)
    wave: int  # with write_waves: the wave this launch writes (its other requests are skipped, as if absent)
    real_kv_hash_mode: int
    log: LogViews


# targets: tuple of CanaryTarget, 1 to MAX_CANARY_BUFFERS; then one view per VERIFY_INPUT_FIELDS
# (dtype and length as plans.VERIFY_PLAN_FIELDS gives them); then the verify's options and the log.
# check_holes: an entry whose slot is the padding slot logs a hole row (FailReason.VERIFY_TABLE_HOLE).
VerifyArgs = NamedTuple("VerifyArgs", [("targets", tuple), *((k, Any) for k in VERIFY_INPUT_FIELDS),
                                       ("check_expected_token", bool), ("check_holes", bool), ("real_kv_hash_mode", int),
                                       ("log", LogViews)])


class PlanVerifyArgs(NamedTuple):
    """A plan and a verify of its entries in one step (the fused decode step): the verify entries
    are checked as they are planned and never stored.  ``verify`` has one target; its entry arrays
    are None and its ``verify_num_valid`` and ``enable`` are ``plan.out``'s.  ``plan.out``'s four
    entry arrays are not touched, except by a GPU batch past one plan launch, which takes plan +
    verify through them (the front door then checks that they hold ``verify_capacity`` entries)."""

    plan: PlanArgs
    verify: VerifyArgs
    verify_capacity: int  # the plan's: more entries than this skip the verify (enable = 0)


class MoveArgs(NamedTuple):
    canary: Any  # [N, F] int64, C-contiguous
    src_pages: Any  # [n] int32 or int64, contiguous
    dst_pages: Any  # [n], same dtype as src_pages
    page_size: int
    workspace: Optional[Any]  # int64, contiguous, >= n * page_size * F elements (GPU staging), or None
    out_of_range_count: Optional[Any]  # [1] int64 or None


class CopyArgs(NamedTuple):
    src_canary: Any  # [Ns, F] int64, C-contiguous
    dst_canary: Any  # [Nd, F] int64, C-contiguous (may be src_canary itself)
    src_pages: Any  # [n] int32 or int64, contiguous
    dst_pages: Any  # [n], same dtype as src_pages
    page_size: int
    workspace: Optional[Any]  # int64, contiguous, >= n * page_size * F elements (GPU staging), or None
    out_of_range_count: Optional[Any]  # [1] int64 or None


class ScatterArgs(NamedTuple):
    flat_in: Any  # [N] int64
    offsets: Any  # [bs+1] int64
    req_pool_indices: Any  # [bs] int64
    pool_out: Any  # [R, C] int32, unit inner stride
    out_of_range_count: Optional[Any]  # [1] int64 or None


# Session staging (CanarySession.end_step).  One int64 record holds a snapshot of the violation
# log taken at the end of a step, the step's plan scalars and the verify entries that read a
# violating slot; its layout is :class:`StageLayout` (mirrored by kernels/session.cu).
STAGE_HEADER = ("rows", "stamp", "matches", "enable", "verify_num_valid", "batch_size", "plan_out_of_range")
STAGE_HEADER_FIELDS = 8  # the header above, padded
ATTRIBUTION = ("slot", "batch_row", "entry", "expected_position", "prev_slot", "expected_token")
MAX_STAGE_RINGS = 8  # kMaxStageRings in kernels/session.cu


def stage_rings(log) -> tuple:
    """``(rings, rows per ring)`` of a staged log: ``write_index`` holds one ticket counter per ring,
    and the ring their equal shares, share g at rows ``[g * rows, (g + 1) * rows)``."""
    rings, capacity = int(log.write_index.shape[0]), int(log.ring.shape[0])
    if not 1 <= rings <= MAX_STAGE_RINGS or capacity % rings:
        raise ValueError(f"kv-canary: a staged log needs 1..{MAX_STAGE_RINGS} write indices, each owning an equal "
                         f"share of the ring; got {rings} for {capacity} rows")
    return rings, capacity // rings


class StageLayout(NamedTuple):
    """Offsets (in int64) of the parts of one staged record."""

    num_kinds: int
    ring_capacity: int
    attribution_capacity: int

    @property
    def counters(self) -> int:  # violation, slot-run, kernel-run, out-of-range counters: [4, num_kinds]
        return STAGE_HEADER_FIELDS

    @property
    def ring(self) -> int:  # the ring rows read this step: [ring_capacity, 8]
        return self.counters + 4 * self.num_kinds

    @property
    def attribution(self) -> int:  # [attribution_capacity, len(ATTRIBUTION)]
        return self.ring + self.ring_capacity * 8

    @property
    def size(self) -> int:
        return self.attribution + self.attribution_capacity * len(ATTRIBUTION)


StageArgs = NamedTuple("StageArgs", [
    ("log", LogViews),
    *((k, Any) for k in VERIFY_INPUT_FIELDS),  # the VerifyPlan's, as in VerifyArgs
    ("plan_out_of_range_count", Any),  # [1] int64: the VerifyPlan's out_of_range_count
    ("verify_offsets", Any),  # [wcap+1] int64
    ("write_num_valid_reqs", Any),  # [1] int32
    ("marks", Any),  # [num_slots] int64: the stamp of the last staging whose ring named the slot
    ("staging", Any),  # [layout.size] int64
    ("layout", StageLayout),
])
StageArgs.__doc__ = "What one staging reads and writes: the log, one plan and the session's marks and record."
