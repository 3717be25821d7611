"""The buffers a canary step reads and writes: plans, violation log, real-KV sources, canary buffer.

Every class here is a frozen record of arrays of one framework (NumPy, CuPy or PyTorch).  Each
has an ``allocate`` that creates it once, at fixed addresses, in the framework and on the device
of ``like`` (NumPy when ``like`` is None), so a whole canary step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from .constants import (
    CANARY_FIELDS_PER_SLOT,
    DEFAULT_RING_CAPACITY,
    MAX_REAL_KV_SOURCES,
    NUM_LAUNCH_TAGS,
    VIOLATION_FIELDS,
)
from .errors import fail, public_api
from .interop import allocate, placement_of, refuse_during_capture
from .validation import check_int, require

INT32_MAX = 2**31 - 1


def check_count(value, name: str, *, positive: bool = False, maximum: int = INT32_MAX) -> int:
    """A non-negative (or ``positive``) Python int (bools refused), or an error naming ``name``."""
    value = check_int(value, name)
    if value < int(positive):
        fail(ValueError, f"{name} must be {'positive' if positive else 'non-negative'}, got {value}")
    if value > maximum:
        fail(ValueError, f"{name} must be at most {maximum}, got {value}")
    return value


def _refuse_allocation_during_capture(like, owner: str) -> None:
    if like is not None:
        refuse_during_capture(placement_of(like, "like"), f"{owner} allocates new arrays",
                              f"call {owner} before capturing and reuse what it returns")


class _ArrayRecord:
    """Shared helpers of the frozen array records below."""

    def arrays(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class PlanField(NamedTuple):
    """One array of a plan record: its name (the record's attribute, the kernel struct's member),
    dtype, length and the value ``allocate`` fills it with."""

    name: str
    dtype: type
    per_request: int | None  # length = capacity + this; None: a one-element device counter
    fill: int | None  # None: left uninitialised

    def length(self, capacity: int) -> int:
        return 1 if self.per_request is None else capacity + self.per_request

    def length_name(self, capacity_name: str) -> str | None:
        if self.per_request is None:
            return None
        return capacity_name + (f" + {self.per_request}" if self.per_request else "")


# The one table of the plan's fields: the records, their allocation, the front door's checks, the
# backends' argument records and the kernels' PlanOutputs struct all derive from it.
VERIFY_PLAN_FIELDS = (
    PlanField("verify_slot_indices", np.int64, 0, None),
    PlanField("verify_expected_tokens", np.int64, 0, None),  # -1 = no token check
    PlanField("verify_expected_positions", np.int64, 0, None),
    PlanField("verify_prev_slot_indices", np.int64, 0, None),
    PlanField("verify_num_valid", np.int32, None, 0),
    PlanField("enable", np.int32, None, 1),
    PlanField("out_of_range_count", np.int64, None, 0),
)
WRITE_PLAN_FIELDS = (
    PlanField("write_offsets", np.int64, 1, 0),
    PlanField("write_seed_slot_indices", np.int64, 0, -1),  # -1 = chain starts at the anchor
    PlanField("write_num_valid_reqs", np.int32, None, 0),
    PlanField("verify_offsets", np.int64, 1, 0),
)


def _plan_record(spec: tuple, capacity_field: str, capacity_name: str):
    """Makes a frozen dataclass whose fields are ``spec``'s, in order, with ``allocate`` and
    ``capacity`` (the length of ``capacity_field``)."""

    def wrap(cls):
        cls.__annotations__ = {f.name: Any for f in spec}
        cls.FIELDS, cls.CAPACITY_FIELD, cls.CAPACITY_NAME = spec, capacity_field, capacity_name
        return dataclass(frozen=True)(cls)

    return wrap


class _PlanRecord(_ArrayRecord):
    FIELDS: tuple
    CAPACITY_FIELD: str
    CAPACITY_NAME: str

    @property
    def capacity(self) -> int:
        return int(getattr(self, self.CAPACITY_FIELD).shape[0])

    @classmethod
    def _allocate(cls, capacity: int, like):
        cap = check_count(capacity, f"{cls.__name__} {cls.CAPACITY_NAME}")
        _refuse_allocation_during_capture(like, f"{cls.__name__}.allocate")
        record = cls(**{f.name: allocate((f.length(cap),), f.dtype, like=like, fill=f.fill) for f in cls.FIELDS})
        mark_clean(record)
        return record


def mark_clean(record) -> None:
    """Remember that ``record`` holds -1 / 0 past its write_num_valid_reqs (as allocated or planned),
    so the next plan into it need only clear the rows its previous batch used."""
    record.__dict__["_kvcanary_clean"] = True


def is_clean(record) -> bool:
    return record.__dict__.get("_kvcanary_clean", False)


# A WritePlan allocated here carries a scan state: int64 [3 * SCAN_STATE_TILES], zeroed, in which
# the blocks of one large-batch plan launch exchange their shares' totals (ScanState in
# kernels/plan.cu, whose kScanStateTiles this mirrors).  It is not a field of the plan (no
# engine's format has it): a WritePlan built from an engine's own arrays has none, and its large
# batches plan without it (each block then reads every row before its share itself).
SCAN_STATE_TILES = 1024


def scan_state(record):
    """The scan state of a WritePlan, or None."""
    return record.__dict__.get("_kvcanary_scan_state")


@_plan_record(VERIFY_PLAN_FIELDS, "verify_slot_indices", "verify_capacity")
class VerifyPlan(_PlanRecord):
    """A flat list of self-contained verify entries (docs/format.md §4).

    ``verify_prev_slot_indices``: -1 = chain head (anchor), 0 = predecessor unknown (chain check
    skipped), else the slot whose record hashes to this entry's prev_hash.  Entries past
    ``verify_num_valid`` are unspecified; ``enable == 0`` (overflow) skips the whole verify.
    ``out_of_range_count`` counts the out-of-range plan inputs that were skipped or clamped
    (README, "Out-of-range values"); it only ever grows.  Fields: :data:`VERIFY_PLAN_FIELDS`.
    """

    @classmethod
    @public_api
    def allocate(cls, verify_capacity: int, *, like=None) -> "VerifyPlan":
        return cls._allocate(verify_capacity, like)


@_plan_record(WRITE_PLAN_FIELDS, "write_seed_slot_indices", "write_req_capacity")
class WritePlan(_PlanRecord):
    """Per-request metadata of a write (docs/format.md §4) plus the per-request verify offsets.

    Request r writes flat tokens ``[write_offsets[r], write_offsets[r+1])`` of
    ``input_ids/positions/out_cache_loc`` and owns verify entries
    ``[verify_offsets[r], verify_offsets[r+1])``.  After a plan of ``bs`` requests,
    ``write_seed_slot_indices[r] == -1`` and ``write_offsets[r+1] == verify_offsets[r+1] == 0``
    for every ``r >= bs``.  Fields: :data:`WRITE_PLAN_FIELDS`.
    """

    @classmethod
    @public_api
    def allocate(cls, write_req_capacity: int, *, like=None) -> "WritePlan":
        record = cls._allocate(write_req_capacity, like)
        record.__dict__["_kvcanary_scan_state"] = allocate((3 * SCAN_STATE_TILES,), np.int64, like=like, fill=0)
        return record


@dataclass(frozen=True)
class ViolationLog(_ArrayRecord):
    """The device-side violation ring and the per-launch-kind counters (docs/format.md §5).

    ``ring`` is fill-once: row k holds the violation that drew ticket k.  Tickets are drawn from
    ``write_index`` only while the ring has room, so ``write_index`` ends at
    ``min(violations since the last reset, capacity)`` and never wraps or goes negative.
    ``violation_counters[kernel_kind]`` counts every violation exactly (64-bit), the dropped ones
    included.  Each launch adds 1 to ``kernel_run_counters[kernel_kind]``, the entries it scanned
    or wrote to ``slot_run_counters[kernel_kind]`` and the out-of-range items it skipped to
    ``out_of_range_counters[kernel_kind]``.
    """

    ring: Any  # [capacity, 8] int64
    write_index: Any  # [1] int32, tickets drawn (at most capacity)
    violation_counters: Any  # [num_kinds] int64, every violation
    slot_run_counters: Any  # [num_kinds] int64
    kernel_run_counters: Any  # [num_kinds] int64
    out_of_range_counters: Any  # [num_kinds] int64

    @property
    def capacity(self) -> int:
        return int(self.ring.shape[0])

    @property
    def num_kinds(self) -> int:
        return int(self.kernel_run_counters.shape[0])

    @classmethod
    @public_api
    def allocate(cls, ring_capacity: int = DEFAULT_RING_CAPACITY, num_kinds: int = NUM_LAUNCH_TAGS, *, like=None) -> "ViolationLog":
        ring_capacity = check_count(ring_capacity, "ViolationLog ring_capacity", positive=True)
        num_kinds = check_count(num_kinds, "ViolationLog num_kinds", positive=True)
        _refuse_allocation_during_capture(like, "ViolationLog.allocate")
        return cls(
            ring=allocate((ring_capacity, VIOLATION_FIELDS), np.int64, like=like, fill=0),
            write_index=allocate((1,), np.int32, like=like, fill=0),
            violation_counters=allocate((num_kinds,), np.int64, like=like, fill=0),
            slot_run_counters=allocate((num_kinds,), np.int64, like=like, fill=0),
            kernel_run_counters=allocate((num_kinds,), np.int64, like=like, fill=0),
            out_of_range_counters=allocate((num_kinds,), np.int64, like=like, fill=0),
        )

    def reset(self) -> None:
        """Zero the ring, the write index and every counter (in place, addresses unchanged)."""
        for arr in self.arrays().values():
            arr[...] = 0

    def read(self):
        """Copy the log to the host and decode it (a host sync): see :class:`ViolationReport`."""
        from .reporting import ViolationReport

        return ViolationReport.from_log(self)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class RealKvSource:
    """A view of one live KV pool whose bytes are fingerprinted into ``real_kv_hash``.

    For canary slot ``s`` the bytes ``[(s % page_size) * num_bytes_per_token, ... + read_bytes)``
    of row ``s // page_size`` of ``tensor`` (viewed as bytes, one row per dim-0 index) are read.
    ``tensor`` is kept as given, never copied; any dtype works (bfloat16 and fp8 pools too).
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    @public_api
    def __post_init__(self):
        require(self.tensor, "RealKvSource.tensor")
        p, n, r = self.page_size, self.num_bytes_per_token, self.read_bytes
        if not _is_int(p) or p < 1:
            fail(ValueError, f"RealKvSource.page_size must be >= 1, got {p}")
        if not _is_int(n) or n <= 0 or n % 16:
            fail(ValueError, f"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {n}")
        for name, value in (("page_size", p), ("num_bytes_per_token", n)):
            if value > INT32_MAX:
                fail(ValueError, f"RealKvSource.{name} must be at most {INT32_MAX} (the kernels take it as int32), got {value}")
        if not _is_int(r) or r <= 0 or r % 16 or r > n:
            fail(ValueError, f"RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token={n}], got {r}")
        shape = tuple(self.tensor.shape)
        if len(shape) < 2:
            fail(ValueError, f"RealKvSource.tensor must be at least 2-D, got shape {shape}")
        itemsize = _itemsize(self.tensor)
        row_stride = _strides(self.tensor)[0] * itemsize
        if row_stride % 16:
            fail(
                ValueError,
                f"RealKvSource.tensor row stride must be a multiple of 16 bytes, got {row_stride} bytes "
                f"(shape={shape}, strides={_strides(self.tensor)}, dtype={self.tensor.dtype})",
            )
        row_bytes = int(np.prod(shape[1:])) * itemsize
        if row_bytes < p * n:
            fail(
                ValueError,
                f"RealKvSource row is too narrow for its slot layout: dim-1 is {row_bytes} bytes but "
                f"page_size={p} x num_bytes_per_token={n} needs {p * n}",
            )

    @property
    def num_rows(self) -> int:
        return int(self.tensor.shape[0])


