"""Randomised plan -> verify -> write -> verify runs: every backend matches NumPy byte for byte.

On the GPU this is the 2,000-case differential of the CUDA kernels against the NumPy backend
(every engine table, padding rows, SWA + LUT, expected-token pool, overflow, out-of-range values,
batches up to 20,000 requests).  Without a GPU it runs a smaller set, wide batches included, on CPU
torch tensors.
"""

import dataclasses

import numpy as np
import pytest

from conftest import get_backend_or_skip
from fuzz_cases import TABLE_KINDS, assert_same, make_case, run_case

NUMPY = get_backend_or_skip("numpy")
GPU_CASES = 2000
GPU_CHUNK = 250


@pytest.mark.parametrize("first", range(0, GPU_CASES, GPU_CHUNK))
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_matches_numpy(backend, first):
    ab = get_backend_or_skip(backend)
    for seed in range(first, first + GPU_CHUNK):
        case = make_case(seed)
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"{backend} seed {seed}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_matches_numpy_wide_batches(backend, seed):
    ab = get_backend_or_skip(backend)
    case = make_case(10_000 + seed, big=True)
    assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"{backend} big seed {seed}")


# A warp's share of the rows of one launch's scan (ceil(bs / 16) of plan_fused's 16 warps, rounded up
# to 32) in passes of 64 rows (two a lane, strided) up to 64 rows, else of 32 * per_lane rows
# (per_lane consecutive rows a lane, odd, at most 9 in plan_fused and 3 in plan_verify):
# 1,100 -> 96 rows (3 a lane), 1,600 -> 128 (5), 2,600 -> 192 (7), 4,096 -> 256 (9; plan_verify 3
# passes of 3), 14,000 (one block's shared arrays) -> 896 (4 passes of 9).
@pytest.mark.parametrize("bs", [1100, 1600, 2600, 4096, 14_000])
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_one_launch_plans_of_thousands_of_requests_match_numpy(backend, bs, launch_policy):
    """plan_fused and the decode step's plan_verify over batches whose warps scan more than 64
    rows each (scan_rows's blocked passes, a variant for each size above), every table kind, each
    against NumPy byte for byte.  plan_fused_max_rows is raised to what one block's shared memory
    holds so that 14,000 requests take one launch too."""
    ab = get_backend_or_skip(backend)
    from kvcanary_cupy.backends.cuda import configs, device as cuda_device

    max_rows = configs.plan_scan_max_rows(cuda_device.current_id())
    assert bs <= max_rows
    launch_policy(plan_fused_max_rows=max_rows)
    for seed in range(20_000, 20_000 + len(TABLE_KINDS)):  # one case per table kind
        case = dataclasses.replace(make_case(seed, big=True, bs=bs), buffers=1)
        assert case.steps[0].prefix_lens.shape[0] == bs
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"{backend} bs {bs} seed {seed}")
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"{backend} bs {bs} seed {seed} fused")


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_one_launch_plans_on_a_grid_of_one_block_match_numpy(backend, monkeypatch):
    """With an SM count of 1 a one-launch grid is one block, so each warp expands several 32-entry
    chunks of a range that starts and ends inside requests: the walk carries its request from one
    chunk to the next, and lane 0 of every chunk looks its predecessor up in the table itself (with
    its out-of-range counts) and, in the decode step's plan_verify, gathers that predecessor's
    record.  The full grid gives most of the fuzz cases' warps one chunk.  16 of the first 80 fuzz
    cases with more entries than a block's warps take in one chunk each, and 4 with fewer: the plan
    and the fused step against NumPy byte for byte."""
    ab = get_backend_or_skip(backend)
    from kvcanary_cupy.backends.cuda import abi, device as cuda_device

    monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: 1)
    cases = [(seed, dataclasses.replace(make_case(seed), buffers=1)) for seed in range(80)]
    one_chunk_each = 32 * (abi.PLAN_THREADS // 32)  # past this many entries a warp takes several chunks
    several = [(seed, case) for seed, case in cases if case.verify_capacity > one_chunk_each]
    one = [(seed, case) for seed, case in cases if case.verify_capacity <= one_chunk_each]
    assert len(several) >= 16 and len(one) >= 4
    for seed, case in several[:16] + one[:4]:
        context = f"{backend} one block seed {seed}"
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=context)
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"{context} fused")


