"""FlashInfer-based engines: the canary planned from the CSR page table handed to FlashInfer; a page
allocated twice caught.

Three requests over a pool of 16-slot pages.  Every step builds what such an engine passes to
``BatchPrefillWithPagedKVCacheWrapper.plan`` / ``BatchDecodeWithPagedKVCacheWrapper.plan``
(``kv_indptr``, ``kv_indices``; ``kv_last_page_len`` is not needed) and calls kv-canary:

  with the step's page table:     plan(None, prefix_lens = cached tokens per request,
                                       extend_seq_lens = qo lengths, PagedKvIndices(kv_indptr, kv_indices, page_size))
  before attention reads the KV:  verify(canary, verify_plan)
  with the step's new tokens:     write(canary, write_plan, input_ids, positions, out_cache_loc)

Rows of a CSR table are batch rows, so there are no request-pool indices.  Before step 2 a
simulated allocator bug hands request 2 a page that request 0 still owns: request 2's write
overwrites request 0's canary rows and the next verify reports it.

    python examples/engines_flashinfer.py [--gpu]
"""

import argparse
import sys

import numpy as np

import kvcanary_cupy as kc
from kvcanary_cupy.interop import cuda_unavailable_reason

PAGE_SIZE, NUM_PAGES = 16, 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="use CuPy arrays (the CUDA kernels)")
    args = parser.parse_args()
    if args.gpu:
        reason = cuda_unavailable_reason()
        if reason:
            print(f"engines_flashinfer --gpu: {reason}", file=sys.stderr)
            return 2
    xp = __import__("cupy") if args.gpu else np

    free_pages = list(np.random.default_rng(1).permutation(np.arange(1, NUM_PAGES)))
    pages = [[], [], []]  # each request's pages, in order
    like = xp.zeros(1, np.int32)
    canary = kc.allocate_canary_buffer(NUM_PAGES * PAGE_SIZE, like=like)
    log = kc.ViolationLog.allocate(ring_capacity=256, like=like)
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=NUM_PAGES * PAGE_SIZE, max_running_requests=3, like=like)

    cached = np.zeros(3, np.int64)
    caught = []
    for step in range(4):
        qo_lens = np.array([18, 10, 31] if step == 0 else [1, 1, 1], np.int64)
        ids, positions, out_cache_loc = [], [], []
        for r in range(3):
            for p in range(cached[r], cached[r] + qo_lens[r]):
                if p % PAGE_SIZE == 0:
                    if step == 2 and r == 2:  # the bug: request 0's page handed out again
                        pages[r].append(pages[0][0])
                        print(f"step {step}: page {pages[0][0]} of request 0 handed to request 2 as well")
                    else:
                        pages[r].append(free_pages.pop())
                out_cache_loc.append(pages[r][p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
                positions.append(p)
                ids.append(1000 * r + p)
        # The engine's FlashInfer inputs of this step.
        kv_indptr = xp.asarray(np.cumsum([0] + [len(x) for x in pages]).astype(np.int32))
        kv_indices = xp.asarray(np.concatenate(pages).astype(np.int32))
        a = lambda v: xp.asarray(np.asarray(v, np.int64))

        vp, wp = planner.plan(None, a(cached), a(qo_lens), kc.PagedKvIndices(kv_indptr, kv_indices, PAGE_SIZE))
        kc.verify(canary, vp, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        kc.write(canary, wp, a(ids), a(positions), a(out_cache_loc), log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
        cached += qo_lens
        report = log.read()  # a host sync: an engine reads the log one step late instead
        caught.append(report.total_violations)
        print(f"step {step}: verified {int(vp.verify_num_valid[0])} slots; violations so far: {report.total_violations}")

    print()
    print(log.read())
    if caught[2] != 0 or caught[3] == 0:
        raise SystemExit("expected a clean run until the doubly allocated page is read")


if __name__ == "__main__":
    sys.exit(main())
