"""Coverage past the 32-byte record: every layer's KV bytes, and KV stores that never happened.

Two optional checks of a :class:`~kvcanary_cupy.CanarySession` (docs/format.md section 9):

- **Deep fingerprints** (``deep_kv_sources``): any number of :class:`RealKvSource` (typically K
  and V of every layer) are folded, every byte, into field 4 of the TAIL buffer's rows (the buffer
  is then ``int64 [num_slots, 6]``; the first 32 bytes stay SGLang's record) for each slot a step
  writes; each step re-fingerprints ``deep_check_slots`` slots in rotation and logs
  ``VERIFY_DEEP_KV_MISMATCH`` for one whose bytes changed, so a flip in any layer of a written slot
  is caught within :attr:`KvCoverage.deep_check_period` steps.
- **Lost stores** (``check_lost_stores``): before the forward, each write slot's per-source hashes
  are taken; after it, a slot some source of which did not change, whose previous record differs
  from the one this step writes, logs ``WRITE_KV_NOT_STORED`` (the bytes are a former owner's).

Both run inside :meth:`~kvcanary_cupy.CanarySession.pre_forward` / ``post_forward``: they allocate
nothing and read nothing back, so they can be captured in a CUDA graph with the step.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from .constants import RealKvHashMode, REAL_KV_PARTIAL_BYTES
from .errors import fail
from .interop import Array, allocate, backend_view, import_cupy, to_numpy
from .binding import CanaryBuffer, log_views, source_views
from .bound import BoundState, full_validation_forced
from .plans import allocate_canary_buffer
from .runtime import launch_stream, refuse_view_copy_during_capture
from .sources import RealKvSource
from .validation import check_count

#: Fields of a coverage TAIL record: SGLang's four, the deep fingerprint, one reserved (rows stay 16-byte aligned).
COVERAGE_FIELDS = 6
DEEP_FIELD = 4
#: int64 fields per source in the device table (kSourceFields in kernels/coverage.cu).
SOURCE_FIELDS = 12
#: Slots a step re-fingerprints in rotation when deep sources are given and no count is.
DEFAULT_DEEP_CHECK_SLOTS = 256


class CoverageSources(NamedTuple):
    """Sources checked against ``num_slots`` once: ``views`` (``(SourceView, nbytes)`` pairs, for the
    NumPy backend) and ``table`` (``int64 [n, SOURCE_FIELDS]`` on the device, for the kernels)."""

    views: tuple
    table: object  # None on the NumPy backend
    count: int
    bytes_per_slot: int  # bytes each slot's fold reads


def pack_sources(sources: Sequence[RealKvSource], mode: int, num_slots: int, *, like, backend: str,
                 name: str) -> CoverageSources:
    """The views and device table of ``sources`` (folding ``mode``'s bytes: 16 under PARTIAL)."""
    sources = tuple(sources)
    for i, s in enumerate(sources):
        if not isinstance(s, RealKvSource):
            fail(TypeError, f"{name}[{i}] must be a RealKvSource, got {type(s).__name__}")
    views = source_views(CanaryBuffer("the TAIL buffer", name, None, 0, sources), mode, num_slots)
    pairs = tuple((v, REAL_KV_PARTIAL_BYTES if mode == RealKvHashMode.PARTIAL else v.read_bytes) for v in views)
    table = None
    if backend != "numpy":
        from .backends.cuda.coverage import source_table

        host = np.zeros((len(pairs), SOURCE_FIELDS), np.int64)
        for j, (v, nbytes) in enumerate(pairs):
            (_, s0), (inner, s1) = v.levels
            host[j] = (v.data.data.ptr, v.data.strides[0], v.stride, v.byte_offset, s0, s1, inner, v.page_size,
                       nbytes, v.piece_bytes or v.num_bytes_per_token, v.unit, v.slot_offset)
        table = source_table(host, like, name)  # once, at construction
    return CoverageSources(pairs, table, len(pairs), sum(nbytes for _, nbytes in pairs))


class _BoundKernel(BoundState):
    """One coverage kernel's parameter record, packed when the session binds: its loaded kernel and
    the setter of its per-step fields (the write's slots and their counts; None for deep_check)."""

    __slots__ = ("kernel", "set_step")


class _GpuLaunches:
    """A session's coverage kernels on the GPU, each record packed once from the session's own
    buffers (the source tables, both canary buffers, the snapshot, the cursor, the TAIL log) and
    launched as the bound launchers launch (``BoundState.launch``: on the step's stream, torch's
    current one for tensors, overlapped where the device allows).  Per step only the slots' address
    and count, and the grid they size, change."""

    def __init__(self, cov: KvCoverage):
        impl, placement = cov._impl, cov._placement
        self.snapshot = self.check = self.deep_write = self.deep_check = None
        self._grid, self._block = impl.grid, (impl.COVERAGE_THREADS,)
        with launch_stream(placement):
            cap = self.cap = impl.grid_cap(placement.device)
            lost, deep, num_slots = cov.lost, cov.deep, cov._tail.shape[0]
            if lost is not None:
                self.snapshot = self._bind(placement, impl.lost_snapshot_launch(lost.table, lost.count, None, num_slots,
                                                                                cov._pre, cap), "slots", "num_tokens")
                self.check = self._bind(placement, impl.lost_check_launch(
                    lost.table, lost.count, None, cov.max_step_tokens, cov._pre, cov._head, cov._tail, cov._log, cov._kind,
                    cap), "slots", "num_tokens", "unchecked")
            if deep is not None:
                self.deep_write = self._bind(placement, impl.deep_write_launch(deep.table, deep.count, None, cov._tail, cap),
                                             "slots", "num_tokens")
            if cov.deep_check_slots:
                self.deep_check = self._bind(placement, impl.deep_check_launch(
                    deep.table, deep.count, cov._tail, cov._state, cov.deep_check_slots, cov._log, cov._kind, cap))
        self.arrays = next(b for b in (self.snapshot, self.deep_write, self.deep_check) if b is not None).arrays

    @staticmethod
    def _bind(placement, launch, *step_fields) -> _BoundKernel:
        b = _BoundKernel(placement, {})  # binds no caller's array: the session's buffers never move
        b.pack(launch.params)
        b.kernel = b.function(launch.family, launch.name)
        b.set_step = b.setter(*step_fields) if step_fields else None
        return b

    def __call__(self, b: _BoundKernel, fields, items: int, per_block: int) -> None:
        if fields is not None:
            b.set_step(fields)
        b.launch(b.kernel, (self._grid(items, per_block, self.cap),), self._block)


class KvCoverage:
    """The coverage checks of one session, bound to its buffers (built by CanarySession).

    ``deep`` and ``lost`` are the packed sources of each check (None: off); ``tail`` / ``head``
    the session's canary buffers; ``log`` the TAIL group's log views; ``kind`` the TAIL tag.
    On the GPU each kernel's parameters are packed here, once (:class:`_GpuLaunches`); a step
    passes only ``out_cache_loc``, taken unchecked in the bound launchers' common case (a
    contiguous int64 array of the session's framework and device), else checked as a view.
    """

    def __init__(self, *, placement, head, tail, log_views, kind: int, like, deep: CoverageSources | None,
                 deep_check_slots: int, lost: CoverageSources | None, max_step_tokens: int):
        self._placement = placement  # the session's: where and on which framework's stream its launches go
        self._cu = placement.backend != "numpy"
        if self._cu:
            from .backends.cuda import coverage as impl
        else:
            from .backends import numpy_coverage as impl
        self._impl = impl
        self._head = backend_view(head, "head_canary", writable=True)
        self._tail = backend_view(tail, "tail_canary", writable=True)
        self._log, self._kind = log_views, kind
        self.deep, self.lost = deep, lost
        num_slots = self._tail.shape[0]
        self.deep_check_slots = min(deep_check_slots, num_slots - 1) if deep is not None else 0
        self._state = None
        if deep is not None:
            self._state = backend_view(allocate((2,), np.int64, like=like, fill=0), "deep cursor", writable=True)
        self.max_step_tokens = max_step_tokens
        self._pre = None
        if lost is not None:
            self._pre = backend_view(allocate((max(max_step_tokens, 1) * lost.count,), np.int64, like=like, fill=0),
                                     "lost-store snapshot", writable=True)
        self._gpu = _GpuLaunches(self) if self._cu and (deep is not None or lost is not None) else None
        self._full = full_validation_forced()  # every step's out_cache_loc checked as a view

    @property
    def deep_check_period(self) -> int:
        """Steps within which every slot is re-fingerprinted once: ``ceil((num_slots - 1) / deep_check_slots)``."""
        ring = self._tail.shape[0] - 1
        return -(-ring // self.deep_check_slots) if self.deep_check_slots else 0

    def forget(self, slots) -> None:
        """Clear the deep fingerprints of ``slots`` (ints in ``[0, num_slots)``): KV the engine no
        longer holds (blocks freed after a detection), which the rotation would otherwise keep
        reporting until the slots are written again.  A host check of ``slots``; not for capture."""
        host = np.asarray(to_numpy(slots) if hasattr(slots, "shape") else slots, np.int64).reshape(-1)
        bad = host[(host < 0) | (host >= self._tail.shape[0])]
        if bad.size:
            fail(ValueError, f"forget slots must be in [0, num_slots={self._tail.shape[0]}), got {int(bad[0])}")
        if self.deep is None or host.size == 0:
            return
        with self._on_step_stream():  # ordered with the session's launches on torch's stream too
            self._tail[import_cupy().asarray(host) if self._cu else host, DEEP_FIELD] = 0

    def _on_step_stream(self):
        """Every launch on the step's stream (torch's current one for tensors): in a torch capture a
        launch on CuPy's own stream would run at capture time, outside the graph."""
        return launch_stream(self._placement)

    def _slots(self, out_cache_loc: Array, limit: int | None = None):
        view = backend_view(out_cache_loc, "out_cache_loc")  # inside the caller's launch_stream: capture-safe DLPack
        if not view.flags.c_contiguous:  # the kernels read slots[i]
            fail(ValueError, f"out_cache_loc must be contiguous for the coverage checks, got strides {tuple(view.strides)}")
        return view if limit is None or view.shape[0] <= limit else view[:limit]

    def _gpu_slots(self, out_cache_loc: Array) -> tuple:
        """``((address, length), keep)`` of ``out_cache_loc`` for the GPU kernels, which read int64
        slots: the common case unchecked; else the checked view, an int32 one widened into a copy
        (``keep``, alive until launched: CuPy's pool reuses its memory only behind the launch on
        this stream), which a capture refuses (the graph would keep reading freed memory)."""
        found = None if self._full else self._gpu.arrays.leading(out_cache_loc)
        if found is not None:
            return found, None
        with self._on_step_stream():
            view = self._slots(out_cache_loc)
            if view.dtype != np.int64:
                refuse_view_copy_during_capture(view, f"the coverage checks widen an {view.dtype} out_cache_loc to int64",
                                                "pass out_cache_loc as int64")
                view = view.astype(np.int64)
        return (view.data.ptr, view.shape[0]), view

    def _src(self, sources: CoverageSources) -> tuple:
        return (sources.views,)  # the NumPy backend's: the GPU's tables are packed in _GpuLaunches

    def before_forward(self, out_cache_loc: Array) -> None:
        """Snapshot the write slots' per-source hashes (lost-store check)."""
        if self.lost is None:
            return
        if self._gpu is not None:
            (slots, total), _keep = self._gpu_slots(out_cache_loc)
            n = min(total, self.max_step_tokens)
            if n:
                self._gpu(self._gpu.snapshot, (slots, n), n * self.lost.count, self._impl.COVERAGE_THREADS)
            return
        slots = self._slots(out_cache_loc, self.max_step_tokens)
        self._impl.lost_snapshot(*self._src(self.lost), slots, self._tail.shape[0], self._pre)

    def tail_write(self, write, step_inputs: tuple, join_head_write) -> None:
        """The session's TAIL write ``write(*step_inputs)`` with the checks around it: before it, the
        lost-store check (on the HEAD records this step wrote: ``join_head_write`` first); after
        it, the written slots' deep fingerprints and this step's share of the rotation."""
        out_cache_loc = step_inputs[2]
        if self._gpu is not None:
            self._gpu_tail_write(write, step_inputs, join_head_write)
            return
        if self.lost is not None:
            join_head_write()
            self._impl.lost_check(*self._src(self.lost), self._slots(out_cache_loc), self.max_step_tokens, self._pre,
                                  self._head, self._tail, self._log, self._kind)
        write(*step_inputs)
        if self.deep is not None:
            self._impl.deep_write(*self._src(self.deep), self._slots(out_cache_loc), self._tail)
        if self.deep_check_slots:  # 0 only for a pool of the padding slot alone
            self._impl.deep_check(*self._src(self.deep), self._tail, self._state, self.deep_check_slots, self._log,
                                  self._kind)

    def _gpu_tail_write(self, write, step_inputs: tuple, join_head_write) -> None:
        """:meth:`tail_write` through the packed launches, in the same order (a refused out_cache_loc
        raises where the unbound code raised: after the join, or after the TAIL write)."""
        gpu, warps = self._gpu, self._impl.WARPS
        found = None
        if self.lost is not None:
            join_head_write()
            found = self._gpu_slots(step_inputs[2])
            (slots, total), _keep = found
            if total:
                n = min(total, self.max_step_tokens)
                gpu(gpu.check, (slots, n, total - n), n, warps)
        write(*step_inputs)
        if self.deep is not None:
            (slots, total), _keep = found or self._gpu_slots(step_inputs[2])
            if total:
                gpu(gpu.deep_write, (slots, total), total, warps)
        if self.deep_check_slots:  # 0 only for a pool of the padding slot alone
            gpu(gpu.deep_check, None, self.deep_check_slots, warps)


def tail_buffer(num_slots: int, deep_kv_sources, like):
    """A session's TAIL buffer: ``int64 [num_slots, COVERAGE_FIELDS]`` with deep sources, else the record's 4 fields."""
    if tuple(deep_kv_sources):
        return allocate((num_slots, COVERAGE_FIELDS), np.int64, like=like, fill=0)
    return allocate_canary_buffer(num_slots, like=like)


def build(session, like, deep_kv_sources, deep_check_slots, check_lost_stores: bool, max_step_tokens,
          lost_kv_sources=()) -> KvCoverage:
    """The coverage checks of ``session`` (a CanarySession whose buffers and launchers exist), its options checked.

    Parameters
    ----------
    session, like
        The session and its ``like``.
    deep_kv_sources : sequence of RealKvSource
        Any number of sources (K and V of every layer) whose every byte is fingerprinted into
        field 4 of the TAIL buffer (then ``int64 [num_slots, 6]``) for each slot written, and
        re-fingerprinted in rotation (docs/format.md section 9).
    deep_check_slots : int, optional
        Slots re-fingerprinted per step, ``>= 1`` (default ``DEFAULT_DEEP_CHECK_SLOTS``): a flip in
        any layer is caught within :attr:`KvCoverage.deep_check_period` steps.
    check_lost_stores : bool
        Flag a write slot whose bytes the forward left unchanged (``WRITE_KV_NOT_STORED``), by the
        ``lost_kv_sources``, else the deep sources, else the real-KV sources; needs ``max_step_tokens``.
    max_step_tokens : int, optional
        The most tokens one step writes (the lost-store snapshot's size); more are not checked,
        counted in ``stats["out_of_range_skipped"]`` (the TAIL tag's out-of-range counter).
    lost_kv_sources : sequence of RealKvSource, optional
        The sources the lost-store check compares instead (any number; folded under the session's
        ``real_kv_hash_mode``, ``ALL`` when it is ``NONE``): leave out a source whose bytes do not
        depend on the token's position and prefix (a first layer's V is the same for the same
        token anywhere), where a legitimate store of the same token leaves identical bytes.

    Returns
    -------
    KvCoverage
        Its ``deep`` and ``lost`` are None for the checks that are off (both, by default).
    """
    num_slots, backend = session.num_slots, session._placement.backend
    real_kv_sources, real_kv_hash_mode = session.real_kv_sources, session.real_kv_hash_mode

    deep_kv_sources, lost_kv_sources = tuple(deep_kv_sources), tuple(lost_kv_sources)
    if not isinstance(check_lost_stores, (bool, np.bool_)):
        fail(TypeError, f"check_lost_stores must be a bool, got {type(check_lost_stores).__name__}")
    if deep_check_slots is not None and not deep_kv_sources:
        fail(ValueError, "deep_check_slots needs deep_kv_sources (the sources whose every byte is re-fingerprinted)")
    deep = None
    if deep_kv_sources:
        deep = pack_sources(deep_kv_sources, RealKvHashMode.ALL, num_slots, like=like, backend=backend,
                            name="deep_kv_sources")
        deep_check_slots = DEFAULT_DEEP_CHECK_SLOTS if deep_check_slots is None else check_count(
            deep_check_slots, "deep_check_slots", positive=True)
    if lost_kv_sources and not check_lost_stores:
        fail(ValueError, "lost_kv_sources needs check_lost_stores=True (they are the bytes the lost-store check compares)")
    lost = None
    if check_lost_stores:
        if max_step_tokens is None:
            fail(ValueError, "check_lost_stores=True needs max_step_tokens (the most tokens one step writes; the "
                             "snapshot of their slots is allocated once)")
        max_step_tokens = check_count(max_step_tokens, "max_step_tokens", positive=True)
        if lost_kv_sources:
            lost = pack_sources(lost_kv_sources, real_kv_hash_mode if real_kv_hash_mode != RealKvHashMode.NONE
                                else RealKvHashMode.ALL, num_slots, like=like, backend=backend, name="lost_kv_sources")
        elif deep is not None:
            lost = deep
        elif real_kv_sources and real_kv_hash_mode != RealKvHashMode.NONE:
            lost = pack_sources(real_kv_sources, real_kv_hash_mode, num_slots, like=like, backend=backend,
                                name="real_kv_sources")
        else:
            fail(ValueError, "check_lost_stores=True needs KV bytes to compare: deep_kv_sources, or real_kv_sources with "
                             "a real_kv_hash_mode other than NONE")
    return KvCoverage(placement=session._placement, head=session.head_canary, tail=session.tail_canary,
                      log_views=log_views(session._group_logs["tail"]), kind=session.tail_tag, like=like, deep=deep,
                      deep_check_slots=deep_check_slots or 0, lost=lost, max_step_tokens=max_step_tokens or 0)