@pytest.mark.parametrize(("tile_rows", "sm_count"), [(1, None), (1, 3), (5, 3), (37, None), (1000, None), (6000, 3)])
@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
@pytest.mark.parametrize("with_scan_state", [True, False])
def test_gpu_two_launch_plan_matches_numpy(backend, tile_rows, sm_count, with_scan_state, monkeypatch, launch_policy):
    """Batches past plan_fused_max_rows take two launches (plan_offsets: each block its share of
    the rows, in one pass when the share fits a row per thread and the shared arrays, else in
    tiles of the shared arrays; then plan_entries): forced here for every batch size.  A grid of
    3 blocks (sm_count) with tiny tiles makes small batches scan several tiles per block; the
    full grid gives them a row or none per block, in one pass.  The blocks learn what precedes
    their shares from each other through the WritePlan's scan state, or, for a WritePlan without
    one (an engine's own arrays), each by reading every earlier row."""
    ab = get_backend_or_skip(backend)
    from kvcanary_cupy import plan_launcher
    from kvcanary_cupy.ops import planning
    from kvcanary_cupy.backends.cuda import configs, device as cuda_device
    from kvcanary_cupy.tables import TableKind

    if with_scan_state:
        launch_policy(plan_scan_state_min_rows=0)  # every batch, not only the largest
    else:
        monkeypatch.setattr(planning, "scan_state", lambda record: None)
        monkeypatch.setattr(plan_launcher, "scan_state", lambda record: None)

    launch_policy(plan_small_max_rows=-1, plan_fused_max_rows=-1, scan_tile_rows=tile_rows)
    if sm_count:
        monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: sm_count)
    assert [k[1].split("<")[0] for k in configs.plan_kernels(TableKind.REQ_TO_TOKEN, 0, 1, False, False)] == [
        "kvcanary::plan_offsets", "kvcanary::plan_entries"]
    seeds = range(0, 60) if tile_rows < 1000 else range(10_000, 10_002)
    for seed in seeds:
        case = make_case(seed, big=seed >= 10_000)
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"{backend} tile {tile_rows} seed {seed}")


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_block_scan_plan_matches_numpy_on_small_batches(backend, launch_policy):
    """Batches of up to plan_small_max_rows requests take plan_small (a warp's scan per warp);
    forced here through plan_fused's block-wide scan instead, so that it too meets the small and
    empty batches."""
    ab = get_backend_or_skip(backend)
    from kvcanary_cupy.backends.cuda import configs
    from kvcanary_cupy.tables import TableKind

    launch_policy(plan_small_max_rows=-1)
    assert [k[1].split("<")[0] for k in configs.plan_kernels(TableKind.REQ_TO_TOKEN, 0, 1, False, False)] == [
        "kvcanary::plan_fused"]
    for seed in range(60):
        case = make_case(seed)
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"{backend} block scan seed {seed}")


def test_torch_cpu_matches_numpy():
    ab = get_backend_or_skip("torch_cpu")
    for seed in range(40):
        case = make_case(seed)
        assert_same(run_case(NUMPY, case), run_case(ab, case), context=f"torch_cpu seed {seed}")


@pytest.mark.parametrize("seed", [0, 5])
def test_torch_cpu_matches_numpy_wide_batches(seed):
    """Thousands of requests through DLPack views of CPU tensors (real-KV sources, a small ring)."""
    ab = get_backend_or_skip("torch_cpu")
    case = make_case(10_000 + seed, big=True)
    assert case.steps[0].req_pool_indices.shape[0] >= 4000 and case.sources
    ref = run_case(NUMPY, case)
    assert ref["snapshots"][-1]["log.slot_run_counters"].sum() > 4000
    assert_same(ref, run_case(ab, case), context=f"torch_cpu big seed {seed}")


