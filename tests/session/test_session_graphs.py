"""CanarySession inside CUDA graphs: pre_forward/post_forward captured once (cupy.cuda.Graph and
torch.cuda.graph), with and without the HEAD write on the side stream, replayed with changing
batches and a stale table entry, end_step outside the graph reading each step one step late; the
final report equals the eager NumPy session's.  And the side stream's order on the GPU: the HEAD
write waits for what the step's stream queued before it, the forward does not wait for the HEAD
write, and what follows post_forward does."""

import gc

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import spin
from conftest import get_backend_or_skip
from session_engine import ToyEngine

SCHEDULE = [[1, 2], [1, 2, 3], [2, 1, 3, 4], [1, 2, 4], [3, 1, 2], [1, 2, 5, 4], [2, 1], [1, 2, 3, 6, 7], [1, 2]]
FAULT_STEP = 4


def _steps():
    """Each step's arrays and table (NumPy), with a stale table entry of row 1 from FAULT_STEP on."""
    engine = ToyEngine()
    out = []
    for step, rows in enumerate(SCHEDULE):
        arrays = engine.step(rows)
        if step == FAULT_STEP:
            engine.rtt[1, 2] = engine.rtt[2, 4]
        out.append((arrays, engine.rtt.copy()))
    return engine, out


def _eager_step(session, a, table):
    session.pre_forward(a["rp"], a["prefix"], a["extend"], table, a["ids"], a["pos"], a["loc"])
    session.post_forward()


def _numpy_reference(engine, steps):
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, on_violation="ignore")
    for arrays, table in steps:
        _eager_step(session, arrays, table)
        session.end_step()
    session.check()
    return session


class _Buffers:
    """Fixed-address step inputs on the GPU, refilled in place before every replay."""

    def __init__(self, ab, arrays, table):
        self.ab = ab
        self.arrays = {k: ab.asarray(v) for k, v in arrays.items()}
        self.table = ab.asarray(table)

    def fill(self, arrays, table):
        for k, v in arrays.items():
            self.arrays[k][...] = self.ab.asarray(v)
        self.table[...] = self.ab.asarray(table)

    def pre_forward(self, session):
        a = self.arrays
        session.pre_forward(a["rp"], a["prefix"], a["extend"], self.table, a["ids"], a["pos"], a["loc"])


def _device_sync():
    import cupy

    cupy.cuda.Device().synchronize()


def _end_step_one_step_late(session, step):
    """end_step handles every earlier step (the device finished them) and never the current one."""
    _device_sync()
    session.end_step()
    first_steps = {v.first_step for v in session.report().violations}
    assert session.stats["pending_steps"] == 1
    assert first_steps == (set() if step <= FAULT_STEP else {FAULT_STEP})


def _assert_same_as_numpy(session, reference):
    got, want = session.report(), reference.report()
    assert len(want.violations) == 4
    assert got.to_dicts() == want.to_dicts()
    assert session.stats == reference.stats


def _graph_session(backend, overlap):
    """The backend, a toy engine's steps, their NumPy reference session and a session on the
    backend to capture (violations recorded, not raised), kernels compiled before any capture."""
    ab = get_backend_or_skip(backend)
    kc.warmup()
    engine, steps = _steps()
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore",
                               overlap_head_write=overlap)
    return ab, steps, _numpy_reference(engine, steps), session


OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "in_order"])


@OVERLAP
def test_cupy_graph_capture_replay_read_one_step_late(overlap):
    import cupy

    ab, steps, reference, session = _graph_session("cupy", overlap=overlap)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        bufs = _Buffers(ab, *steps[0])
        stream.synchronize()
        stream.begin_capture()
        bufs.pre_forward(session)
        session.post_forward()
        with pytest.raises(RuntimeError, match="end_step\\(\\) must run outside CUDA graph capture"):
            session.end_step()
        graph = stream.end_capture()
        for step, (arrays, table) in enumerate(steps):
            bufs.fill(arrays, table)
            graph.launch(stream)
            _end_step_one_step_late(session, step)
        session.check()
    _assert_same_as_numpy(session, reference)


