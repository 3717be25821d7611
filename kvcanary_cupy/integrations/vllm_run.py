"""``kvcanary vllm``: the fault-injection run of ``kvcanary sim`` on vLLM's real (CPU) engine.

A tiny random-weight Llama built from a config (no download) is served by ``vllm.LLM`` with its
engine core in this process and prefix caching on.  Every episode runs the same workload (requests
sharing a two-block prompt, so later requests hit blocks earlier ones write, some in the same
step) through ``llm.generate`` with a fresh canary attached; a faulty episode arms one fault of
:mod:`.vllm_faults`, which fires once at vLLM's own data structures.  A violation detects the
fault when it names one of the fault's victims or lies in the slots it touched; anything else is
*unattributed*.  A clean episode must report nothing, with the same greedy tokens as a run without
the canary.  The JSON, table and PNG are ``kvcanary sim``'s (:mod:`kvcanary_cupy.sim.report`).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from ..sim.runner import FaultResult, RunStats, cost_summary
from .vllm_faults import FAULTS

#: The models a run can serve: tiny (the CI job) and the benchmark's 8-layer / 512-hidden one.
MODELS = {"tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2),
          "8x512": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4)}
BLOCK_SIZE = 32  # the CPU attention backend takes multiples of 32
# The share of the machine's memory vLLM's CPU worker asks for at startup (its 0.92 default fails on
# a shared machine); the KV pool itself is VLLM_CPU_KVCACHE_SPACE (1 GiB) and 64 blocks of it are used.
MEMORY_UTILIZATION = 0.3


@dataclass(frozen=True)
class VllmRunConfig:
    seed: int = 0
    faults: tuple = tuple(FAULTS)
    episodes: int = 1  # injections per fault class
    requests: int = 10
    max_tokens: int = 12
    model: str = "tiny"
    dtype: str = "float32"
    real_kv_hash_mode: str = "PARTIAL"
    device: str = "cpu"
    addressing: str = "vllm"  # for the shared report (the plot's subtitle)

    @property
    def steps(self) -> int:  # the plot's and table's "steps" of the faulty run, filled after it
        return 0


@dataclass
class VllmRunResult:
    config: VllmRunConfig
    faults: list
    faulty: RunStats
    clean: RunStats
    outputs_unchanged: bool = True
    victims: dict = field(default_factory=dict)  # fault name -> (victims, named)

    @property
    def partial(self) -> bool:
        return self.faulty.interrupted or self.clean.interrupted

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        cfg["faults"] = list(self.config.faults)
        faults = []
        for f in self.faults:
            entry = f.to_json()
            victims, named = self.victims.get(f.name, ((), ()))
            entry.update(victims=sorted(victims), victims_named=sorted(named))
            faults.append(entry)
        return {"partial": self.partial, "steps_run": {"faulty": self.faulty.steps, "clean": self.clean.steps},
                "config": cfg, "faults": faults,
                "clean": {"steps": self.clean.steps, "false_positives": self.clean.violations,
                          "outputs_unchanged": self.outputs_unchanged},
                "cost": cost_summary(self.clean)}


def tiny_llama(folder: str, model: str = "tiny", seed: int = 0) -> str:
    """A random-weight Llama saved in ``folder`` (created by transformers from a config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=1024, **MODELS[model])
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def start_engine(folder: str, *, dtype: str = "float32", max_num_seqs: int = 8, num_blocks: int = 64,
                 block_size: int = BLOCK_SIZE, **kwargs):
    """``vllm.LLM`` over ``folder``: eager, prefix caching, the engine core in this process.  (On a
    CPU with AMX tiles bfloat16 takes vLLM's AMX kernels, whose packed K and V are not fingerprinted.)"""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(model=folder, enforce_eager=True, block_size=block_size, enable_prefix_caching=True, max_num_seqs=max_num_seqs,
               max_model_len=512, dtype=dtype, skip_tokenizer_init=True, num_gpu_blocks_override=num_blocks,
               gpu_memory_utilization=MEMORY_UTILIZATION, **kwargs)


