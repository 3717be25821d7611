"""A session's violation bookkeeping and policy: decoding staged records into distinct violations,
attributing them to the verify entries that read their slot, and handing new ones to ``on_violation``.

Violations are deduplicated by ``(kernel_kind, slot_idx, position, fail_reason_bits)``.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..args import ATTRIBUTION, STAGE_HEADER, STAGE_HEADER_FIELDS
from ..constants import FailReason
from ..errors import CanaryCoverageWarning, CanaryHealthError, CanaryUsageError, CanaryViolationError, fail
from ..interop import allocate
from ..log import ViolationLog
from ..planner import CanaryCapacityWarning
from ..reporting import Reader, Violation, ViolationReport, reason_name, tag_name
from ..validation import check_int

if TYPE_CHECKING:
    from .staging import _Record

logger = logging.getLogger("kvcanary_cupy")

#: Distinct violations a session keeps.  When the table is full, a new key evicts the oldest one
#: (first seen longest ago): every new violation still reaches the policy and ``report()``; the
#: evicted keys and their rows are counted in ``stats`` (``evicted_violations``, ``untracked_rows``).
MAX_DISTINCT_VIOLATIONS = 65536
#: Under ``on_violation="log"``, this many new violations at once add a summary line.
LOG_SUMMARY_AT = 5
#: Reads of a violating slot one violation keeps (``Violation.readers``, the newest); older ones are
#: counted in its ``readers_dropped`` and in ``stats["dropped_readers"]``.
MAX_READERS = 128
#: The violations an error message lists (the rest are in its ``report``).
MESSAGE_MAX_LINES = 20
POLICIES = ("raise", "log", "ignore")
#: The launch groups that each own a share of ``ring_capacity`` rows of the session's ring (and a
#: ticket counter), so that one group's flood cannot starve another's rows.
RING_GROUPS = ("head", "tail", "sweep")

_ATTRIBUTION = {name: i for i, name in enumerate(ATTRIBUTION)}
_ROWS, _MATCHES, _ENABLE, _NUM_VALID, _PLAN_OUT_OF_RANGE = (
    STAGE_HEADER.index(k) for k in ("rows", "matches", "enable", "verify_num_valid", "plan_out_of_range"))
_PACKAGE_DIR = os.path.dirname(__file__)


def _warn(message: str, category) -> None:
    """Warn at the first frame outside this package (the engine's call of a session method)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called _warn
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class ViolationsMixin:
    """The results half of :class:`~kvcanary_cupy.session.CanarySession`: what handling a staged
    record adds (decoded without changing anything, then committed under the lock), the report,
    the stats and the ``on_violation`` policy."""

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
        violating slots past the attribution capacity), ``dropped_readers`` (reads of violating slots
        past ``MAX_READERS`` per violation), ``staging_waits`` (stagings that waited for the oldest
        staged record: the host was ``STAGED_RECORDS`` stagings ahead of the device).  Safe to
        read from another thread.
        """
        with self._lock:
            s = dict(self._stats)
            counters = self._counter_arrays()
            total = int(counters[0].sum())
            s.update(
                pending_steps=sum(r.origin == "step" for r in self._pending),
                violations=total,
                distinct_violations=len(self._distinct),
                violations_by_reason={k: n for k, n in self._rows_by_reason.items() if n},
                violations_by_tag={tag_name(k): int(n) for k, n in enumerate(counters[0]) if n},
                dropped_rows=total - s["rows_read"],
                out_of_range_skipped=self._out_of_range_skipped(),
            )
        if self.same_step is not None:  # a host read of three counters
            counts = self.same_step.counts()
            s.update(same_step_verified=counts["verified_as_written"], same_step_deeper=counts["deeper_than_waves"])
        return s

    def close(self) -> None:
        """Stop the ``process_group`` reductions' worker thread (after the reduction it runs); a
        no-op without a group, idempotent.  Call :meth:`check` on every rank first: a reduction
        not read yet is never judged.  Dropping the session, or the interpreter exiting, does the same.
        """
        if self.distributed is not None:
            self.distributed.close()

    def gather_report(self, dst: int = 0) -> ViolationReport | None:
        """Every rank's :meth:`report` merged (:meth:`ViolationReport.merge`) on rank ``dst`` of the
        session's ``process_group``; None on the other ranks.

        A blocking collective outside the step loop: every rank must call it.  Each violation
        carries its ``rank`` and ``device``.
        """
        if self.distributed is None:
            fail(CanaryUsageError, "gather_report() needs a session built with a process_group")
        dst = check_int(dst, "dst", minimum=0)
        if dst >= self.distributed.world_size:
            fail(ValueError, f"dst must be a rank of the process_group (< {self.distributed.world_size}), got {dst}")
        return self.distributed.gather_report(self.report(), dst)

    def __repr__(self) -> str:
        s = self.stats
        c = self.planner.capacities
        policy = self.on_violation if isinstance(self.on_violation, str) else "callable"
        window = f", swa_window_size={self.planner.swa_window_size}" if self.planner.swa_window_size else ""
        return (f"CanarySession(num_slots={self.num_slots}, on={self._placement.describe()}, "
                f"max_batch_size={self.max_batch_size}, verify_capacity={c.verify_capacity}, "
                f"ring_capacity={self.log.capacity // len(RING_GROUPS)}, on_violation={policy!r}{window}, "
                f"steps={s['steps']}, violations={s['violations']}, distinct={s['distinct_violations']})")

    def _refuse_in_policy(self, what: str) -> None:
        if self._in_policy:
            fail(CanaryUsageError, f"{what}() from inside the on_violation callback: the callback runs within "
                                   "end_step()/check(); return from it and call end_step() for the next step")

    def _out_of_range_skipped(self) -> int:
        kernels = self._latest[self._layout.counters + 3 * self.log.num_kinds : self._layout.ring]  # out-of-range counters
        return int(sum(kernels)) + self._plan_out_of_range["step"] + self._plan_out_of_range["sweep"]

    def _decode(self, record: _Record):
        """What handling ``record`` adds: ``(head, stats increments, health problem or None, rows
        per reason, key -> [new Violation or None, rows])``."""
        head = record.head.tolist()  # the header and the exact int64 counters, in one read
        origin, problem = record.origin, None
        # a plain dict of distinct keys (a Counter costs ~10 us to build); the rows' decoding adds to a Counter of it
        add = {f"verify_skipped_{origin}s": 1} if head[_ENABLE] == 0 else {"verified_entries": max(head[_NUM_VALID], 0)}
        if origin == "step":
            runs, before = (head[self._runs_at[0]], head[self._runs_at[1]]), self._runs_at_last_step
            if runs[0] <= before[0] or runs[1] <= before[1]:
                stalled = [tag.name for tag, now, was in zip((self.head_tag, self.tail_tag), runs, before) if now <= was]
                add["health_failures"] = 1
                problem = (f"kv-canary: no canary kernel ran for launch tags {stalled} in step {record.step} "
                           "(between two end_step calls); is pre_forward()/post_forward() part of the graph you replay?")
        by_reason, keys = {}, {}
        if head[_ROWS]:
            add = collections.Counter(add)
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
            keys[key] = [replace(_attribute(v, matching, record.labels), first_step=record.step), 1, readers]
        return by_reason, keys

    def _commit(self, record: _Record, head, add, problem, by_reason, keys) -> None:
        """Apply one decoded record (under the lock): plain assignments and dict updates only."""
        stats, distinct, step = self._stats, self._distinct, record.step
        self._latest = head
        self._plan_out_of_range[record.origin] = head[_PLAN_OUT_OF_RANGE]
        if record.origin == "step":
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

    def _warn_after(self, origin: str) -> None:
        """The session's one-time warnings, once the record that calls for them is handled."""
        if not self._capacity_warned and self._stats[f"verify_skipped_{origin}s"]:
            self._capacity_warned = True
            _warn(f"kv-canary: a {origin}'s verify plan overflowed verify_capacity={self.planner.capacities.verify_capacity}, "
                  "so its verify was skipped; further skips are counted in session.stats['verify_skipped_steps'/'_sweeps']. "
                  "Raise verify_capacity.", CanaryCapacityWarning)
        if not self._coverage_warned and self._out_of_range_skipped():
            self._coverage_warned = True
            _warn(f"kv-canary: {self._out_of_range_skipped()} plan inputs or kernel items were out of range of the "
                  f"canary (slots past num_slots={self.num_slots}: a canary smaller than the pool, rows past the table, "
                  "or write tokens past max_step_tokens) "
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
        violations = tuple(replace(v, repeats=n, last_step=last, readers=tuple(readers), readers_dropped=dropped,
                                   **self._origin) for v, n, last, readers, dropped in entries)
        return ViolationReport(violations=violations, total_violations=int(c[0].sum()), ring_capacity=self.log.capacity,
                               violation_counters=c[0], slot_run_counters=c[1], kernel_run_counters=c[2],
                               out_of_range_counters=c[3],
                               rows_read=self._stats["rows_read"], steps=self._stats["steps"])

    def _apply_policy(self) -> None:
        if self._new or self._problems or self._undelivered:  # most steps: nothing new, nothing to take
            self._deliver(*self._take_new())

    def _take_new(self):
        """The new violation keys, health problems and evicted new entries handled since the last take."""
        taken = self._new, self._problems, self._undelivered
        self._new, self._problems, self._undelivered = {}, [], {}
        return taken

    def _deliver(self, new, problems, undelivered, verdict=None) -> None:
        """Apply the policy to ``new`` keys and ``problems``; with a group, to its ``verdict`` too
        (the same on every rank: what any rank found, with this rank's own findings)."""
        elsewhere = verdict is not None and verdict.violations_anywhere
        if verdict is not None:
            problems = problems + verdict.remote_problems()
        if not new and not problems and not elsewhere:
            return
        report = None
        if new or elsewhere:
            report = self._report([self._distinct.get(k) or undelivered[k] for k in new])
        if elsewhere:
            report = replace(report, ranks=verdict.ranks, replica_mismatches=verdict.mismatches)
        headline = f"kv-canary: {len(new)} new violation(s)" + (verdict.where() if verdict is not None else "")
        policy = self.on_violation
        if policy == "raise":
            if report is not None:
                for problem in problems:
                    logger.error(problem)
                lines = [v.format() for v in report.violations[:MESSAGE_MAX_LINES]]
                if len(report.violations) > MESSAGE_MAX_LINES:
                    lines.append(f"... {len(report.violations) - MESSAGE_MAX_LINES} more in the error's .report")
                lines += [m.format() for m in report.replica_mismatches[:MESSAGE_MAX_LINES]]
                raise CanaryViolationError(headline + ":\n" + "\n".join(lines) + "\n" + report.summary(), report)
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
            for m in report.replica_mismatches:
                logger.warning(m.format())
            if elsewhere:
                logger.warning(headline)
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


def _matching_entries(v: Violation, entries) -> list:
    """The attribution entries of ``v``'s slot that could have produced it (same position verdict,
    same expected token), in entry order."""
    position_failed = bool(v.fail_reason_bits & FailReason.VERIFY_POSITION_MISMATCH)
    a = _ATTRIBUTION
    return [e for e in entries
            if (e[a["expected_position"]] != v.position) == position_failed
            and (v.expected_token == -1 or e[a["expected_token"]] == v.expected_token)]


def _readers(record: "_Record", matching) -> list:
    """A :class:`Reader` per matching attribution entry of one staged record."""
    labels, sweep, row = record.labels, record.origin == "sweep", _ATTRIBUTION["batch_row"]
    return [Reader(record.step, e[row], labels[e[row]] if labels is not None and 0 <= e[row] < len(labels) else None, sweep)
            for e in matching]


def _attribute(v: Violation, matching, labels=None) -> Violation:
    """``v`` with the batch rows, expected position and predecessor of the verify entries that
    read its slot and could have produced it (:func:`_matching_entries`), and with ``labels`` (the
    step's row labels) the request ids of those rows."""
    a = _ATTRIBUTION
    if not matching:
        return v
    first = matching[0]
    chain_failed = bool(v.fail_reason_bits & FailReason.VERIFY_CHAIN_HASH_MISMATCH)
    rows = tuple(sorted({e[a["batch_row"]] for e in matching if e[a["batch_row"]] >= 0}))
    if labels is not None:  # pre_forward's row_labels: the engine's request ids of these rows
        v = replace(v, request_ids=tuple(dict.fromkeys(str(labels[r]) for r in rows if r < len(labels))))
    return replace(v, batch_rows=rows,
                   expected_position=first[a["expected_position"]],
                   prev_slot_idx=first[a["prev_slot"]] if chain_failed else None)
