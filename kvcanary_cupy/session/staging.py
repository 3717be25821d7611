"""A session's staging transport: the fixed ring of staged records and how a step's log reaches the host.

``end_step`` stages the step's log on the device (one block copies the counters and the new ring
rows into a record, resets the ring and lists the verify entries that read a violating slot), copies
the record to pinned host memory on a side stream behind an event, and handles every earlier record
whose copy has completed: no host sync, unless every record of the ring is in flight.
"""

from __future__ import annotations

import numpy as np

from ..args import VERIFY_INPUT_FIELDS, LogViews, StageArgs, StageLayout
from ..errors import fail
from ..interop import allocate, backend_view, import_cupy
from ..planner import CanaryPlanner
from ..runtime import launch_stream_getter, stream_is_capturing
from ..validation import I64

#: Staged records a session allocates up front (each on the device and in pinned host memory on a
#: GPU): the host may run this many stagings (steps and sweeps) ahead of the device; a staging
#: past that waits for the oldest copy (counted in ``stats["staging_waits"]``).
STAGED_RECORDS = 8


class _Record:
    """One staged record: ``host`` (what the session reads; pinned memory on a GPU) and ``head``,
    its header and counters as one view; ``target``, what the staging writes (the host record
    itself on the CPU, a device record on a GPU) and ``staging``, how the stager takes it (the
    array, or the device address); the ``event`` of its copy; and, while in flight, the ``origin``
    ("step" or "sweep"), ``step`` (0-based; a sweep: of the last step ended before it),
    ``stamp`` and ``labels`` (the engine's row labels, or None) of the staging."""

    __slots__ = ("host", "head", "target", "staging", "host_ptr", "event", "origin", "step", "stamp", "labels")

    def __init__(self, host, layout: StageLayout, target, staging, event=None):
        self.host, self.head, self.target, self.staging, self.event = host, host[: layout.ring], target, staging, event
        self.host_ptr = host.ctypes.data
        self.origin, self.step, self.stamp, self.labels = None, -1, 0, None


class _HostTransport:
    """NumPy sessions: the staging writes the host record; it has landed when it returns."""

    def new_record(self, layout: StageLayout) -> _Record:
        host = np.zeros(layout.size, np.int64)
        return _Record(host, layout, host, host)

    def launch_stream(self):
        return None

    def capturing(self, stream) -> bool:
        return False

    def stage(self, stager, record: _Record, stamp: int, stream) -> None:
        stager(stamp, None, record.staging)

    def done(self, record: _Record) -> bool:
        return True

    def wait(self, record: _Record) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CudaTransport:
    """GPU sessions: the staging kernels write a record's device memory on the step's stream; an
    event orders the side stream behind them, which copies it to the record's pinned host memory
    and records the copy's event.  A record is staged again only after the host has handled it
    (its copy event completed), so no staging waits on the device for an earlier copy."""

    def __init__(self, placement, like, layout: StageLayout):
        self._cupy = cupy = import_cupy()
        import cupyx

        self._empty_pinned = cupyx.empty_pinned
        self._like = like
        self._device = placement.device
        self._get_device = cupy.cuda.runtime.getDevice
        self._memcpy, self._d2h = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpyDeviceToHost
        self._nbytes = layout.size * I64.itemsize
        self.launch_stream = launch_stream_getter(placement)
        with cupy.cuda.Device(self._device):
            self._side = cupy.cuda.Stream(non_blocking=True)
            self._staged = cupy.cuda.Event(disable_timing=True)

    def new_record(self, layout: StageLayout) -> _Record:
        with self._cupy.cuda.Device(self._device):
            target = allocate((layout.size,), np.int64, like=self._like, fill=0)
            address = backend_view(target, "staging", writable=True).data.ptr
            return _Record(self._empty_pinned((layout.size,), np.int64), layout, target, address,
                           self._cupy.cuda.Event(disable_timing=True))

    def capturing(self, stream) -> bool:
        return stream_is_capturing(stream)

    def stage(self, stager, record: _Record, stamp: int, stream) -> None:
        if self._get_device() == self._device:
            self._stage(stager, record, stamp, stream)
        else:
            with self._cupy.cuda.Device(self._device):
                self._stage(stager, record, stamp, stream)

    def _stage(self, stager, record: _Record, stamp: int, stream) -> None:
        stager(stamp, stream, record.staging)
        side, staged = self._side, self._staged
        staged.record(stream)
        side.wait_event(staged)
        self._memcpy(record.host_ptr, record.staging, self._nbytes, self._d2h, side.ptr)
        record.event.record(side)

    def done(self, record: _Record) -> bool:
        return record.event.done

    def wait(self, record: _Record) -> None:
        record.event.synchronize()

    def synchronize(self) -> None:
        self._side.synchronize()


