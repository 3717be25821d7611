"""CPU profile of the free functions' host path (kc.plan / kc.verify / kc.write / kc.plan_and_verify), no GPU needed.

Each free call runs on long-lived arrays (canary buffer, plans, log, table) as a script would,
with the backend's work taken out: CuPy arrays on the fake device
(``kvcanary_cupy/devtools/fake_cupy.py``: launches recorded, not run), CPU torch tensors and NumPy
arrays with the NumPy backend stubbed.  Prints host microseconds and Python-level calls per call;
``KVCANARY_FULL_VALIDATION=1`` in the environment turns the validation cache off (every call validates
everything), so the two runs show what the cache saves.

    python benchmarks/free_host_profile.py [--workload W1] [--calls 1000] [--top 0]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's package, installed or not

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.devtools.bench.host_setup import (add_arguments, free_ops, measure, placed,  # noqa: E402
                                                     stubbed_numpy_backend, workload)
from kvcanary_cupy.validation_cache import enabled  # noqa: E402


def long_lived_ops(d, move):
    """kc.plan / kc.verify / kc.write on one workload's arrays; ``move`` puts a NumPy array in place."""
    a = placed(d, move)
    vp = kc.VerifyPlan.allocate(d["total_verify"], like=a["rp"])
    wp = kc.WritePlan.allocate(d["bs"], like=a["rp"])
    log = kc.ViolationLog.allocate(1024, like=a["rp"])
    return free_ops(d, a, vp, wp, log)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, workload="W1", calls=1000)
    parser.add_argument("--arrays", default="numpy,torch,cupy")
    args = parser.parse_args()
    d = workload(args.workload)
    cache = "on" if enabled() else "off"
    print(f"free-function host us and Python-level calls per call at {args.workload}, validation cache {cache} "
          "(backend work stubbed out)")
    print(f"{'arrays':<20} {'op':<15} {'us':>8} {'calls':>6}")

    movers = {"numpy": ("NumPy", lambda x: x)}
    try:
        import torch

        movers["torch"] = ("CPU torch", torch.from_numpy)
    except ImportError:
        pass
    wanted = args.arrays.split(",")
    with stubbed_numpy_backend():
        for key, (label, move) in movers.items():
            if key in wanted:
                report(label, long_lived_ops(d, move), args)
    if "cupy" in wanted:
        from kvcanary_cupy.devtools.fake_cupy import fake_device

        with fake_device(record_bytes=False) as dev:
            report("CuPy (fake device)", long_lived_ops(d, dev.asarray), args)


def report(label, ops, args):
    for op, fn in ops.items():
        us, calls = measure(fn, args.calls, args.top)
        print(f"{label:<20} {op:<15} {us:>8.1f} {calls:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
