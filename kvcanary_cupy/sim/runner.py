"""Run the simulated engine with faults injected one at a time, and measure what the canary sees.

**Attribution.**  One fault is live at a time.  A violation counts as a detection of the live fault
only if its slot lies in the fault's blast radius (:meth:`Engine.blast_radius`: the slots it
touched, every slot of a request or cached block path holding a touched block, since a corrupted
record also breaks its successor's chain check, and the blocks its victims read or wrote, or
any request read whose table held a touched block).  Every
sighting counts, a repeat of a violation the session saw before included.  An episode ends at its
first detection or ``window`` steps after it fired.

**Containment.**  Whenever the canary reports violations, the engine reacts from the reports
alone (:func:`containment.contain`: abort the requests they name, evict the cached blocks holding
a poisoned page and the blocks below them, abort the requests holding those blocks).  A detected
episode ends there: nothing of the simulator's knowledge of the fault repairs it.  From the next
step on, :class:`containment.Aftermaths` measures what is left against the simulator's knowledge
(the requests that kept reading poisoned KV: ``leaked``, target 0); for ``window`` steps,
violations inside the episode's blast radius are late sightings of it.  An episode the canary missed (or
whose trigger never came) is repaired with the simulator's knowledge (:meth:`Engine.repair`), so
the next one starts clean.  Any other violation is counted as *unattributed*: it would be a false
positive of the canary or a bug of the simulator.  A clean run (no faults, same seed and length)
must report no violation at all.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..constants import FailReason
from .containment import Aftermath
from ..digest import DigestFailReason
from .engine import Engine, EngineConfig
from .faults import FAULTS, Episode
from .tables import ADDRESSING_MODES
from .transfer import TRANSFER_FAULTS
from .transfer_path import DIGEST_MODES

KNOWN_FAULTS = {**FAULTS, **TRANSFER_FAULTS}  # the transfer classes run with a transfer digest only

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class SimConfig:
    steps: int = 2000
    seed: int = 0
    faults: tuple = tuple(FAULTS)
    rate: float = 0.5  # probability per step of injecting a fault when none is live
    addressing: str = "sglang"
    device: str = "cpu"
    window: int = 16  # steps after firing within which a detection counts
    arm_timeout: int = 24  # steps an armed fault may wait for its trigger before it is dropped
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        unknown = [f for f in self.faults if f not in KNOWN_FAULTS]
        if unknown:
            raise ValueError(f"kvcanary sim: unknown fault class {', '.join(unknown)}; known: {', '.join(KNOWN_FAULTS)}")
        if self.engine.transfer_digest not in DIGEST_MODES:
            raise ValueError(f"kvcanary sim: transfer_digest must be one of {', '.join(DIGEST_MODES)}, got {self.engine.transfer_digest!r}")
        needs = [f for f in self.faults if f in TRANSFER_FAULTS]
        if needs and self.engine.transfer_digest == "off":
            raise ValueError(f"kvcanary sim: fault class {', '.join(needs)} acts on the digested transfer path; "
                             "pass --transfer-digest full or default")
        if self.addressing not in ADDRESSING_MODES:
            raise ValueError(f"kvcanary sim: addressing must be one of {', '.join(ADDRESSING_MODES)}, got {self.addressing!r}")
        if self.device not in DEVICES:
            raise ValueError(f"kvcanary sim: device must be cpu or cuda, got {self.device!r}")
        if self.steps < 1:
            raise ValueError(f"kvcanary sim: steps must be >= 1, got {self.steps}")
        if self.seed < 0:  # NumPy's SeedSequence refuses negative seeds with a traceback
            raise ValueError(f"kvcanary sim: seed must be >= 0, got {self.seed}")
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"kvcanary sim: rate must be in (0, 1], got {self.rate}")
        if self.engine.num_layers < 2:
            raise ValueError("kvcanary sim: the KV pool needs at least 2 layers (layer 0 is fingerprinted, the rest not)")


@dataclass
class FaultResult:
    name: str
    description: str
    detectable: bool
    why_not_detectable: str | None
    injected: int = 0
    detected: int = 0
    latencies: list = field(default_factory=list)
    first_reason: str | None = None
    dropped_armed: int = 0  # armed, but the trigger never came within arm_timeout (nothing corrupted)
    aftermaths: list = field(default_factory=list)  # of containment.Aftermath, one per detection

    def to_json(self) -> dict:
        lat = self.latencies
        leaked = sum(len(a.leaked) for a in self.aftermaths)
        return {
            "name": self.name,
            "description": self.description,
            "injected": self.injected,
            "detected": self.detected,
            "detection_rate": self.detected / self.injected if self.injected else None,
            "latency_steps_median": statistics.median(lat) if lat else None,
            "latency_steps_max": max(lat) if lat else None,
            "first_reason": self.first_reason,
            "detectable": self.detectable,
            "why_not_detectable": self.why_not_detectable,
            "contained": {
                "requests_aborted": sum(a.aborted for a in self.aftermaths),
                "cached_blocks_evicted": sum(a.evicted for a in self.aftermaths),
                "leaked_requests": leaked,  # kept reading poisoned KV after the detection (target 0)
                "leaked_reads": sum(a.leaked_reads for a in self.aftermaths),
                "still_poisoned_slots": sum(len(a.poisoned) for a in self.aftermaths),
            },
        }


@dataclass
class RunStats:
    steps: int = 0
    violations: int = 0  # violations seen (a distinct one once per step it is seen in)
    late_sightings: int = 0  # violations of a contained fault, inside its blast radius, within `window` steps
    unattributed: int = 0
    unattributed_examples: list = field(default_factory=list)  # the first few, as text
    step_us: list = field(default_factory=list)  # host CPU time of each engine step
    canary_us: list = field(default_factory=list)  # host CPU time of the canary calls of each step
    canary_device_us: list = field(default_factory=list)  # CUDA events around the canary calls (None: a kernel sample)
    model_device_us: list = field(default_factory=list)
    canary_kernel_us: list = field(default_factory=list)  # the same events on the kernel samples that held (StepTimer)
    kernel_samples_spoiled: int = 0  # kernel samples whose spin ended before the step's last canary call was queued
    canary_ops: list = field(default_factory=list)  # library ops of the canary calls of each step (session.call_ops)
    canary_bound_us: list = field(default_factory=list)  # those ops at the bound path's per-op host figures
    engine_counters: dict = field(default_factory=dict)
    session_stats: dict = field(default_factory=dict)
    interrupted: bool = False  # KeyboardInterrupt: ``steps`` counts the steps that completed


@dataclass
class SimResult:
    config: SimConfig
    faults: list  # of FaultResult
    faulty: RunStats
    clean: RunStats

    @property
    def partial(self) -> bool:
        """True when an interrupt stopped the run: the counts cover only ``steps_run``."""
        return self.faulty.interrupted or self.clean.interrupted

    def to_json(self) -> dict:
        """The report in the fixed schema: partial, steps_run, config, faults, clean, cost."""
        cfg = asdict(self.config)
        cfg["faults"] = list(self.config.faults)
        cfg["engine"] = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg["engine"].items()}
        return {
            "partial": self.partial,
            "steps_run": {"faulty": self.faulty.steps, "clean": self.clean.steps},
            "config": cfg,
            "faults": [f.to_json() for f in self.faults],
            "clean": {"steps": self.clean.steps, "false_positives": self.clean.violations},
            "cost": cost_summary(self.clean),
        }


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def _ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def cost_summary(run: RunStats) -> dict:
    """Per step medians of the clean run, in microseconds: host CPU time of this thread (the engine's
    whole step, and the canary calls within it); device time from CUDA events (only under CUDA):
    around the eager calls (``canary_device_us``) and on the kernel samples (``canary_kernel_us``,
    the calls run back to back: :class:`engine.StepTimer`); the library ops per step and the two
    targets as ratios (each <= 2): host time against those ops at the bound path's per-op host
    figures on the H200 (``session.BOUND_HOST_US``; only under CUDA, where those figures apply), and
    event time against kernel time."""
    step, canary = _median(run.step_us), _median(run.canary_us)
    device, kernel, bound = _median(run.canary_device_us), _median(run.canary_kernel_us), _median(run.canary_bound_us)
    gpu = run.canary_device_us and any(v is not None for v in run.canary_device_us)
    return {
        "measured_on": "clean run",
        "engine_step_host_us": step,
        "canary_host_us": canary,
        "canary_host_fraction": round(canary / step, 3) if step else None,
        "canary_device_us": device,
        "model_kv_store_device_us": _median(run.model_device_us),
        "canary_verified_entries_per_step": round(sum(s["verified_entries"] for s in run.session_stats.values()) / max(run.steps, 1), 1),
        "canary_kernel_us": kernel,
        "kernel_samples": len([v for v in run.canary_kernel_us if v is not None]),
        "kernel_samples_spoiled": run.kernel_samples_spoiled,
        "canary_event_x_kernel": _ratio(device, kernel),
        "canary_ops_per_step": _median(run.canary_ops),
        "canary_bound_host_us": bound if gpu else None,
        "canary_host_x_bound": _ratio(canary, bound) if gpu else None,
    }


def _array_modules(device: str):
    if device == "cpu":
        return np, None
    import cupy

    return cupy, cupy


def reason_label(bits: int) -> str:
    """The canary's and the digest's fail-reason names of ``bits``, joined by ``+``."""
    names = [n for n in FailReason.label(bits).split("+") if n != "none"]
    names += [m.name.lower() for m in DigestFailReason if bits & m.value]
    return "+".join(names) or "none"


def simulate(config: SimConfig, *, faults=None, progress=None) -> tuple[list, RunStats]:
    """One run of ``config.steps`` steps with ``faults`` (default: the config's) injected."""
    names = config.faults if faults is None else faults
    xp, cupy = _array_modules(config.device)
    engine = Engine(config.engine, seed=config.seed, addressing=config.addressing, xp=xp, cupy=cupy)
    results = {}
    for n in names:
        cls = KNOWN_FAULTS[n]
        detectable = cls.detectable_with(config.addressing, config.engine)
        results[n] = FaultResult(n, cls.description, detectable, None if detectable else cls.why_not_detectable)
    rotation = [KNOWN_FAULTS[n]() for n in names]
    turn = 0
    episode: Episode | None = None
    stats = RunStats()
    seen = 0

    def unattributed(pool_violations):
        stats.unattributed += len(pool_violations)
        live = "none" if episode is None else f"{episode.fault.name} (fired at {episode.fired_step})"
        for p, v in pool_violations[: max(0, 10 - len(stats.unattributed_examples))]:
            stats.unattributed_examples.append(f"step {step} pool {p} live fault {live}: {v.format()}")

    try:
        for _ in range(config.steps):
            step = engine.step_index
            if episode is None and rotation and engine.fault_rng.random() < config.rate:
                fault = rotation[turn % len(rotation)]
                turn += 1
                candidate = Episode(fault, step)
                if fault.inject(engine, candidate):
                    episode = engine.hook = candidate
            t0 = time.thread_time()
            engine.step()
            step_us = (time.thread_time() - t0) * 1e6
            timing = engine.timer.take()
            # a kernel sample's check() waits out the spin (a spinning sync counts as CPU time): not a step's cost
            stats.step_us.append(step_us if timing["kernel_sample"] is None else None)
            stats.canary_us.append(timing["canary_host_us"])
            stats.canary_device_us.append(timing["canary_device_us"])
            stats.model_device_us.append(timing["model_device_us"])
            stats.canary_kernel_us.append(timing["canary_kernel_us"])
            stats.kernel_samples_spoiled += timing["kernel_sample"] == "spoiled"
            if timing["canary_ops"]:  # a step that ran no canary call has no mix to count
                stats.canary_ops.append(timing["canary_ops"])
                stats.canary_bound_us.append(timing["canary_bound_us"])
            reported = engine.take_violations()
            seen += len(reported)
            stats.steps += 1
            if progress is not None:
                progress(1)
            live = episode is not None and episode.fired_step is not None
            radius = {p: engine.blast_radius(p, episode) for p in engine.pools} if live and reported else {}
            hits, others = [], []
            for p, v in reported:
                if v.slot_idx in radius.get(p, ()):
                    hits.append(v)
                elif engine.aftermaths.explains(p, v.slot_idx, step):
                    stats.late_sightings += 1
                else:
                    others.append((p, v))
            if reported:  # the engine's reaction, from the reports alone
                aborted, evicted = engine.contain(reported)
            if hits:
                aftermath = Aftermath(episode.fault.name, step, engine.poisoned_slots(episode),
                                      {r.rid for r in episode.victims - episode.bystanders if r.alive},
                                      {r.rid for r in episode.bystanders},
                                      {p: frozenset(r) for p, r in radius.items()}, step + config.window,
                                      aborted=len(aborted), evicted=len(evicted))
                engine.aftermaths.add(aftermath)
                results[episode.fault.name].aftermaths.append(aftermath)
            if episode is None:
                unattributed(others)
                continue
            result = results[episode.fault.name]
            if episode.fired_step is None:
                unattributed(others)
                if step - episode.armed_step >= config.arm_timeout:
                    result.dropped_armed += 1
                    engine.repair(episode)
                    episode = None
                continue
            unattributed(others)
            if hits:
                result.injected += 1
                result.detected += 1
                result.latencies.append(step - episode.fired_step)
                if result.first_reason is None:
                    bits = 0
                    for v in hits:
                        bits |= v.fail_reason_bits
                    result.first_reason = reason_label(bits)
                engine.end_episode()  # contained from the report alone
            elif step - episode.fired_step >= config.window - 1:
                result.injected += 1
                engine.repair(episode)  # missed: the simulator cleans up, so the next episode starts clean
            else:
                continue
            episode = None
    except KeyboardInterrupt:  # keep what was measured; the caller reports the run as partial
        stats.interrupted = True
    stats.violations = seen
    stats.engine_counters = dict(engine.counters)
    stats.session_stats = {name: dict(pool.session.stats) for name, pool in engine.pools.items()}
    if engine.digest is not None:
        stats.engine_counters["digest_verdicts"] = engine.digest.verdicts
    return list(results.values()), stats


def run(config: SimConfig, *, progress=None) -> SimResult:
    """The faulty run, then a clean run of as many steps; after an interrupt (KeyboardInterrupt),
    what was measured so far, with ``partial`` set (an interrupted faulty run skips the clean one)."""
    faults, faulty = simulate(config, progress=progress)
    _, clean = simulate(config, faults=(), progress=progress) if not faulty.interrupted else ((), RunStats())
    return SimResult(config, faults, faulty, clean)
