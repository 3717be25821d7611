"""Several canary buffers in one write/verify call, and the write on a side stream.

Each buffer of a multi-buffer call must end up with the bytes, ring rows and counters a call of
its own would give it (checked against single-buffer calls on every backend, and against the
pure-Python oracle); the argument errors name the offending item; a write on a side stream runs
after the work queued before it and is joined back, eagerly and inside CUDA-graph captures.
"""

import gc

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy import CanaryLaunchTag as Tag
from kvcanary_cupy import RealKvHashMode, RealKvSource
from canary_builders import (
    host,
    kv_bytes,
    make_log,
    make_verify_plan,
    make_write_plan,
    oracle_write,
    HostSource,
    ring_rows,
    sorted_rows,
    spin,
)
from conftest import get_backend_or_skip

NUMPY = get_backend_or_skip("numpy")
N_SLOTS = 96


def step_inputs(rng):
    """A mixed batch: a 40-token prefill, decode requests of one token, an empty request, with
    input-assert and chain-position violations, seeds from the first buffer's earlier chain."""
    lens = np.array([40, 1, 1, 0, 3, 1])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    total = int(offsets[-1])
    loc = rng.permutation(np.arange(20, N_SLOTS))[:total]
    seeds = np.array([-1, 5, 6, -1, 7, 0])
    ids = rng.integers(0, 50000, total)
    pos = np.concatenate([np.arange(n) + 10 for n in lens]).astype(np.int64)
    pos[3] += 1  # chain-position violation (seeded requests)
    exp_t = np.where(rng.random(total) < 0.2, ids + 1, ids)
    exp_p = pos.copy()
    return offsets, seeds, ids, pos, loc, exp_t, exp_p


def start_buffers(rng, n):
    """n buffers whose seed slots 5..7 hold records (different per buffer) and garbage elsewhere."""
    bufs = []
    for _ in range(n):
        buf = rng.integers(-(2**62), 2**62, (N_SLOTS, 4))
        buf[5:8, 1] = 9  # seed positions: the chain-position assert expects 10
        bufs.append(buf)
    return bufs


