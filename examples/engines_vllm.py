"""vLLM v1: the canary planned straight from a KV-cache group's block table; a bad prefix-cache hit caught.

A toy persistent batch of three requests over a pool of 16-slot blocks (block 0 is vLLM's null
block, never handed out).  Every step does what vLLM's model runner does with its tensors and
calls kv-canary at the points docs/engines.md names:

  after the block table and slot_mapping of the step are committed:
      plan(req_pool_indices = persistent-batch rows, prefix_lens = num_computed_tokens,
           extend_seq_lens = query lens, BlockTable(block_table, block_size))
  before the forward reads the KV cache:   verify(canary, verify_plan)
  with the step's new tokens:              write(canary, write_plan, input_ids, positions, slot_mapping)

Before the last step a simulated prefix-cache bug points request 0 at a block that holds request
1's tokens; the verify of that step reports it.

    python examples/engines_vllm.py [--gpu]
"""

import argparse
import sys

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.interop import cuda_unavailable_reason

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS_PER_REQ, MAX_REQS = 16, 32, 8, 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="use CuPy arrays (the CUDA kernels)")
    args = parser.parse_args()
    if args.gpu:
        reason = cuda_unavailable_reason()
        if reason:
            print(f"engines_vllm --gpu: {reason}", file=sys.stderr)
            return 2
    xp = __import__("cupy") if args.gpu else np

    # vLLM's tensors: the group's block table [max_num_reqs, max_num_blocks_per_req] (int32).
    block_table = np.zeros((MAX_REQS, MAX_BLOCKS_PER_REQ), np.int32)
    free_blocks = list(np.random.default_rng(0).permutation(np.arange(1, NUM_BLOCKS)))
    block_table_dev = xp.asarray(block_table)

    num_slots = NUM_BLOCKS * BLOCK_SIZE  # one canary row per KV slot of the group
    canary = kc.allocate_canary_buffer(num_slots, like=block_table_dev)
    log = kc.ViolationLog.allocate(ring_capacity=256, like=block_table_dev)
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=num_slots, max_running_requests=MAX_REQS, like=block_table_dev)

    num_reqs = 3  # persistent-batch rows 0..2: every row is real (no padding row)
    num_computed = np.zeros(num_reqs, np.int64)
    prompt_len = 20
    caught = []
    for step in range(4):
        query_lens = np.full(num_reqs, prompt_len if step == 0 else 1, np.int64)
        ids, positions, slot_mapping = [], [], []
        for row in range(num_reqs):
            for p in range(num_computed[row], num_computed[row] + query_lens[row]):
                if p % BLOCK_SIZE == 0:  # the scheduler allocates a new block
                    block_table[row, p // BLOCK_SIZE] = free_blocks.pop()
                slot_mapping.append(block_table[row, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
                positions.append(p)
                ids.append(1000 * row + p)
        if step == 3:  # the bug: a prefix-cache hit hands request 0 the block holding request 1's tokens
            block_table[0, 0] = block_table[1, 0]
            print(f"step {step}: request 0's block 0 now points at block {block_table[1, 0]} (request 1's)")
        block_table_dev[...] = xp.asarray(block_table)  # vLLM commits the block table to the GPU
        a = lambda v: xp.asarray(np.asarray(v, np.int64))

        vp, wp = planner.plan(a(np.arange(num_reqs)), a(num_computed), a(query_lens),
                              kc.BlockTable(block_table_dev, BLOCK_SIZE))
        kc.verify(canary, vp, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        kc.write(canary, wp, a(ids), a(positions), a(slot_mapping), log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        num_computed += query_lens
        report = log.read()  # a host sync: an engine reads the log one step late instead
        caught.append(report.total_violations)
        print(f"step {step}: verified {int(vp.verify_num_valid[0])} slots; violations so far: {report.total_violations}")

    print()
    print(log.read())
    if caught[2] != 0 or caught[3] == 0:
        raise SystemExit("expected a clean run until the bad prefix-cache hit, then violations")


if __name__ == "__main__":
    sys.exit(main())
