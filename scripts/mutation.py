"""Mutation testing of the CPU path with mutmut: run it, summarise it, flag unexplained survivors.

    pip install -e ".[test,mutation]"
    python scripts/mutation.py                    # every module of [tool.mutmut] only_mutate
    python scripts/mutation.py hashing strict     # some modules (kvcanary_cupy.<name>)
    python scripts/mutation.py --fresh            # forget cached results (do this to record the score)

mutmut copies the package to ``mutants/``, maps every test to the functions it reaches, then runs,
for each mutant, only the fast CPU tests that reach the mutated function (pyproject.toml
``[tool.mutmut]``).  Results are cached in ``mutants/``: a rerun only retries mutants of functions
that changed.  The script prints the counts per module and exits 1 if a mutant that was not killed
is not listed in docs/mutation-score.md: kill it with a test, or add it there with the reason no
test can (one line each).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCORE_DOC = ROOT / "docs" / "mutation-score.md"
PACKAGE = "kvcanary_cupy"


def mutmut(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=ROOT, **kw)


def statuses() -> dict[str, str]:
    """``{mutant name: status}`` of every mutant mutmut knows (killed, survived, no tests, ...)."""
    out = mutmut("results", "--all", "true", capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s*(\S+__mutmut_\d+): (.+?)\s*$", out, re.M))


def documented() -> set[str]:
    """Mutant names listed (in backquotes, at the start of a list item) in docs/mutation-score.md."""
    if not SCORE_DOC.exists():
        return set()
    return set(re.findall(r"^\s*[-*] `(\S+__mutmut_\d+)`", SCORE_DOC.read_text(), re.M))


def module_of(name: str) -> str:
    return name.split(".x", 1)[0].removeprefix(PACKAGE + ".")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="modules under kvcanary_cupy, e.g. ops backends.numpy_backend")
    parser.add_argument("--fresh", action="store_true", help="delete mutants/ first (no cached results)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel mutant runs (default: CPUs)")
    args = parser.parse_args()

    if args.fresh:
        shutil.rmtree(ROOT / "mutants", ignore_errors=True)
    # one thread per test process: the workers already use every core
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    patterns = [f"{PACKAGE}.{m}.*" for m in args.modules]
    run = mutmut("run", "--max-children", str(args.jobs), *patterns, env=env)
    if run.returncode:  # mutmut itself failed (survivors do not change its exit status)
        return run.returncode

    found = statuses()
    if args.modules:
        found = {k: v for k, v in found.items() if module_of(k) in args.modules}
    by_module = collections.defaultdict(collections.Counter)
    for name, status in found.items():
        by_module[module_of(name)][status] += 1
    print(f"\n{'module':<28} {'mutants':>8} {'killed':>8} {'survived':>9} {'other':>6}")
    for module, counts in sorted(by_module.items()):
        total = sum(counts.values())
        other = total - counts["killed"] - counts["survived"]
        print(f"{module:<28} {total:>8} {counts['killed']:>8} {counts['survived']:>9} {other:>6}")
    total = collections.Counter(found.values())
    print(f"{'all':<28} {sum(total.values()):>8} {total['killed']:>8} {total['survived']:>9} "
          f"{sum(total.values()) - total['killed'] - total['survived']:>6}  {dict(total)}")

    listed = documented()
    unexplained = sorted(k for k, v in found.items() if v != "killed" and k not in listed)
    print(f"\n{len(found) - total['killed'] - len(unexplained)} not killed and listed in "
          f"{SCORE_DOC.relative_to(ROOT)}; {len(unexplained)} not listed:")
    for name in unexplained:
        print(f"  {name}: {found[name]}   (python -m mutmut show {name})")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