def _table_layouts(case) -> set:
    """The table layouts (abi.TableLayout) the case's steps plan through on the GPU."""
    from kvcanary_cupy.backends.cuda.configs import table_layout
    from kvcanary_cupy.tables import TableKind

    t = case.table
    if case.table_kind == "block":
        bt = t["block_table"]
        return {table_layout(TableKind.BLOCK, bt.shape[1] * t["block_size"], t["block_size"], t["null_block"],
                             bt.dtype == np.int64, False)}
    if case.table_kind == "csr":
        return {table_layout(TableKind.PAGED_KV, s.kv_indices.shape[0] * t["block_size"], t["block_size"], 0,
                             s.kv_indices.dtype == np.int64, s.kv_indptr.dtype == np.int64) for s in case.steps}
    return {TableKind.REQ_TO_TOKEN if case.table_kind == "rtt" else TableKind.VIRTUAL_PAGES}


def test_fuzz_cases_exercise_every_path():
    """The generator reaches overflow, out-of-range skips, violations and dropped rows, and plans
    through every table kind with out-of-range plan inputs, and through every table layout (block
    and CSR tables of int32 and int64 ids, power-of-two page sizes and others)."""
    from kvcanary_cupy.backends.cuda.abi import TableLayout

    seen = {"overflow": 0, "out_of_range": 0, "violations": 0, "dropped": 0, "lut": 0, "several_buffers": 0}
    seen.update({f"{kind} plan out of range": 0 for kind in TABLE_KINDS})
    seen.update({f"{layout.name} layout": 0 for layout in TableLayout})
    for seed in range(120):
        case = make_case(seed)
        snapshots = run_case(NUMPY, case)["snapshots"]
        last = snapshots[-1]
        for layout in _table_layouts(case):
            seen[f"{TableLayout(layout).name} layout"] += 1
        seen[f"{case.table_kind} plan out of range"] += int(last["vp.out_of_range_count"][0] > 0)
        seen["overflow"] += int(any(s["vp.enable"][0] == 0 for s in snapshots))
        seen["out_of_range"] += int(last["vp.out_of_range_count"][0] + last["log.out_of_range_counters"].sum() > 0)
        seen["violations"] += int(last["log.write_index"][0] > 0)
        seen["dropped"] += int(last["log.violation_counters"].sum() > last["log.ring"].shape[0])
        seen["lut"] += int(case.lut is not None)
        seen["several_buffers"] += int(case.buffers > 1 and last["log.violation_counters"].sum() > 0)
    assert all(v >= 3 for v in seen.values()), seen


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_two_launch_plan_survives_a_scan_state_out_of_step(backend, launch_policy):
    """A scan state whose flags disagree (as a grid of another size would leave them) costs each
    waiting block its bounded wait, then it sums the rows before its share itself: the plan stays
    byte-identical to NumPy's, plan after plan."""
    ab = get_backend_or_skip(backend)
    import numpy as np

    import kvcanary_cupy as kc

    launch_policy(plan_small_max_rows=-1, plan_fused_max_rows=-1, plan_scan_state_min_rows=0)
    rng = np.random.default_rng(7)
    bs, cols = 3000, 40
    rtt = rng.integers(-2, 5000, (bs + 1, cols)).astype(np.int32)
    rp = rng.integers(0, bs + 1, bs).astype(np.int64)
    args = lambda: (rp, rng.integers(-1, cols + 2, bs).astype(np.int64), rng.integers(-1, 4, bs).astype(np.int64))
    vcap = bs * cols
    vp, wp = kc.VerifyPlan.allocate(vcap, like=ab.like), kc.WritePlan.allocate(bs, like=ab.like)
    ref = kc.VerifyPlan.allocate(vcap), kc.WritePlan.allocate(bs)
    for entries in ref[0].FIELDS[:4]:  # unspecified past verify_num_valid: the same poison on both
        getattr(ref[0], entries.name)[...] = 0x5A5A
        getattr(vp, entries.name)[...] = 0x5A5A
    state = kc.plans.scan_state(wp)
    state[5] = 1000  # block 5 publishes 1001 where the others wait for 1, then 1002 for 2
    for _ in range(2):
        inputs = args()
        kc.plan(*inputs, rtt, verify_capacity=vcap, out=ref)
        kc.plan(*(ab.asarray(x) for x in inputs), ab.asarray(rtt), verify_capacity=vcap, out=(vp, wp))
        for want, got in ((ref[0], vp), (ref[1], wp)):
            for key, value in want.arrays().items():
                assert (ab.to_numpy(got.arrays()[key]) == value).all(), key
    assert int(ab.to_numpy(state)[5]) == 1002