def workload(seed: int, requests: int):
    """Prompts sharing a 64-token (two-block) prefix, each with its own 40 to 59 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(2 * BLOCK_SIZE)]
    return [{"prompt_token_ids": shared + [rng.randrange(1, 500) for _ in range(rng.randrange(40, 60))]}
            for _ in range(requests)]


class _Episode:
    """Hooks one fault (or none) and the step timing onto the engine for one ``generate``."""

    def __init__(self, llm, fault):
        core = llm.llm_engine.engine_core.engine_core
        self.runner = core.model_executor.driver_worker.worker.model_runner
        self.manager = core.scheduler.kv_cache_manager
        self.fault, self.step, self.step_us = fault, 0, []

    def __enter__(self):
        runner, manager, fault = self.runner, self.manager, self.fault
        prepare, lookup, execute = runner._prepare_inputs, manager.get_computed_blocks, runner.execute_model

        def prepare_inputs(*args, **kwargs):
            out = prepare(*args, **kwargs)
            if fault is not None and fault.fired_step is None and fault.on_inputs(runner, self.step):
                fault.fired_step = self.step
            return out

        def get_computed_blocks(request):
            if fault is not None and fault.fired_step is None and fault.on_lookup(manager, request):
                fault.fired_step = self.step
            return lookup(request)

        def execute_model(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return execute(*args, **kwargs)
            finally:
                self.step_us.append((time.thread_time() - t0) * 1e6)
                self.step += 1

        runner._prepare_inputs, manager.get_computed_blocks, runner.execute_model = prepare_inputs, get_computed_blocks, execute_model
        return self

    def __exit__(self, *exc):
        for obj, name in ((self.runner, "_prepare_inputs"), (self.manager, "get_computed_blocks"), (self.runner, "execute_model")):
            del obj.__dict__[name]


def run_episode(llm, prompts, params, fault, *, mode: str):
    """One ``generate`` with a fresh canary: (tokens per request, report, stats, step times, canary times)."""
    from .vllm import attach

    llm.reset_prefix_cache()
    with _Episode(llm, fault) as episode:
        canary = attach(llm, on_violation="ignore", real_kv_hash_mode=mode)
        canary._timing = []
        try:
            out = llm.generate(prompts, params, use_tqdm=False)
        finally:
            canary.detach()
    return ([o.outputs[0].token_ids for o in out], canary.report(), canary.stats, episode.step_us, canary._timing)


def _matches(v, fault) -> bool:
    return bool(set(v.request_ids) & fault.victims) or v.slot_idx in fault.slots


def run(config: VllmRunConfig, *, progress=None) -> VllmRunResult:
    """The faulty episodes, then the clean one (and a reference run without the canary)."""
    from vllm import SamplingParams

    from .vllm_layouts import has_strided_sources

    params = SamplingParams(max_tokens=config.max_tokens, temperature=0, ignore_eos=True)
    prompts = workload(config.seed, config.requests)
    faulty, clean = RunStats(), RunStats()
    results, victims = [], {}
    with tempfile.TemporaryDirectory(prefix="kvcanary-vllm-") as folder:
        llm = start_engine(tiny_llama(folder, config.model, config.seed), dtype=config.dtype)
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        try:
            for n, name in enumerate(config.faults):
                cls = FAULTS[name]
                blind = name == "cached_block_bit_flip_k" and not has_strided_sources()
                result = FaultResult(name, cls.description, not blind,
                                     "K is stored transposed and this build has no strided real-KV source" if blind else None)
                hurt, named = set(), set()
                for e in range(config.episodes):
                    fault = cls(random.Random(config.seed * 1000 + 10 * n + e))
                    _, report, stats, steps, _ = run_episode(llm, prompts, params, fault, mode=config.real_kv_hash_mode)
                    faulty.steps += len(steps)
                    faulty.violations += len(report.violations)
                    if fault.fired_step is None:
                        result.dropped_armed += 1
                        continue
                    result.injected += 1
                    hits = [v for v in report.violations if _matches(v, fault)]
                    other = [v for v in report.violations if not _matches(v, fault)]
                    faulty.unattributed += len(other)
                    faulty.unattributed_examples += [f"{name}: {v.format()}" for v in other[:3]]
                    hurt |= fault.victims
                    named |= {r for v in hits for r in v.request_ids} & fault.victims
                    if hits:
                        result.detected += 1
                        result.latencies.append(max(0, min(v.first_step for v in hits) - fault.fired_step))
                        if result.first_reason is None:
                            first = min(v.first_step for v in hits)
                            bits = 0
                            for v in hits:
                                bits |= v.fail_reason_bits if v.first_step == first else 0
                            from ..constants import FailReason

                            result.first_reason = FailReason.label(bits)
                    if progress is not None:
                        progress(1)
                results.append(result)
                victims[name] = (hurt, named)
            tokens, report, stats, steps, timing = run_episode(llm, prompts, params, None, mode=config.real_kv_hash_mode)
        except KeyboardInterrupt:
            faulty.interrupted = True
            return VllmRunResult(config, results, faulty, clean, True, victims)
        clean.steps = len(steps)
        clean.violations = len(report.violations)
        clean.unattributed_examples = [v.format() for v in report.violations[:10]]
        clean.step_us, clean.canary_us = steps, timing
        clean.session_stats = {"vllm": stats}
        if progress is not None:
            progress(1)
    return VllmRunResult(config, results, faulty, clean, tokens == reference, victims)


def median_us(values) -> float | None:
    return round(statistics.median(values), 1) if values else None

