"""How a :class:`~kvcanary_cupy.distributed.RankReducer` moves its rows: every rank fills its own
row of a ``[world_size, width]`` int64 buffer, the others stay zero, and an asynchronous SUM
all-reduce gives every rank every row.  :class:`HostExchange` for gloo (a CPU tensor),
:class:`DeviceExchange` for NCCL (on the session's GPU, on a side stream, never blocking the host).
Both: ``start(host_values, offset, slots)``, ``ready()``, ``finish()`` (the rows, valid until the
next start).
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
    """gloo: the rows are a CPU tensor, reduced in place on gloo's thread."""

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, column):
        self.buffer = torch.zeros((rows, width), dtype=torch.int64)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self.rows = self.buffer.numpy()
        self._own = self.rows[rank]
        self._column = column  # the TAIL canary's real_kv_hash column (NumPy view), or None
        self._work = None

    def start(self, host_values: np.ndarray, offset: int, slots: int) -> None:
        self.rows.fill(0)
        own, h = self._own, len(host_values)
        own[:h] = host_values
        if slots:
            own[h : h + slots] = self._column[offset : offset + slots]
        self._work = self._all_reduce()

    def ready(self) -> bool:
        return self._work.is_completed()

    def finish(self) -> np.ndarray:
        """The reduced rows (valid until the next start)."""
        self._work.wait()
        self._work = None
        return self.rows


class DeviceExchange:
    """NCCL: the rows live on the session's GPU; a side stream, ordered after the step's stream by
    an event, zeroes them, copies this rank's totals from pinned memory and its fingerprints from
    the TAIL canary (the step's stream then waits for that copy only), runs the all-reduce
    (``work.wait()`` there makes the side stream, not the host, wait for NCCL's), copies the
    result to pinned memory and records an event."""

    def __init__(self, torch, dist, group, rank: int, rows: int, width: int, column, device: int, launch_stream):
        self._torch, self._rank = torch, rank
        self._device = torch.device("cuda", device)
        self.buffer = torch.zeros((rows, width), dtype=torch.int64, device=self._device)
        self._all_reduce = all_reduce_fn(dist, group, self.buffer)
        self._host_in = None
        self._host_out = torch.zeros((rows, width), dtype=torch.int64, pin_memory=True)
        self.rows = self._host_out.numpy()
        self._column = column  # torch view of the TAIL canary's real_kv_hash column, or None
        self._side = torch.cuda.Stream(device=self._device)
        self._done = torch.cuda.Event()
        self._snapshot = torch.cuda.Event()
        self._launch_stream = launch_stream
        self._external = {}  # CuPy stream pointer -> torch.cuda.ExternalStream

    def _step_stream(self):
        ptr = self._launch_stream().ptr
        if ptr == 0:  # CuPy's null stream is the legacy default stream, torch's default stream
            return self._torch.cuda.default_stream(self._device)
        stream = self._external.get(ptr)
        if stream is None:
            stream = self._external[ptr] = self._torch.cuda.ExternalStream(ptr, device=self._device)
        return stream

    def start(self, host_values: np.ndarray, offset: int, slots: int) -> None:
        torch = self._torch
        h = len(host_values)
        if self._host_in is None:  # the views made once: each costs the host a microsecond or two
            self._host_in = torch.zeros(h, dtype=torch.int64, pin_memory=True)
            self._host_in_np = self._host_in.numpy()
            self._own, self._own_head = self.buffer[self._rank], self.buffer[self._rank, :h]
        self._host_in_np[:] = host_values  # its previous copy has completed: finish() came first
        step_stream = self._step_stream()
        self._side.wait_stream(step_stream)
        with torch.cuda.stream(self._side):
            self.buffer.zero_()
            self._own_head.copy_(self._host_in, non_blocking=True)
            if slots:
                self._own[h : h + slots].copy_(self._column[offset : offset + slots])
                # the next step's TAIL write waits for the snapshot (not for the all-reduce), so that
                # every rank compares the canary as this step left it
                self._snapshot.record(self._side)
                step_stream.wait_event(self._snapshot)
            work = self._all_reduce()  # NCCL's stream waits for the side stream's copies
            work.wait()
            self._host_out.copy_(self.buffer, non_blocking=True)
            self._done.record(self._side)

    def ready(self) -> bool:
        return self._done.query()

    def finish(self) -> np.ndarray:
        """The reduced rows (valid until the next start)."""
        self._done.synchronize()
        return self.rows