def sources(ab, n_buffers, seed):
    """Per buffer: a different real-KV source (device view, host oracle view)."""
    out = []
    for b in range(n_buffers):
        data = kv_bytes(N_SLOTS // 4, 4 * 32, seed + b)
        out.append(((RealKvSource(ab.asarray(data), 4, 32, 32),), (HostSource(data, 4, 32, 32),)))
    return out


@pytest.mark.parametrize("n_buffers", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", [RealKvHashMode.NONE, RealKvHashMode.ALL])
def test_each_buffer_gets_what_its_own_write_and_verify_give(ab, n_buffers, mode):
    rng = np.random.default_rng(n_buffers)
    offsets, seeds, ids, pos, loc, exp_t, exp_p = step_inputs(rng)
    start = start_buffers(rng, n_buffers)
    kinds = [Tag.HEAD_K_FULL, Tag.HEAD_V_FULL, Tag.TAIL_K_FULL, Tag.TAIL_V_FULL][:n_buffers]
    srcs = sources(ab, n_buffers, seed=n_buffers)
    a = ab.asarray
    args = (make_write_plan(ab, offsets, seeds), a(ids), a(pos), a(loc))
    kw = dict(expected_input_tokens=a(exp_t), expected_input_positions=a(exp_p), real_kv_hash_mode=mode)

    together = [a(b) for b in start]
    log_together = make_log(ab)
    kc.write(together, *args, log=log_together, kernel_kind=kinds, real_kv_sources=[s[0] for s in srcs], **kw)
    apart = [a(b) for b in start]
    log_apart = make_log(ab)
    for buf, kind, src in zip(apart, kinds, srcs):
        kc.write(buf, *args, log=log_apart, kernel_kind=kind, real_kv_sources=src[0], **kw)

    rows = []
    for b, (buf, kind, src) in enumerate(zip(together, kinds, srcs)):
        want = start[b].copy()
        r, written, _ = oracle_write(want, offsets, seeds, len(seeds), ids, pos, loc, kind=int(kind),
                                     expected_tokens=exp_t, expected_positions=exp_p, sources=src[1], mode=mode)
        rows += r
        assert np.array_equal(ab.to_numpy(buf), want), f"buffer {b}"
        assert np.array_equal(ab.to_numpy(apart[b]), want), f"buffer {b} written alone"
    lt, la = host(ab, log_together), host(ab, log_apart)
    assert rows and ring_rows(lt) == ring_rows(la) == sorted_rows(rows)
    for key in ("write_index", "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        assert np.array_equal(lt[key], la[key]), key

    # verify every buffer with one plan: slots written above, their chains and real KV
    entries = [(int(s), int(p), -1) for s, p in zip(loc[:5], pos[:5])]
    vp = make_verify_plan(ab, [e[0] for e in entries], [e[1] for e in entries], [-1] + [e[0] for e in entries[:-1]])
    log_together, log_apart = make_log(ab), make_log(ab)
    kc.verify(together, vp, log=log_together, kernel_kind=kinds, real_kv_sources=[s[0] for s in srcs], real_kv_hash_mode=mode)
    for buf, kind, src in zip(together, kinds, srcs):
        kc.verify(buf, vp, log=log_apart, kernel_kind=kind, real_kv_sources=src[0], real_kv_hash_mode=mode)
    lt, la = host(ab, log_together), host(ab, log_apart)
    assert ring_rows(lt) == ring_rows(la)
    for key in ("write_index", "violation_counters", "slot_run_counters", "kernel_run_counters", "out_of_range_counters"):
        assert np.array_equal(lt[key], la[key]), key


def test_verify_flood_over_many_warps_keeps_exact_counts(ab):
    """Every entry fails (a corrupted batch) and the ring overflows: write_index stops at the
    capacity, violation_counters is exact and each kept row is one of the NumPy backend's rows."""
    n = 20_000
    buf = np.zeros((n + 1, 4), np.int64)
    slots = np.arange(1, n + 1)
    vp = make_verify_plan(ab, slots, np.full(n, 3), np.full(n, -1))
    log = make_log(ab, capacity=1000)
    kc.verify([ab.asarray(buf), ab.asarray(buf + 0)], vp, log=log, kernel_kind=[1, 2])
    lg = host(ab, log)
    assert int(lg["write_index"][0]) == 1000
    assert lg["violation_counters"][1] == n and lg["violation_counters"][2] == n
    ref_log = make_log(NUMPY, capacity=2 * n)
    kc.verify([buf, buf.copy()], make_verify_plan(NUMPY, slots, np.full(n, 3), np.full(n, -1)), log=ref_log, kernel_kind=[1, 2])
    ref = {tuple(r) for r in ref_log.ring}
    kept = [tuple(r) for r in lg["ring"]]
    assert len(set(kept)) == 1000 and set(kept) <= ref


def test_sequence_argument_errors():
    log = make_log(NUMPY)
    wp = make_write_plan(NUMPY, [0, 1], [-1])
    one = np.ones(1, np.int64)
    a, b = kc.allocate_canary_buffer(16), kc.allocate_canary_buffer(16)

    def write(bufs, **kw):
        kw.setdefault("kernel_kind", [0] * (len(bufs) if isinstance(bufs, list) else 1))
        kc.write(bufs, wp, one, one, one, log=log, **kw)

    with pytest.raises(ValueError, match=r"canary_buf must be one buffer or a sequence of 1 to 4 buffers, got 5"):
        write([a] * 5)
    with pytest.raises(ValueError, match=r"kernel_kind must be a sequence of 2 launch kinds"):
        write([a, b], kernel_kind=3)
    with pytest.raises(ValueError, match=r"kernel_kind\[1\] must be in \[0, 12\)"):
        write([a, b], kernel_kind=[0, 12])
    with pytest.raises(ValueError, match=r"^kv-canary: canary_buf\[1\] has 8 slots but canary_buf\[0\] has 16; the canary "
                                         r"buffers of one call share its plan and need the same num_slots$"):
        write([a, kc.allocate_canary_buffer(8)])
    with pytest.raises(ValueError, match=r"canary_buf\[0\] and canary_buf\[1\] overlap in memory"):
        write([a, a])
    with pytest.raises(ValueError, match=r"canary_buf\[\d\] and canary_buf\[\d\] overlap in memory"):
        big = kc.allocate_canary_buffer(32)
        write([big[:16], big[8:24]])
    write([big[16:], big[:16]])  # adjacent is not overlapping
    src = RealKvSource(kv_bytes(16, 32), 1, 32, 32)
    with pytest.raises(ValueError, match=r"real_kv_sources must be empty or a sequence of 2 tuples"):
        write([a, b], real_kv_sources=(src, src))
    with pytest.raises(ValueError, match=r"real_kv_sources\[1\]\[0\].tensor has 8 rows"):
        write([a, b], real_kv_sources=[(src,), (RealKvSource(kv_bytes(8, 32), 1, 32, 32),)], real_kv_hash_mode=2)
    with pytest.raises(ValueError, match=r"stream is for CUDA arrays"):
        write([a], stream=object())
    assert (a == 0).all() and (b == 0).all() and int(log.write_index[0]) == 0
    # reading one buffer twice is fine
    vp = make_verify_plan(NUMPY, [1], [0], [-1])
    kc.verify([a, a], vp, log=log, kernel_kind=[0, 1])
    assert list(log.violation_counters[:2]) == [1, 1]


# ---- the write on a side stream (GPU) ----------------------------------------------------------

def _current_cupy_stream(ab):
    import cupy

    if ab.name == "torch_cuda":
        import torch

        return cupy.cuda.Stream.from_external(torch.cuda.current_stream())
    return cupy.cuda.get_current_stream()


def _new_side_stream(ab):
    if ab.name == "torch_cuda":
        import torch

        return torch.cuda.Stream()
    import cupy

    return cupy.cuda.Stream(non_blocking=True)


def _prefill(ab, n=4096):
    rng = np.random.default_rng(7)
    loc = rng.permutation(np.arange(1, n + 1))
    return dict(offsets=[0, n], ids=rng.integers(0, 50000, n), pos=np.arange(n), loc=loc, n=n)


def _side_writer(bound, buf, wp, log, side):
    """``write(ids, pos, loc)`` on ``side``: the free function or a bound WriteLauncher."""
    if bound:
        return kc.WriteLauncher(buf, wp, log=log, stream=side)
    return lambda ids, pos, loc: kc.write(buf, wp, ids, pos, loc, log=log, stream=side)


@pytest.mark.parametrize("bound,join", [(False, "join_stream"), (True, "join_stream"), (True, "launcher")],
                         ids=["free", "bound", "bound-launcher-join"])
def test_side_stream_write_runs_after_queued_work_and_is_joined(gpu_ab, bound, join):
    """Inputs filled on the current stream behind a ~5 ms spin are seen by the side-stream write,
    and after join_stream (or WriteLauncher.join) the current stream sees the whole 4,096-token chain."""
    ab = gpu_ab
    p = _prefill(ab)
    want = np.zeros((p["n"] + 1, 4), np.int64)
    oracle_write(want, p["offsets"], [-1], 1, p["ids"], p["pos"], p["loc"])
    buf = ab.asarray(np.zeros_like(want))
    ids, pos, loc = (ab.asarray(np.zeros(p["n"], np.int64)) for _ in range(3))
    wp, log = make_write_plan(ab, p["offsets"], [-1]), make_log(ab)
    new = [ab.asarray(p[k]) for k in ("ids", "pos", "loc")]
    ab.synchronize()
    side = _new_side_stream(ab)
    write = _side_writer(bound, buf, wp, log, side)
    spin(10_000_000, _current_cupy_stream(ab))
    for dst, src in zip((ids, pos, loc), new):
        dst[...] = src  # queued behind the spin on the current stream
    write(ids, pos, loc)
    if join == "launcher":
        write.join()
    else:
        kc.join_stream(side)
    assert np.array_equal(ab.to_numpy(buf), want)
    assert int(host(ab, log)["slot_run_counters"][0]) == p["n"]


@pytest.mark.parametrize("bound", [False, True], ids=["free", "bound"])
def test_side_stream_write_inside_a_graph_capture(gpu_ab, bound):
    """write(..., stream=side) + join_stream captured in a CUDA graph (CuPy's or torch's) and
    replayed with new inputs gives the NumPy backend's bytes."""
    ab = gpu_ab
    p = _prefill(ab, 300)
    buf = ab.asarray(np.zeros((p["n"] + 1, 4), np.int64))
    ids, pos, loc = (ab.asarray(np.zeros(p["n"], np.int64)) for _ in range(3))
    wp, log = make_write_plan(ab, p["offsets"], [-1]), make_log(ab)
    kc.warmup()
    side = _new_side_stream(ab)
    write = _side_writer(bound, buf, wp, log, side)

    def step():
        write(ids, pos, loc)
        kc.join_stream(side)

    if ab.name == "torch_cuda":
        import torch

        gc.collect()  # a CuPy graph freed by the GC inside torch's capture would invalidate it
        graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(capture_stream):
            step()  # eager warm-up on the capturing stream
            with torch.cuda.graph(graph, stream=capture_stream):
                step()
        torch.cuda.current_stream().wait_stream(capture_stream)
        replay = graph.replay
    else:
        import cupy

        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            step()
            stream.begin_capture()
            step()
            graph = stream.end_capture()
        stream.synchronize()
        replay = lambda: graph.launch(stream)  # noqa: E731
    ab.synchronize()
    for k in ("ids", "pos", "loc"):
        {"ids": ids, "pos": pos, "loc": loc}[k][...] = ab.asarray(p[k])
    ab.synchronize()
    replay()
    ab.synchronize()
    if ab.name == "cupy":
        stream.synchronize()
    want = np.zeros((p["n"] + 1, 4), np.int64)
    oracle_write(want, p["offsets"], [-1], 1, p["ids"], p["pos"], p["loc"])
    assert np.array_equal(ab.to_numpy(buf), want)