class StagingMixin:
    """The staging half of :class:`~kvcanary_cupy.session.CanarySession`: records go from free to
    pending when their staging is queued and back to free once handled (``_decode``/``_commit``
    of :class:`~kvcanary_cupy.session.violations.ViolationsMixin`), so no record is restaged before
    the host has read it."""

    def _launch_stream(self, what: str):
        """The stream the session stages on (None on the CPU), refusing one that captures a CUDA graph."""
        transport = self._transport
        stream = transport.launch_stream()
        if transport.capturing(stream):
            fail(RuntimeError, f"{what}() must run outside CUDA graph capture (it stages copies and reads host "
                               "memory); capture only pre_forward() and post_forward()")
        return stream

    @property
    def overlap_head_write(self) -> bool:
        """Whether the HEAD write runs on the session's side stream (GPU sessions built with
        ``overlap_head_write=True``); fixed at construction."""
        return self._head_write_stream is not None

    def _join_head_write(self) -> None:
        """The step's stream waits for the HEAD write queued on the side stream (when one is)."""
        if self._head_write_unjoined:
            self._head_write.join()
            self._head_write_unjoined = False

    def _stager(self, planner: CanaryPlanner):
        """The backend's staging of the log against ``planner``'s plan, its arguments viewed once."""
        view = lambda x, name: backend_view(x, name, writable=True)
        vp, wp = planner.verify_plan, planner.write_plan
        args = StageArgs(
            log=LogViews(**{k: view(v, f"log.{k}") for k, v in self.log.arrays().items()}),
            **{k: view(getattr(vp, k), k) for k in VERIFY_INPUT_FIELDS},
            plan_out_of_range_count=view(vp.out_of_range_count, "out_of_range_count"),
            verify_offsets=view(wp.verify_offsets, "verify_offsets"),
            write_num_valid_reqs=view(wp.write_num_valid_reqs, "write_num_valid_reqs"),
            marks=view(self._marks, "marks"),
            staging=view(self._records[0].target, "staging"),  # each staging names its record
            layout=self._layout,
        )
        return self._backend.prepare_stage(args)

    def _stage(self, origin: str, step: int, stager, stream, labels=None) -> None:
        """Stage into a free record; it joins the pending ones only once its staging was queued, so
        an exception (an interrupt) on the way leaves it free and the log to the next staging."""
        if not self._free:  # every record is in flight: the host ran STAGED_RECORDS stagings ahead of the device
            self._stats["staging_waits"] += 1
            self._transport.wait(self._pending[0])
            self._handle_oldest()  # its results reach the policy with this end_step's (or the next one's)
        record = self._free[-1]
        self._stamp += 1  # a stamp is never reused, even by a staging that failed
        record.origin, record.step, record.stamp, record.labels = origin, step, self._stamp, labels
        self._transport.stage(stager, record, self._stamp, stream)
        with self._lock:
            self._pending.append(self._free.pop())

    def _drain(self, before) -> None:
        """Handle, oldest first, the staged records stamped before ``before`` (None: all) whose copy has landed."""
        pending, done = self._pending, self._transport.done
        while pending and (before is None or pending[0].stamp < before) and done(pending[0]):
            self._handle_oldest()

    def _handle_oldest(self) -> None:
        """Handle the oldest staged record (its copy has landed) and free it.  Decoding changes
        nothing; an exception there leaves the record pending, handled whole by the next call."""
        record = self._pending[0]
        decoded = self._decode(record)
        with self._lock:
            self._commit(record, *decoded)
            self._free.append(self._pending.popleft())
        self._warn_after(record.origin)

