"""Prometheus metrics of a :class:`~kvcanary_cupy.CanarySession` (optional extra ``prometheus``).

:class:`SessionMetrics` registers a collector that reads ``session.stats`` at every scrape, so
the numbers are always the session's own (exact, under its lock) and nothing is added to the
step loop.  Every series (each launch tag, each fail reason) is exported from the start, at 0,
so a dashboard tells "no violation" from "not running"; the heartbeat gauge
``kvcanary_last_handled_step`` stops moving when the canary stops.  Labels: ``rank`` (the
session's rank in its ``process_group``, or the one given), ``tag`` (launch tag), ``reason``
(fail reason).  docs/distributed.md ("Metrics") lists the series.
"""

from __future__ import annotations

from typing import Any

from .constants import CanaryLaunchTag, FailReason
from .errors import fail, public_api
from .reporting import reason_name

#: ``(name without the _total suffix, stats key, help)`` of each counter without a tag or reason label.
COUNTERS = (
    ("kvcanary_steps", "steps", "Steps ended (end_step calls)"),
    ("kvcanary_verified_entries", "verified_entries", "Plan entries verified by handled steps and sweeps"),
    ("kvcanary_dropped_rows", "dropped_rows", "Violations counted but never read (the ring filled within one step)"),
    ("kvcanary_verify_skipped_steps", "verify_skipped_steps", "Steps whose verify was skipped (verify_capacity overflow)"),
    ("kvcanary_verify_skipped_sweeps", "verify_skipped_sweeps", "Sweeps whose verify was skipped (verify_capacity overflow)"),
    ("kvcanary_health_failures", "health_failures", "Steps in which a HEAD or TAIL launch tag ran no canary kernel"),
    ("kvcanary_out_of_range_skipped", "out_of_range_skipped", "Plan inputs and kernel items out of the canary's range, never verified"),
    ("kvcanary_sweeps", "sweeps", "Sweeps launched"),
    ("kvcanary_replica_mismatches", None, "Replicated-KV mismatches found by this rank's group (replicated_kv=True)"),
)
TAGS = tuple(t.name for t in CanaryLaunchTag)
REASONS = tuple(reason_name(m) for m in FailReason)


def _import_prometheus():
    try:
        import prometheus_client
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:
        raise ImportError("kv-canary: kvcanary_cupy.metrics needs prometheus_client: "
                          "pip install kvcanary-cupy[prometheus]") from exc
    return prometheus_client, CounterMetricFamily, GaugeMetricFamily


class SessionMetrics:
    """Export a session's counters to a Prometheus registry.

    Parameters
    ----------
    session : CanarySession
        The session whose ``stats`` each scrape reads.
    registry : prometheus_client.CollectorRegistry, optional
        Where to register (default: ``prometheus_client.REGISTRY``).
    rank : int, optional
        The ``rank`` label; default the session's rank in its ``process_group``, else 0.

    Series (all labelled ``rank``): counters ``kvcanary_steps_total``,
    ``kvcanary_verified_entries_total``, ``kvcanary_violations_total{tag}`` (exact, per launch
    tag), ``kvcanary_violation_rows_total{reason}`` (rows read, per fail reason),
    ``kvcanary_dropped_rows_total``, ``kvcanary_verify_skipped_steps_total``,
    ``kvcanary_verify_skipped_sweeps_total``, ``kvcanary_health_failures_total``,
    ``kvcanary_out_of_range_skipped_total``, ``kvcanary_sweeps_total``,
    ``kvcanary_replica_mismatches_total``; gauges ``kvcanary_last_handled_step`` (heartbeat: the
    steps whose log was handled) and ``kvcanary_pending_steps``.

    Raises
    ------
    ImportError
        prometheus_client is not installed (one line naming the extra).
    TypeError
        ``session`` is not a CanarySession.

    Examples
    --------
    >>> registry = prometheus_client.CollectorRegistry()       # doctest: +SKIP
    >>> metrics = kc.metrics.SessionMetrics(session, registry=registry)  # doctest: +SKIP
    >>> registry.get_sample_value("kvcanary_steps_total", {"rank": "0"})  # doctest: +SKIP
    0.0
    """

    @public_api
    def __init__(self, session: Any, *, registry: Any = None, rank: int | None = None):
        from .session import CanarySession

        prometheus_client, self._counter, self._gauge = _import_prometheus()
        if not isinstance(session, CanarySession):
            fail(TypeError, f"session must be a CanarySession, got {type(session).__name__}")
        if rank is None:
            rank = session.distributed.rank if session.distributed is not None else 0
        self.session, self.rank = session, str(rank)
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.registry.register(self)

    def unregister(self) -> None:
        """Remove the series from the registry (e.g. when the session ends)."""
        self.registry.unregister(self)

    def describe(self):
        """The series without reading the session (prometheus_client calls it at registration)."""
        return self._families(None)

    def collect(self):
        """Every series, read from ``session.stats`` now."""
        return self._families(self.session.stats)

    def _families(self, stats):
        rank, get = self.rank, (lambda key: 0 if stats is None else stats[key])
        out = []
        for name, key, text in COUNTERS:
            family = self._counter(name, text, labels=["rank"])
            if key is None:
                reducer = self.session.distributed
                value = reducer.stats["replica_mismatches"] if stats is not None and reducer is not None else 0
            else:
                value = get(key)
            family.add_metric([rank], value)
            out.append(family)
        by_tag = {} if stats is None else stats["violations_by_tag"]
        family = self._counter("kvcanary_violations", "Violations counted (exact), per launch tag", labels=["rank", "tag"])
        for tag in TAGS:
            family.add_metric([rank, tag], by_tag.get(tag, 0))
        out.append(family)
        by_reason = {} if stats is None else stats["violations_by_reason"]
        family = self._counter("kvcanary_violation_rows", "Violation rows read, per fail reason", labels=["rank", "reason"])
        for reason in REASONS:
            family.add_metric([rank, reason], by_reason.get(reason, 0))
        out.append(family)
        heartbeat = self._gauge("kvcanary_last_handled_step", "Steps whose log the canary has handled (heartbeat)",
                                labels=["rank"])
        heartbeat.add_metric([rank], get("steps") - get("pending_steps"))
        pending = self._gauge("kvcanary_pending_steps", "Steps staged and not handled yet", labels=["rank"])
        pending.add_metric([rank], get("pending_steps"))
        return out + [heartbeat, pending]
