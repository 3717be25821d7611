"""CanarySession: the KV canary inside an engine's step loop.

Per step, an engine calls :meth:`CanarySession.pre_forward` before the model reads the KV cache
(plan, HEAD verify, HEAD write), :meth:`~CanarySession.post_forward` after it (TAIL verify and
write, with real-KV fingerprints) and :meth:`~CanarySession.end_step` outside any CUDA graph.
``end_step`` stages the step's log on the device (one block copies the counters and the new ring
rows into a record of a fixed ring, resets the ring and lists the verify entries that read a
violating slot), copies the record to pinned host memory on a side stream behind an event, and
handles every earlier record whose copy has completed: no host sync, unless every record of the
ring is in flight (the host ran ``STAGED_RECORDS`` stagings ahead of the device).  Violations are deduplicated by
``(kernel_kind, slot_idx, position, fail_reason_bits)`` and handed to the ``on_violation``
policy.  docs/guide.md ("Using the canary in an engine") explains every choice.
"""

from __future__ import annotations

import collections
import logging
import re
import sys
import threading
import warnings
from dataclasses import replace
from typing import Any

import numpy as np

from .args import ATTRIBUTION, STAGE_HEADER, STAGE_HEADER_FIELDS, VERIFY_INPUT_FIELDS, LogViews, StageArgs, StageLayout
from .backends import get_backend
from .constants import DEFAULT_RING_CAPACITY, CanaryLaunchTag, FailReason, RealKvHashMode
from .errors import (CanaryCoverageWarning, CanaryHealthError, CanaryUsageError, CanaryViolationError, fail, public_api,
                     trimmed_argument_error)
from .interop import Array, allocate, backend_view, import_cupy, placement_of, stream_is_capturing
from .launchers import VerifyLauncher, WriteLauncher, launch_stream_getter
from .planner import CanaryCapacities, CanaryCapacityWarning, CanaryPlanner
from .plans import ViolationLog, allocate_canary_buffer, check_num_sources
from .reporting import Reader, Violation, ViolationReport, reason_name, tag_name
from .validation import I64, INT32_MAX, check_count, check_int

logger = logging.getLogger("kvcanary_cupy")

#: ``verify_capacity`` defaults to this many times ``num_slots`` (``CanaryCapacities.from_engine``'s
#: headroom: radix sharing lets a batch's summed prefixes exceed the pool).
VERIFY_HEADROOM = 3
#: Distinct violations a session keeps.  When the table is full, a new key evicts the oldest one
#: (first seen longest ago): every new violation still reaches the policy and ``report()``; the
#: evicted keys and their rows are counted in ``stats`` (``evicted_violations``, ``untracked_rows``).
MAX_DISTINCT_VIOLATIONS = 65536
#: Under ``on_violation="log"``, this many new violations at once add a summary line.
LOG_SUMMARY_AT = 5
#: Staged records a session allocates up front (each on the device and in pinned host memory on a
#: GPU): the host may run this many stagings (steps and sweeps) ahead of the device; a staging
#: past that waits for the oldest copy (counted in ``stats["staging_waits"]``).
STAGED_RECORDS = 8
#: Reads of a violating slot one violation keeps (``Violation.readers``, the newest); older ones are
#: counted in its ``readers_dropped`` and in ``stats["dropped_readers"]``.
MAX_READERS = 128
#: The violations an error message lists (the rest are in its ``report``).
MESSAGE_MAX_LINES = 20
POLICIES = ("raise", "log", "ignore")
#: The launch groups that each own a share of ``ring_capacity`` rows of the session's ring (and a
#: ticket counter), so that one group's flood cannot starve another's rows.
RING_GROUPS = ("head", "tail", "sweep")

_TAGS = {  # (head, tail, sweep) launch tags of a FULL and of an SWA session
    False: (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.SWEEP_K_FULL),
    True: (CanaryLaunchTag.HEAD_K_SWA, CanaryLaunchTag.TAIL_K_SWA, CanaryLaunchTag.SWEEP_K_SWA),
}
_ATTRIBUTION = {name: i for i, name in enumerate(ATTRIBUTION)}
_ROWS, _MATCHES, _ENABLE, _NUM_VALID, _PLAN_OUT_OF_RANGE = (
    STAGE_HEADER.index(k) for k in ("rows", "matches", "enable", "verify_num_valid", "plan_out_of_range"))
_STEP_ORDER = "pre_forward(), post_forward(), end_step() per step"


