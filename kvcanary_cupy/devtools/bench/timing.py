"""How the benchmark times: CUDA graphs of K calls replayed, eager calls, the copy and read bandwidth floors."""

from __future__ import annotations

import statistics
import time


def _capture(cupy, stream, fn, k):
    """A graph of ``k`` calls of ``fn`` on ``stream``, warmed up by one replay."""
    fn()
    stream.synchronize()
    stream.begin_capture()
    for _ in range(k):
        fn()
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    return graph


def _replay_us(cupy, stream, graph, k) -> float:
    """Device microseconds of one of a graph's ``k`` calls, from one replay between two events."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1000 / k


def time_graph(cupy, fn, k=50, replays=20) -> float:
    """Median device microseconds of one ``fn()`` from a graph of ``k`` calls."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graph = _capture(cupy, stream, fn, k)
        return statistics.median(_replay_us(cupy, stream, graph, k) for _ in range(replays))


def time_graphs_interleaved(cupy, fns: dict, k=50, rounds=60) -> dict:
    """Median device microseconds of one call of each of ``fns`` (name -> fn), each from a graph of
    ``k`` calls, their replays taken in turn: the GPU's clock and temperature drift over a run, so
    variants compared with each other are timed side by side, not one after another.  Every call
    must leave the same state (the replays of one variant follow another's)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        graphs = {name: _capture(cupy, stream, fn, k) for name, fn in fns.items()}
        times = {name: [] for name in fns}
        for _ in range(rounds):
            for name, graph in graphs.items():
                times[name].append(_replay_us(cupy, stream, graph, k))
    return {name: statistics.median(t) for name, t in times.items()}


def time_eager(cupy, fn, reps=20) -> float:
    """Median microseconds of an eager ``fn()`` (host syncs included: that is how it runs)."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(cupy) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 1 << 30
    a = cupy.ones(n, cupy.uint8)
    b = cupy.empty_like(a)
    us = time_graph(cupy, lambda: cupy.copyto(b, a), k=5, replays=10)
    return 2 * n / (us * 1e-6)


_READ_KERNEL = r"""
extern "C" __global__ void read_all(const ulonglong2* __restrict__ p, long long n, unsigned long long* out) {
  unsigned long long acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const ulonglong2 v = __ldg(p + i);
    acc ^= v.x ^ v.y;
  }
  if (acc == 0x5eed) *out = acc;  // never true for the ones read: keeps the loads, writes nothing
}
"""


def read_bandwidth(cupy, nbytes: int = 1 << 31) -> float:
    """Device read bandwidth in bytes/s: one kernel streaming ``nbytes`` with 16-byte loads and
    writing nothing (the floor of an op that reads KV and writes a few sums, e.g. a FULL digest)."""
    n = nbytes // 16
    a = cupy.ones(n * 2, cupy.uint64)
    out = cupy.zeros(1, cupy.uint64)
    kernel = cupy.RawKernel(_READ_KERNEL, "read_all")
    blocks = cupy.cuda.Device().attributes["MultiProcessorCount"] * 8
    us = time_graph(cupy, lambda: kernel((blocks,), (256,), (a, cupy.int64(n), out)), k=5, replays=10)
    return n * 16 / (us * 1e-6)
