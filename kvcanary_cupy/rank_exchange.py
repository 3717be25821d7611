"""How a :class:`~kvcanary_cupy.distributed.RankReducer` moves its rows: every rank fills its own
row of a ``[world_size, width]`` int64 buffer, the others stay zero, and a SUM all-reduce gives
every rank every row.  :class:`HostExchange` for gloo (a CPU tensor), :class:`DeviceExchange` for
NCCL (on the session's GPU, on a side stream).

Two halves, for the two threads of a reduction:

- ``prepare(offset, slots)``, on the step's thread: the little that must happen there, in the
  step's order (the replicated window's snapshot, NCCL's ordering event);
- ``run(slots)``, on the reducer's worker thread (kvcanary_cupy/rank_worker.py), after the
  reducer wrote this rank's numbers into ``staging[:host_width]``: the collective itself, waited
  for there; returns the reduced rows (valid until the next ``run``).

The reducer runs one reduction at a time (it reads a result before it prepares the next one), so
``staging`` and the snapshot are free when ``prepare`` writes them.
"""

from __future__ import annotations

import numpy as np


def all_reduce_fn(dist, group, tensor):
    """A function starting the in-place SUM all-reduce of ``tensor`` over ``group`` and returning
    its work: the group's own method with options made once (a third of ``dist.all_reduce``'s
    host time, which checks its arguments at every call), or ``dist.all_reduce`` where a torch
    build lacks it."""
    method = getattr(group, "allreduce", None)
    options = getattr(dist, "AllreduceOptions", None)
    if method is None or options is None:
        return lambda: dist.all_reduce(tensor, group=group, async_op=True)
    opts, tensors = options(), [tensor]
    opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True  # as dist.all_reduce(..., async_op=True) sets it
    return lambda: method(tensors, opts)


class HostExchange:
    """gloo: the rows are a CPU tensor reduced in place; ``staging`` holds this rank's row."""

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, host_width: int, column):
        self.buffer = torch.zeros((rows, width), dtype=torch.int64)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self.rows = self.buffer.numpy()
        self._own = self.rows[rank]
        self.staging = np.zeros(width, np.int64)
        self._h = host_width
        self._column = column  # the TAIL canary's real_kv_hash column (NumPy view), or None

    def prepare(self, offset: int, slots: int) -> None:
        if slots:  # the canary as this step left it: the next step writes it on this thread
            self.staging[self._h : self._h + slots] = self._column[offset : offset + slots]

    def run(self, slots: int) -> np.ndarray:
        self.rows.fill(0)
        n = self._h + slots
        self._own[:n] = self.staging[:n]
        self._all_reduce().wait()
        return self.rows


class DeviceExchange:
    """NCCL: the rows live on the session's GPU.

    ``prepare`` (step's thread) copies the replicated window of the TAIL canary into a snapshot
    buffer on the step's stream (so the next step's TAIL write comes after it, with no event) and
    records an event there; a CUDA runtime call each, no torch.  ``run`` (worker thread) makes
    the side stream wait for that event, zeroes the rows, copies this rank's numbers in from
    pinned ``staging`` and the snapshot, runs the all-reduce (``work.wait()`` makes the side
    stream wait for NCCL's), copies the result to pinned memory, and waits for it.
    """

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, host_width: int, column, device: int,
                 launch_stream):
        from .interop import import_cupy

        self._torch, self._cupy = torch, import_cupy()
        self._device = torch.device("cuda", device)
        self.buffer = torch.zeros((rows, width), dtype=torch.int64, device=self._device)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self._host_out = torch.zeros((rows, width), dtype=torch.int64, pin_memory=True)
        self.rows = self._host_out.numpy()
        self._host_in = torch.zeros(host_width, dtype=torch.int64, pin_memory=True)
        self.staging = self._host_in.numpy()
        self._own_head, self._own_tail = self.buffer[rank, :host_width], self.buffer[rank, host_width:]
        self._snapshot = torch.zeros(max(width - host_width, 1), dtype=torch.int64, device=self._device)
        self._snapshot_ptr = self._snapshot.data_ptr()
        if column is not None:
            self._column_ptr, self._column_pitch = column.data_ptr(), column.stride(0) * column.element_size()
        self._side = torch.cuda.Stream(device=self._device)
        self._done = torch.cuda.Event()
        self._cupy_device = self._cupy.cuda.Device(device)
        with self._cupy_device:  # an event records on streams of its own device only
            self._ordered = self._cupy.cuda.Event(block=False, disable_timing=True)  # the step's work so far
        self._launch_stream = launch_stream

    def setup_thread(self) -> None:
        """On the worker thread, before its first job: the session's device is its current one."""
        self._torch.cuda.set_device(self._device)
        self._cupy.cuda.Device(self._device.index).use()

    def prepare(self, offset: int, slots: int) -> None:
        runtime, stream = self._cupy.cuda.runtime, self._launch_stream().ptr
        with self._cupy_device:
            if slots:
                runtime.memcpy2DAsync(self._snapshot_ptr, 8, self._column_ptr + offset * self._column_pitch,
                                      self._column_pitch, 8, slots, runtime.memcpyDeviceToDevice, stream)
            runtime.eventRecord(self._ordered.ptr, stream)

    def run(self, slots: int) -> np.ndarray:
        torch = self._torch
        self._cupy.cuda.runtime.streamWaitEvent(self._side.cuda_stream, self._ordered.ptr, 0)
        with torch.cuda.stream(self._side):
            self.buffer.zero_()
            self._own_head.copy_(self._host_in, non_blocking=True)
            if slots:
                self._own_tail[:slots].copy_(self._snapshot[:slots])
            self._all_reduce().wait()  # NCCL's stream waits for the side stream's copies, the side stream for NCCL's
            self._host_out.copy_(self.buffer, non_blocking=True)
            self._done.record(self._side)
        self._done.synchronize()
        return self.rows
