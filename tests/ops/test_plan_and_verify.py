"""plan_and_verify(): the fused decode step equals plan + verify in every observable byte.

Hand cases with known corruption and counts, the fuzz cases of tests/_support/fuzz_cases.py on every
backend (the "fused" step against NumPy's plan + verify + write), capacity overflow, out-of-range
inputs, argument errors, the GPU fallback for batches past one plan launch and CUDA-graph capture.
"""

import dataclasses

import numpy as np
import pytest

import kvcanary_cupy as kc
from conftest import get_backend_or_skip
from fuzz_cases import assert_same, make_case, run_case

NUMPY = get_backend_or_skip("numpy")


def decode_step(seed=0, bs=6):
    """A decode step over stamped prefixes (as bench.build makes them, small): a req_to_token of
    permuted slots, every prefix's records written by an earlier step."""
    from kvcanary_cupy.devtools.bench import Workload, build

    return build(Workload("test", bs, 3, 12, 1), np, seed=seed)


def fused_and_reference(ab, d, canary, *, verify_capacity=None, out=None, **kw):
    """``(fused, reference)``: each the host copies of the VerifyPlan's counters, the WritePlan and
    the log after plan_and_verify, and after plan + verify, on backend ``ab`` from the same bytes."""
    a = ab.asarray
    vcap = d["total_verify"] if verify_capacity is None else verify_capacity
    inputs = (a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"]))
    results = []
    for fused in (True, False):
        log = kc.ViolationLog.allocate(64, like=ab.like)
        buf = a(canary)
        if fused:
            vp, wp = kc.plan_and_verify(*inputs, buf, log=log, verify_capacity=vcap, out=out, **kw)
        else:
            check = kw.pop("check_expected_token", False)
            vp, wp = kc.plan(*inputs, verify_capacity=vcap, **kw)
            kc.verify(buf, vp, log=log, check_expected_token=check)
        snap = {f"vp.{k}": ab.to_numpy(getattr(vp, k)) for k in ("verify_num_valid", "enable", "out_of_range_count")}
        snap.update({f"wp.{k}": ab.to_numpy(v) for k, v in wp.arrays().items()})
        snap.update({f"log.{k}": ab.to_numpy(v) for k, v in log.arrays().items()})
        assert np.array_equal(ab.to_numpy(buf), canary)  # verify never writes the canary
        results.append(snap)
    return results


def assert_same_snapshot(got, ref):
    for key in ref:
        if key == "log.ring":
            n = int(ref["log.write_index"][0])
            rows = [r[key][:n][np.lexsort(r[key][:n].T[::-1])] for r in (got, ref)]
            np.testing.assert_array_equal(*rows, err_msg=key)
        else:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)


def test_clean_step_verifies_every_entry(ab):
    d = decode_step()
    fused, ref = fused_and_reference(ab, d, d["canary"])
    assert_same_snapshot(fused, ref)
    assert int(fused["log.write_index"][0]) == 0
    assert fused["log.slot_run_counters"][0] == d["total_verify"] > 0
    assert fused["log.kernel_run_counters"][0] == 1
    assert (fused["vp.verify_num_valid"][0], fused["vp.enable"][0]) == (d["total_verify"], 1)


def test_corruption_is_found_with_the_rows_verify_writes(ab):
    """A wrong position and a flipped prev_hash: each fails its slot and its successor's chain
    check (a record's hash covers its position and prev_hash), 4 rows."""
    d = decode_step()
    rtt, prefix = d["rtt"], d["prefix"]
    bad = d["canary"].copy()
    first = int(rtt[1, 2])  # row 1 position 2: its successor (position 3) is read too (prefix >= 4)
    assert prefix[0] >= 4 and prefix[1] >= 2
    bad[first, 1] += 1
    other = int(rtt[2, 0])  # the head of row 2's chain
    bad[other, 2] ^= 1
    fused, ref = fused_and_reference(ab, d, bad)
    assert_same_snapshot(fused, ref)
    assert int(fused["log.write_index"][0]) == 4 == fused["log.violation_counters"][0]
    by_slot = {int(r[1]): int(r[7]) for r in fused["log.ring"][:4]}
    chain, position = kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH.value, kc.FailReason.VERIFY_POSITION_MISMATCH.value
    assert by_slot == {first: position, int(rtt[1, 3]): chain, other: chain, int(rtt[2, 1]): chain}


