"""CanarySession's step loop: construction, ``pre_forward`` / ``post_forward`` / ``end_step``,
``check`` and ``sweep``.  The staging transport is in :mod:`.staging`, the violation bookkeeping and
policy in :mod:`.violations`; docs/guide.md ("Using the canary in an engine") explains every choice.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..args import StageLayout
from ..backends import get_backend
from ..constants import DEFAULT_RING_CAPACITY, CanaryLaunchTag, FailReason, RealKvHashMode
from ..distributed import RankReducer
from ..errors import CanaryUsageError, fail, public_api
from ..interop import Array, allocate, import_cupy, placement_of
from .. import coverage
from ..launchers import VerifyLauncher, WriteLauncher, WriteWaves
from ..planner import CanaryCapacities, CanaryPlanner
from ..plans import allocate_canary_buffer, check_num_sources
from ..reporting import reason_name
from ..same_step import SameStepReads, resolve_same_step_reads
from ..validation import I64, INT32_MAX, check_count, check_int
from .staging import STAGED_RECORDS, StagingMixin, _CudaTransport, _HostTransport
from .sweep import SweepMixin, _checked_labels, _length, _one_of
from .violations import POLICIES, RING_GROUPS, ViolationsMixin, _group_logs

#: ``verify_capacity`` defaults to this many times ``num_slots`` (``CanaryCapacities.from_engine``'s
#: headroom: radix sharing lets a batch's summed prefixes exceed the pool).
VERIFY_HEADROOM = 3

_TAGS = {  # (head, tail, sweep) launch tags of a FULL and of an SWA session
    False: (CanaryLaunchTag.HEAD_K_FULL, CanaryLaunchTag.TAIL_K_FULL, CanaryLaunchTag.SWEEP_K_FULL),
    True: (CanaryLaunchTag.HEAD_K_SWA, CanaryLaunchTag.TAIL_K_SWA, CanaryLaunchTag.SWEEP_K_SWA),
}
_STEP_ORDER = "pre_forward(), post_forward(), end_step() per step"


class CanarySession(StagingMixin, ViolationsMixin, SweepMixin):
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
        Report reads whose table entry is the padding slot (:func:`verify`'s ``check_holes``);
        False: SGLang's rule.  Off with ``same_step_reads`` (docs/guide.md, "Containment").
    same_step_reads : bool
        The engine lets a request read, in the same step, slots another request writes (vLLM's
        prefix cache matches blocks at scheduling time): each step runs
        :func:`resolve_same_step_reads`, so such reads are verified as written and a request's
        chain that continues from such a slot is written after it (``stats["same_step_verified"]``,
        ``stats["same_step_deeper"]``).
    process_group : torch.distributed.ProcessGroup, optional
        A group *dedicated* to the canary (``dist.new_group(...)``; gloo for NumPy arrays and CPU
        tensors, nccl for CUDA arrays): each rank keeps its own canary, and every
        ``reduce_every`` steps the ranks' totals and verdicts are all-reduced over it without a
        host sync, so that every rank applies its policy on the same step (docs/distributed.md).
        Building the session is then a collective that checks the ranks agree on the pool size,
        the canary size and the capacities.  :attr:`distributed` holds the group's totals.
    reduce_every : int
        With a group: reduce every ``reduce_every``-th ``end_step`` (``>= 1``).
    replicated_kv : bool
        With a group whose ranks hold identical KV (MLA caches; GQA caches when tensor parallelism
        exceeds the KV-head count): compare the ranks' TAIL real-KV fingerprints, a window of
        ``kc.distributed.REPLICATED_WINDOW`` slots per reduction; a difference is a
        ``replicated_kv_mismatch`` (:class:`ReplicaMismatch`) naming both ranks and the slot.
    allow_default_group : bool
        Accept the default (WORLD) group as ``process_group``: only when nothing else (the model,
        a KV transfer) issues collectives on it.
    deep_kv_sources, deep_check_slots, check_lost_stores, lost_kv_sources, max_step_tokens
        The coverage past the record, off by default: :func:`kvcanary_cupy.coverage.build`.

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
    def __init__(self, num_slots, *, max_batch_size=None, verify_capacity=None, like=None, ring_capacity=DEFAULT_RING_CAPACITY,
                 on_violation="raise", swa_window_size=0, full_to_swa_index_mapping=None, kv_token_id_vs_position_offset=0,
                 real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE, check_expected_tokens=False, sweep_every=0,
                 sweep_source=None, overlap_head_write=True, write_req_capacity=None, process_group=None,
                 reduce_every=1, replicated_kv=False, allow_default_group=False, same_step_reads=False,
                 deep_kv_sources=(), deep_check_slots=None, check_lost_stores=False, max_step_tokens=None,
                 check_holes=True, lost_kv_sources=()):
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
        reduce_every = check_count(reduce_every, "reduce_every", positive=True)
        for name, flag in (("check_expected_tokens", check_expected_tokens), ("overlap_head_write", overlap_head_write),
                           ("replicated_kv", replicated_kv), ("allow_default_group", allow_default_group),
                           ("same_step_reads", same_step_reads), ("check_holes", check_holes)):
            if not isinstance(flag, (bool, np.bool_)):
                fail(TypeError, f"{name} must be a bool, got {type(flag).__name__}")
        self.sweep_every = check_int(sweep_every, "sweep_every", minimum=0)
        if self.sweep_every and not callable(sweep_source):
            fail(ValueError, "sweep_every > 0 needs sweep_source: a callable returning (req_pool_indices, seq_lens, table) or None")
        if process_group is None and (replicated_kv or reduce_every != 1):
            fail(ValueError, "replicated_kv and reduce_every apply to a session with a process_group; pass one")
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
        self.check_holes = bool(check_holes) and not same_step_reads
        self.sweep_source = sweep_source
        self.head_tag, self.tail_tag, self.sweep_tag = _TAGS[window > 0]
        self._like = like
        self._planner_options = dict(swa_window_size=window, full_to_swa_index_mapping=full_to_swa_index_mapping,
                                     kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
        self.planner = CanaryPlanner(capacities, like=like, **self._planner_options)
        self.head_canary = allocate_canary_buffer(num_slots, like=like)
        self.tail_canary = coverage.tail_buffer(num_slots, deep_kv_sources, like)
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
        self.same_step = None
        if same_step_reads:  # one write launch per wave, each in both buffers
            self.same_step = SameStepReads.allocate(num_slots, self.max_batch_size, like=like)
            waves = self.same_step.wave_options()
            self._tail_write = WriteWaves([WriteLauncher(self.tail_canary, wp, log=tail_log, kernel_kind=self.tail_tag,
                                                         **self._kv, **w) for w in waves])
            self._head_write = WriteWaves([WriteLauncher(self.head_canary, wp, log=head_log, kernel_kind=self.head_tag,
                                                         stream=self._head_write_stream, **w) for w in waves])
        self._row_labels = None  # the engine's labels of this step's batch rows (pre_forward's row_labels)
        self._head_write_unjoined = False
        self.coverage = coverage.build(self, like, deep_kv_sources, deep_check_slots, check_lost_stores, max_step_tokens,
                                       lost_kv_sources)

        self._stamp = 0
        self._step_inputs = None  # (input_ids, positions, out_cache_loc) between pre_ and post_forward
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
        # Held by end_step, sweep and check while they stage and handle records: check() from another thread
        # than the engine's (docs/guide.md, "Threads") waits for the engine's end_step instead of racing it.
        self._handling = threading.RLock()
        self._stats = dict(steps=0, verified_entries=0, verify_skipped_steps=0, verify_skipped_sweeps=0, sweeps=0,
                           rows_read=0, health_failures=0, untracked_rows=0, evicted_violations=0,
                           unattributed_entries=0, staging_waits=0, dropped_readers=0)
        self._origin = {}  # the rank and device a distributed session's violations carry
        self.distributed = None  # RankReducer: the group's verdicts and totals
        if process_group is not None:
            self.distributed = RankReducer(self, process_group, reduce_every=reduce_every, replicated_kv=replicated_kv,
                                           allow_default_group=allow_default_group)
            self._origin = dict(rank=self.distributed.rank, device=self.distributed.device)

    # -- the step ----------------------------------------------------------------------------------

    @public_api
    def pre_forward(self, req_pool_indices: Array | None, prefix_lens: Array, extend_seq_lens: Array, table: Any,
                    input_ids: Array, positions: Array, out_cache_loc: Array, *,
                    expected_tokens: Array | None = None, expected_tokens_valid_lens: Array | None = None,
                    req_to_verify_expected_tokens: Array | None = None,
                    req_to_verify_expected_tokens_valid_lens: Array | None = None,
                    row_labels: Sequence | None = None) -> None:
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
        input_ids, positions, out_cache_loc : int64 or int32 arrays [T]
            As for :func:`write`: int32 ones, as transformers builds them, are read as they are,
            each of the three its own dtype.  With the lost-store check or deep fingerprints, an
            int32 ``out_cache_loc`` is widened into a copy each step (refused in a capture): pass
            that one as int64 there.
        expected_tokens, expected_tokens_valid_lens : optional
            The expected-token pool and its valid lengths, checked when the session was built
            with ``check_expected_tokens``.
        req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens : optional
            The same two arrays under :func:`plan`'s names; give either spelling of each.
        row_labels : sequence of int or str, optional
            The engine's name of each batch row (its request id; the first ``len(prefix_lens)``
            used): the step's violations carry the labels of the rows that read them
            (``request_ids``, ``Violation.readers``), so reports name requests even when rows
            move between steps.  Copied (host-side: no device work, capture-safe).

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
        labels = _checked_labels(row_labels, bs)
        tokens = _length(input_ids, "input_ids")
        for name, x in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
            n = _length(x, name)
            if n != tokens:
                fail(ValueError, f"{name} length must be len(input_ids)={tokens}, got {n}")
            dtype = x.dtype
            if dtype is not I64 and str(dtype) not in ("int64", "torch.int64", "int32", "torch.int32"):  # str() of a NumPy dtype costs ~1.5 us
                fail(TypeError, f"{name} must have dtype int32 or int64, got {dtype}")
        self._join_head_write()  # a post_forward that raised may have left the HEAD write unjoined
        if self.distributed is not None:
            self.distributed.note_table(table)
        self.planner.plan(req_pool_indices, prefix_lens, extend_seq_lens, table,
                          req_to_verify_expected_tokens=_one_of(expected_tokens, req_to_verify_expected_tokens,
                                                                "expected_tokens", "req_to_verify_expected_tokens"),
                          req_to_verify_expected_tokens_valid_lens=_one_of(
                              expected_tokens_valid_lens, req_to_verify_expected_tokens_valid_lens,
                              "expected_tokens_valid_lens", "req_to_verify_expected_tokens_valid_lens"))
        if self.same_step is not None:
            vp, wp = self.planner.verify_plan, self.planner.write_plan
            resolve_same_step_reads(self.same_step, vp, wp, input_ids, positions, out_cache_loc)
        self._row_labels = labels
        self._head_verify()
        self._head_write(input_ids, positions, out_cache_loc)
        self._head_write_unjoined = self._head_write_stream is not None
        self.coverage.before_forward(out_cache_loc)
        self._step_inputs = (input_ids, positions, out_cache_loc)
        self._step_open = True

    def post_forward(self) -> None:
        """After the forward: verify the TAIL buffer (real KV included) and write it, on this step's plan,
        then make the step's stream wait for the HEAD write when it ran on the side stream.

        Capture-safe like :meth:`pre_forward`.
        """
        if self._step_inputs is None:
            fail(CanaryUsageError, f"post_forward() needs a pre_forward() of the same step before it; call {_STEP_ORDER}")
        self._tail_verify()
        self.coverage.tail_write(self._tail_write, self._step_inputs, self._join_head_write)
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
        with self._handling:
            first = self._stamp + 1  # the stamp of this step's staging: it and later ones stay pending
            self._stage("step", stats["steps"], self._step_stager, stream, labels=self._row_labels)
            self._row_labels = None
            stats["steps"] += 1
            self._step_open, self._step_inputs = False, None
            if self.sweep_every and stats["steps"] % self.sweep_every == 0:
                source = self.sweep_source()
                if source is not None:
                    self.sweep(*source)
            self._drain(first)
            if self.distributed is None:
                self._apply_policy()
            else:  # every reduce_every-th step: the group's verdict, the same on every rank
                self.distributed.end_step(self)

    def check(self) -> int:
        """Block until every staged step and sweep is handled, then apply the policy.

        A host sync (not capture-safe): call it at shutdown, in tests, or whenever the latest
        steps must be judged now.  With a ``process_group`` it is a collective: every rank must call
        it at the same point.  Raises as :meth:`end_step` does.  Returns how many plan inputs
        and kernel items were skipped as out of range of the canary so far, never verified
        (``stats["out_of_range_skipped"]``; 0 when the canary covers the pool).
        """
        self._refuse_in_policy("check")
        self._launch_stream("check")
        with self._handling:
            self._transport.synchronize()
            self._drain(None)
            if self.distributed is None:
                self._apply_policy()
            else:
                self.distributed.check(self)
            return self._out_of_range_skipped()

    # -- internals ---------------------------------------------------------------------------------
