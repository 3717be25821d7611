"""The buffers a canary step reads and writes: plans, real-KV sources, canary buffer.

Every class here is a frozen record of arrays of one framework (NumPy, CuPy or PyTorch).  Each
has an ``allocate`` that creates it once, at fixed addresses, in the framework and on the device
of ``like`` (NumPy when ``like`` is None), so a whole canary step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .constants import CANARY_FIELDS_PER_SLOT
from .errors import public_api
from .interop import Array, allocate, placement_of, to_numpy
from .runtime import is_capturing
from .validation import check_count
from .log import ViolationLog  # noqa: F401  (it lived here before log.py)
from .records import ArrayRecord, refuse_allocation_during_capture
from .sources import RealKvSource, check_num_sources  # noqa: F401  (they lived here before sources.py)




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


class _PlanRecord(ArrayRecord):
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
        refuse_allocation_during_capture(like, f"{cls.__name__}.allocate")
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
    refuse_allocation_during_capture(like, "allocate_canary_buffer")
    return allocate((num_slots, CANARY_FIELDS_PER_SLOT), np.int64, like=like, fill=0)