def test_positions_past_2_53_are_checked_exactly(ab):
    """Positions past 2**53 are int64 through the fused step, as through plan + verify (float64
    would read an odd one as its even neighbour).  One request on 2**22 + 3 pages of 2**31 - 1
    tokens, all page 0; a window of 2 at the end of its prefix: positions q + 1 and q + 2 (q = 2**22 + 2
    whole pages), slots 1 and 2.  Slot 1's predecessor (slot 0) is unknown: only slot 2's chain,
    from slot 1's record, is checked, and differs."""
    a = ab.asarray
    page, pages = 2**31 - 1, 2**22 + 3
    q = (pages - 1) * page
    assert q > 2**53 and float(q + 1) != q + 1
    table = kc.PagedKvIndices(a(np.array([0, pages], np.int64)), a(np.zeros(pages, np.int32)), page)
    canary = np.zeros((3, 4), np.int64)
    canary[1:, 1] = [q + 1, q + 2]
    inputs = (None, a(np.array([q + 3])), a(np.zeros(1, np.int64)), table)
    rings = []
    for fused in (True, False):
        log = kc.ViolationLog.allocate(4, like=ab.like)
        if fused:
            kc.plan_and_verify(*inputs, a(canary), log=log, verify_capacity=2, swa_window_size=2)
        else:
            kc.verify(a(canary), kc.plan(*inputs, verify_capacity=2, swa_window_size=2)[0], log=log)
        assert int(ab.to_numpy(log.write_index)[0]) == 1
        rings.append(ab.to_numpy(log.ring)[:1])
    np.testing.assert_array_equal(rings[0], rings[1])
    assert (int(rings[0][0, 1]), int(rings[0][0, 7])) == (2, kc.FailReason.VERIFY_CHAIN_HASH_MISMATCH.value)


def test_strict_checks_the_lookups_of_the_entries_it_plans(ab):
    """strict=True checks the LUT lookup of every entry the fused step plans (all of them when they
    fit verify_capacity), though out[0] (allocated with no entries here) stores none: position 0
    of a row whose seed is not looked up (nothing is written) is outside the LUT."""
    a = ab.asarray
    rtt = np.array([[0, 1, 2, 3], [100, 5, 6, 7]], np.int32)
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token\[1, 0\] = 100 \(batch row 0\) is outside "
                                         r"full_to_swa_index_mapping of length 60$"):
        kc.plan_and_verify(a(np.array([1])), a(np.array([3])), a(np.array([0])), a(rtt), a(np.zeros((60, 4), np.int64)),
                           log=kc.ViolationLog.allocate(4, like=ab.like), verify_capacity=8,
                           full_to_swa_index_mapping=a(np.arange(60)), strict=True)


def test_expected_tokens_are_checked_when_asked(ab):
    d = decode_step()
    pool = np.zeros((d["rtt"].shape[0], d["rtt"].shape[1]), np.int32)
    canary = d["canary"]
    for r in range(d["bs"]):
        n = int(d["prefix"][r])
        pool[r + 1, :n] = canary[d["rtt"][r + 1, :n], 0]
    pool[3, 1] += 1  # one expected token differs from the stored one
    lens = d["prefix"].copy()
    kw = dict(req_to_verify_expected_tokens=ab.asarray(pool), req_to_verify_expected_tokens_valid_lens=ab.asarray(lens))
    for check, rows in ((True, 1), (False, 0)):
        fused, ref = fused_and_reference(ab, d, canary, check_expected_token=check, **kw)
        assert_same_snapshot(fused, ref)
        assert int(fused["log.write_index"][0]) == rows
    assert fused["log.slot_run_counters"][0] == d["total_verify"]


def test_more_entries_than_verify_capacity_skip_the_verify(ab):
    d = decode_step()
    fused, ref = fused_and_reference(ab, d, d["canary"], verify_capacity=d["total_verify"] - 1)
    assert_same_snapshot(fused, ref)
    assert (fused["vp.enable"][0], fused["vp.verify_num_valid"][0]) == (0, d["total_verify"] - 1)
    assert (fused["log.kernel_run_counters"][0], fused["log.slot_run_counters"][0]) == (1, 0)


