"""A fuzz subset for compute-sanitizer: random steps (a third with out-of-range values) on CuPy,
each compared with NumPy (also through the two-launch plan with tiny tiles, and the single-buffer
ones through the fused plan_and_verify step, on its usual grid and on one block), then a whole
step captured in a CUDA graph and replayed with new batch contents (both plan paths), then random
scatters with repeated pool rows, then a CanarySession loop.  CuPy's memory pool is turned off so
every array is its own cudaMalloc and memcheck sees any access past it.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_fuzz.py --cases 40
"""

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import cupy  # noqa: E402

import kvcanary_cupy as kc  # noqa: E402
from conftest import get_backend_or_skip  # noqa: E402
from fuzz_cases import assert_same, make_case, make_move_case, run_case, run_move_case  # noqa: E402
from test_gpu_graphs import SHAPES, TABLES, _prepare, replay_in_cupy_graph  # noqa: E402


def replay_graphs(cupy_ab) -> int:
    """Capture one step per plan path and table in a cupy.cuda.Graph and replay it over changing batches."""
    replays = 0
    for shape in sorted(SHAPES):
        for table in TABLES:
            steps, want, engine = _prepare(cupy_ab, shape, table=table)
            replays += replay_in_cupy_graph(engine, steps, want)
    return replays


def scatter_case(seed: int) -> None:
    """Batch rows racing for a few pool rows, some sources outside flat_in: CuPy writes NumPy's bytes."""
    rng = np.random.default_rng(seed)
    bs, rows, cols = int(rng.integers(1, 3000)), int(rng.integers(1, 6)), int(rng.integers(1, 300))
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 2 * cols, size=bs))])
    offsets[rng.integers(0, bs + 1, size=3)] -= int(rng.integers(0, 20))
    flat = rng.integers(-(2**31), 2**31, size=max(int(offsets.max()), 0) + 1)
    rp = rng.integers(-1, rows + 1, size=bs)
    outs = []
    for xp in (np, cupy):
        pool, count = xp.zeros((rows, cols), np.int32), xp.zeros(1, np.int64)
        kc.scatter_req_token_ids(xp.asarray(flat), xp.asarray(offsets), xp.asarray(rp), pool, out_of_range_count=count)
        outs.append((cupy.asnumpy(pool), cupy.asnumpy(count)))
    for want, got in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(got, want, err_msg=f"scatter seed {seed}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--first", type=int, default=5000)
    parser.add_argument("--scatter-cases", type=int, default=6)
    args = parser.parse_args()
    cupy.cuda.set_allocator(None)
    numpy_ab, cupy_ab = get_backend_or_skip("numpy"), get_backend_or_skip("cupy")
    injected = 0
    for seed in range(args.first, args.first + args.cases):
        case = make_case(seed)
        ref = run_case(numpy_ab, case)
        assert_same(ref, run_case(cupy_ab, case), context=f"seed {seed}")
        last = ref["snapshots"][-1]
        injected += int(last["vp.out_of_range_count"][0] + last["log.out_of_range_counters"].sum() > 0)
    # The two-launch plan (forced for every batch), on half as many cases: on the full grid (a row
    # or none per block, one pass) and on 3 blocks (several tiles per block).
    from unittest import mock

    from kvcanary_cupy.backends.cuda import configs, device as cuda_device

    two_launches = dict(plan_small_max_rows=-1, plan_fused_max_rows=-1, scan_tile_rows=7, plan_scan_state_min_rows=0)
    for blocks in (None, 3):
        with configs.overridden(**two_launches), \
                mock.patch.object(cuda_device, "sm_count", lambda device_id: blocks) if blocks else contextlib.nullcontext():
            for seed in range(args.first, args.first + args.cases // 2):
                case = make_case(seed)
                assert_same(run_case(numpy_ab, case), run_case(cupy_ab, case), context=f"two-launch seed {seed} ({blocks})")
    # Small batches through plan_fused's block-wide scan instead of plan_small, likewise.
    with configs.overridden(plan_small_max_rows=-1):
        for seed in range(args.first, args.first + args.cases // 2):
            case = make_case(seed)
            assert_same(run_case(numpy_ab, case), run_case(cupy_ab, case), context=f"block-scan seed {seed}")
    # The fused plan_and_verify step (one canary buffer: multi-buffer cases are left out), likewise,
    # on its usual grid (a warp per 32 entries) and on one block (each warp many chunks).
    fused = [case for case in map(make_case, range(args.first, args.first + args.cases // 2)) if case.buffers == 1]
    one_block = configs.overridden(one_launch_blocks=1)
    for grid, patch in (("usual grid", contextlib.nullcontext()), ("one block", one_block)):
        with patch:
            for case in fused:
                assert_same(run_case(numpy_ab, case, step="fused"), run_case(cupy_ab, case, step="fused"),
                            context=f"fused step ({grid}) seed {case.seed}")
    for seed in range(args.first, args.first + args.cases):
        case = make_move_case(seed)
        for want, got in zip(run_move_case(numpy_ab, case), run_move_case(cupy_ab, case)):
            assert (want == got).all(), f"move seed {seed}"
    replays = replay_graphs(cupy_ab)
    for seed in range(args.first, args.first + args.scatter_cases):
        scatter_case(seed)
    cupy.cuda.Device().synchronize()
    print(f"sanitizer fuzz: {args.cases} cases (and half as many through the two-launch plan, and through "
          f"the block-scan plan for small batches; {len(fused)} single-buffer ones through plan_and_verify, twice) and "
          f"{args.cases} page moves passed, {injected} with out-of-range values; "
          f"{replays} graph replays and {args.scatter_cases} scatters matched NumPy")
    # A CanarySession loop with a stale table entry: its staging and attribution kernels too.
    from test_session import run_fault_loop

    session = run_fault_loop(cupy_ab, "ignore")[0]
    assert session.report().to_dicts() == run_fault_loop(numpy_ab, "ignore")[0].report().to_dicts()
    cupy.cuda.Device().synchronize()
    print(f"sanitizer session loop: {session.stats['distinct_violations']} distinct violations, as NumPy")


if __name__ == "__main__":
    main()
