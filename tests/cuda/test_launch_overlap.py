"""Launch overlap (kvcanary_cupy/backends/cuda/launch.py): record launches through
cuLaunchKernelEx with programmatic stream serialization on sm_90 and later.

On the CPU: every kernel waits for the work before it as its first statement, the ctypes structs
have cuda.h's layout, the gating (compute capability, driver entry, KVCANARY_LAUNCH_OVERLAP,
plain_launches), and, on a fake CuPy device, overlapped launches carry the same kernels, grids,
blocks, streams and argument bytes as CuPy's.  On the GPU: the same bytes as plain launches
(eager, bound and captured, CuPy and torch), and each op reads what a kernel before it wrote
even when that kernel lets its dependents launch early (griddepcontrol.launch_dependents, as
PDL-aware engine kernels do).
"""

import ctypes
import importlib.resources
import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from conftest import get_backend_or_skip
from fuzz_cases import _plan_inputs, assert_same, make_case, run_case

KERNELS = importlib.resources.files("kvcanary_cupy.kernels")


def _kernel_bodies():
    """(file, kernel name, the body's first statement) of every __global__ function of kernels/."""
    found = []
    for path in sorted(KERNELS.iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".cu"):
            continue
        filename, source = path.name, path.read_text(encoding="utf-8")
        for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(", source):
            depth, i = 1, m.end()
            while depth:  # the parameter list's closing parenthesis
                depth += {"(": 1, ")": -1}.get(source[i], 0)
                i += 1
            body = source[source.index("{", i) + 1:]
            found.append((filename, m.group(1), body.lstrip().split(";", 1)[0] + ";"))
    return found


def test_every_kernel_waits_for_the_work_before_it_first():
    """A kernel launched with programmatic stream serialization may start before the work before it
    has finished: each one's first statement waits for it (none reads or writes memory before)."""
    bodies = _kernel_bodies()
    assert {name for _, name, _ in bodies} >= {"plan_fused", "plan_small", "plan_offsets", "plan_entries", "plan_verify",
                                               "canary_write", "canary_verify", "session_stage", "session_attribute",
                                               "scatter_req_token_ids", "move_gather", "move_clear", "move_scatter"}
    for filename, name, first in bodies:
        assert first == "wait_for_prior_grids();", f"{filename}: {name} starts with {first!r}"
    common = KERNELS.joinpath("canary_common.cuh").read_text(encoding="utf-8")
    wait = common[common.index("void wait_for_prior_grids()"):]
    wait = wait[: wait.index("\n}\n")]
    assert "#if __CUDA_ARCH__ >= 900" in wait and 'asm volatile("griddepcontrol.wait;" ::: "memory");' in wait
    assert not [p.name for p in KERNELS.iterdir() if "launch_dependents;" in p.read_text(encoding="utf-8")]


def test_launch_structs_have_the_layout_of_cuda_h():
    """CUlaunchAttribute and CUlaunchConfig as cuda.h (CUDA 12 and 13) lays them out on 64-bit hosts."""
    from kvcanary_cupy.backends.cuda.abi import CuLaunchAttribute, CuLaunchConfig

    assert ctypes.sizeof(CuLaunchAttribute) == 72 and CuLaunchAttribute.value.offset == 8
    assert ctypes.sizeof(CuLaunchConfig) == 56
    offsets = {name: getattr(CuLaunchConfig, name).offset for name, _ in CuLaunchConfig._fields_}
    assert offsets == {"gridDimX": 0, "gridDimY": 4, "gridDimZ": 8, "blockDimX": 12, "blockDimY": 16, "blockDimZ": 20,
                       "sharedMemBytes": 24, "hStream": 32, "attrs": 40, "numAttrs": 48}


def test_launches_overlap_on_sm90_with_a_cuda_12_3_driver_unless_turned_off(monkeypatch):
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device
    from kvcanary_cupy.backends.cuda import device as cuda_device, launch as launch_overlap

    with fake_device(overlap=False):
        assert not launch_overlap.enabled(0)
    with fake_device(overlap=True):
        assert launch_overlap.enabled(0)
        with launch_overlap.plain_launches():
            with launch_overlap.plain_launches():
                assert not launch_overlap.enabled(0)
            assert not launch_overlap.enabled(0)
        assert launch_overlap.enabled(0)
    with fake_device(overlap=True):
        monkeypatch.setenv(launch_overlap.LAUNCH_OVERLAP_ENV, "0")
        assert not launch_overlap.enabled(0)
    monkeypatch.delenv(launch_overlap.LAUNCH_OVERLAP_ENV)
    with fake_device(overlap=True) as dev:
        dev.driver_version = launch_overlap.MIN_DRIVER_VERSION - 10  # CUDA 12.2: graphs drop programmatic edges
        assert not launch_overlap.enabled(0)
    with fake_device(overlap=True), pytest.MonkeyPatch.context() as mp:  # undone before the fake device is
        mp.setattr(cuda_device, "driver_launch", lambda: None)  # a driver before CUDA 12
        cuda_device.cache.clear()  # the fake device's answers so far
        assert not launch_overlap.enabled(0)


def _fake_steps(dev, case, stream):
    """A function running a case's steps through the free functions, a bound planner, bound
    launchers and a write on a side stream, launched on ``stream`` of the fake device ``dev``, on
    arrays made once (so two runs launch the same argument bytes)."""
    a = dev.asarray
    buf = a(np.zeros((case.num_slots, 4), np.int64))
    log = kc.ViolationLog.allocate(case.ring_capacity, like=buf)
    lut = None if case.lut is None else a(case.lut)
    swa = dict(swa_window_size=case.window, full_to_swa_index_mapping=lut)
    planner = kc.CanaryPlanner(kc.CanaryCapacities(case.verify_capacity, case.write_req_capacity), like=buf, **swa)
    vp, wp = planner.verify_plan, planner.write_plan
    verify, write = kc.VerifyLauncher(buf, vp, log=log), kc.WriteLauncher(buf, wp, log=log)
    side = dev.cupy.cuda.Stream(non_blocking=True)
    side_write = kc.WriteLauncher(buf, wp, log=log, stream=side)
    steps = [(*_plan_inputs(case, s, a)[:2], (a(s.prefix_lens), a(s.extend_seq_lens)),
              (a(s.input_ids), a(s.positions), a(s.out_cache_loc))) for s in case.steps]

    def run():
        for rp, table, lens, tokens in steps:
            with stream:
                kc.plan(rp, *lens, table, verify_capacity=case.verify_capacity,
                        write_req_capacity=case.write_req_capacity, out=(vp, wp), **swa)
                kc.verify(buf, vp, log=log)
                kc.write(buf, wp, *tokens, log=log)
                kc.write(buf, wp, *tokens, log=log, stream=side)
                kc.join_stream(side)
                planner.plan(rp, *lens, table)
                verify()
                write(*tokens)
                side_write(*tokens)
                side_write.join()

    return run


def _events_renamed(timeline):
    """A fake device's timeline with its events named by first appearance (a free function's
    side-stream write makes a fresh one per call)."""
    names = {}
    rename = lambda x: names.setdefault(x, f"event#{len(names)}") if str(x).startswith("event") else x  # noqa: E731
    return [tuple(rename(x) for x in entry) for entry in timeline]


def test_overlapped_launches_equal_plain_ones_on_a_fake_device():
    """Free functions, bound launchers and a side-stream write, on the current stream and on
    another: the overlapped launches have CuPy's kernels, grids, blocks, streams and argument bytes,
    in the same order beside the same event records and waits; a bound launcher packs its launch
    once, pointing into its bound parameter record."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device
    from kvcanary_cupy.backends.cuda import launch as launch_overlap

    for seed in range(12):
        case = make_case(seed)
        with fake_device(overlap=True) as dev:
            for stream in (dev.current[-1], dev.cupy.cuda.Stream(non_blocking=True)):
                run = _fake_steps(dev, case, stream)
                run()  # once first: a free plan's overflow check keeps a copy per plan, so both runs start alike
                runs = []
                for plain in (True, False):
                    dev.launches[:], dev.timeline[:], dev.overlapped[:] = [], [], []
                    if plain:
                        with launch_overlap.plain_launches():
                            run()
                    else:
                        run()
                    runs.append((list(dev.launches), list(dev.timeline), list(dev.overlapped)))
                (plain_launches, plain_timeline, none), (launches, timeline, overlapped) = runs
                assert launches == plain_launches, f"seed {seed} on {stream}"
                assert _events_renamed(timeline) == _events_renamed(plain_timeline), f"seed {seed} on {stream}"
                assert none == [] and len(overlapped) == len(launches) > 0
                repeated = [addresses for addresses in overlapped if overlapped.count(addresses) > 1]
                assert repeated, "a bound launcher's repeated launches read the record it packed once"


def test_launchers_bound_where_launches_cannot_overlap_launch_through_cupy():
    """A device before sm_90, or KVCANARY_LAUNCH_OVERLAP=0 (both asked once, when a launcher is
    bound): free functions and bound launchers alike launch through CuPy, never the driver."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device
    from kvcanary_cupy.backends.cuda import launch as launch_overlap

    case = make_case(3)
    for overlap, env in ((False, None), (True, "0")):
        with fake_device(overlap=overlap) as dev, pytest.MonkeyPatch.context() as mp:
            if env is not None:
                mp.setenv(launch_overlap.LAUNCH_OVERLAP_ENV, env)
            run = _fake_steps(dev, case, dev.current[-1])
            dev.launches[:], dev.overlapped[:] = [], []
            run()
            assert dev.launches and dev.overlapped == [], f"overlap={overlap} env={env}"


# ----------------------------------------------------------------------------------------------
# on the GPU


def _overlap_supported():
    from kvcanary_cupy.backends.cuda import launch as launch_overlap

    import cupy

    device = cupy.cuda.Device()
    if int(device.compute_capability) < launch_overlap.MIN_COMPUTE_CAPABILITY:
        pytest.skip("launch overlap needs sm_90 or later")  # every launch is plain: nothing to compare
    assert launch_overlap.supported(device.id), "an sm_90+ device whose driver has cuLaunchKernelEx must overlap"
    return launch_overlap


@pytest.mark.parametrize("backend", ["cupy", "torch_cuda"])
def test_gpu_overlapped_steps_match_plain_ones(backend):
    """Fuzzed steps (every table kind, several buffers, real KV, out-of-range values), free and
    bound, and the fused decode step: overlapped launches give plain launches' bytes."""
    ab = get_backend_or_skip(backend)
    launch_overlap = _overlap_supported()
    for seed in range(60):
        case = make_case(seed)
        for kwargs in ({}, {"bound": True}, {"step": "fused"} if case.buffers == 1 else {"step": "decode"}):
            with launch_overlap.plain_launches():
                want = run_case(ab, case, **kwargs)
            assert_same(want, run_case(ab, case, **kwargs), context=f"{backend} seed {seed} {kwargs}")


# A kernel that lets its dependents launch at once (as PDL-aware engine kernels do), then spins for
# `cycles` before filling dst: an op launched behind it that did not wait would read dst too early.
SLOW_FILL = r"""
extern "C" __global__ void slow_fill(long long* dst, long long n, long long value, long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;");
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = value;
}
"""
SPIN_CYCLES = 4_000_000  # about 2 ms


def _slow_fill(cupy):
    kernel = cupy.RawKernel(SLOW_FILL, "slow_fill")

    def fill(dst, value):
        kernel((1,), (128,), (dst, np.int64(dst.size), np.int64(value), np.int64(SPIN_CYCLES)))

    return fill


class _Batch:
    """Four requests of a req_to_token table (row r + 1: request r), a planner over them, and a
    canary of 128 slots whose records of positions 0-7 of each request a prefill step wrote."""

    def __init__(self, cupy):
        self.bs, cols = 4, 16
        self.table = (1 + np.arange((self.bs + 1) * cols)).reshape(self.bs + 1, cols)
        self.rtt = cupy.asarray(self.table.astype(np.int32))
        self.rp = cupy.arange(1, self.bs + 1, dtype=cupy.int64)
        self.prefix, self.extend = cupy.zeros(self.bs, cupy.int64), cupy.ones(self.bs, cupy.int64)
        self.planner = kc.CanaryPlanner(kc.CanaryCapacities(self.bs * cols, self.bs), like=self.rp)
        self.vp, self.wp = self.planner.verify_plan, self.planner.write_plan
        self.canary = cupy.zeros((128, 4), cupy.int64)
        self.log = kc.ViolationLog.allocate(64, like=self.rp)

    def prefill(self, cupy):
        bs = self.bs
        self.planner.plan(self.rp, cupy.zeros(bs, cupy.int64), cupy.full(bs, 8, cupy.int64), self.rtt)
        kc.write(self.canary, self.wp, cupy.zeros(bs * 8, cupy.int64), cupy.tile(cupy.arange(8, dtype=cupy.int64), bs),
                 cupy.asarray(self.table[1:, :8].ravel().astype(np.int64)), log=self.log)
        self.prefix.fill(8)
        self.planner.plan(self.rp, self.prefix, self.extend, self.rtt)  # the decode step after it
        kc.verify(self.canary, self.vp, log=self.log)
        cupy.cuda.Device().synchronize()
        assert int(self.log.write_index[0]) == 0, "the prefill's records must verify clean"


def test_gpu_plans_read_the_lengths_an_early_triggering_kernel_before_them_wrote():
    """plan (bound, free, captured in a graph) and plan_and_verify launched right behind a kernel
    that triggers its dependents at once and writes the prefix lengths 2 ms later: each plans them."""
    import cupy

    get_backend_or_skip("cupy")
    _overlap_supported()
    fill, b = _slow_fill(cupy), _Batch(cupy)
    fused_out = (kc.VerifyPlan.allocate(0, like=b.rp), kc.WritePlan.allocate(b.bs, like=b.rp))

    def planned(plan, verify_plan=b.vp, write_plan=b.wp):
        b.prefix.fill(0)
        verify_plan.verify_num_valid.fill(-1)
        fill(b.prefix, 8)
        plan()
        return int(verify_plan.verify_num_valid[0]), cupy.asnumpy(write_plan.write_seed_slot_indices).tolist()

    want = (b.bs * 8, b.table[1:, 7].tolist())
    assert planned(lambda: b.planner.plan(b.rp, b.prefix, b.extend, b.rtt)) == want
    assert planned(lambda: kc.plan(b.rp, b.prefix, b.extend, b.rtt, verify_capacity=b.vp.capacity, out=(b.vp, b.wp))) == want
    assert planned(lambda: kc.plan_and_verify(b.rp, b.prefix, b.extend, b.rtt, b.canary, log=b.log,
                                              verify_capacity=b.vp.capacity, out=fused_out), *fused_out) == want
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the same pair captured: the graph keeps the programmatic edge and the wait
        b.prefix.fill(0)
        stream.synchronize()
        stream.begin_capture()
        fill(b.prefix, 8)
        b.planner.plan(b.rp, b.prefix, b.extend, b.rtt)
        graph = stream.end_capture()
        b.prefix.fill(0)
        b.vp.verify_num_valid.fill(-1)
        graph.launch(stream)
        stream.synchronize()
    assert int(b.vp.verify_num_valid[0]) == b.bs * 8


def test_gpu_a_verify_reads_the_records_an_early_triggering_kernel_before_it_wrote():
    """A bound verify launched right behind a kernel that triggers its dependents at once and zeroes
    every canary record 2 ms later: every entry violates (the records it was planned over were clean)."""
    import cupy

    get_backend_or_skip("cupy")
    _overlap_supported()
    fill, b = _slow_fill(cupy), _Batch(cupy)
    b.prefill(cupy)
    log = kc.ViolationLog.allocate(64, like=b.rp)
    verify = kc.VerifyLauncher(b.canary, b.vp, log=log)
    fill(b.canary.reshape(-1), 0)
    verify()
    cupy.cuda.Device().synchronize()
    assert int(log.violation_counters.sum()) == b.bs * 8


def test_gpu_a_write_reads_the_tokens_an_early_triggering_kernel_before_it_wrote():
    """A bound write launched right behind a kernel that triggers its dependents at once and writes
    the step's input ids 2 ms later: the records hold those ids."""
    import cupy

    get_backend_or_skip("cupy")
    _overlap_supported()
    fill, b = _slow_fill(cupy), _Batch(cupy)
    b.prefill(cupy)
    write = kc.WriteLauncher(b.canary, b.wp, log=b.log)
    ids, positions, slots = cupy.zeros(b.bs, cupy.int64), cupy.full(b.bs, 8, cupy.int64), cupy.asarray(b.table[1:, 8].astype(np.int64))
    fill(ids, 77)
    write(ids, positions, slots)
    assert cupy.asnumpy(b.canary[slots, 0]).tolist() == [77] * b.bs