def test_out_of_range_inputs_are_counted_as_plan_and_verify_count_them(ab):
    """A request row past the table (the plan's count) and table slots past the canary (the
    verify's count, in the log) are skipped and counted exactly as the two ops count them."""
    d = decode_step()
    d = dict(d, rp=d["rp"].copy(), rtt=d["rtt"].copy())
    d["rp"][4] = d["rtt"].shape[0] + 3
    num_slots = d["canary"].shape[0]
    d["rtt"][2, 1] = num_slots + 5
    d["rtt"][3, 0] = -2
    d["total_verify"] = int(d["prefix"].sum() - d["prefix"][4])
    fused, ref = fused_and_reference(ab, d, d["canary"])
    assert_same_snapshot(fused, ref)
    assert fused["vp.out_of_range_count"][0] == 1
    # slot past the canary (1), its successor's prev past the canary (1), the negative slot (1)
    assert fused["log.out_of_range_counters"][0] == 3


def test_zero_capacity_verify_plan_is_enough_and_keeps_its_entries(ab):
    d = decode_step()
    a = ab.asarray
    vp, wp = kc.VerifyPlan.allocate(0, like=ab.like), kc.WritePlan.allocate(d["bs"] + 3, like=ab.like)
    log = kc.ViolationLog.allocate(16, like=ab.like)
    got = kc.plan_and_verify(a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"]), a(d["canary"]), log=log,
                             verify_capacity=d["total_verify"], out=(vp, wp))
    assert got[0] is vp and got[1] is wp
    _, ref_wp = kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=d["total_verify"],
                        write_req_capacity=d["bs"] + 3)
    for k, v in ref_wp.arrays().items():
        np.testing.assert_array_equal(ab.to_numpy(getattr(wp, k)), v, err_msg=k)
    assert int(ab.to_numpy(log.slot_run_counters)[0]) == d["total_verify"]


def test_a_full_step_is_plan_and_verify_then_write(ab):
    """plan_and_verify + write leaves the canary, the WritePlan and the log as plan + verify + write."""
    d = decode_step(seed=3)
    a = ab.asarray
    out = []
    for fused in (True, False):
        buf, log = a(d["canary"]), kc.ViolationLog.allocate(16, like=ab.like)
        inputs = (a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"]))
        if fused:
            _, wp = kc.plan_and_verify(*inputs, buf, log=log, verify_capacity=d["total_verify"])
        else:
            vp, wp = kc.plan(*inputs, verify_capacity=d["total_verify"])
            kc.verify(buf, vp, log=log)
        kc.write(buf, wp, a(d["ids"]), a(d["pos"]), a(d["loc"]), log=log)
        out.append((ab.to_numpy(buf), {k: ab.to_numpy(v) for k, v in log.arrays().items()}))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    for k in out[1][1]:
        np.testing.assert_array_equal(out[0][1][k], out[1][1][k], err_msg=k)
    assert not np.array_equal(out[0][0], d["canary"])  # the write stamped the new tokens


def _fused_case(seed, **kw):
    return dataclasses.replace(make_case(seed, **kw), buffers=1)  # plan_and_verify verifies one buffer


@pytest.mark.parametrize("backend", ["numpy", "torch_cpu"])
def test_fuzz_cases_on_the_cpu(backend):
    ab = get_backend_or_skip(backend)
    for seed in range(40):
        case = _fused_case(seed)
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"{backend} seed {seed}")


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_fuzz_cases_on_the_gpu(backend):
    """Small batches take the one launch (plan_verify); the big ones (4,000 to 20,000 requests)
    mostly take plan + verify through the VerifyPlan's entries (run_case checks that the entries
    stay untouched exactly where configs.plan_verify_stores_entries says so)."""
    ab = get_backend_or_skip(backend)
    for seed in range(200):
        case = _fused_case(seed)
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"{backend} seed {seed}")
    for seed in range(2):
        case = _fused_case(10_000 + seed, big=True)
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"{backend} big seed {seed}")


