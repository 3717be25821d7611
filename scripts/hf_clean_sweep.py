"""Clean runs of transformers' engine under kvcanary hf's coverage: the lost-store check's false positives.

    python scripts/hf_clean_sweep.py [--seeds 4] [--device cpu]

Runs the clean configurations of ``kvcanary hf`` and two tighter caches (20 blocks; 10 blocks of 16
tokens), each with ``--seeds`` workloads, the canary attached with deep fingerprints of every layer
and the lost-store check, and prints the steps, the stores the lost-store check examined, the
unexplained violations (false positives) and the labelled findings; exits 1 when any violation was
unexplained.  Not part of CI (about 20 s on a 2-core machine); the README quotes its figure.
"""

from __future__ import annotations

import argparse
import collections
import sys

from kvcanary_cupy.hf import CLEAN_CONFIGS, HfEngineConfig
from kvcanary_cupy.hf.runner import run_engine, tiny_llama

CONFIGS = {**CLEAN_CONFIGS, "tight_20_blocks": {"num_blocks": 20}, "tight_10_blocks_of_16": {"num_blocks": 10, "block_size": 16}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    engine = HfEngineConfig()
    model = tiny_llama(engine, args.device, seed=0)
    total = collections.Counter()
    for name, overrides in CONFIGS.items():
        for seed in range(args.seeds):
            outcome = run_engine(model, engine, overrides, seed=seed)
            total.update(steps=outcome.steps, stores_checked=outcome.written_tokens, unexplained=len(outcome.violations))
            total.update(v.finding for v in outcome.findings)
            for v in outcome.violations:
                print(f"{name} seed {seed}: {v.format()}")
    print(", ".join(f"{k} {v}" for k, v in total.items()))
    return 1 if total["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
