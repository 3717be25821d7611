"""``kvcanary bench``: plan, verify and write on five serving workloads; prints a table of ratios.

GPU (``--backend cupy``, the default): device time per call = one CUDA graph holding K calls,
replayed R times, median replay / K (METHOD: one replay per event pair measures the host).  The
floor of each op is the bytes it must move over the device-to-device copy bandwidth measured in
the same run; the baseline is the same plan/verify written with vectorised CuPy ops (cumsum,
searchsorted, gathers), eager, as a user would without this library.
CPU (``--backend numpy``): wall-clock medians of the NumPy backend's free functions, plan and verify
against memory floors measured in the same rounds (``numpy_section``: what each floor counts).

    kvcanary bench [--backend cupy|numpy] [--workloads W1,W2,W3,W4,W5]
                   [--sections ops,detail,tables,capacity,step,overlap,host,coverage,cold,holes,loop] [--out FILE] [--json FILE]

``tables`` times the plan through a vLLM block table and a FlashInfer CSR table (block size 16)
next to the equivalent req_to_token at W1, W3 and W4, against what a user writes without them;
``capacity`` times the plan at write_req_capacity = bs, 4,096 and 65,536.  ``step`` times the fused
decode step (plan_and_verify + write) against plan + verify + write at W1, W3, W4 and W5.
``overlap`` times the plan and the steps with launch overlap (sm_90 and later,
``kvcanary_cupy.backends.cuda.launch``) against plain CuPy launches.
``host`` (issue #10): host microseconds per eager call, back to back, of the free functions and of
the bound path (CanaryPlanner, VerifyLauncher, WriteLauncher; plan_and_verify, which has no bound
launcher, as a free call), with CuPy arrays and with CUDA
torch tensors, against the targets and SGLang's eager calls (``benchmarks/host_profile.py``
profiles the same front door on the CPU).  ``benchmarks/bench_canary.py`` runs the same from a
source checkout.  ``coverage`` (issue #27): a session step with the checks past the record
(``coverage_section``) against SGLang's coverage at W1 and W3.  ``holes`` (issue #27): the verify,
the bound verify and plan_and_verify with ``check_holes`` off and on at W1 and W3
(``holes_section``; with ``--backend numpy`` too).  ``loop`` (issue #31): a CanarySession through
``kvcanary sim``'s per-step mix, host, event and kernel us per step against the 2x targets
(``loop_section``; with ``--backend numpy`` too, host time only).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from kvcanary_cupy.interop import cuda_unavailable_reason
from .workloads import TABLE_WORKLOADS, WORKLOADS, Workload, build
from .cold_section import cold_rows
from .ops_sections import detail_rows, run_gpu
from .numpy_section import run_numpy
from .step_sections import HOST_TARGET_US, STEP_WORKLOADS, host_times, overlap_rows, run_capacity, run_tables, step_rows


# What benchmarks/ and the tests take from here.
__all__ = ["HOST_TARGET_US", "WORKLOADS", "Workload", "add_arguments", "build", "main", "run"]


def _hole_workloads(names, xp) -> dict:
    """name -> (title, inputs) of the workloads of ``names`` the holes section times."""
    from .holes_section import HOLE_WORKLOADS

    return {n: (WORKLOADS[n].name, build(WORKLOADS[n], xp)) for n in names if n in HOLE_WORKLOADS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["cupy", "numpy"], default="cupy",
                        help="cupy: this machine's GPU; numpy: the CPU backend")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    parser.add_argument("--sections", default="ops,detail,tables,capacity,step,overlap,host,coverage,cold,holes,loop",
                        help="GPU sections: ops (plan/verify/write), detail (verify/write: grids, floors, several "
                             "buffers), tables (engine tables), capacity, step (the fused decode step), overlap "
                             "(overlapped launches against plain ones), host, coverage (the checks past the record "
                             "in a session step), cold (first calls and warmup() in a fresh process, empty kernel cache then warm), "
                             "holes (the hole check's cost, also with --backend numpy), loop (a session through "
                             "kvcanary sim's per-step mix: host, event and kernel us per step; also with --backend numpy)")
    parser.add_argument("--out", metavar="FILE", help="also write the table to FILE")
    parser.add_argument("--json", metavar="FILE", help="also write the measurements as JSON to FILE")


def run(args) -> int:
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"kvcanary bench: unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    rows: list = []
    if args.backend == "cupy":
        reason = cuda_unavailable_reason()
        if reason:
            print(f"kvcanary bench: {reason} (or run --backend numpy)", file=sys.stderr)
            return 2
        import cupy

        sections = args.sections.split(",")
        lines = run_gpu(names, rows) if "ops" in sections else []
        if "detail" in sections:
            lines += detail_rows(cupy, names, rows)
        if "tables" in sections:
            lines += run_tables(cupy, [n for n in names if n in TABLE_WORKLOADS], rows)
        if "capacity" in sections:
            lines += run_capacity(cupy, rows)
        if "step" in sections:
            lines += step_rows(cupy, [n for n in names if n in STEP_WORKLOADS], rows)
        if "overlap" in sections:
            lines += overlap_rows(cupy, [n for n in names if n in STEP_WORKLOADS], rows)
        if "host" in sections:
            lines += host_times(cupy, names, rows)
        if "coverage" in sections:
            from .coverage_section import COVERAGE_WORKLOADS, coverage_rows

            lines += coverage_rows(cupy, [n for n in names if n in COVERAGE_WORKLOADS], rows)
        if "cold" in sections:
            lines += cold_rows(rows)
        if "holes" in sections:
            from .holes_section import hole_rows
            from .step_sections import eager_us
            from .timing import time_graph

            lines += hole_rows(_hole_workloads(names, cupy), rows, cupy=cupy, timers=(time_graph, eager_us))
        if "loop" in sections:
            from .loop_section import loop_rows

            lines += loop_rows(rows, cupy=cupy)
    else:
        lines = run_numpy(names, rows)
        if "holes" in args.sections.split(","):
            from .holes_section import hole_rows

            lines += hole_rows(_hole_workloads(names, np), rows)
        if "loop" in args.sections.split(","):
            from .loop_section import loop_rows

            lines += loop_rows(rows)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "workloads": names, "rows": rows}, f, indent=2)
            f.write("\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvcanary bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