def test_gpu_big_batches_in_one_launch(launch_policy):
    """The big fuzz cases through plan_verify itself: plan_fused_max_rows raised to what one
    block's shared memory holds, so batches of thousands of requests with up to ~100,000 entries
    plan and verify in one launch, each warp many chunks of entries."""
    ab = get_backend_or_skip("cupy")
    from kvcanary_cupy.backends.cuda import configs, device as cuda_device

    launch_policy(plan_fused_max_rows=configs.plan_scan_max_rows(cuda_device.current_id()))
    ran = 0
    for seed in range(4):
        case = _fused_case(10_000 + seed, big=True)
        if configs.plan_verify_stores_entries(case.steps[0].prefix_lens.shape[0]):
            continue
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"big seed {seed}")
        ran += 1
    assert ran >= 2  # 6,662, 11,188 and 9,087 requests fit an H200's 14,399 rows (an A100's 10,303: two)


def test_gpu_warps_walk_many_chunks_and_requests(launch_policy):
    """plan_verify on one block: each warp takes hundreds of entries, several steps of the sink's
    chunks, the lanes walking across request boundaries inside and between chunks (the usual grid
    gives each warp 32 entries at these sizes)."""
    ab = get_backend_or_skip("cupy")
    launch_policy(one_launch_blocks=1)
    for seed in range(60):
        case = _fused_case(seed)
        assert_same(run_case(NUMPY, case, step="decode"), run_case(ab, case, step="fused"), context=f"seed {seed}")


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_batches_past_one_launch_take_plan_then_verify(backend, launch_policy):
    """Past plan_fused_max_rows requests (lowered to 5 here) plan_and_verify takes plan + verify:
    the plan (plan_small for these 9 requests) stores the entries in out[0], which must hold
    verify_capacity of them, and the verify reads them; the same bytes."""
    ab = get_backend_or_skip(backend)
    launch_policy(plan_fused_max_rows=5)
    d = decode_step(bs=9)
    bad = d["canary"].copy()
    bad[int(d["rtt"][4, 1]), 0] ^= 3  # a changed token breaks its successor's chain
    fused, ref = fused_and_reference(ab, d, bad, out=(kc.VerifyPlan.allocate(d["total_verify"], like=ab.like),
                                                      kc.WritePlan.allocate(9, like=ab.like)))
    assert_same_snapshot(fused, ref)
    assert int(fused["log.write_index"][0]) == 1
    a = ab.asarray
    with pytest.raises(ValueError, match="verify_capacity=.* does not match out\\[0\\]"):
        kc.plan_and_verify(a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"]), a(bad), log=kc.ViolationLog.allocate(4, like=ab.like),
                           verify_capacity=d["total_verify"], out=(kc.VerifyPlan.allocate(0, like=ab.like), kc.WritePlan.allocate(9, like=ab.like)))


