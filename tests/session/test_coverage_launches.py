"""The coverage checks' launches on the GPU road (kvcanary_cupy/coverage.py, _GpuLaunches): each
kernel's parameters packed once when the session binds, per step only the slots' address and count.

On the fake device (kvcanary_cupy/devtools/fake_cupy.py: launches recorded with each argument's
bytes and their stream, nothing run): every coverage launch of a step carries exactly the arguments
the kernels' signatures take (each one encoded here by hand, as the unpacked RawKernel call passed
them), in the order of the unbound code, on the step's stream, for plain and overlapped launches;
the checked path (a strided out_cache_loc, KVCANARY_FULL_VALIDATION=1) gives the same launches or
the same errors; a step makes no device query (nothing allocated: capture-safe); and the checks
add a few Python-level calls per launch, not the repacking they used to.
"""

from __future__ import annotations

import cProfile
import pstats
import struct

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import outcome
from kvcanary_cupy.devtools.fake_cupy import FakeDevice
from kvcanary_cupy.validation_cache import FULL_VALIDATION_ENV

SLOTS, ROW, LAYERS, BS, MAX_STEP = 64, 32, 2, 2, 8
RP, PREFIX, EXTEND = np.array([1, 2], np.int64), np.array([0, 3], np.int64), np.array([3, 2], np.int64)
LOC = np.array([5, 6, 7, 20, 21], np.int64)
COVERAGE = ("kvcanary::lost_snapshot", "kvcanary::lost_check", "kvcanary::deep_write", "kvcanary::deep_check")


@pytest.fixture(params=[False, True], ids=["cupy-launch", "overlapped"])
def dev(request):
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device(overlap=request.param) as d:
        yield d


class Step:
    """A session with both checks on (deep: every layer's K and V; lost stores: layer 0's) and one step's arrays."""

    def __init__(self, dev, **options):
        self.dev = dev
        self.pool = dev.asarray(np.zeros((LAYERS, 2, SLOTS, ROW), np.uint8))
        every = tuple(kc.RealKvSource(self.pool[l, h], 1, ROW, ROW) for l in range(LAYERS) for h in (0, 1))
        like = dev.asarray(np.zeros(1, np.int32))
        options = dict(dict(deep_kv_sources=every, deep_check_slots=8, check_lost_stores=True, max_step_tokens=MAX_STEP,
                            lost_kv_sources=every[:2]), **options)
        self.session = kc.CanarySession(SLOTS, max_batch_size=BS, like=like, on_violation="ignore", **options)
        rtt = np.zeros((4, 16), np.int32)
        rtt[1, :3], rtt[2, :5] = LOC[:3], [30, 31, 32, 20, 21]
        self.inputs = [dev.asarray(a) for a in (RP, PREFIX, EXTEND, rtt, np.arange(5), np.array([0, 1, 2, 3, 4]), LOC)]

    def run(self, loc=None):
        rp, prefix, extend, rtt, ids, pos, own_loc = self.inputs
        if loc is not None and loc.shape[0] != own_loc.shape[0]:  # padded tokens, or none
            ids = pos = self.dev.asarray(np.arange(loc.shape[0], dtype=np.int64))
        s = self.session
        s.pre_forward(rp, prefix, extend, rtt, ids, pos, own_loc if loc is None else loc)
        s.post_forward()

    def coverage_launches(self, loc=None) -> list:
        self.dev.launches.clear()
        self.run(loc)
        return [(x.name, x.grid, x.block, x.stream.name, x.args) for x in self.dev.launches if x.name in COVERAGE]


def _q(v):
    return struct.pack("<q", v)


def _i(v):
    return struct.pack("<i", v)


def _ptr(x) -> bytes:
    return struct.pack("<Q", 0 if x is None else x.data.ptr)


def _log(cov) -> bytes:
    log = cov._log
    addresses = b"".join(_ptr(getattr(log, k)) for k in ("ring", "write_index", "violation_counters", "slot_run_counters",
                                                         "kernel_run_counters", "out_of_range_counters"))
    return addresses + _i(log.ring.shape[0]) + b"\0" * 4  # LaunchLog: 6 pointers, the capacity, padding


