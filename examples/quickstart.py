"""A few serving steps of a toy engine with the KV canary, and one deliberate KV-slot bug.

Three requests prefill 6 tokens each, then decode 3 steps.  Before step 3 a simulated allocator
bug hands request 2's KV slot to request 1 (a stale req_to_token entry).  The canary's verify
then reports it.  Runs on the CPU (NumPy) by default; ``--gpu`` runs the same on CUDA via CuPy.

    python examples/quickstart.py [--gpu]
"""

import argparse
import sys

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.interop import cuda_unavailable_reason


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="use CuPy arrays (the CUDA kernels)")
    args = parser.parse_args()
    if args.gpu:
        reason = cuda_unavailable_reason()
        if reason:
            print(f"quickstart --gpu: {reason}", file=sys.stderr)
            return 2
        import cupy as xp
    else:
        xp = np

    # The engine's tables: req_to_token[req_pool_index, position] = KV slot; slot 0 is padding.
    max_reqs, max_len, num_slots = 4, 16, 64
    req_to_token = np.zeros((max_reqs, max_len), np.int32)
    rng = np.random.default_rng(0)
    free_slots = list(rng.permutation(np.arange(1, num_slots)))
    req_to_token_dev = xp.asarray(req_to_token)

    canary = kc.allocate_canary_buffer(num_slots, like=req_to_token_dev)  # int64 [num_slots, 4]
    log = kc.ViolationLog.allocate(ring_capacity=64, like=req_to_token_dev)
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=num_slots, max_running_requests=max_reqs - 1,
                                           like=req_to_token_dev)
    # Launchers bind the long-lived buffers once; each call then checks only the step's arrays.
    verify = kc.VerifyLauncher(canary, planner.verify_plan, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
    write = kc.WriteLauncher(canary, planner.write_plan, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)

    reqs = np.array([1, 2, 3])  # pool rows of the running requests (row 0 = CUDA-graph padding)
    lengths = np.zeros(3, np.int64)
    for step in range(4):
        extend = np.full(3, 6 if step == 0 else 1)
        # Allocate KV slots for the new tokens and build the step's flat token arrays.
        loc, pos, ids = [], [], []
        for i, r in enumerate(reqs):
            for p in range(lengths[i], lengths[i] + extend[i]):
                req_to_token[r, p] = free_slots.pop()
                loc.append(req_to_token[r, p]); pos.append(p); ids.append(1000 * r + p)
        if step == 3:  # the bug: request 1's newest prefix entry now points at request 2's slot
            req_to_token[1, lengths[0] - 1] = req_to_token[2, lengths[1] - 1]
            print(f"step {step}: corrupting req_to_token[1, {lengths[0] - 1}] (a stale table entry)")
        req_to_token_dev[...] = xp.asarray(req_to_token)
        a = lambda v: xp.asarray(np.asarray(v, np.int64))

        vp, wp = planner.plan(a(reqs), a(lengths), a(extend), req_to_token_dev)
        verify()  # before the model reads the KV cache
        write(a(ids), a(pos), a(loc))
        lengths += extend
        report = log.read()  # a host sync: an engine reads the log one step late instead
        print(f"step {step}: planned {int(vp.verify_num_valid[0])} verify entries, "
              f"{int(wp.write_offsets[3])} new tokens; violations so far: {report.total_violations}")

    print()
    print(log.read())


if __name__ == "__main__":
    sys.exit(main())