@pytest.mark.parametrize("bs", [0, 5, 32, 33, 256, 4096, 4097])
def test_launches_follow_the_plan_paths_on_a_fake_device(bs):
    """Up to plan_fused_max_rows requests: one launch of plan_verify with plan_fused's grid for the
    verify capacity (plan_small's batches too: the fused step always scans block-wide; up to two
    blocks per SM where plan_fused takes one, below) and the capacity in its outputs; past it:
    exactly plan's launches then verify's, over out[0]'s entries."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device
    from kvcanary_cupy.backends.cuda import abi, configs

    rtt = np.arange(1, 3 * bs + 4, dtype=np.int32).reshape(bs + 1, 3)
    prefix, extend = np.full(bs, 2, np.int64), np.ones(bs, np.int64)
    vcap = 2 * bs
    stores = configs.plan_verify_stores_entries(bs)
    assert stores == (bs > configs.policy().plan_fused_max_rows)
    with fake_device() as dev:
        a = dev.asarray
        args = (a(np.arange(1, bs + 1, dtype=np.int64)), a(prefix), a(extend), a(rtt))
        canary, log = a(np.zeros((rtt.size + 1, 4), np.int64)), kc.ViolationLog.allocate(4, like=a(rtt))
        out = (kc.VerifyPlan.allocate(vcap if stores else 0, like=canary), kc.WritePlan.allocate(bs, like=canary))
        kc.plan_and_verify(*args, canary, log=log, verify_capacity=vcap, out=out)
        fused, dev.launches[:] = list(dev.launches), []
        vp, _ = kc.plan(*args, verify_capacity=vcap, out=out if stores else (kc.VerifyPlan.allocate(vcap, like=canary), out[1]))
        kc.verify(canary, vp, log=log)
        unfused = list(dev.launches)
        grid = (configs.plan_one_launch_blocks(vcap, per_sm=configs.plan_verify_blocks_per_sm(bs, vcap)),)  # the fake device's SMs
    if stores:
        assert fused == unfused
        return
    (launch,) = fused
    assert launch.name.startswith("kvcanary::plan_verify<") and launch.block == (abi.PLAN_THREADS,)
    assert launch.grid == grid
    assert np.frombuffer(launch.args[1], abi.PLAN_OUTPUTS)["verify_capacity"][0] == vcap
    if bs > abi.PLAN_SMALL_MAX_ROWS:  # the same grid as plan_fused's
        assert launch.grid == unfused[0].grid and unfused[0].name.startswith("kvcanary::plan_fused<")


def test_small_batches_run_two_blocks_per_sm(monkeypatch):
    """plan_verify's grid: a block per PLAN_THREADS entries of verify capacity, at most two per SM
    when the capacity holds PLAN_VERIFY_PACKED_MIN_ENTRIES_PER_ROW entries per request (its launch
    bounds let an SM hold two), else one per SM (every block scans every row), with the scan's
    shared arrays for the batch."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.backends.cuda import abi, configs, device as cuda_device
    from kvcanary_cupy.tables import TableKind

    monkeypatch.setattr(cuda_device, "current_id", lambda: 0)
    monkeypatch.setattr(cuda_device, "sm_count", lambda device_id: 132)

    def config(bs, capacity):
        family, name, config = configs.plan_verify_kernel(TableKind.REQ_TO_TOKEN, bs, capacity, False, False, False, False)
        assert (family, name) == ("step_req_to_token", "kvcanary::plan_verify<0, false, false, false, false>")
        return config

    threads, per_row = abi.PLAN_THREADS, configs.policy().plan_verify_packed_min_entries_per_row
    assert (abi.PLAN_VERIFY_BLOCKS_PER_SM, per_row) == (2, 1024)
    assert config(0, 0) == configs.LaunchConfig(1, threads, 16)
    assert config(256, 100 * threads) == configs.LaunchConfig(100, threads, 257 * 16)
    assert config(256, 524_288) == configs.LaunchConfig(264, threads, 257 * 16)  # W1's 256 decodes of ~2,048 tokens
    assert config(256, 256 * per_row - 1) == configs.LaunchConfig(132, threads, 257 * 16)
    assert config(4096, 4096 * per_row) == configs.LaunchConfig(264, threads, 4097 * 16)
    assert config(4096, 557_056) == configs.LaunchConfig(132, threads, 4097 * 16)  # W5's 4,096 decodes of ~136 tokens
    assert [configs.plan_verify_blocks_per_sm(bs, cap) for bs, cap in ((0, 0), (0, per_row), (1, per_row - 1), (1, per_row),
                                                                  (32, 32 * 512), (4096, 10**9))] == [1, 2, 1, 2, 1, 2]
    # The one variant bounded to one block per SM (its launch bounds, step.cu): the packed W1 batch
    # gets 132 blocks, not 264; a narrow block table or any option off keeps two.
    every = (True, True, True, True)
    assert configs.plan_verify_kernel(TableKind.BLOCK, 256, 524_288, *every)[2].grid == 132
    assert configs.plan_verify_kernel(abi.TableLayout.BLOCK_NARROW, 256, 524_288, *every)[2].grid == 264
    assert configs.plan_verify_kernel(TableKind.BLOCK, 256, 524_288, True, True, True, False)[2].grid == 264
    assert configs.plan_verify_blocks_per_sm(256, 524_288, one_block=True) == 1


