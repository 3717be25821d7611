"""The simulator's cost figures (issue #31, real loops): kernel time beside event time through the
spin-held kernel samples, the canary's ops per step and the 2x targets, the bench's loop section,
and the host-path changes leaving the simulator's results as they were."""

import contextlib

import pytest

from conftest import EXPECT_GPU
from kvcanary_cupy.interop import cuda_unavailable_reason
from kvcanary_cupy.sim import SimConfig, run
from kvcanary_cupy.sim import engine as engine_mod
from kvcanary_cupy.sim.session import BOUND_HOST_US, call_ops

COST_KEYS = {"measured_on", "engine_step_host_us", "canary_host_us", "canary_host_fraction", "canary_device_us",
             "model_kv_store_device_us", "canary_verified_entries_per_step", "canary_kernel_us", "kernel_samples",
             "kernel_samples_spoiled", "canary_event_x_kernel", "canary_ops_per_step", "canary_bound_host_us",
             "canary_host_x_bound"}

# Seed 0, 150 steps, every class: (injected, detected, latency max, requests aborted), measured at
# 367ed05, before the timer's kernel samples and the coverage's packed log record.
PINNED = {"stale_prefix_after_eviction": [2, 2, 0, 4], "double_allocation": [2, 2, 0, 1],
          "off_by_one_write_slot": [3, 3, 1, 4], "lost_write": [3, 3, 1, 4], "cached_prefix_bitflip": [2, 2, 3, 0],
          "token_swap": [3, 3, 1, 6], "off_by_one_position": [3, 3, 0, 3], "block_table_swap": [2, 2, 0, 4],
          "late_write_after_abort": [3, 3, 1, 3], "page_move_stale_table": [3, 3, 0, 4],
          "page_move_without_canary": [1, 1, 0, 1], "transfer_wrong_slots": [3, 3, 1, 3],
          "zeroed_table_entry": [3, 3, 0, 3], "kv_store_dropped": [3, 3, 0, 3],
          "unfingerprinted_layer_bitflip": [3, 3, 3, 3]}


@pytest.fixture(scope="module")
def seeded():
    return run(SimConfig(steps=150, seed=0)).to_json()


def test_seeded_detections_are_unchanged(seeded):
    got = {f["name"]: [f["injected"], f["detected"], f["latency_steps_max"], f["contained"]["requests_aborted"]]
           for f in seeded["faults"]}
    assert got == PINNED
    assert seeded["clean"] == {"steps": 150, "false_positives": 0}


def test_cost_fields_on_the_cpu(seeded):
    cost = seeded["cost"]
    assert set(cost) == COST_KEYS
    assert cost["canary_host_us"] > 0 and cost["canary_ops_per_step"] >= 18  # two pools, pre + post + end_step
    for key in ("canary_device_us", "canary_kernel_us", "canary_event_x_kernel", "canary_bound_host_us",
                "canary_host_x_bound", "model_kv_store_device_us"):
        assert cost[key] is None, key
    assert cost["kernel_samples"] == cost["kernel_samples_spoiled"] == 0


def test_call_ops_count_the_session_coverage():
    from kvcanary_cupy.sim.engine import Engine, EngineConfig
    import numpy as np

    pool = Engine(EngineConfig(), seed=0, addressing="sglang", xp=np).pools["prefill"]
    s = pool.session
    assert call_ops(s, "pre_forward") == ("plan", "verify", "write", "launch")  # + lost-store snapshot
    assert call_ops(s, "post_forward") == ("verify", "write", "launch", "launch", "launch")  # lost check, deep write, rotation
    assert call_ops(s, "move") == call_ops(s, "copy") == ("launch", "launch")  # HEAD and TAIL buffers
    assert all(k in BOUND_HOST_US for call in pool.ops.values() for k in call[1])
    plain = Engine(EngineConfig(deep_kv=False, lost_stores=False), seed=0, addressing="sglang", xp=np).pools["decode"]
    assert call_ops(plain.session, "pre_forward") == ("plan", "verify", "write")
    assert call_ops(plain.session, "post_forward") == ("verify", "write")
    with pytest.raises(ValueError, match="call must be one of"):
        call_ops(s, "forward")


class _Event:
    """A CUDA event stand-in: ``done`` as the test sets it; elapsed time 1 ms per pair."""

    def __init__(self, device):
        self.device, self.recorded = device, 0

    def record(self, stream=None):
        self.recorded += 1

    @property
    def done(self):
        return self.device.spin_finished

    def synchronize(self):
        pass


class _Cupy:
    """What StepTimer uses of CuPy."""

    def __init__(self):
        self.spin_finished = False
        self.spins = []
        test = self

        class cuda:
            @staticmethod
            def Event():
                return _Event(test)

            @staticmethod
            def get_elapsed_time(a, b):
                return 1.0

        self.cuda = cuda


@pytest.fixture
def fake_timer(monkeypatch):
    cupy = _Cupy()
    import kvcanary_cupy.devtools.spin as spin_mod

    monkeypatch.setattr(spin_mod, "spin", lambda cycles, stream=None: cupy.spins.append(cycles))
    monkeypatch.setattr(spin_mod, "cycles_per_second", lambda: 1e9)
    return cupy, engine_mod.StepTimer(cupy, sample_every=2)


