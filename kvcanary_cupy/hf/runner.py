"""``kvcanary hf``: the canary attached to transformers' real continuous-batching engine.

A tiny random-weight Llama built from a config (no download) serves a workload of prompts with
shared prefixes (prefix-cache hits, chunked prefill) under :func:`kvcanary_cupy.integrations.
transformers.attach`.  Each fault class (:mod:`.faults`) gets ``rounds`` runs of its own, each with
one fault injected inside the engine; then the clean configurations run without faults.  A run's
violation counts as a detection when it is unexplained (not a documented engine finding) and was
first seen at or after the step the fault fired in; an unexplained violation before it, or any in
a clean run, is a false positive.  The result has ``kvcanary sim``'s JSON schema, table and plot
(:mod:`kvcanary_cupy.sim.report`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..integrations._hf_step import FIRST_STORE_UNCHANGED
from ..sim.runner import FaultResult, RunStats, SimResult
from .config import HfEngineConfig
from .faults import FAULTS

DEVICES = ("cpu", "cuda")
#: The clean configurations: (name, ContinuousBatchingConfig / GenerationConfig overrides).
CLEAN_CONFIGS = {
    "prefix_sharing_chunked_prefill": {},
    "no_sharing": {"allow_block_sharing": False},
    "tight_cache_soft_resets": {"num_blocks": 14, "requests": 8},
    "forks_with_sampling": {"num_return_sequences": 3, "do_sample": True, "requests": 4},
    "block_size_16": {"block_size": 16},
}


@dataclass(frozen=True)
class HfConfig:
    seed: int = 0
    faults: tuple = tuple(FAULTS)
    rounds: int = 2
    device: str = "cpu"
    addressing: str = "transformers CSR (read_index)"
    engine: HfEngineConfig = field(default_factory=HfEngineConfig)

    def __post_init__(self):
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"kvcanary hf: unknown fault class {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        if self.device not in DEVICES:
            raise ValueError(f"kvcanary hf: device must be cpu or cuda, got {self.device!r}")
        if self.seed < 0:
            raise ValueError(f"kvcanary hf: seed must be >= 0, got {self.seed}")
        if self.rounds < 1:
            raise ValueError(f"kvcanary hf: rounds must be >= 1, got {self.rounds}")

    @property
    def steps(self) -> int:  # sim's table names the run's length in steps; here it is a count of runs
        return self.rounds * len(self.faults)


def tiny_llama(engine: HfEngineConfig, device: str, seed: int):
    """A random-weight Llama from a config (nothing downloaded), in eval mode on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=engine.hidden_size, intermediate_size=2 * engine.hidden_size,
                         num_hidden_layers=engine.num_layers, num_attention_heads=engine.num_heads,
                         num_key_value_heads=engine.num_kv_heads, vocab_size=engine.vocab_size,
                         max_position_embeddings=1024)
    return LlamaForCausalLM(config).to(device).eval()


def workload(rng, requests: int, block_size: int, vocab: int) -> list:
    """Prompts in three families sharing a prefix of two or three blocks; some are exactly their
    shared blocks (5.17 then recomputes the last prompt token into a cached block)."""
    families = [list(rng.integers(1, vocab, block_size * int(rng.integers(2, 4)))) for _ in range(3)]
    prompts = []
    for i in range(requests):
        prefix = families[i % 3]
        tail = [] if i % 5 == 4 else list(rng.integers(1, vocab, int(rng.integers(1, 2 * block_size))))
        prompts.append([int(t) for t in prefix + tail])
    return prompts


def configs(engine: HfEngineConfig, overrides: dict):
    """(ContinuousBatchingConfig, GenerationConfig, requests) of one run."""
    import transformers
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    o = dict(overrides)
    block = o.pop("block_size", engine.block_size)
    size = {"block_size": block} if transformers.__version__ < "5.23" else {"page_size": block}
    gen = GenerationConfig(max_new_tokens=engine.max_new_tokens, do_sample=o.pop("do_sample", False), eos_token_id=-1,
                           pad_token_id=0, num_return_sequences=o.pop("num_return_sequences", 1))
    requests = o.pop("requests", engine.requests)
    cb = ContinuousBatchingConfig(num_blocks=o.pop("num_blocks", engine.num_blocks), max_batch_tokens=engine.max_batch_tokens,
                                  use_cuda_graph=False, seed=0, **size, **o)
    return cb, gen, requests, block


@dataclass
class Outcome:
    """One engine run under the canary."""

    steps: int
    outputs: dict
    violations: tuple  # unexplained ones
    findings: tuple
    stats: dict
    step_us: list
    canary_us: list
    written_tokens: int = 0  # KV stores the steps made: the slots the lost-store check examined (with it on)


