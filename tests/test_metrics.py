"""kvcanary_cupy.metrics scraped from a real prometheus_client registry: every series at 0 before
the first step, then the session's own numbers, in the text format Prometheus scrapes."""

import subprocess
import sys
import textwrap

import pytest

import kvcanary_cupy as kc
from session_engine import ToyEngine

TAGS = [t.name for t in kc.CanaryLaunchTag]
REASONS = ["verify_chain_hash", "verify_position", "verify_real_kv_hash", "write_token", "write_position", "verify_token"]


def _loop(ab, session, engine, steps, fault_step):
    for step in range(steps):
        arrays = {k: ab.asarray(v) for k, v in engine.step([1, 2]).items()}
        if step == fault_step:
            engine.rtt[1, 2] = engine.rtt[2, 4]  # a stale table entry: 4 distinct violations a step from here
        session.pre_forward(arrays["rp"], arrays["prefix"], arrays["extend"], ab.asarray(engine.rtt), arrays["ids"],
                            arrays["pos"], arrays["loc"])
        session.post_forward()
        session.end_step()
    session.check()


def test_every_series_starts_at_zero_then_follows_the_session(ab):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    engine = ToyEngine()
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore")
    kc.metrics.SessionMetrics(session, registry=registry, rank=3)
    value = lambda name, **labels: registry.get_sample_value(name, {"rank": "3", **labels})

    names = ["kvcanary_steps_total", "kvcanary_verified_entries_total", "kvcanary_dropped_rows_total",
             "kvcanary_verify_skipped_steps_total", "kvcanary_verify_skipped_sweeps_total",
             "kvcanary_health_failures_total", "kvcanary_out_of_range_skipped_total", "kvcanary_sweeps_total",
             "kvcanary_replica_mismatches_total", "kvcanary_last_handled_step", "kvcanary_pending_steps"]
    assert [value(n) for n in names] == [0.0] * len(names)
    assert [value("kvcanary_violations_total", tag=t) for t in TAGS] == [0.0] * 12
    assert [value("kvcanary_violation_rows_total", reason=r) for r in REASONS] == [0.0] * 6
    text = prometheus_client.generate_latest(registry).decode()
    assert "# TYPE kvcanary_violations_total counter" in text and "# TYPE kvcanary_last_handled_step gauge" in text
    assert 'kvcanary_violations_total{rank="3",tag="TAIL_K_SWA"} 0.0' in text

    steps, fault_step = 6, 3
    _loop(ab, session, engine, steps, fault_step)
    s = session.stats
    repeats = steps - fault_step
    assert value("kvcanary_steps_total") == value("kvcanary_last_handled_step") == steps
    assert value("kvcanary_verified_entries_total") == s["verified_entries"] > 0
    assert value("kvcanary_violations_total", tag="HEAD_K_FULL") == value("kvcanary_violations_total", tag="TAIL_K_FULL") == 2 * repeats
    assert value("kvcanary_violations_total", tag="SWEEP_K_FULL") == 0
    assert value("kvcanary_violation_rows_total", reason="verify_chain_hash") == 4 * repeats
    assert value("kvcanary_violation_rows_total", reason="verify_position") == 2 * repeats
    assert value("kvcanary_violation_rows_total", reason="verify_real_kv_hash") == 0
    assert value("kvcanary_pending_steps") == 0 and value("kvcanary_health_failures_total") == 0


def test_the_rank_label_defaults_to_0_without_a_group_and_bad_sessions_are_refused():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    session = kc.CanarySession(16, max_batch_size=2)
    metrics = kc.metrics.SessionMetrics(session, registry=registry)
    assert registry.get_sample_value("kvcanary_steps_total", {"rank": "0"}) == 0
    metrics.unregister()
    assert registry.get_sample_value("kvcanary_steps_total", {"rank": "0"}) is None
    with pytest.raises(TypeError, match=r"^kv-canary: session must be a CanarySession, got dict$"):
        kc.metrics.SessionMetrics({}, registry=registry)


def test_without_prometheus_client_the_package_imports_and_metrics_names_the_extra():
    script = textwrap.dedent("""
        import sys
        sys.modules["prometheus_client"] = None
        import kvcanary_cupy as kc
        session = kc.CanarySession(16, max_batch_size=2)
        try:
            kc.metrics.SessionMetrics(session)
        except ImportError as exc:
            print(exc)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout == "kv-canary: kvcanary_cupy.metrics needs prometheus_client: pip install kvcanary-cupy[prometheus]\n"