def _warn(message: str, category) -> None:
    """Warn at the first frame outside this module (the engine's call of a session method)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called _warn
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class _Record:
    """One staged record: ``host`` (what the session reads; pinned memory on a GPU) and ``head``,
    its header and counters as one view; ``target``, what the staging writes (the host record
    itself on the CPU, a device record on a GPU) and ``staging``, how the stager takes it (the
    array, or the device address); the ``event`` of its copy; and, while in flight, the ``kind``
    ("step" or "sweep"), ``step`` (0-based; a sweep: of the last step ended before it),
    ``stamp`` and ``labels`` (the engine's row labels, or None) of the staging."""

    __slots__ = ("host", "head", "target", "staging", "host_ptr", "event", "kind", "step", "stamp", "labels")

    def __init__(self, host, layout: StageLayout, target, staging, event=None):
        self.host, self.head, self.target, self.staging, self.event = host, host[: layout.ring], target, staging, event
        self.host_ptr = host.ctypes.data
        self.kind, self.step, self.stamp, self.labels = None, -1, 0, None


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


def _one_of(alias, value, alias_name: str, name: str):
    """An argument given under either of its two spellings (both: only if they are the same array)."""
    if alias is None:
        return value
    if value is not None and value is not alias:
        fail(ValueError, f"{alias_name} and {name} are two spellings of one argument; pass one")
    return alias


def _length(x, name: str) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        fail(TypeError, f"{name} must be a NumPy array, a CuPy array or a PyTorch tensor, got {type(x).__name__}")
    if len(shape) != 1:
        fail(ValueError, f"{name} must be 1-D, got shape {tuple(shape)}")
    return int(shape[0])


class CanarySession:
    """The canary of one KV pool group inside an engine's step loop.

    ``num_slots`` canary slots (slot 0 is the padding slot) in a HEAD buffer (chain-only, checked
    and written before the forward) and a TAIL buffer (after it, with real-KV fingerprints).  Per
    step: :meth:`pre_forward`, the model's forward, :meth:`post_forward` (both capture-safe), then
    :meth:`end_step` outside any CUDA graph, which hands the violations of earlier steps to the
    ``on_violation`` policy without blocking.  :meth:`report` and :attr:`stats` say what was found.

    Parameters
    ----------
    num_slots : int
        Canary slots, ``>= 1``: the KV pool's slot count.
    max_batch_size : int
        The most requests one step may hold (``write_req_capacity`` of its plans).
    write_req_capacity : int, optional
        The same limit under :func:`plan`'s name; give either (both must agree).
    verify_capacity : int, optional
        The most verify entries (slots read) one step may plan; a step with more skips its
        verify, counted in ``stats["verify_skipped_steps"]`` and warned.  Default
        ``VERIFY_HEADROOM * num_slots``.
    like : array, optional
        NumPy (None), CuPy or torch, and the device of every buffer.
    ring_capacity : int
        Violation rows a step keeps per launch group (HEAD, TAIL, sweep: :data:`RING_GROUPS`),
        ``>= 1``; each group has its own share of ``log.ring``, so one group's flood cannot
        crowd out another's rows.  More in one step are counted (``stats["dropped_rows"]``),
        never lost from the totals.
    on_violation : {"raise", "log", "ignore"} or callable
        ``"raise"``: :class:`CanaryViolationError` from ``end_step`` / ``check``; ``"log"``: a
        WARNING per distinct violation to the ``"kvcanary_cupy"`` logger; ``"ignore"``: only
        recorded; a callable receives the :class:`ViolationReport` of the new violations.
    swa_window_size : int
        ``> 0`` makes it a sliding-window group (SWA launch tags; the LUT translates slots).
    full_to_swa_index_mapping : int64 array, optional
        The full -> SWA slot LUT, required with ``swa_window_size > 0``.
    kv_token_id_vs_position_offset : int
        As for :func:`plan`.
    real_kv_sources : sequence of RealKvSource
        The KV pools the TAIL buffer fingerprints (up to ``MAX_REAL_KV_SOURCES``).
    real_kv_hash_mode : RealKvHashMode
        ``NONE``, ``PARTIAL`` or ``ALL``, for the TAIL buffer.
    check_expected_tokens : bool
        Check stored tokens against the ``expected_tokens`` pool given to :meth:`pre_forward`
        (``check_expected_tokens`` of :func:`verify`).
    sweep_every : int
        With ``sweep_source``, run :meth:`sweep` from every ``sweep_every``-th ``end_step``
        (0: never).
    sweep_source : callable, optional
        Returns ``(req_pool_indices, seq_lens, table)`` of the cached sequences to sweep, or None.
    overlap_head_write : bool
        GPU sessions: run the HEAD write on a side stream of the session, overlapping the forward
        pass; ``post_forward`` joins it, so both must be captured in the same CUDA graph (pass
        False to capture them apart).
    check_holes : bool
        Report a position a step (or sweep) reads whose table entry addresses the padding slot
        (``VERIFY_TABLE_HOLE``, ``check_holes`` of :func:`verify`); False keeps SGLang's rule
        (skipped unseen).

    Raises
    ------
    TypeError, ValueError
        A bad argument; the message names it.

    Examples
    --------
    >>> session = kc.CanarySession(64, max_batch_size=4, on_violation="ignore")
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> session.pre_forward(np.array([1]), np.array([0]), np.array([3]), req_to_token,
    ...                     np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]))
    >>> session.post_forward()
    >>> session.end_step()
    >>> session.check()  # slots never verified: the canary covers the pool
    0
    >>> session.stats["steps"], session.stats["violations"]
    (1, 0)

    Notes
    -----
    Every launch goes through launchers bound once here (:mod:`kvcanary_cupy.launchers`): the
    planner's plan, the HEAD verify and write, the TAIL verify and write, and (bound with the sweep's
    plan buffers) the sweep's verify; ``end_step``'s staging kernels through parameters packed
    here too (``prepare_stage`` of the backend).
    """

    @public_api
    def __init__(self, num_slots, *, max_batch_size=None, verify_capacity=None, like=None,
                 ring_capacity=DEFAULT_RING_CAPACITY, on_violation="raise", swa_window_size=0,
                 full_to_swa_index_mapping=None, kv_token_id_vs_position_offset=0, real_kv_sources=(),
                 real_kv_hash_mode=RealKvHashMode.NONE, check_expected_tokens=False, sweep_every=0,
                 sweep_source=None, overlap_head_write=True, write_req_capacity=None, check_holes=True):
        num_slots = check_count(num_slots, "num_slots", maximum=2**62)
        if num_slots == 0:
            fail(ValueError, "num_slots must be >= 1 (slot 0 is the padding slot), got 0")
        if max_batch_size is None and write_req_capacity is None:
            fail(TypeError, "CanarySession needs max_batch_size (or its other spelling, write_req_capacity)")
        if write_req_capacity is not None:
            write_req_capacity = check_count(write_req_capacity, "write_req_capacity")
            if max_batch_size is not None and check_count(max_batch_size, "max_batch_size") != write_req_capacity:
                fail(ValueError, f"max_batch_size={max_batch_size} and write_req_capacity={write_req_capacity} name the "
                                 "same limit and disagree; pass one")
            max_batch_size = write_req_capacity
        self.max_batch_size = check_count(max_batch_size, "max_batch_size")
        ring_capacity = check_count(ring_capacity, "ring_capacity", positive=True, maximum=INT32_MAX // len(RING_GROUPS))
        if not (callable(on_violation) or (isinstance(on_violation, str) and on_violation in POLICIES)):
            fail(ValueError, f"on_violation must be one of {POLICIES} or a callable taking a ViolationReport, got {on_violation!r}")
        window = check_int(swa_window_size, "swa_window_size", minimum=0)
        if window > 0 and full_to_swa_index_mapping is None:
            fail(ValueError, "a session with swa_window_size > 0 needs full_to_swa_index_mapping (the full->SWA slot LUT, int64)")
        self.real_kv_sources = check_num_sources(real_kv_sources)
        try:
            self.real_kv_hash_mode = RealKvHashMode(real_kv_hash_mode)
        except (ValueError, TypeError):
            fail(ValueError, f"real_kv_hash_mode must be a RealKvHashMode (NONE, PARTIAL or ALL), got {real_kv_hash_mode!r}")
        for name, flag in (("check_expected_tokens", check_expected_tokens), ("overlap_head_write", overlap_head_write),
                           ("check_holes", check_holes)):
            if not isinstance(flag, (bool, np.bool_)):
                fail(TypeError, f"{name} must be a bool, got {type(flag).__name__}")
        self.sweep_every = check_int(sweep_every, "sweep_every", minimum=0)
        if self.sweep_every and not callable(sweep_source):
            fail(ValueError, "sweep_every > 0 needs sweep_source: a callable returning (req_pool_indices, seq_lens, table) or None")
        if like is not None:
            placement_of(like, "like")

        if verify_capacity is None:
            capacities = CanaryCapacities.from_engine(kv_pool_size=num_slots, max_running_requests=self.max_batch_size,
                                                      verify_headroom=VERIFY_HEADROOM)
        else:
            capacities = CanaryCapacities(check_count(verify_capacity, "verify_capacity"), self.max_batch_size)
        self.num_slots = num_slots
        self.on_violation = on_violation
        self.check_expected_tokens = bool(check_expected_tokens)
        self.check_holes = bool(check_holes)
        self.sweep_source = sweep_source
        self.head_tag, self.tail_tag, self.sweep_tag = _TAGS[window > 0]
        self._like = like
        self._planner_options = dict(swa_window_size=window, full_to_swa_index_mapping=full_to_swa_index_mapping,
                                     kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
        self.planner = CanaryPlanner(capacities, like=like, **self._planner_options)
        self.head_canary = allocate_canary_buffer(num_slots, like=like)
        self.tail_canary = allocate_canary_buffer(num_slots, like=like)
        self.log, self._group_logs = _group_logs(ring_capacity, like)
        self._layout = StageLayout(self.log.num_kinds, self.log.capacity, attribution_capacity=ring_capacity)
        self._marks = allocate((num_slots,), np.int64, like=like, fill=0)
        self._placement = placement = placement_of(self.log.ring, "like")
        self._backend = get_backend(placement.backend)
        self._transport = (_HostTransport() if placement.backend == "numpy"
                           else _CudaTransport(placement, like, self._layout))
        self._records = tuple(self._transport.new_record(self._layout) for _ in range(STAGED_RECORDS))
        self._free = list(self._records)
        self._pending = collections.deque()  # records staged and not handled yet, oldest first
        self._step_stager = self._stager(self.planner)
        self._sweep_planner = self._sweep_stager = self._sweep_zeros = self._sweep_verify = None

        vp, wp = self.planner.verify_plan, self.planner.write_plan
        head_log, tail_log = self._group_logs["head"], self._group_logs["tail"]
        token = dict(check_expected_tokens=self.check_expected_tokens, check_holes=self.check_holes)
        self._kv = dict(real_kv_sources=self.real_kv_sources, real_kv_hash_mode=self.real_kv_hash_mode)
        self._head_verify = VerifyLauncher(self.head_canary, vp, log=head_log, kernel_kind=self.head_tag, **token)
        self._tail_verify = VerifyLauncher(self.tail_canary, vp, log=tail_log, kernel_kind=self.tail_tag, **token, **self._kv)
        self._tail_write = WriteLauncher(self.tail_canary, wp, log=tail_log, kernel_kind=self.tail_tag, **self._kv)
        self._head_write_stream = None
        if overlap_head_write and placement.backend == "cupy":
            cupy = import_cupy()
            with cupy.cuda.Device(placement.device):
                self._head_write_stream = cupy.cuda.Stream(non_blocking=True)
        self._head_write = WriteLauncher(self.head_canary, wp, log=head_log, kernel_kind=self.head_tag,
                                         stream=self._head_write_stream)
        self._head_write_unjoined = False

        self._stamp = 0
        self._step_inputs = None  # (input_ids, positions, out_cache_loc) between pre_ and post_forward
        self._step_labels = None  # the row labels pre_forward was given for this step
        self._step_open = False
        self._distinct = {}  # key -> [Violation, repeats, last step, readers (list of Reader), readers dropped]
        self._new, self._problems = {}, []  # handled since the policy was last applied: new keys (in order), health messages
        self._undelivered = {}  # key -> entry of new keys evicted before the policy saw them
        self._latest = [0] * self._layout.ring  # the latest handled record's header and four counter arrays
        runs = self._layout.counters + 2 * self.log.num_kinds  # where the kernel-run counters start
        self._runs_at = (runs + self.head_tag, runs + self.tail_tag)
        self._runs_at_last_step = (0, 0)  # kernel runs of the HEAD and TAIL tags at the last step handled
        self._rows_by_reason = {reason_name(m): 0 for m in FailReason}
        self._plan_out_of_range = {"step": 0, "sweep": 0}  # the plans' cumulative counts, as last handled
        self._capacity_warned = self._coverage_warned = self._eviction_warned = False
        self._in_policy = False  # inside the on_violation callback
        self._lock = threading.Lock()  # held while handled results change, so another thread can read them
        self._stats = dict(steps=0, verified_entries=0, verify_skipped_steps=0, verify_skipped_sweeps=0, sweeps=0,
                           rows_read=0, health_failures=0, untracked_rows=0, evicted_violations=0,
                           unattributed_entries=0, staging_waits=0, dropped_readers=0)

    # -- the step ----------------------------------------------------------------------------------

    @public_api
    def pre_forward(self, req_pool_indices: Array | None, prefix_lens: Array, extend_seq_lens: Array, table: Any,
                    input_ids: Array, positions: Array, out_cache_loc: Array, *,
                    expected_tokens: Array | None = None, expected_tokens_valid_lens: Array | None = None,
                    req_to_verify_expected_tokens: Array | None = None,
                    req_to_verify_expected_tokens_valid_lens: Array | None = None, row_labels=None) -> None:
        """Before the model reads the KV cache: plan the step, verify the HEAD buffer, write it.

        Capture-safe: allocates nothing, reads nothing back, never synchronises.  Pass the
        per-step arrays contiguous (they are used in place).  With ``overlap_head_write`` the
        HEAD write runs on the session's side stream until :meth:`post_forward` joins it:
        ``input_ids``, ``positions`` and ``out_cache_loc`` must stay alive and unchanged until
        then (the TAIL write reads them there too).

        Parameters
        ----------
        req_pool_indices, prefix_lens, extend_seq_lens, table
            As for :func:`plan`; ``len(prefix_lens)`` at most ``max_batch_size``.
        input_ids, positions, out_cache_loc : int64 arrays [T]
            As for :func:`write`.
        expected_tokens, expected_tokens_valid_lens : optional
            The expected-token pool and its valid lengths, checked when the session was built
            with ``check_expected_tokens``.
        req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens : optional
            The same two arrays under :func:`plan`'s names; give either spelling of each.
        row_labels : sequence of int or str, optional
            The engine's name of each batch row (a request id), ``len(prefix_lens)`` of them;
            the report's ``Violation.readers`` carry them.  Copied (host only: capture-safe).

        Raises
        ------
        TypeError, ValueError
            A bad argument (a batch past ``max_batch_size``, lengths that differ, ...).
        """
        if self._step_inputs is not None:
            fail(CanaryUsageError, f"pre_forward() twice without post_forward() or end_step() in between; call {_STEP_ORDER} "
                                   "(a repeated HEAD write without its TAIL write would read as KV corruption)")
        bs = _length(prefix_lens, "prefix_lens")  # req_pool_indices is None with a PagedKvIndices table
        if bs > self.max_batch_size:
            fail(ValueError, f"bs={bs} (len(prefix_lens)) exceeds the session's max_batch_size={self.max_batch_size}")
        labels = _row_labels(row_labels, bs)
        tokens = _length(input_ids, "input_ids")
        for name, x in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
            n = _length(x, name)
            if n != tokens:
                fail(ValueError, f"{name} length must be len(input_ids)={tokens}, got {n}")
            dtype = x.dtype
            if dtype is not I64 and str(dtype) not in ("int64", "torch.int64"):  # str() of a NumPy dtype costs ~1.5 us
                fail(TypeError, f"{name} must have dtype int64, got {dtype}")
        self._join_head_write()  # a post_forward that raised may have left the HEAD write unjoined
        self.planner.plan(req_pool_indices, prefix_lens, extend_seq_lens, table,
                          req_to_verify_expected_tokens=_one_of(expected_tokens, req_to_verify_expected_tokens,
                                                                "expected_tokens", "req_to_verify_expected_tokens"),
                          req_to_verify_expected_tokens_valid_lens=_one_of(
                              expected_tokens_valid_lens, req_to_verify_expected_tokens_valid_lens,
                              "expected_tokens_valid_lens", "req_to_verify_expected_tokens_valid_lens"))
        self._head_verify()
        self._head_write(input_ids, positions, out_cache_loc)
        self._head_write_unjoined = self._head_write_stream is not None
        self._step_inputs = (input_ids, positions, out_cache_loc)
        self._step_labels = labels
        self._step_open = True

    def post_forward(self) -> None:
        """After the forward: verify the TAIL buffer (real KV included) and write it, on this step's plan,
        then make the step's stream wait for the HEAD write when it ran on the side stream.

        Capture-safe like :meth:`pre_forward`.
        """
        if self._step_inputs is None:
            fail(CanaryUsageError, f"post_forward() needs a pre_forward() of the same step before it; call {_STEP_ORDER}")
        self._tail_verify()
        self._tail_write(*self._step_inputs)
        self._join_head_write()
        self._step_inputs = None

    def end_step(self) -> None:
        """Outside CUDA graphs, once per step: stage this step's log and handle earlier steps.

        Never blocks, unless the host has run ``STAGED_RECORDS`` stagings ahead of the device:
        then it waits for the oldest one's copy (counted in ``stats["staging_waits"]``).  Raises
        :class:`CanaryViolationError` / :class:`CanaryHealthError` under ``on_violation="raise"``
        when a handled step brought new violations / ran no canary kernel, and
        :class:`CanaryUsageError` when called from inside the ``on_violation`` callback.

        An exception (an interrupt) before the step is staged leaves it open: call ``end_step``
        again.  One while earlier records are handled leaves them pending for the next call; the
        step itself is ended.  Either way no row or count is lost.
        """
        self._refuse_in_policy("end_step")
        stream = self._launch_stream("end_step")
        self._join_head_write()  # post_forward was not called: the staging reads the log the write fills
        stats = self._stats
        first = self._stamp + 1  # the stamp of this step's staging: it and later ones stay pending
        self._stage("step", stats["steps"], self._step_stager, stream, self._step_labels)
        stats["steps"] += 1
        self._step_open, self._step_inputs, self._step_labels = False, None, None
        if self.sweep_every and stats["steps"] % self.sweep_every == 0:
            source = self.sweep_source()
            if source is not None:
                self.sweep(*source)
        self._drain(first)
        self._apply_policy()

    def check(self) -> int:
        """Block until every staged step and sweep is handled, then apply the policy.

        A host sync (not capture-safe): call it at shutdown, in tests, or whenever the latest
        steps must be judged now.  Raises as :meth:`end_step` does.  Returns how many plan inputs
        and kernel items were skipped as out of range of the canary so far, never verified
        (``stats["out_of_range_skipped"]``; 0 when the canary covers the pool).
        """
        self._refuse_in_policy("check")
        self._launch_stream("check")
        self._transport.synchronize()
        self._drain(None)
        self._apply_policy()
        return self._out_of_range_skipped()

    @public_api
    def sweep(self, req_pool_indices: Array | None, seq_lens: Array, table: Any, *, row_labels=None) -> None:
        """Verify (TAIL buffer, real KV, no token check) every slot of the given cached sequences.

        ``seq_lens`` (int64 ``[n]``, ``n <= max_batch_size``): sequence i covers positions ``[0,
        seq_lens[i])`` of table row ``req_pool_indices[i]`` (the window's end only, for SWA); ``table`` is anything :func:`plan` takes
        (``req_pool_indices`` None with a :class:`PagedKvIndices`).  Outside graphs, between
        ``end_step`` and the next ``pre_forward``; staged like a step and handled by the next
        ``end_step``/``check``.  A violation's ``batch_rows`` are indices into these sequences;
        ``row_labels`` (one per sequence, as :meth:`pre_forward`'s) name them in its ``readers``.
        """
        self._refuse_in_policy("sweep")
        stream = self._launch_stream("sweep")
        if self._step_open:
            fail(CanaryUsageError, "sweep() between pre_forward() and end_step() would mix the sweep's violations with the "
                               "step's; call it after end_step()")
        n = _length(seq_lens, "seq_lens")  # req_pool_indices is None with a PagedKvIndices table
        labels = _row_labels(row_labels, n)
        planner = self._sweep_planner_for(n)
        renamed = None
        try:
            planner.plan(req_pool_indices, seq_lens, self._sweep_zeros[:n], table)
        except (TypeError, ValueError) as exc:  # the planner calls seq_lens prefix_lens: name the caller's
            message = str(exc).removeprefix("kv-canary: ")
            if trimmed_argument_error(exc) is None or "prefix_lens" not in message:
                raise
            renamed = type(exc), re.sub(r"\bprefix_lens\b", "seq_lens", message)
        if renamed is not None:
            fail(*renamed)  # outside the except block: no "during handling" chain
        self._sweep_verify()
        self._stats["sweeps"] += 1
        self._stage("sweep", self._stats["steps"] - 1, self._sweep_stager, stream, labels)

    @property
    def overlap_head_write(self) -> bool:
        """Whether the HEAD write runs on the session's side stream (GPU sessions built with
        ``overlap_head_write=True``); fixed at construction."""
        return self._head_write_stream is not None

    # -- results -----------------------------------------------------------------------------------

    def report(self) -> ViolationReport:
        """Every distinct violation handled so far (the newest ``MAX_DISTINCT_VIOLATIONS``), in
        first-seen order, with the session's totals.  Safe to call from another thread.

        Steps staged but not handled yet are not in it: :meth:`check` first to include them.
        """
        with self._lock:
            return self._report(self._distinct.values())

    @property
    def stats(self) -> dict:
        """Counts of what the session did and found, over the steps handled so far.

        ``steps`` (ended), ``pending_steps`` (staged, not handled yet), ``verified_entries`` (plan
        entries verified by steps and sweeps), ``violations`` (exact total),
        ``distinct_violations``, ``violations_by_reason`` (rows read), ``violations_by_tag``
        (exact), ``verify_skipped_steps`` / ``verify_skipped_sweeps`` (capacity overflow),
        ``dropped_rows`` (never read: the ring filled within one step), ``rows_read``, ``sweeps``,
        ``health_failures``, ``out_of_range_skipped``, ``evicted_violations`` (distinct keys evicted
        from the full table, oldest first), ``untracked_rows`` (the rows of the evicted keys: the
        report's repeats plus these are ``rows_read``), ``unattributed_entries`` (verify entries of
        violating slots past the attribution capacity), ``staging_waits`` (stagings that waited for the oldest
        staged record: the host was ``STAGED_RECORDS`` stagings ahead of the device).  Safe to
        read from another thread.
        """
        with self._lock:
            s = dict(self._stats)
            counters = self._counter_arrays()
            total = int(counters[0].sum())
            s.update(
                pending_steps=sum(r.kind == "step" for r in self._pending),
                violations=total,
                distinct_violations=len(self._distinct),
                violations_by_reason={k: n for k, n in self._rows_by_reason.items() if n},
                violations_by_tag={tag_name(k): int(n) for k, n in enumerate(counters[0]) if n},
                dropped_rows=total - s["rows_read"],
                out_of_range_skipped=self._out_of_range_skipped(),
            )
        return s

    def __repr__(self) -> str:
        s = self.stats
        c = self.planner.capacities
        policy = self.on_violation if isinstance(self.on_violation, str) else "callable"
        window = f", swa_window_size={self.planner.swa_window_size}" if self.planner.swa_window_size else ""
        return (f"CanarySession(num_slots={self.num_slots}, on={self._placement.describe()}, "
                f"max_batch_size={self.max_batch_size}, verify_capacity={c.verify_capacity}, "
                f"ring_capacity={self.log.capacity // len(RING_GROUPS)}, on_violation={policy!r}{window}, "
                f"steps={s['steps']}, violations={s['violations']}, distinct={s['distinct_violations']})")

    # -- internals ---------------------------------------------------------------------------------

    def _launch_stream(self, what: str):
        """The stream the session stages on (None on the CPU), refusing one that captures a CUDA graph."""
        transport = self._transport
        stream = transport.launch_stream()
        if transport.capturing(stream):
            fail(RuntimeError, f"{what}() must run outside CUDA graph capture (it stages copies and reads host "
                               "memory); capture only pre_forward() and post_forward()")
        return stream

    def _refuse_in_policy(self, what: str) -> None:
        if self._in_policy:
            fail(CanaryUsageError, f"{what}() from inside the on_violation callback: the callback runs within "
                                   "end_step()/check(); return from it and call end_step() for the next step")

    def _out_of_range_skipped(self) -> int:
        kernels = self._latest[self._layout.counters + 3 * self.log.num_kinds : self._layout.ring]  # out-of-range counters
        return int(sum(kernels)) + self._plan_out_of_range["step"] + self._plan_out_of_range["sweep"]

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

    def _sweep_planner_for(self, bs: int) -> CanaryPlanner:
        """The sweep's own plan buffers, grown (to a power of two) when a sweep has more sequences."""
        planner = self._sweep_planner
        if planner is None or planner.capacities.write_req_capacity < bs:
            capacity = max(64, 1 << max(bs - 1, 0).bit_length())
            capacities = CanaryCapacities(self.planner.capacities.verify_capacity, capacity)
            grown = CanaryPlanner(capacities, like=self._like, **self._planner_options)
            if planner is not None:  # the out-of-range count carries on (on the device, in stream order)
                grown.verify_plan.out_of_range_count[...] = planner.verify_plan.out_of_range_count
            planner = self._sweep_planner = grown
            self._sweep_zeros = allocate((capacity,), np.int64, like=self._like, fill=0)
            self._sweep_stager = self._stager(planner)
            self._sweep_verify = VerifyLauncher(self.tail_canary, planner.verify_plan, log=self._group_logs["sweep"],
                                                kernel_kind=self.sweep_tag, check_holes=self.check_holes, **self._kv)
        return planner

    def _stage(self, kind: str, step: int, stager, stream, labels=None) -> None:
        """Stage into a free record; it joins the pending ones only once its staging was queued, so
        an exception (an interrupt) on the way leaves it free and the log to the next staging."""
        if not self._free:  # every record is in flight: the host ran STAGED_RECORDS stagings ahead of the device
            self._stats["staging_waits"] += 1
            self._transport.wait(self._pending[0])
            self._handle_oldest()  # its results reach the policy with this end_step's (or the next one's)
        record = self._free[-1]
        self._stamp += 1  # a stamp is never reused, even by a staging that failed
        record.kind, record.step, record.stamp, record.labels = kind, step, self._stamp, labels
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
        self._warn_after(record.kind)

    def _decode(self, record: _Record):
        """What handling ``record`` adds: ``(head, stats increments, health problem or None, rows
        per reason, key -> [new Violation or None, rows])``."""
        head = record.head.tolist()  # the header and the exact int64 counters, in one read
        kind, add, problem = record.kind, collections.Counter(), None
        if head[_ENABLE] == 0:
            add[f"verify_skipped_{kind}s"] += 1
        else:
            add["verified_entries"] += max(head[_NUM_VALID], 0)
        if kind == "step":
            runs, before = (head[self._runs_at[0]], head[self._runs_at[1]]), self._runs_at_last_step
            if runs[0] <= before[0] or runs[1] <= before[1]:
                stalled = [tag.name for tag, now, was in zip((self.head_tag, self.tail_tag), runs, before) if now <= was]
                add["health_failures"] += 1
                problem = (f"kv-canary: no canary kernel ran for launch tags {stalled} in step {record.step} "
                           "(between two end_step calls); is pre_forward()/post_forward() part of the graph you replay?")
        by_reason, keys = {}, {}
        if head[_ROWS]:
            by_reason, keys = self._decode_rows(record, head[_ROWS], head[_MATCHES], add)
        return head, add, problem, by_reason, keys

    def _decode_rows(self, record: _Record, n: int, matches: int, add):
        """Decode the ring rows of one record by key (new keys attributed)."""
        layout, host = self._layout, record.host
        rows = host[layout.ring : layout.ring + 8 * n].reshape(n, 8)
        rows = rows[np.lexsort((rows[:, 7], rows[:, 2], rows[:, 1], rows[:, 0]))]  # a fixed order on every backend
        add["rows_read"] += n
        by_reason = {reason_name(m): int(np.count_nonzero(rows[:, 7] & m.value)) for m in FailReason}
        kept = min(matches, layout.attribution_capacity)
        add["unattributed_entries"] += matches - kept
        width = len(ATTRIBUTION)
        attribution = host[layout.attribution : layout.attribution + width * kept].reshape(kept, width)
        by_slot, keys, distinct = None, {}, self._distinct
        for row in rows.tolist():
            key = (row[0], row[1], row[2], row[7])
            seen = keys.get(key)
            if seen is not None:
                seen[1] += 1
                continue
            v = Violation.from_row(row)
            matching = ()
            if not v.is_write:
                if by_slot is None:
                    by_slot = collections.defaultdict(list)
                    for entry in attribution[np.argsort(attribution[:, _ATTRIBUTION["entry"]], kind="stable")].tolist():
                        by_slot[entry[_ATTRIBUTION["slot"]]].append(entry)
                matching = _matching_entries(v, by_slot.get(v.slot_idx, ()))
            readers = _readers(record, matching)
            if key in distinct:
                keys[key] = [None, 1, readers]
                continue
            keys[key] = [replace(_attribute(v, matching), first_step=record.step), 1, readers]
        return by_reason, keys

    def _commit(self, record: _Record, head, add, problem, by_reason, keys) -> None:
        """Apply one decoded record (under the lock): plain assignments and dict updates only."""
        stats, distinct, step = self._stats, self._distinct, record.step
        self._latest = head
        self._plan_out_of_range[record.kind] = head[_PLAN_OUT_OF_RANGE]
        if record.kind == "step":
            self._runs_at_last_step = (head[self._runs_at[0]], head[self._runs_at[1]])
        for k, n in add.items():
            stats[k] += n
        if problem is not None:
            self._problems.append(problem)
        for k, n in by_reason.items():
            self._rows_by_reason[k] += n
        new = []
        for key, (v, n, readers) in keys.items():  # known keys first: an eviction below may take one of them
            if v is None:
                seen = distinct[key]
                seen[1] += n
                seen[2] = step
                self._add_readers(seen, readers)
            else:
                new.append((key, v, n, readers))
        for key, v, n, readers in new:
            if len(distinct) >= MAX_DISTINCT_VIOLATIONS:
                oldest = next(iter(distinct))
                entry = distinct.pop(oldest)
                if oldest in self._new:  # the policy still gets it
                    self._undelivered[oldest] = entry
                stats["untracked_rows"] += entry[1]
                stats["evicted_violations"] += 1
            distinct[key] = entry = [v, n, step, [], 0]
            self._add_readers(entry, readers)
            self._new[key] = None

    def _add_readers(self, entry, readers) -> None:
        """Append ``readers`` to a distinct violation's (under the lock), keeping the newest MAX_READERS:
        the reads still running are the ones an engine acts on."""
        entry[3].extend(readers)
        dropped = len(entry[3]) - MAX_READERS
        if dropped > 0:
            del entry[3][:dropped]
            entry[4] += dropped
            self._stats["dropped_readers"] += dropped

    def _warn_after(self, kind: str) -> None:
        """The session's one-time warnings, once the record that calls for them is handled."""
        if not self._capacity_warned and self._stats[f"verify_skipped_{kind}s"]:
            self._capacity_warned = True
            _warn(f"kv-canary: a {kind}'s verify plan overflowed verify_capacity={self.planner.capacities.verify_capacity}, "
                  "so its verify was skipped; further skips are counted in session.stats['verify_skipped_steps'/'_sweeps']. "
                  "Raise verify_capacity.", CanaryCapacityWarning)
        if not self._coverage_warned and self._out_of_range_skipped():
            self._coverage_warned = True
            _warn(f"kv-canary: {self._out_of_range_skipped()} plan inputs or kernel items were out of range of the "
                  f"canary (slots past num_slots={self.num_slots}: a canary smaller than the pool, or rows past the table) "
                  "and were never verified; counted in session.stats['out_of_range_skipped'] and returned by check()",
                  CanaryCoverageWarning)
        if not self._eviction_warned and self._stats["evicted_violations"]:
            self._eviction_warned = True
            _warn(f"kv-canary: the session's distinct violations reached MAX_DISTINCT_VIOLATIONS={MAX_DISTINCT_VIOLATIONS}; "
                  "each new one now evicts the oldest (counted in session.stats['evicted_violations'] and "
                  "['untracked_rows']) and still reaches the policy", CanaryCoverageWarning)

    def _counter_arrays(self) -> np.ndarray:
        """The latest handled record's violation, slot-run, kernel-run and out-of-range counters."""
        return np.array(self._latest[STAGE_HEADER_FIELDS:], np.int64).reshape(4, self.log.num_kinds)

    def _report(self, entries) -> ViolationReport:
        """A report of ``entries`` (``[Violation, repeats, last step, readers, readers dropped]`` of the
        distinct table)."""
        c = self._counter_arrays()
        violations = tuple(replace(v, repeats=n, last_step=last, readers=tuple(readers), readers_dropped=dropped)
                           for v, n, last, readers, dropped in entries)
        return ViolationReport(violations=violations, total_violations=int(c[0].sum()), ring_capacity=self.log.capacity,
                               violation_counters=c[0], slot_run_counters=c[1], kernel_run_counters=c[2],
                               out_of_range_counters=c[3],
                               rows_read=self._stats["rows_read"], steps=self._stats["steps"])

    def _apply_policy(self) -> None:
        new, problems = self._new, self._problems
        if not new and not problems:
            return
        undelivered, self._undelivered = self._undelivered, {}
        self._new, self._problems = {}, []
        report = self._report([self._distinct.get(k) or undelivered[k] for k in new]) if new else None
        policy = self.on_violation
        if policy == "raise":
            if report is not None:
                for problem in problems:
                    logger.error(problem)
                lines = [v.format() for v in report.violations[:MESSAGE_MAX_LINES]]
                if len(report.violations) > MESSAGE_MAX_LINES:
                    lines.append(f"... {len(report.violations) - MESSAGE_MAX_LINES} more in the error's .report")
                raise CanaryViolationError(f"kv-canary: {len(new)} new violation(s):\n" + "\n".join(lines)
                                           + "\n" + report.summary(), report)
            if problems:
                raise CanaryHealthError("\n".join(problems))
            return
        for problem in problems:
            logger.error(problem)
        if report is None:
            return
        if policy == "log":
            for v in report.violations:
                logger.warning(v.format())
            if len(new) >= LOG_SUMMARY_AT:
                logger.warning(report.summary())
        elif callable(policy):
            self._in_policy = True
            try:
                policy(report)
            finally:
                self._in_policy = False


def _group_logs(ring_capacity: int, like):
    """The session's log (its ring one share of ``ring_capacity`` rows per launch group, its
    ``write_index`` one ticket counter per share) and each group's view of it: its share and
    counter, the counters shared (each launch counts under its own kernel kind)."""
    log = ViolationLog.allocate(len(RING_GROUPS) * ring_capacity, like=like)
    log = replace(log, write_index=allocate((len(RING_GROUPS),), np.int32, like=like, fill=0))
    views = {name: replace(log, ring=log.ring[g * ring_capacity : (g + 1) * ring_capacity],
                           write_index=log.write_index[g : g + 1])
             for g, name in enumerate(RING_GROUPS)}
    return log, views


def _row_labels(labels, n: int):
    """The row labels of ``n`` batch rows as a tuple (None: none given)."""
    if labels is None:
        return None
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__len__"):
        fail(TypeError, f"row_labels must be a sequence of int or str (one per batch row), got {type(labels).__name__}")
    labels = tuple(x.item() if isinstance(x, np.generic) else x for x in labels)
    if len(labels) != n:
        fail(ValueError, f"row_labels must hold one label per batch row ({n}), got {len(labels)}")
    for x in labels:
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            fail(TypeError, f"row_labels must be ints or strs, got {type(x).__name__} {x!r}")
    return labels


def _matching_entries(v: Violation, entries) -> list:
    """The attribution entries of ``v``'s slot that could have produced it (same position verdict,
    same expected token), in entry order."""
    position_failed = bool(v.fail_reason_bits & FailReason.VERIFY_POSITION_MISMATCH)
    a = _ATTRIBUTION
    return [e for e in entries
            if (e[a["expected_position"]] != v.position) == position_failed
            and (v.expected_token == -1 or e[a["expected_token"]] == v.expected_token)]


def _readers(record: _Record, matching) -> list:
    """A :class:`Reader` per matching attribution entry of one staged record."""
    labels, sweep, row = record.labels, record.kind == "sweep", _ATTRIBUTION["batch_row"]
    return [Reader(record.step, e[row], labels[e[row]] if labels is not None and 0 <= e[row] < len(labels) else None, sweep)
            for e in matching]


def _attribute(v: Violation, matching) -> Violation:
    """``v`` with the batch rows, expected position and predecessor of the verify entries that
    read its slot and could have produced it (:func:`_matching_entries`)."""
    a = _ATTRIBUTION
    if not matching:
        return v
    first = matching[0]
    chain_failed = bool(v.fail_reason_bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    return replace(v, batch_rows=tuple(sorted({e[a["batch_row"]] for e in matching if e[a["batch_row"]] >= 0})),
                   expected_position=first[a["expected_position"]],
                   prev_slot_idx=first[a["prev_slot"]] if chain_failed else None)
