"""SGLang with a unified pool: the canary planned through virtual token ids and virtual_to_physical;
pages compacted with their canary rows; a compaction that loses its page-map update caught.

``req_to_token`` holds virtual token ids; ``virtual_to_physical`` maps each virtual page of
PAGE_SIZE tokens to a physical page (-1 = unbound).  Every step calls kv-canary with the
ForwardBatch's tensors:

  after req_to_token and out_cache_loc are set:  plan(req_pool_indices, extend_prefix_lens,
                                                      extend_seq_lens, ReqToToken(req_to_token,
                                                      virtual_to_physical=..., page_size=...))
  before attention reads the KV cache:           verify(canary, verify_plan)
  with the step's new tokens:                    write(canary, write_plan, input_ids, positions,
                                                       physical slots of out_cache_loc)
  when a compaction moves physical pages:        move_pages(canary, src_pages, dst_pages, page_size=...)

Step 2 compacts two pages correctly (the canary rows move with them: verify stays clean).  Before
step 3 a compaction moves a page but loses the page-map update: the table still points at the
page's old place, which move_pages cleared, and verify reports it.  (For a plain req_to_token of
physical slots, pass the array itself: see examples/quickstart.py.)

    python examples/engines_sglang.py [--gpu]
"""

import argparse
import sys

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.interop import cuda_unavailable_reason

PAGE_SIZE, NUM_PAGES, MAX_LEN = 4, 24, 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="use CuPy arrays (the CUDA kernels)")
    args = parser.parse_args()
    if args.gpu:
        reason = cuda_unavailable_reason()
        if reason:
            print(f"engines_sglang --gpu: {reason}", file=sys.stderr)
            return 2
    xp = __import__("cupy") if args.gpu else np

    req_to_token = np.zeros((4, MAX_LEN), np.int32)  # row 0: the CUDA-graph padding row
    virtual_to_physical = np.full(NUM_PAGES + 1, -1, np.int64)
    free_virtual = list(range(1, NUM_PAGES + 1))
    free_physical = list(range(NUM_PAGES - 1, 0, -1))  # handed out from the top: compaction moves pages down
    like = xp.zeros(1, np.int32)
    canary = kc.allocate_canary_buffer(NUM_PAGES * PAGE_SIZE, like=like)  # one row per physical slot
    log = kc.ViolationLog.allocate(ring_capacity=256, like=like)
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=NUM_PAGES * PAGE_SIZE, max_running_requests=4, like=like)

    reqs, lengths = np.array([1, 2, 3]), np.zeros(3, np.int64)
    caught = []
    for step in range(4):
        if step >= 2:  # compaction: move the two highest pages in use down to free low pages
            used = sorted((int(p), v) for v, p in enumerate(virtual_to_physical) if p > 0)
            moves = [(p, v, q) for (p, v), q in zip(used[-2:], sorted(free_physical)[:2])]
            src = xp.asarray(np.array([p for p, _, _ in moves], np.int64))
            dst = xp.asarray(np.array([q for _, _, q in moves], np.int64))
            kc.move_pages(canary, src, dst, page_size=PAGE_SIZE)  # with the engine's KV copy, same stream
            for i, (p, v, q) in enumerate(moves):
                free_physical.remove(q)
                free_physical.append(p)
                if step == 3 and i == 0:
                    print(f"step {step}: page {p} moved to {q} but virtual page {v} still maps to {p}")
                else:
                    virtual_to_physical[v] = q
        extend = np.full(3, 6 if step == 0 else 1, np.int64)
        ids, positions, out_cache_loc = [], [], []
        for i, r in enumerate(reqs):
            for p in range(lengths[i], lengths[i] + extend[i]):
                if p % PAGE_SIZE == 0:  # a new virtual page, bound to a physical page
                    v = free_virtual.pop(0)
                    virtual_to_physical[v] = free_physical.pop()
                    req_to_token[r, p:p + PAGE_SIZE] = v * PAGE_SIZE + np.arange(PAGE_SIZE)
                token = int(req_to_token[r, p])
                out_cache_loc.append(virtual_to_physical[token // PAGE_SIZE] * PAGE_SIZE + token % PAGE_SIZE)
                positions.append(p)
                ids.append(1000 * r + p)
        a = lambda v: xp.asarray(np.asarray(v, np.int64))
        table = kc.ReqToToken(xp.asarray(req_to_token), virtual_to_physical=xp.asarray(virtual_to_physical),
                              page_size=PAGE_SIZE)

        vp, wp = planner.plan(a(reqs), a(lengths), a(extend), table)
        kc.verify(canary, vp, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        kc.write(canary, wp, a(ids), a(positions), a(out_cache_loc), log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        lengths += extend
        report = log.read()  # a host sync: an engine reads the log one step late instead
        caught.append(report.total_violations)
        print(f"step {step}: verified {int(vp.verify_num_valid[0])} slots; violations so far: {report.total_violations}")

    print()
    print(log.read())
    if caught[2] != 0 or caught[3] == 0:
        raise SystemExit("expected a clean run through the first compaction, then violations")


if __name__ == "__main__":
    sys.exit(main())
