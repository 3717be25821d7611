"""The canary session the simulator drives, and the one place that touches its buffers.

The engine calls only the method names of ``kvcanary_cupy.CanarySession`` (``pre_forward``,
``post_forward``, ``end_step``, ``check``, ``sweep``, ``report``, ``stats``).  Until that class
exists, :class:`_SessionShim` provides them on top of ``plan`` / ``write`` / ``verify`` and a
``ViolationLog``.  :func:`make_session` is the single place that picks the implementation, and
:func:`canary_buffers` the single place that reaches into a session for its buffers (moving canary
rows with KV pages, transferring them between pools, a late write).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..constants import CanaryLaunchTag, RealKvHashMode
from ..interop import to_numpy
from ..plans import VerifyPlan, ViolationLog, WritePlan, allocate_canary_buffer


def make_session(num_slots: int, *, max_batch_size: int, like, real_kv_sources, on_violation):
    """The session of one KV pool: HEAD (chain only) and TAIL (real-KV fingerprints) buffers,
    token check on.  Swap in ``kc.CanarySession`` here once it exists (same arguments)."""
    return _SessionShim(num_slots, max_batch_size=max_batch_size, like=like, on_violation=on_violation,
                        real_kv_sources=tuple(real_kv_sources), real_kv_hash_mode=RealKvHashMode.ALL,
                        check_expected_tokens=True)


def canary_buffers(session) -> tuple:
    """``(head, tail)`` canary buffers of a session (``int64 [num_slots, 4]``)."""
    return session.head, session.tail


def move_canary_rows(session, src_slots, dst_slots) -> None:
    """Move canary rows with KV pages: ``rows = buf[src]; buf[src] = 0; buf[dst] = rows``, on both
    buffers (what ``kc.move_pages`` will do once it exists)."""
    for buf in canary_buffers(session):
        rows = buf[src_slots].copy()
        buf[src_slots] = 0
        buf[dst_slots] = rows


def copy_canary_rows(src_session, dst_session, src_slots, dst_slots) -> None:
    """A KV transfer between pools carries the canary rows of both buffers (as SGLang's transfer
    lists do: the canary buffers are spliced around the KV layers)."""
    for src, dst in zip(canary_buffers(src_session), canary_buffers(dst_session)):
        dst[dst_slots] = src[src_slots]


@dataclass(frozen=True)
class ShimReport:
    """Distinct violations (keyed by launch tag, slot, stored position, reason bits)."""

    violations: tuple  # of Violation, in first-seen order
    repeats: tuple  # of int, how often each was seen


class _SessionShim:
    """A stand-in for ``kc.CanarySession`` with its method names and meaning, kept minimal.

    Differences from the real session: the log is read (a host sync on the GPU) and reset in
    ``end_step`` instead of one step late; policies are ``"ignore"`` or a callable receiving a
    :class:`ShimReport` of the new distinct violations; no health check.
    """

    def __init__(self, num_slots, *, max_batch_size, verify_capacity=None, like=None, ring_capacity=1024,
                 on_violation="ignore", real_kv_sources=(), real_kv_hash_mode=RealKvHashMode.NONE,
                 check_expected_tokens=False):
        if on_violation != "ignore" and not callable(on_violation):
            raise ValueError(f"kv-canary: the session shim supports on_violation='ignore' or a callable, got {on_violation!r}")
        self.head = allocate_canary_buffer(num_slots, like=like)
        self.tail = allocate_canary_buffer(num_slots, like=like)
        self._like = self.head
        self._capacity = 3 * num_slots if verify_capacity is None else verify_capacity
        self._plans = (VerifyPlan.allocate(self._capacity, like=like), WritePlan.allocate(max_batch_size, like=like))
        self._log = ViolationLog.allocate(ring_capacity, like=like)
        self._on_violation = on_violation
        self._sources = tuple(real_kv_sources)
        self._mode = real_kv_hash_mode
        self._check_tokens = check_expected_tokens
        self._step_inputs = None
        self._seen: dict = {}
        self.stats = {"steps": 0, "slot_runs": 0, "violations": 0, "verify_skipped_steps": 0,
                      "dropped_rows": 0, "sweeps": 0}

    def pre_forward(self, req_pool_indices, prefix_lens, extend_seq_lens, table, input_ids, positions,
                    out_cache_loc, *, expected_tokens=None, expected_tokens_valid_lens=None):
        if not self._check_tokens:
            expected_tokens = expected_tokens_valid_lens = None
        vp, wp = ops.plan(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity=self._capacity,
                          write_req_capacity=self._plans[1].capacity, out=self._plans,
                          req_to_verify_expected_tokens=expected_tokens,
                          req_to_verify_expected_tokens_valid_lens=expected_tokens_valid_lens)
        ops.verify(self.head, vp, log=self._log, kernel_kind=CanaryLaunchTag.HEAD_K_FULL,
                   check_expected_token=self._check_tokens)
        ops.write(self.head, wp, input_ids, positions, out_cache_loc, log=self._log,
                  kernel_kind=CanaryLaunchTag.HEAD_K_FULL)
        self._step_inputs = (input_ids, positions, out_cache_loc)

    def post_forward(self):
        vp, wp = self._plans
        ops.verify(self.tail, vp, log=self._log, kernel_kind=CanaryLaunchTag.TAIL_K_FULL,
                   real_kv_sources=self._sources, real_kv_hash_mode=self._mode,
                   check_expected_token=self._check_tokens)
        ops.write(self.tail, wp, *self._step_inputs, log=self._log, kernel_kind=CanaryLaunchTag.TAIL_K_FULL,
                  real_kv_sources=self._sources, real_kv_hash_mode=self._mode)

    def sweep(self, req_pool_indices, seq_lens, table):
        """Verify-only pass (TAIL buffer, real KV, no token check) over cached sequences."""
        bs = int(req_pool_indices.shape[0])
        total = int(to_numpy(seq_lens).sum())
        vp, _ = ops.plan(req_pool_indices, seq_lens, seq_lens * 0, table, verify_capacity=total, write_req_capacity=bs)
        ops.verify(self.tail, vp, log=self._log, kernel_kind=CanaryLaunchTag.SWEEP_K_FULL,
                   real_kv_sources=self._sources, real_kv_hash_mode=self._mode)
        self.stats["sweeps"] += 1

    def end_step(self):
        self.stats["steps"] += 1
        if self._step_inputs is not None and int(to_numpy(self._plans[0].enable)[0]) == 0:
            self.stats["verify_skipped_steps"] += 1
        self._step_inputs = None
        self._drain()

    def check(self):
        self._drain()

    def report(self) -> ShimReport:
        return ShimReport(tuple(v for v, _ in self._seen.values()), tuple(n for _, n in self._seen.values()))

    def _drain(self):
        log = self._log.read()
        self._log.reset()
        self.stats["slot_runs"] += int(log.slot_run_counters.sum())
        self.stats["violations"] += log.total_violations
        self.stats["dropped_rows"] += log.dropped
        new = []
        for v in log.violations:
            key = (v.kernel_kind, v.slot_idx, v.position, v.fail_reason_bits)
            if key in self._seen:
                self._seen[key][1] += 1
            else:
                self._seen[key] = [v, 1]
                new.append(v)
        if new and callable(self._on_violation):
            self._on_violation(ShimReport(tuple(new), (1,) * len(new)))

