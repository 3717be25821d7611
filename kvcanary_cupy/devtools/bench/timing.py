"""How the benchmark times: CUDA graphs of K calls replayed, eager calls, the copy bandwidth floor."""

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