@OVERLAP
def test_torch_graph_capture_replay_read_one_step_late(overlap):
    import torch

    ab, steps, reference, session = _graph_session("torch_cuda", overlap=overlap)
    bufs = _Buffers(ab, *steps[0])
    torch.cuda.synchronize()
    gc.collect()  # a CuPy graph of an earlier test freed by the GC inside torch's capture would invalidate it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bufs.pre_forward(session)
        session.post_forward()
        with pytest.raises(RuntimeError, match="check\\(\\) must run outside CUDA graph capture"):
            session.check()
    for step, (arrays, table) in enumerate(steps):
        bufs.fill(arrays, table)
        graph.replay()
        _end_step_one_step_late(session, step)
    session.check()
    _assert_same_as_numpy(session, reference)


def test_end_step_does_not_wait_for_the_device():
    """With the stream busy for about a second, end_step returns and leaves the step pending."""
    import torch

    ab = get_backend_or_skip("torch_cuda")
    engine, steps = _steps()
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore")
    bufs = _Buffers(ab, *steps[0])
    for arrays, table in steps[:2]:
        bufs.fill(arrays, table)
        bufs.pre_forward(session)
        session.post_forward()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of device time before the staging of this step
        session.end_step()
        assert not torch.cuda.current_stream().query()  # end_step returned while the device was busy
        assert session.stats["pending_steps"] >= 1
    session.check()
    assert session.stats["pending_steps"] == 0 and session.stats["steps"] == 2
    assert session.report().violations == ()


def test_pre_and_post_forward_in_separate_graphs_without_overlap():
    """overlap_head_write=False: nothing forks in pre_forward, so it can be captured apart from post_forward."""
    import cupy

    ab, steps, reference, session = _graph_session("cupy", overlap=False)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        bufs = _Buffers(ab, *steps[0])
        stream.synchronize()
        graphs = []
        for part in (lambda: bufs.pre_forward(session), session.post_forward):
            stream.begin_capture()
            part()
            graphs.append(stream.end_capture())
        for step, (arrays, table) in enumerate(steps):
            bufs.fill(arrays, table)
            for graph in graphs:
                graph.launch(stream)
            _end_step_one_step_late(session, step)
        session.check()
    _assert_same_as_numpy(session, reference)


def _step_stream(ab):
    """The stream a session step runs on, as a CuPy stream (torch's current one for torch tensors)."""
    import cupy

    if ab.name == "torch_cuda":
        import torch

        return cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    return cupy.cuda.get_current_stream()


def test_head_write_waits_for_queued_inputs_overlaps_the_forward_and_is_joined(gpu_ab):
    import cupy

    ab = gpu_ab
    kc.warmup()
    engine, steps = _steps()
    reference = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, on_violation="raise")
    session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="raise")
    side, main = session._head_write_stream, _step_stream(ab)
    bufs = _Buffers(ab, *steps[0])
    for x in bufs.arrays.values():
        x[...] = 0
    ab.synchronize()

    # 1. The step's inputs land on the step's stream behind ~5 ms of work: the HEAD write sees them.
    arrays, table = steps[0]
    spin(10_000_000, main)
    bufs.fill(arrays, table)
    bufs.pre_forward(session)
    session.post_forward()
    _eager_step(reference, arrays, table)
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(ab.to_numpy(session.head_canary), reference.head_canary)

    # 2. With the side stream busy for ~200 ms, the forward (here an event on the step's stream) does
    #    not wait for the HEAD write; what is queued after post_forward does.
    arrays, table = steps[1]
    bufs.fill(arrays, table)
    cupy.cuda.Device().synchronize()
    spin(400_000_000, side)
    bufs.pre_forward(session)
    forward = cupy.cuda.Event(disable_timing=True)
    forward.record(main)
    forward.synchronize()
    assert not side.done, "the side stream finished early: the spin is too short for this check"
    session.post_forward()
    after = cupy.cuda.Event(disable_timing=True)
    after.record(main)
    assert not after.done  # the step's stream now waits for the HEAD write
    head = session.head_canary.clone() if ab.name == "torch_cuda" else session.head_canary.copy()  # on the step's stream
    _eager_step(reference, arrays, table)
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(ab.to_numpy(head), reference.head_canary)
    for s in (session, reference):
        s.end_step()
        s.check()
    assert session.stats == reference.stats
