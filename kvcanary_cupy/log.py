"""The violation log: the device-side ring of violation rows and the per-launch-kind counters that
write and verify append to (docs/format.md section 5); :meth:`ViolationLog.read` decodes it on the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .constants import DEFAULT_RING_CAPACITY, NUM_LAUNCH_TAGS, VIOLATION_FIELDS
from .errors import public_api
from .interop import Array, allocate, placement_of
from .records import ArrayRecord, refuse_allocation_during_capture
from .validation import check_count

if TYPE_CHECKING:
    from .reporting import ViolationReport


@dataclass(frozen=True)
class ViolationLog(ArrayRecord):
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
        refuse_allocation_during_capture(like, "ViolationLog.allocate")
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


