"""NVRTC compile time of the kernel families, cold, on the CPU (no GPU needed).

For each family: the whole family as ``kc.warmup()`` and a first call compile it today (every
instantiation in one module), and its most expensive single instantiation alone (what a call
compiling only the instantiation it needs would wait for).  Then two families compiled at once on
two threads against one after the other, which says whether NVRTC releases the GIL (it helps only
on a machine with cores to spare).  Each compile gets a source of its own, so no cache answers.

    python benchmarks/cold_compile.py [--arch sm_90] [--families plan_req_to_token,write,verify]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvcanary_cupy.backends.cuda import compile as cc  # noqa: E402

_IDS = itertools.count()


def compile_seconds(family: str, exprs, arch: str) -> float:
    from cupy_backends.cuda.libs import nvrtc

    source = cc.family_source(family) + f"\n// cold_compile {os.getpid()} {next(_IDS)} {time.time_ns()}\n"
    t0 = time.perf_counter()
    prog = nvrtc.createProgram(source, cc.FAMILIES[family].filename, [], [])
    try:
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        nvrtc.compileProgram(prog, [*cc.NVRTC_OPTIONS, f"-arch={arch}"])
        nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--families", default="plan_req_to_token,write,verify")
    args = parser.parse_args()
    families = list(cc.FAMILIES) if args.families == "all" else args.families.split(",")
    print(f"NVRTC cold compile seconds ({args.arch}, CPU of this machine)")
    print(f"{'family':<24} {'variants':>8} {'whole':>8} {'one alone':>10} {'one':<50}")
    total = 0.0
    for fam in families:
        exprs = cc.FAMILIES[fam].instantiations()
        whole = compile_seconds(fam, exprs, args.arch)
        total += whole
        one = exprs[-1]  # every flag on: the largest instantiation
        alone = compile_seconds(fam, [one], args.arch)
        print(f"{fam:<24} {len(exprs):>8} {whole:>8.1f} {alone:>10.1f} {one:<50}", flush=True)
    print(f"{'all of the above':<24} {'':>8} {total:>8.1f}")
    if len(families) >= 2:
        a, b = families[:2]
        jobs = [(a, cc.FAMILIES[a].instantiations()[-1:]), (b, cc.FAMILIES[b].instantiations()[-1:])]
        t0 = time.perf_counter()
        for fam, exprs in jobs:
            compile_seconds(fam, exprs, args.arch)
        serial = time.perf_counter() - t0
        threads = [threading.Thread(target=compile_seconds, args=(fam, exprs, args.arch)) for fam, exprs in jobs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parallel = time.perf_counter() - t0
        print(f"two single instantiations ({a}, {b}): one after the other {serial:.1f} s, on two threads "
              f"{parallel:.1f} s ({serial / parallel:.2f}x; {os.cpu_count()} CPUs here, shared)")


if __name__ == "__main__":
    main()