def test_arguments_are_checked_before_anything_is_written():
    d = decode_step()
    log = kc.ViolationLog.allocate(4)
    args = (d["rp"], d["prefix"], d["extend"], d["rtt"])
    with pytest.raises(TypeError, match="one canary buffer"):
        kc.plan_and_verify(*args, [d["canary"], d["canary"]], log=log, verify_capacity=10)
    with pytest.raises(TypeError, match="log must be a ViolationLog"):
        kc.plan_and_verify(*args, d["canary"], log=None, verify_capacity=10)
    with pytest.raises(ValueError, match="verify_capacity must be non-negative"):
        kc.plan_and_verify(*args, d["canary"], log=log, verify_capacity=-1)
    with pytest.raises(TypeError, match="check_expected_token must be a bool"):
        kc.plan_and_verify(*args, d["canary"], log=log, verify_capacity=10, check_expected_token=1)
    with pytest.raises(ValueError, match="prefix_lens length must be bs"):
        kc.plan_and_verify(d["rp"], d["prefix"][:-1], d["extend"], d["rtt"], d["canary"], log=log, verify_capacity=10)
    assert int(log.kernel_run_counters.sum()) == 0


def test_cuda_graph_capture_and_replay(gpu_ab):
    """plan_and_verify + write captured once, replayed on new batch contents: NumPy's bytes."""
    import cupy

    d = decode_step(seed=1)
    a = gpu_ab.asarray
    rp, prefix, extend, rtt = a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"])
    ids, pos, loc = a(d["ids"]), a(d["pos"]), a(d["loc"])
    buf, log = a(d["canary"]), kc.ViolationLog.allocate(64, like=gpu_ab.like)
    vp, wp = kc.VerifyPlan.allocate(0, like=gpu_ab.like), kc.WritePlan.allocate(d["bs"], like=gpu_ab.like)
    kw = dict(log=log, verify_capacity=d["total_verify"], out=(vp, wp))

    def step():
        kc.plan_and_verify(rp, prefix, extend, rtt, buf, **kw)
        kc.write(buf, wp, ids, pos, loc, log=log)

    if gpu_ab.name == "cupy":
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            step()  # binds the torch/CuPy views outside the capture
            stream.synchronize()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
    else:
        import torch

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    # replay on a fresh copy of the inputs, with one corrupted record: NumPy gives the same bytes
    bad = d["canary"].copy()
    bad[int(d["rtt"][2, 0]), 1] += 1
    ref_buf, ref_log = bad.copy(), kc.ViolationLog.allocate(64)
    ref_vp, ref_wp = kc.plan(d["rp"], d["prefix"], d["extend"], d["rtt"], verify_capacity=d["total_verify"])
    kc.verify(ref_buf, ref_vp, log=ref_log)
    kc.write(ref_buf, ref_wp, d["ids"], d["pos"], d["loc"], log=ref_log)
    if gpu_ab.name == "cupy":
        with stream:  # a non-blocking stream does not wait for the legacy default stream: fill on it
            buf[...] = a(bad)
            for arr in log.arrays().values():
                arr[...] = 0
            graph.launch(stream)
            stream.synchronize()
    else:
        buf[...] = a(bad)
        for arr in log.arrays().values():
            arr[...] = 0
        graph.replay()
        torch.cuda.synchronize()
    np.testing.assert_array_equal(gpu_ab.to_numpy(buf), ref_buf)
    for k, v in ref_log.arrays().items():
        np.testing.assert_array_equal(gpu_ab.to_numpy(getattr(log, k)), v, err_msg=k)


def test_capture_refuses_allocating_out(gpu_ab):
    import cupy

    if gpu_ab.name != "cupy":
        pytest.skip("one framework is enough: the refusal is the front door's")
    d = decode_step()
    a = gpu_ab.asarray
    args = (a(d["rp"]), a(d["prefix"]), a(d["extend"]), a(d["rtt"]), a(d["canary"]))
    log = kc.ViolationLog.allocate(4, like=gpu_ab.like)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="plan_and_verify with out=None allocates"):
                kc.plan_and_verify(*args, log=log, verify_capacity=10)
        finally:
            stream.end_capture()
