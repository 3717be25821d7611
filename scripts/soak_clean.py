"""Clean soak of the simulated engine: many steps with no fault, which must report no violation.

    python scripts/soak_clean.py [--steps 100000] [--runs 1] [--seed 0] [--addressing sglang] [--device cpu]

Runs ``--runs`` engines of ``--steps`` / ``--runs`` steps each (seeds ``seed``, ``seed + 1``, ...),
with the default scenario of ``kvcanary sim`` and every check on (holes included), and prints the
steps run, the verify entries checked and the violations seen (false positives); exits 1 when any
was seen.  Not part of CI (100,000 steps took 21 minutes on a shared 2-core machine, every check on); the README
quotes its figure.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvcanary_cupy.sim import SimConfig, simulate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="soak_clean", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=1, help="engines the steps are split over (fresh state each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--addressing", default="sglang")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.runs < 1:
        parser.error("--steps and --runs must be >= 1")
    total = dict(steps=0, violations=0, verified=0, unattributed=0)
    t0 = time.perf_counter()
    for i in range(args.runs):
        steps = args.steps // args.runs + (i < args.steps % args.runs)
        config = SimConfig(steps=steps, seed=args.seed + i, faults=(), addressing=args.addressing, device=args.device)
        _, stats = simulate(config)
        total["steps"] += stats.steps
        total["violations"] += stats.violations
        total["unattributed"] += stats.unattributed
        total["verified"] += sum(s["verified_entries"] for s in stats.session_stats.values())
        for example in stats.unattributed_examples[:5]:
            print("  " + example)
        print(f"run {i + 1}/{args.runs} (seed {args.seed + i}): {stats.steps} steps, {stats.violations} violations", flush=True)
    minutes = (time.perf_counter() - t0) / 60
    print(f"clean soak: {total['steps']:,} steps ({args.addressing}, {args.device}), {total['verified']:,} verify entries "
          f"checked, {total['violations']} false positives, {minutes:.1f} min")
    return 1 if total["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