def _itemsize(t) -> int:
    return t.element_size() if hasattr(t, "element_size") else t.dtype.itemsize


def _strides(t) -> tuple:
    """Strides in elements, for NumPy/CuPy arrays (bytes natively) and torch tensors."""
    if hasattr(t, "element_size"):
        return tuple(t.stride())
    return tuple(s // t.dtype.itemsize for s in t.strides)


@public_api
def allocate_canary_buffer(num_slots: int, *, like=None):
    """A zeroed canonical canary buffer ``int64 [num_slots, 4]`` (slot 0 is the padding slot)."""
    num_slots = check_count(num_slots, "num_slots", maximum=2**62)
    _refuse_allocation_during_capture(like, "allocate_canary_buffer")
    return allocate((num_slots, CANARY_FIELDS_PER_SLOT), np.int64, like=like, fill=0)


def check_num_sources(sources) -> tuple:
    sources = tuple(sources)
    if len(sources) > MAX_REAL_KV_SOURCES:
        fail(ValueError, f"real_kv_sources must hold at most {MAX_REAL_KV_SOURCES} RealKvSource entries (the CUDA ABI's limit), got {len(sources)}")
    for i, s in enumerate(sources):
        if not isinstance(s, RealKvSource):
            fail(TypeError, f"real_kv_sources[{i}] must be a RealKvSource, got {type(s).__name__}")
    return sources