def expected(step: Step, loc) -> list:
    """The coverage launches of a step by hand: the kernels' parameters in signature order."""
    cov = step.session.coverage
    lost, deep, tail, head = cov.lost, cov.deep, cov._tail, cov._head
    n = loc.shape[0]
    cap = FakeDevice.SM_COUNT * 4  # configs.BLOCKS_PER_SM
    warps = lambda items: (max(1, min(-(-items // 8), cap)),)  # noqa: E731  (a slot per warp, 8 warps a block)
    kind = _i(step.session.tail_tag)
    return [
        ("kvcanary::lost_snapshot", (max(1, min(-(-n * lost.count // 256), cap)),), (256,), "main",
         (_ptr(lost.table), _i(lost.count), struct.pack("<Q", loc.data.ptr), _q(n), _q(SLOTS), _ptr(cov._pre))),
        ("kvcanary::lost_check", warps(n), (256,), "main",
         (_ptr(lost.table), _i(lost.count), struct.pack("<Q", loc.data.ptr), _q(n), _q(0), _ptr(cov._pre), _ptr(head),
          _i(head.shape[1]), _ptr(tail), _i(tail.shape[1]), _q(SLOTS), _log(cov), kind)),
        ("kvcanary::deep_write", warps(n), (256,), "main",
         (_ptr(deep.table), _i(deep.count), struct.pack("<Q", loc.data.ptr), _q(n), _ptr(tail), _q(SLOTS),
          _i(tail.shape[1]))),
        ("kvcanary::deep_check", warps(8), (256,), "main",
         (_ptr(deep.table), _i(deep.count), _ptr(tail), _q(SLOTS), _i(tail.shape[1]), _q(8), _ptr(cov._state), _log(cov),
          kind)),
    ]


def test_coverage_launches_carry_the_kernels_arguments_on_the_step_stream(dev):
    step = Step(dev)
    loc = step.inputs[-1]
    want = expected(step, loc)
    assert step.coverage_launches() == want
    assert step.coverage_launches() == want  # the packed records, patched again: the same bytes
    side = dev.cupy.cuda.Stream()
    with side:
        got = step.coverage_launches()
    assert [g[3] for g in got] == [side.name] * 4 and [g[:3] + g[4:] for g in got] == [w[:3] + w[4:] for w in want]


def test_a_step_of_another_length_patches_the_slots_and_the_grid(dev):
    step = Step(dev)
    step.coverage_launches()
    longer = dev.asarray(np.array([5, 6, 7, 20, 21, 9, 10, 11, 12, 13], np.int64))  # past max_step_tokens=8
    got = step.coverage_launches(longer)
    snapshot, check = got[0], got[1]
    assert snapshot[4][2:4] == (struct.pack("<Q", longer.data.ptr), _q(MAX_STEP))
    assert check[4][2:5] == (struct.pack("<Q", longer.data.ptr), _q(MAX_STEP), _q(2))  # 2 tokens past the snapshot
    assert got[2][4][3] == _q(10)  # every written slot is fingerprinted
    empty = dev.asarray(np.zeros(0, np.int64))
    assert [g[0] for g in step.coverage_launches(empty)] == ["kvcanary::deep_check"]  # nothing written: the rotation alone


def test_the_checked_path_gives_the_same_launches_and_errors(dev, monkeypatch):
    step = Step(dev)
    want = step.coverage_launches()
    monkeypatch.setenv(FULL_VALIDATION_ENV, "1")  # read when the session binds
    checked = Step(dev)
    got = checked.coverage_launches(step.inputs[-1])
    cov, ref = checked.session.coverage, step.session.coverage
    assert cov._full and not ref._full
    assert [g[:4] for g in got] == [w[:4] for w in want] and len(got) == 4
    monkeypatch.delenv(FULL_VALIDATION_ENV)
    assert expected(checked, step.inputs[-1]) == got
    wide = dev.asarray(np.repeat(LOC, 2))[::2]  # strided: refused before any coverage launch, as the unbound code did
    for s in (step, checked):  # (the session's writes would copy it first: a CuPy kernel, which the fake cannot run)
        dev.launches.clear()
        got = outcome(lambda: s.session.coverage.before_forward(wide))
        assert got is not None and got[0] is ValueError and "out_cache_loc must be contiguous" in got[1]
        assert outcome(lambda: s.session.coverage.tail_write(lambda *a: None, (None, None, wide), lambda: None)) == got
        assert not dev.launches


def test_a_step_queries_nothing_of_the_device(dev):
    """Capture-safe: no capture query (a copy's or an allocation's guard), no copy, no event query."""
    step = Step(dev, deep_kv_sources=(), deep_check_slots=None, overlap_head_write=False)
    step.run()
    dev.timeline.clear()
    dev.capture_queries = 0
    step.run()
    assert dev.capture_queries == 0 and {e[0] for e in dev.timeline} == {"launch"}


def _calls(fn) -> float:
    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(20):
        fn()
    profile.disable()
    return pstats.Stats(profile).total_calls / 20


def test_the_checks_add_a_few_calls_per_launch():
    """The bound launchers' cost per launch, not a parameter packing per launch (before: 112 Python
    calls for the lost-store check's two launches and 182 for all four, on benchmarks/host_profile.py's W3)."""
    pytest.importorskip("cupy")
    from kvcanary_cupy.devtools.fake_cupy import fake_device

    with fake_device(record_bytes=False) as dev:
        plain = Step(dev, deep_kv_sources=(), deep_check_slots=None, check_lost_stores=False, max_step_tokens=None,
                     lost_kv_sources=())
        both = Step(dev)
        added = _calls(both.run) - _calls(plain.run)
    # four launches, each through BoundLaunch and the fake's recording of it (about 8 calls of its own)
    assert added <= 4 * 20, added