def _step(timer, *, spin_finished_by_then, cupy):
    timer.begin_step()
    with timer.canary(("pre_forward", ("plan", "verify", "write"))):
        pass
    with timer.canary(("end_step", ("stage",))):
        pass
    cupy.spin_finished = spin_finished_by_then
    timer.enqueued()
    return timer.take()


def test_kernel_samples_and_a_spoiled_one(fake_timer):
    cupy, timer = fake_timer
    plain = _step(timer, spin_finished_by_then=True, cupy=cupy)  # step 1: not sampled, the spin state is not asked
    assert plain["kernel_sample"] is None and plain["canary_device_us"] == 2000.0 and plain["canary_kernel_us"] is None
    assert plain["canary_ops"] == 4 and plain["canary_bound_us"] == pytest.approx(sum(BOUND_HOST_US[k] for k in (
        "plan", "verify", "write", "stage")))
    held = _step(timer, spin_finished_by_then=False, cupy=cupy)  # step 2: sampled, the spin outlasted the enqueueing
    assert held["kernel_sample"] == "ok" and held["canary_kernel_us"] == 2000.0 and held["canary_device_us"] is None
    assert len(cupy.spins) == 1 and cupy.spins[0] >= engine_mod.StepTimer.MIN_SPIN_S * 1e9
    _step(timer, spin_finished_by_then=True, cupy=cupy)
    spoiled = _step(timer, spin_finished_by_then=True, cupy=cupy)  # step 4: the spin ended before the last call
    assert spoiled["kernel_sample"] == "spoiled" and spoiled["canary_kernel_us"] is None
    assert spoiled["canary_device_us"] is None and spoiled["model_device_us"] is None
    assert timer._margin == 6.0  # the next spin is longer
    assert len(timer._spare) >= 4  # the events came back for reuse


def test_spoiled_samples_reach_the_cost_summary():
    from kvcanary_cupy.sim.runner import RunStats, cost_summary

    stats = RunStats(steps=3, canary_us=[10.0, 10.0, 10.0], step_us=[20.0, None, 20.0],
                     canary_device_us=[400.0, None, None], canary_kernel_us=[None, 100.0, None], kernel_samples_spoiled=1,
                     canary_ops=[20, 20, 20], canary_bound_us=[5.0, 5.0, 5.0])
    cost = cost_summary(stats)
    assert cost["canary_kernel_us"] == 100.0 <= cost["canary_device_us"] == 400.0
    assert cost["canary_event_x_kernel"] == 4.0 and cost["kernel_samples"] == 1 and cost["kernel_samples_spoiled"] == 1
    assert cost["canary_host_x_bound"] == 2.0 and cost["engine_step_host_us"] == 20.0


def test_bench_loop_section_on_numpy():
    from kvcanary_cupy.devtools.bench.loop_section import loop_rows

    rows = []
    lines = loop_rows(rows, steps=12)
    (row,) = rows
    assert row["section"] == "loop" and row["backend"] == "numpy" and row["steps"] == 12
    assert row["host_us_per_step"] > 0 and row["ops_per_step"] >= 18
    assert row["event_us_per_step"] is row["kernel_us_per_step"] is row["host_x_bound"] is None
    assert "session loop (numpy)" in lines[0]


def test_loop_section_measures_launch_and_stage_in_the_same_run():
    """The coverage launch's and the stage's per-op figures come from sessions of this run (NumPy
    standing in for CuPy here): three eager loops a round, each synchronised around, and the
    sessions they step stay clean (session_op_us checks them)."""
    import types

    import numpy as np

    from kvcanary_cupy.devtools.bench import Workload, build
    from kvcanary_cupy.devtools.bench.loop_section import session_op_us

    synced = []
    device = types.SimpleNamespace(synchronize=lambda: synced.append(1))
    xp = types.SimpleNamespace(zeros=np.zeros, float16=np.float16, cuda=types.SimpleNamespace(Device=lambda: device))
    d = build(Workload("tiny", 6, 8, 40, 1), np)
    figures = session_op_us(xp, d, rounds=2)
    assert set(figures) == {"launch", "stage"} and all(np.isfinite(v) for v in figures.values())  # differences: noise may take one below 0 here
    assert len(synced) == 2 * 3 * 2  # three eager loops a round, each synchronised before and after


def test_bench_lists_the_loop_section():
    import argparse

    from kvcanary_cupy.devtools import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert "loop" in parser.get_default("sections").split(",")
    assert "loop (" in next(a.help for a in parser._actions if a.dest == "sections")


@pytest.mark.gpu
def test_cuda_kernel_time_within_event_time():
    reason = cuda_unavailable_reason()
    if reason:
        if EXPECT_GPU:
            pytest.fail(reason)
        pytest.skip(reason)
    cost = run(SimConfig(device="cuda", steps=120, seed=0)).to_json()["cost"]
    assert cost["kernel_samples"] >= 10
    assert cost["canary_kernel_us"] is not None and 0 < cost["canary_kernel_us"] <= cost["canary_device_us"]
    assert cost["canary_host_x_bound"] > 0 and cost["canary_event_x_kernel"] >= 1
