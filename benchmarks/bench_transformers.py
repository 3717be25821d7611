"""Canary host time per engine step inside transformers' continuous batching, and its share of the step.

    python benchmarks/bench_transformers.py [--device cpu|cuda] [--repeats 3]

For two random-weight Llamas (the tiny one of ``kvcanary hf`` and an 8-layer, 512-hidden one) the
same seeded workload runs through ``generate_batch`` with the canary attached.  Per step: the
engine's wall time (batch preparation, the forward with the canary's calls, the update) and the
canary's share of it (its ``compute_batch`` wrapper minus the forward inside), medians over all
steps of ``--repeats`` runs after a warm-up run; then the step time of the same runs without the
canary, for the ratio.  Wall time, so the figures move with the machine's load: compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from kvcanary_cupy.hf.harness import Harness
from kvcanary_cupy.hf.runner import HfEngineConfig, configs, tiny_llama, workload
from kvcanary_cupy.integrations.transformers import attach

MODELS = {
    "tiny (3 layers, 64 hidden)": HfEngineConfig(),
    "8 layers, 512 hidden": HfEngineConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, vocab_size=2048,
                                          num_blocks=96, max_batch_tokens=64, requests=12, max_new_tokens=16),
}


def _run(model, engine: HfEngineConfig, seed: int, canary: bool):
    cb, gen, requests, block = configs(engine, {})
    prompts = workload(np.random.default_rng(seed), requests, block, engine.vocab_size)
    with Harness(model, None, np.random.default_rng(0)) as h:
        if canary:
            with attach(model, on_violation="raise"):
                model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
        else:
            model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return h.step_us, h.canary_us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import torch
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'model':<28} {'steps':>6} {'step us':>10} {'canary us':>10} {'share':>7} {'no-canary step us':>18} {'ratio':>6}")
    for name, engine in MODELS.items():
        model = tiny_llama(engine, args.device, seed=0)
        _run(model, engine, 0, canary=True)  # warm-up: kernels compiled, caches filled
        steps, canary, plain = [], [], []
        for r in range(args.repeats):
            s, c = _run(model, engine, 100 + r, canary=True)
            steps += s
            canary += c
            plain += _run(model, engine, 100 + r, canary=False)[0]
        step, cost, bare = statistics.median(steps), statistics.median(canary), statistics.median(plain)
        print(f"{name:<28} {len(steps):>6} {step:>10.0f} {cost:>10.0f} {100 * cost / step:>6.1f}% {bare:>18.0f} "
              f"{step / bare:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