def run_engine(model, engine: HfEngineConfig, overrides: dict, seed: int, fault=None, *, canary: bool = True,
               progress=None) -> Outcome:
    """``model.generate_batch`` over a seeded workload, the canary attached (and ``fault`` injected)."""
    from ..integrations.transformers import attach
    from .harness import Harness

    cb, gen, requests, block = configs(engine, overrides)
    rng = np.random.default_rng(seed)
    prompts = workload(rng, requests, block, engine.vocab_size)
    harness = Harness(model, fault, np.random.default_rng(seed + 1), progress)
    with harness:
        if not canary:
            outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
            return Outcome(harness.steps, outputs, (), (), {}, harness.step_us, [], harness.written_tokens)
        with attach(model, on_violation="ignore", sweep_every=engine.sweep_every, **engine.coverage_options()) as c:
            outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    report = c.report()
    return Outcome(harness.steps, outputs, tuple(v for v in report.violations if v.finding is None),
                   tuple(v for v in report.violations if v.finding is not None), c.stats, harness.step_us, harness.canary_us,
                   harness.written_tokens)


@dataclass
class HfResult(SimResult):
    """``kvcanary sim``'s result, with the lost-store check's false-positive rate over the clean runs
    (``clean.lost_store_check`` in the JSON: the slots it examined and the ones it flagged)."""

    lost_store_checked: int = 0
    lost_store_flagged: int = 0  # unexplained write_kv_not_stored rows: false positives
    lost_store_first_use: int = 0  # rows labelled first_store_unchanged_bytes (reported, not counted)

    def to_json(self) -> dict:
        doc = super().to_json()
        if self.config.engine.check_lost_stores:
            n, k = self.lost_store_checked, self.lost_store_flagged
            doc["clean"]["lost_store_check"] = {"checked_slots": n, "flagged_slots": k,
                                                "false_positive_rate": k / n if n else None,
                                                "labelled_first_store_rows": self.lost_store_first_use}
        return doc

    @property
    def notes(self) -> list:
        """Lines the table adds under the clean run."""
        lost = self.to_json()["clean"].get("lost_store_check")
        if lost is None:
            return []
        return [f"lost-store check over the clean runs: {lost['flagged_slots']} of {lost['checked_slots']} written slots "
                f"flagged (false-positive rate {_fmt_rate(lost['false_positive_rate'])}); "
                f"{lost['labelled_first_store_rows']} labelled {FIRST_STORE_UNCHANGED} (a slot's first store)"]


def _fmt_rate(rate) -> str:
    return "-" if rate is None else f"{rate:.2g}"


def _add(stats: RunStats, outcome: Outcome, counters) -> None:
    stats.steps += outcome.steps
    stats.step_us += outcome.step_us
    stats.canary_us += outcome.canary_us
    counters["findings"] = counters.get("findings", 0) + len(outcome.findings)
    for k, v in outcome.stats.items():
        if isinstance(v, int):
            stats.session_stats.setdefault("canary", {}).setdefault(k, 0)
            stats.session_stats["canary"][k] += v


def run(config: HfConfig, *, progress=None) -> SimResult:
    """Every fault class ``rounds`` times, then the clean configurations; after an interrupt, what was
    measured so far (``partial``)."""
    model = tiny_llama(config.engine, config.device, config.seed)
    results = {n: FaultResult(n, FAULTS[n].description, FAULTS[n].detectable_with(engine=config.engine),
                              FAULTS[n].why_not_detectable) for n in config.faults}
    checked = flagged = first_use = 0
    faulty, clean = RunStats(), RunStats()
    try:
        for r in range(config.rounds):
            for i, name in enumerate(config.faults):
                fault = FAULTS[name]()
                seed = config.seed * 1000 + r * 100 + i
                outcome = run_engine(model, config.engine, fault.overrides, seed, fault, progress=progress)
                _add(faulty, outcome, faulty.engine_counters)
                result = results[name]
                if fault.fired_step is None:
                    result.dropped_armed += 1
                    faulty.unattributed += len(outcome.violations)
                    continue
                result.injected += 1
                before = [v for v in outcome.violations if v.first_step < fault.fired_step]
                after = [v for v in outcome.violations if v.first_step >= fault.fired_step]
                faulty.unattributed += len(before)
                faulty.unattributed_examples += [f"{name} round {r}: {v.format()}" for v in before[:3]]
                faulty.violations += len(outcome.violations)
                if after:
                    result.detected += 1
                    result.latencies.append(min(v.first_step for v in after) - fault.fired_step)
                    if result.first_reason is None:
                        first = min(after, key=lambda v: v.first_step)
                        result.first_reason = first.reasons
        for j, (name, overrides) in enumerate(CLEAN_CONFIGS.items()):
            outcome = run_engine(model, config.engine, overrides, config.seed * 1000 + 900 + j, progress=progress)
            _add(clean, outcome, clean.engine_counters)
            clean.violations += len(outcome.violations)
            checked += outcome.written_tokens
            flagged += sum(v.repeats for v in outcome.violations if "write_kv_not_stored" in v.reasons.split("+"))
            first_use += sum(v.repeats for v in outcome.findings if v.finding == FIRST_STORE_UNCHANGED)
            clean.unattributed_examples += [f"{name}: {v.format()}" for v in outcome.violations[:3]]
    except KeyboardInterrupt:
        (clean if clean.steps or faulty.steps >= config.steps else faulty).interrupted = True
    return HfResult(config, list(results.values()), faulty, clean, lost_store_checked=checked, lost_store_flagged=flagged,
                    lost_store_first_use=first_use)

