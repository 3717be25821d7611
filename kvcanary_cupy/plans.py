"""The buffers a canary step reads and writes: plans, violation log, real-KV sources, canary buffer.

Every class here is a frozen record of arrays of one framework (NumPy, CuPy or PyTorch).  Each
has an ``allocate`` that creates it once, at fixed addresses, in the framework and on the device
of ``like`` (NumPy when ``like`` is None), so a whole canary step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .constants import (
    CANARY_FIELDS_PER_SLOT,
    DEFAULT_RING_CAPACITY,
    MAX_REAL_KV_SOURCES,
    NUM_LAUNCH_TAGS,
    VIOLATION_FIELDS,
)
from .errors import fail, public_api
from .interop import Array, allocate, placement_of, to_numpy
from .runtime import is_capturing, refuse_during_capture
from .validation import INT32_MAX, _is_int, check_count, check_int, require

if TYPE_CHECKING:
    from .reporting import ViolationReport


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
        return dataclass(frozen=True, repr=False)(cls)  # _PlanRecord.__repr__: no uninitialised entries

    return wrap


class _PlanRecord(_ArrayRecord):
    FIELDS: tuple
    CAPACITY_FIELD: str
    CAPACITY_NAME: str

    @property
    def capacity(self) -> int:
        return int(getattr(self, self.CAPACITY_FIELD).shape[0])

    def __repr__(self) -> str:
        """Capacity, framework and the one-element counters; never the entries (those past the
        valid count are unspecified, uninitialised memory in a fresh plan)."""
        try:
            where = placement_of(getattr(self, self.CAPACITY_FIELD), self.CAPACITY_NAME)
            head = f"<{type(self).__name__} {self.CAPACITY_NAME}={self.capacity} on {where.describe()}"
        except (TypeError, ValueError, AttributeError, IndexError):
            return f"<{type(self).__name__} (not a record of arrays)>"
        if is_capturing(where):  # reading a counter would synchronise the capturing stream
            return head + ": counters not read (the stream is capturing a CUDA graph)>"
        counters = [f.name for f in self.FIELDS if f.per_request is None]
        values = {name: int(to_numpy(getattr(self, name)).reshape(-1)[0]) for name in counters}
        text = ", ".join(f"{k}={v}" for k, v in values.items())
        if not values.get("verify_num_valid", values.get("write_num_valid_reqs", 1)):
            text += " (nothing planned: no valid entries)"
        return f"{head}: {text}>"

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
    """A flat list of self-contained verify entries (docs/format.md section 4).

    :func:`plan` fills it; :func:`verify` reads it.  Build one with :meth:`allocate` (or take a
    :class:`CanaryPlanner`'s); the constructor takes an engine's own arrays as they are.

    Attributes
    ----------
    verify_slot_indices : int64 array [verify_capacity]
        The slot each entry verifies.
    verify_expected_tokens : int64 array [verify_capacity]
        The token the slot must hold; -1 = no token check.
    verify_expected_positions : int64 array [verify_capacity]
        The position the slot must hold.
    verify_prev_slot_indices : int64 array [verify_capacity]
        -1 = chain head (the anchor), 0 = predecessor unknown (chain check skipped), else the
        slot whose record hashes to this entry's prev_hash.
    verify_num_valid : int32 array [1]
        How many entries the last plan wrote; entries past it are unspecified.
    enable : int32 array [1]
        0 when the last plan overflowed ``verify_capacity``: the whole verify is skipped.
    out_of_range_count : int64 array [1]
        Out-of-range plan inputs skipped or clamped; it only ever grows.

    The fields and their order are :data:`VERIFY_PLAN_FIELDS`.  ``capacity`` is
    ``verify_capacity``.
    """

    @classmethod
    @public_api
    def allocate(cls, verify_capacity: int, *, like: Array | None = None) -> "VerifyPlan":
        """A new plan of ``verify_capacity`` entries, at fixed addresses.

        Parameters
        ----------
        verify_capacity : int
            Entries it holds, ``>= 0`` (0 for :func:`plan_and_verify`, which stores none).
        like : array, optional
            Allocate in this array's framework and on its device; None: NumPy.

        Returns
        -------
        VerifyPlan
            ``verify_num_valid`` = 0, ``enable`` = 1, ``out_of_range_count`` = 0; the entry
            arrays are left uninitialised.

        Raises
        ------
        ValueError
            A negative capacity, or ``like`` on a stream capturing a CUDA graph.

        Examples
        --------
        >>> kc.VerifyPlan.allocate(8)
        <VerifyPlan verify_capacity=8 on numpy: verify_num_valid=0, enable=1, out_of_range_count=0 (nothing planned: no valid entries)>
        """
        return cls._allocate(verify_capacity, like)


@_plan_record(WRITE_PLAN_FIELDS, "write_seed_slot_indices", "write_req_capacity")
class WritePlan(_PlanRecord):
    """Per-request metadata of a write (docs/format.md section 4) plus the per-request verify offsets.

    :func:`plan` fills it; :func:`write` reads it.  After a plan of ``bs`` requests,
    ``write_seed_slot_indices[r] == -1`` and ``write_offsets[r+1] == verify_offsets[r+1] == 0``
    for every ``r >= bs`` (nothing stale).

    Attributes
    ----------
    write_offsets : int64 array [write_req_capacity + 1]
        Request r writes flat tokens ``[write_offsets[r], write_offsets[r+1])`` of
        ``input_ids`` / ``positions`` / ``out_cache_loc``.
    write_seed_slot_indices : int64 array [write_req_capacity]
        The slot its chain continues from (its last prefix token); -1 = the chain anchor.
    write_num_valid_reqs : int32 array [1]
        The batch size of the last plan.
    verify_offsets : int64 array [write_req_capacity + 1]
        Request r owns verify entries ``[verify_offsets[r], verify_offsets[r+1])``.

    The fields and their order are :data:`WRITE_PLAN_FIELDS`.  ``capacity`` is
    ``write_req_capacity``.  A plan clears only the rows its previous batch used: if you write
    into a WritePlan yourself, keep -1 / 0 past its ``write_num_valid_reqs``.
    """

    @classmethod
    @public_api
    def allocate(cls, write_req_capacity: int, *, like: Array | None = None) -> "WritePlan":
        """A new write plan for batches of up to ``write_req_capacity`` requests.

        Parameters
        ----------
        write_req_capacity : int
            The batch limit, ``>= 0``.
        like : array, optional
            Allocate in this array's framework and on its device; None: NumPy.

        Returns
        -------
        WritePlan
            Offsets 0, seeds -1, ``write_num_valid_reqs`` = 0 (and a zeroed scan state the GPU
            plan of a large batch uses).

        Raises
        ------
        ValueError
            A negative capacity, or ``like`` on a stream capturing a CUDA graph.

        Examples
        --------
        >>> kc.WritePlan.allocate(4)
        <WritePlan write_req_capacity=4 on numpy: write_num_valid_reqs=0 (nothing planned: no valid entries)>
        """
        record = cls._allocate(write_req_capacity, like)
        record.__dict__["_kvcanary_scan_state"] = allocate((3 * SCAN_STATE_TILES,), np.int64, like=like, fill=0)
        return record

    def verify_entries_needed(self) -> int:
        """The verify entries the last plan into this record asked for (``verify_offsets[bs]``; a host
        read, so a sync on a GPU).  More than its VerifyPlan's ``verify_capacity`` means that plan
        overflowed: ``enable == 0`` and its verify was skipped; size ``verify_capacity`` to this."""
        bs = int(to_numpy(self.write_num_valid_reqs)[0])
        return int(to_numpy(self.verify_offsets[bs : bs + 1])[0])


@dataclass(frozen=True)
class ViolationLog(_ArrayRecord):
    """The device-side violation ring and the per-launch-kind counters (docs/format.md section 5).

    Build one with :meth:`allocate`; :func:`write` and :func:`verify` append to it and
    :meth:`read` decodes it on the host.

    Attributes
    ----------
    ring : int64 array [ring_capacity, 8]
        Fill-once: row k holds the violation that drew ticket k (the columns are
        :class:`Violation`'s first eight fields).
    write_index : int32 array [1]
        Tickets drawn, only while the ring has room: it ends at ``min(violations since the last
        reset, capacity)`` and never wraps or goes negative.
    violation_counters : int64 array [num_kinds]
        Every violation per ``kernel_kind``, exactly, the ones the full ring dropped included.
    slot_run_counters : int64 array [num_kinds]
        Entries each launch scanned or tokens it wrote.
    kernel_run_counters : int64 array [num_kinds]
        +1 per launch.
    out_of_range_counters : int64 array [num_kinds]
        Out-of-range items each launch skipped.
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

    def __repr__(self) -> str:
        try:
            where = placement_of(self.ring, "ring").describe()
            return f"<ViolationLog ring_capacity={self.capacity} num_kinds={self.num_kinds} on {where}>"
        except (TypeError, ValueError, AttributeError, IndexError):
            return "<ViolationLog (not a record of arrays)>"

    @property
    def num_kinds(self) -> int:
        return int(self.kernel_run_counters.shape[0])

    @classmethod
    @public_api
    def allocate(cls, ring_capacity: int = DEFAULT_RING_CAPACITY, num_kinds: int = NUM_LAUNCH_TAGS, *,
                 like: Array | None = None) -> "ViolationLog":
        """A zeroed log.

        Parameters
        ----------
        ring_capacity : int
            Ring rows, ``>= 1``: the violations kept between resets (later ones are counted only).
        num_kinds : int
            Counter entries, ``>= 1``: one per launch kind (``NUM_LAUNCH_TAGS`` = 12 tags).
        like : array, optional
            Allocate in this array's framework and on its device; None: NumPy.

        Returns
        -------
        ViolationLog

        Raises
        ------
        ValueError
            ``ring_capacity`` or ``num_kinds`` below 1, or ``like`` on a capturing stream.

        Examples
        --------
        >>> kc.ViolationLog.allocate(16)
        <ViolationLog ring_capacity=16 num_kinds=12 on numpy>
        """
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
        """Zero the ring, the write index and every counter (in place, addresses unchanged).

        Runs on the arrays' framework and device (queued on the current stream for device arrays).
        """
        for arr in self.arrays().values():
            arr[...] = 0

    def read(self) -> "ViolationReport":
        """Copy the log to the host and decode it (a host sync; not capture-safe).

        Returns
        -------
        ViolationReport
            One :class:`Violation` per ring row taken, in ring order, and the exact counters.

        Examples
        --------
        >>> kc.ViolationLog.allocate(16).read().total_violations
        0
        """
        from .reporting import ViolationReport

        return ViolationReport.from_log(self)


@dataclass(frozen=True)
class RealKvSource:
    """A view of one live KV pool whose bytes are fingerprinted into ``real_kv_hash``.

    For canary slot ``s`` the bytes ``[(s % page_size) * num_bytes_per_token, ... + read_bytes)``
    of row ``s // page_size`` of ``tensor`` (viewed as bytes, one row per dim-0 index) are read
    (16 of them under ``RealKvHashMode.PARTIAL``) and folded as :func:`real_kv_fold` does.

    Parameters
    ----------
    tensor : array, at least 2-D
        The KV pool, kept as given, never copied; any dtype (bfloat16 and fp8 pools too).  Its
        row stride must be a multiple of 16 bytes and a row must hold ``page_size *
        num_bytes_per_token`` bytes; its rows must cover every canary slot (``rows * page_size
        >= num_slots``, checked at call time).
    page_size : int
        Slots per row, ``>= 1``.
    num_bytes_per_token : int
        Bytes of one slot within a row, a positive multiple of 16.
    read_bytes : int
        Bytes read per slot under ``ALL``: a positive multiple of 16, at most
        ``num_bytes_per_token``.
    slot_offset : int
        ``>= 0``: canary slot ``s`` fingerprints pool slot ``s - slot_offset`` (above, read as
        ``s``), so an engine whose slot 0 is a real slot can keep the canary's padding slot 0
        apart: give the canary ``slot_offset`` more slots and add it to the slots its tables
        and ``out_cache_loc`` name.  Canary slots below it have no KV bytes in this source (its
        strip folds as zero).  The rows must then cover ``num_slots - slot_offset`` slots.

    Raises
    ------
    ValueError
        Any of the rules above broken; the message names the field.

    Examples
    --------
    >>> k_pool = np.zeros((64, 8, 128), np.float16)  # [slots, heads, head_dim]: 2048 bytes a slot
    >>> src = kc.RealKvSource(k_pool, page_size=1, num_bytes_per_token=2048, read_bytes=256)
    >>> src.num_rows
    64
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    slot_offset: int = 0

    @public_api
    def __post_init__(self):
        require(self.tensor, "RealKvSource.tensor")
        p, n, r = self.page_size, self.num_bytes_per_token, self.read_bytes
        if not _is_int(self.slot_offset) or not 0 <= self.slot_offset < 2**62:
            fail(ValueError, f"RealKvSource.slot_offset must be an int in [0, 2**62), got {self.slot_offset!r}")
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
def allocate_canary_buffer(num_slots: int, *, like: Array | None = None) -> Array:
    """A zeroed canonical canary buffer ``int64 [num_slots, 4]`` (slot 0 is the padding slot).

    Row ``s`` is the record ``(token, position, prev_hash, real_kv_hash)`` of KV slot ``s``.

    Parameters
    ----------
    num_slots : int
        Rows, ``>= 0``: the KV pool's slot count (slot 0 included).
    like : array, optional
        Allocate in this array's framework and on its device; None: NumPy.

    Returns
    -------
    array
        int64 ``[num_slots, 4]``, zeroed, contiguous.

    Raises
    ------
    ValueError
        A negative ``num_slots``, or ``like`` on a stream capturing a CUDA graph.

    Examples
    --------
    >>> kc.allocate_canary_buffer(4).shape
    (4, 4)
    """
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
