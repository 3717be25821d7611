"""Benchmark of the transfer digest (issue 24's targets): one row per case, each as a ratio to its floor.

70B-shaped KV: 80 layers, 8 KV heads, head_dim 128, bf16 (320 KiB a token), SGLang-style per-layer
K and V pools of 16-token pages, requests on randomly permuted pages.

- ``FULL 16K``: the FULL digest of one 16,384-token request; floor: its 5.4 GB read at the read
  bandwidth measured in the same run (a kernel streaming 2 GiB with 16-byte loads and writing
  nothing; the copy bandwidth, read + write, is printed beside it).  Target 1.6 ms.
- ``default 16K`` / ``default 4K``: the default sampled spec (2 layers, 32-byte windows) of one
  16,384- and one 4,096-token request; floor: the sampled 32-byte sectors at the same bandwidth
  (the DRAM moves them in 64-byte bursts, twice the sampled bytes).  Targets 20 us and 10 us.
  They run before FULL: its 80 ms stream leaves the rows after it about 5% slower for seconds.
- ``verify 4096``: ``verify_digest`` of 4,096 requests; floor: one launch.  Target 3 us.
- ``numpy default 4K``: the NumPy reference's default digest of the 4,096-token request (CPU ms of
  the process, one core).  Target 8 ms.
- ``eager host``: host microseconds per eager ``digest_pages`` (default spec, 4 requests of 256
  tokens) and ``verify_digest`` call, back to back, with CuPy arrays and with CUDA torch tensors:
  with the same arrays each call (an engine's preallocated buffers: the last call's checked
  launches replayed, ``digest/memo.py``), and alternating between two sets (every call checked).
  Targets 25 us (CuPy) and 40 us (torch).

GPU times: a CUDA graph of K calls, median replay / K (``kvcanary_cupy.devtools.bench``'s method).

    python benchmarks/bench_digest.py [--backend cupy|numpy] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kvcanary_cupy as kc  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 80, 8, 128, 16
TARGETS = {"FULL 16K": 1600.0, "default 16K": 20.0, "default 4K": 10.0, "verify 4096": 3.0, "numpy default 4K": 8000.0}
HOST_TARGET_US = {"cupy": 25.0, "torch": 40.0}


def pool(xp, tokens: int, seed=0):
    """A 70B-shaped pool holding one request of ``tokens`` tokens (bf16 bits as uint16) and its table."""
    rng = np.random.default_rng(seed)
    pages = tokens // PAGE + 2
    shape = (pages * PAGE, HEADS, HEAD_DIM)
    # one random template, tiled: random bytes for 80 x 2 layers from the host would take minutes
    template = xp.asarray(rng.integers(0, 2**16, shape[0] * HEADS * HEAD_DIM // 64, dtype=np.uint16))
    fill = lambda: xp.tile(template, 64).reshape(shape)
    layout = kc.KvLayout.from_sglang([fill() for _ in range(LAYERS)], [fill() for _ in range(LAYERS)], page_size=PAGE,
                                     dtype="bfloat16")
    rtt = np.zeros((2, tokens), np.int32)
    perm = rng.permutation(np.arange(1, pages))[: -(-tokens // PAGE)]
    pos = np.arange(tokens)
    rtt[1] = perm[pos // PAGE] * PAGE + pos % PAGE
    return layout, xp.asarray(rtt)


def digest_call(xp, layout, rtt, tokens, spec, bs=1):
    rows = xp.asarray(np.ones(bs, np.int64))
    starts, ends = xp.asarray(np.zeros(bs, np.int64)), xp.asarray(np.full(bs, tokens, np.int64))
    keys = xp.asarray(np.arange(bs, dtype=np.int64) + 11)
    out = kc.DigestBatch.allocate(bs, like=rows)
    return lambda: kc.digest_pages(layout, rtt, rows, starts, ends, spec=spec, sample_keys=keys, out=out)


def sampled_bytes(tokens: int, spec) -> int:
    return tokens * HEADS * 2 * min(spec.sample_layers or LAYERS, LAYERS) * (spec.window_bytes or HEAD_DIM * 2)


def run_gpu(lines: list) -> None:
    import cupy

    from kvcanary_cupy.devtools.bench.step_sections import eager_us
    from kvcanary_cupy.devtools.bench.timing import copy_bandwidth, read_bandwidth, time_graph

    kc.warmup()
    bw, read_bw = copy_bandwidth(cupy), read_bandwidth(cupy)
    launch = 1.0  # the floor of a one-kernel op: a launch inside a graph, about 1 us on the H200 (README)
    full, default = kc.DigestSpec.full(LAYERS, records=False), kc.DigestSpec(LAYERS, records=False)
    lines.append(f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write); read bandwidth {read_bw / 1e9:.0f} GB/s (a kernel "
                 "streaming 2 GiB with 16-byte loads, writing nothing): the floors are the sampled bytes at the read bandwidth")
    lines.append(f"{'case':<18} {'device us':>10} {'floor us':>9} {'x floor':>8} {'target us':>10} {'x target':>9}")
    big = pool(cupy, 16384)
    cases = (("default 16K", default, 16384, big), ("default 4K", default, 4096, pool(cupy, 4096)), ("FULL 16K", full, 16384, big))
    for name, spec, tokens, (layout, rtt) in cases:
        us = time_graph(cupy, digest_call(cupy, layout, rtt, tokens, spec), k=5 if spec is full else 50, replays=10)
        floor = sampled_bytes(tokens, spec) / read_bw * 1e6
        lines.append(f"{name:<18} {us:>10.1f} {floor:>9.2f} {us / floor:>8.2f} {TARGETS[name]:>10.1f} {us / TARGETS[name]:>9.2f}")
    layout, rtt = cases[1][3]
    del big, cases
    n = 4096
    rows = np.tile(np.frombuffer(kc.DigestRecord(3, 5, 0, 4096, 11, 12, 524288).to_bytes(), np.int64), (n, 1))
    expected = kc.DigestBatch(cupy.asarray(rows), cupy.zeros(1, cupy.int64))  # every row MATCHes: the common case
    actual = kc.DigestBatch(cupy.asarray(rows), cupy.zeros(1, cupy.int64))
    log = kc.ViolationLog.allocate(16, num_kinds=kc.DIGEST_NUM_KINDS, like=rtt)
    codes = cupy.zeros(n, cupy.int32)
    us = time_graph(cupy, lambda: kc.verify_digest(expected, actual, log=log, out=codes), k=50)
    lines.append(f"{'verify 4096':<18} {us:>10.1f} {launch:>9.2f} {us / launch:>8.2f} {TARGETS['verify 4096']:>10.1f} {us / 3.0:>9.2f}")
    lines.append("")
    lines.append(f"{'eager host':<18} {'arrays':<6} {'op':<14} {'replayed us':>12} {'target':>7} {'x target':>9} "
                 f"{'checked us':>11}")
    frameworks = [("cupy", lambda x: x)]
    try:
        import torch

        frameworks.append(("torch", torch.from_dlpack))
    except ImportError:
        pass
    for framework, convert in frameworks:
        sets = [eager_calls(cupy, convert, layout, rtt, default, log) for _ in range(2)]
        for op in ("digest_pages", "verify_digest"):
            same = eager_us(cupy, sets[0][op])  # the last call's arguments again: its launches replayed
            alternating = eager_us(cupy, lambda: (sets[0][op](), sets[1][op]())) / 2  # every call checked
            target = HOST_TARGET_US[framework]
            lines.append(f"{'':<18} {framework:<6} {op:<14} {same:>12.1f} {target:>7.0f} {same / target:>9.2f} "
                         f"{alternating:>11.1f}")


def eager_calls(cupy, convert, layout, rtt, spec, log) -> dict:
    """One set of the eager calls' arrays (4 requests of 256 tokens) in a framework, and the two calls."""
    rows, starts = convert(cupy.ones(4, cupy.int64)), convert(cupy.zeros(4, cupy.int64))
    ends, keys = convert(cupy.full(4, 256, cupy.int64)), convert(cupy.arange(4, dtype=cupy.int64))
    out, table, codes = kc.DigestBatch.allocate(4, like=rows), convert(rtt), convert(cupy.zeros(4, cupy.int32))
    return {"digest_pages": lambda: kc.digest_pages(layout, table, rows, starts, ends, spec=spec, sample_keys=keys, out=out),
            "verify_digest": lambda: kc.verify_digest(out, out, log=log, out=codes)}


def run_numpy(lines: list) -> None:
    layout, rtt = pool(np, 4096)
    fn = digest_call(np, layout, rtt, 4096, kc.DigestSpec(LAYERS, records=False))
    fn()
    times = []
    for _ in range(5):  # CPU time of this process: the target is per core, and a shared host's wall time is not
        t0 = time.process_time()
        fn()
        times.append((time.process_time() - t0) * 1e3)
    ms = sorted(times)[len(times) // 2]
    lines.append(f"{'numpy default 4K':<18} {ms:>8.2f} CPU ms  target {TARGETS['numpy default 4K'] / 1e3:.0f} ms  "
                 f"x target {ms * 1e3 / TARGETS['numpy default 4K']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("cupy", "numpy"), default="cupy")
    parser.add_argument("--out")
    args = parser.parse_args()
    lines = [f"transfer digest benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    if args.backend == "cupy":
        run_gpu(lines)
        lines.append("")
    run_numpy(lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
