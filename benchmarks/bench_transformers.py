"""Canary host time per engine step inside transformers' continuous batching, and its share of the step.

    python benchmarks/bench_transformers.py [--device cpu|cuda] [--repeats 3] [--coverage] [--profile N [--dump PREFIX]]

For two random-weight Llamas (the tiny one of ``kvcanary hf`` and an 8-layer, 512-hidden one) the
same seeded workload runs through ``generate_batch`` with the canary attached (default options).
Per step: the engine's wall time (batch preparation, the forward with the canary's calls, the
update) and the canary's share of it (its ``compute_batch`` wrapper minus the forward inside, wall
time and this thread's CPU time), medians over all steps of ``--repeats`` runs after a warm-up run;
then the step time of the same runs without the canary, for the ratio.  Wall time moves with the
machine's load: compare the ratios, and the CPU time.  ``--coverage`` adds a row per model with the
coverage ``kvcanary hf`` runs (deep fingerprints of every layer, period 2, and the lost-store check).
The rows the README takes: ``canary us`` (host us per step) and ``share``.  ``--profile N`` then
runs each model once more with the canary's share of each step under cProfile (the forward left
out) and prints its N costliest functions by own and by cumulative time.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from kvcanary_cupy.hf.config import HfEngineConfig
from kvcanary_cupy.hf.harness import Harness
from kvcanary_cupy.hf.runner import configs, tiny_llama, workload
from kvcanary_cupy.devtools.bench.host_setup import print_profile
from kvcanary_cupy.integrations.transformers import attach

MODELS = {
    "tiny (5 layers, 64 hidden)": HfEngineConfig(),
    "8 layers, 512 hidden": HfEngineConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, vocab_size=2048,
                                          num_blocks=96, max_batch_tokens=64, requests=12, max_new_tokens=16),
}


def _run(model, engine: HfEngineConfig, seed: int, options, profile=None):
    """(step us, canary wall us, canary CPU us) of each step; ``options`` None: no canary."""
    cb, gen, requests, block = configs(engine, {})
    prompts = workload(np.random.default_rng(seed), requests, block, engine.vocab_size)
    with Harness(model, None, np.random.default_rng(0), profile=profile) as h:
        if options is not None:
            with attach(model, on_violation="raise", **options):
                model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
        else:
            model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, progress_bar=False)
    return h.step_us, h.canary_us, h.canary_cpu_us


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coverage", action="store_true", help="add rows with kvcanary hf's coverage options")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile each model's canary calls and print the N costliest functions")
    parser.add_argument("--dump", metavar="PREFIX", help="with --profile: write each model's pstats file to PREFIX<i>.prof")
    args = parser.parse_args(argv)
    import torch
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {args.device}, "
          f"{torch.get_num_threads()} torch threads")
    print(f"{'model':<36} {'steps':>6} {'step us':>10} {'canary us':>10} {'share':>7} {'canary CPU us':>14} "
          f"{'no-canary step us':>18} {'ratio':>6}")
    variants = {"": {}}
    if args.coverage:
        variants[" + coverage"] = HfEngineConfig().coverage_options()
    for name, engine in MODELS.items():
        model = tiny_llama(engine, args.device, seed=0)
        for suffix, options in variants.items():
            _run(model, engine, 0, options)  # warm-up: kernels compiled, caches filled
            steps, canary, cpu, plain = [], [], [], []
            for r in range(args.repeats):
                s, c, p = _run(model, engine, 100 + r, options)
                steps, canary, cpu = steps + s, canary + c, cpu + p
                plain += _run(model, engine, 100 + r, None)[0]
            step, cost, bare = statistics.median(steps), statistics.median(canary), statistics.median(plain)
            print(f"{name + suffix:<36} {len(steps):>6} {step:>10.0f} {cost:>10.0f} {100 * cost / step:>6.1f}% "
                  f"{statistics.median(cpu):>14.0f} {bare:>18.0f} {step / bare:>5.2f}x")
    if args.profile:
        import cProfile
        import pstats

        for i, (name, engine) in enumerate(MODELS.items()):
            profile = cProfile.Profile()
            steps = len(_run(tiny_llama(engine, args.device, seed=0), engine, 100, {}, profile)[0])
            if args.dump:
                profile.dump_stats(f"{args.dump}{i}.prof")
            print(f"\ncProfile of the canary's share of {steps} steps, {name} (the forward left out):")
            print_profile(pstats.Stats(profile), steps, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
