"""Issue 24's A/B of the digest kernel's variants (``kvcanary_cupy.digest.cuda.DIGEST_VARIANTS``) in one process.

First a byte check: fuzzed pools (SGLang and vLLM shapes, 1-6 layers, 1-8 heads, strips of 8-256
bytes, page sizes 1-16, random page order, MLA-like K-only pools), specs (sampled layers, windows,
FULL, a pipeline stage's ``layer_offset``) and requests (random ranges, out-of-range rows and
slots, sender and receiver provenance) are digested by every variant and by the NumPy reference;
every variant's records and out-of-range count must equal the reference's byte for byte.  Then,
for the variants that matched in every case, the device times of ``bench_digest.py``'s rows (FULL 16K, default 16K,
default 4K) for each variant, the variants' CUDA-graph replays taken in turn
(``time_graphs_interleaved``), side by side.

    python benchmarks/bench_digest_variants.py [--variants base,grid,hoist,units,...] [--cases 60]
        [--seed 0] [--no-timing] [--fake [--emulate]] [--out FILE]

``--fake`` runs on the fake device (``kvcanary_cupy/devtools/fake_cupy.py``: launches recorded, not
run): it checks the launches build for every variant and case; with ``--emulate`` the recorded
launches also run on the CPU (``digest_emulate.py``: the kernels built with g++, a thread a lane)
and their bytes are compared with the reference's, as on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kvcanary_cupy as kc  # noqa: E402
from kvcanary_cupy.digest import cuda as digest_cuda  # noqa: E402


def parse_variants(text: str) -> list:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"variants: expected a comma-separated list, got {text!r}")
    for v in names:
        try:
            digest_cuda.variant_features(v)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


@contextlib.contextmanager
def variant(name: str):
    """digest_pages' checked calls launch ``name`` inside (the variable is read at each checked call)."""
    old = os.environ.get(digest_cuda.VARIANT_ENV)
    os.environ[digest_cuda.VARIANT_ENV] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ[digest_cuda.VARIANT_ENV]
        else:
            os.environ[digest_cuda.VARIANT_ENV] = old


def in_variant(name: str, fn):
    with variant(name):
        return fn()


class Case:
    """One fuzzed digest call, built on the host: its pool bytes, table and arguments."""

    def __init__(self, rng, index: int):
        self.index = index
        self.kind = ("sglang", "vllm-NHD", "vllm-HND", "mla")[rng.integers(4)]
        self.layers = int(rng.integers(1, 7))
        self.heads = 1 if self.kind == "mla" else int(rng.integers(1, 9))
        self.strip = int(rng.choice([8, 16, 32, 64, 128, 256]))  # bytes: uint8 elements, the dtype named fp8
        self.page = int(rng.choice([1, 2, 4, 16]))
        self.layer_offset = int(rng.choice([0, 0, 2]))
        bs = int(rng.integers(1, 6))
        lengths = rng.integers(0, 300, bs)
        pages_needed = int(sum(-(-int(n) // self.page) for n in lengths))
        self.num_pages = pages_needed + 2 + int(rng.integers(0, 3))
        halves = 1 if self.kind == "mla" else 2
        if self.kind == "vllm-HND":
            shape = (self.layers, 2, self.num_pages, self.heads, self.page, self.strip)
        elif self.kind == "vllm-NHD":
            shape = (self.layers, 2, self.num_pages, self.page, self.heads, self.strip)
        else:
            shape = (self.layers, halves, self.num_pages * self.page, self.heads, self.strip)
        self.kv = rng.integers(0, 256, shape, dtype=np.uint8)
        width = int(max(lengths.max(), 1)) + self.page
        width = -(-width // self.page) * self.page
        self.table = np.zeros((bs + 1, width), np.int32)
        pages = rng.permutation(np.arange(1, self.num_pages))
        at = 0
        for r, n in enumerate(lengths):
            own = pages[at: at + -(-int(n) // self.page)]
            at += len(own)
            pos = np.arange(int(n))
            self.table[r + 1, : int(n)] = own[pos // self.page] * self.page + pos % self.page
        if rng.random() < 0.2:  # a slot past the pool: counted out of range, skipped
            r = int(rng.integers(1, bs + 1))
            self.table[r, int(rng.integers(0, width))] = self.num_pages * self.page + 3
        self.rows = np.arange(1, bs + 1, dtype=np.int64)
        if rng.random() < 0.15:  # a row outside the table: the request is skipped and counted
            self.rows[int(rng.integers(bs))] = bs + 5
        ends = np.array([int(rng.integers(0, n + 1)) for n in lengths], np.int64)
        self.starts = np.array([int(rng.integers(0, e + 1)) for e in ends], np.int64)
        self.ends = ends
        self.keys = rng.integers(-2**62, 2**62, bs, dtype=np.int64)
        total = self.layer_offset + self.layers + int(rng.choice([0, 0, 3, 70]))
        sample = int(rng.choice([0, 1, 2, 3, total]))
        window = int(rng.choice([0, 8, 16, 32, 64, self.strip]))
        mode = ("none", "sender", "receiver")[rng.integers(3)]
        self.spec = kc.DigestSpec(total, sample_layers=sample, window_bytes=window if window < self.strip else 0,
                                  records=mode != "none")
        self.mode = mode
        slots = self.num_pages * self.page
        self.canary = rng.integers(-2**40, 2**40, (slots, 4), dtype=np.int64) if mode != "none" else None
        self.expected = rng.integers(0, 30000, (bs + 2, width), dtype=np.int32) if mode == "receiver" else None

    def describe(self) -> str:
        return (f"case {self.index}: {self.kind} layers {self.layer_offset}+{self.layers} heads {self.heads} strip "
                f"{self.strip} B page {self.page}, spec (total {self.spec.num_layers_total}, sample "
                f"{self.spec.sample_layers}, window {self.spec.window_bytes} B, {self.mode}), "
                f"{len(self.starts)} requests")

    def layout(self, xp):
        kv = xp.asarray(self.kv)
        shard = {"layer_offset": self.layer_offset, "dtype": "float8_e4m3fn"}
        if self.kind in ("vllm-NHD", "vllm-HND"):
            caches = [kv[layer] for layer in range(self.layers)]
            if self.kind == "vllm-HND":
                caches = [c.transpose(0, 1, 3, 2, 4) for c in caches]
            return kc.KvLayout.from_vllm(caches, **shard), kv
        if self.kind == "mla":
            return kc.KvLayout.from_mla([kv[layer, 0] for layer in range(self.layers)], page_size=self.page, **shard), kv
        return kc.KvLayout.from_sglang([kv[layer, 0] for layer in range(self.layers)],
                                       [kv[layer, 1] for layer in range(self.layers)], page_size=self.page, **shard), kv

    def run(self, xp, to_host, after=None):
        """The records and out-of-range count of this case's digest_pages on ``xp`` (NumPy or CuPy);
        ``after()`` runs between the call and the read (the emulator running the fake device's launches)."""
        layout, keep = self.layout(xp)
        if self.kind in ("vllm-NHD", "vllm-HND"):
            # vLLM's block table over the same pages (slot // page in each row's first entries)
            blocks = (self.table[:, :: self.page] // self.page).astype(np.int32)
            tab = kc.BlockTable(xp.asarray(blocks), self.page)
        else:
            tab = xp.asarray(self.table)
        out = kc.DigestBatch.allocate(len(self.starts), like=xp.asarray(self.rows))
        extra = {}
        if self.mode != "none":
            extra["records"] = xp.asarray(self.canary)
        if self.mode == "receiver":
            extra["expected_tokens"] = xp.asarray(self.expected)
        kc.digest_pages(layout, tab, xp.asarray(self.rows), xp.asarray(self.starts), xp.asarray(self.ends),
                        spec=self.spec, sample_keys=xp.asarray(self.keys), out=out, **extra)
        if after is not None:
            after()
        del keep
        return to_host(out.records).copy(), to_host(out.out_of_range_count).copy()


def check(cupy, to_host, variants: list, cases: int, seed: int, fake: bool, lines: list, after=None) -> list:
    """Every variant's bytes against the NumPy reference's on ``cases`` fuzzed cases (``fake``:
    launches only, nothing compared, unless ``after`` runs them: the CPU emulator); returns the
    variants that matched in every case."""
    rng = np.random.default_rng(seed)
    bad = {v: 0 for v in variants}
    taken = {v: 0 for v in variants}
    for i in range(cases):
        case = Case(rng, i)
        want = case.run(np, np.asarray)
        for v in variants:
            with variant(v):
                got = case.run(cupy, to_host, after)
            spec = case.spec
            taken[v] += "units" in v and bool(digest_cuda.unit_words(
                case.layout(np)[0], spec.num_layers_total, spec.sample_layers, spec.window_bytes))
            if fake and after is None:
                continue  # the fake device records launches without running them: no bytes to compare
            if not (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])):
                bad[v] += 1
                diff = np.nonzero((got[0] != want[0]).any(axis=1))[0].tolist()
                lines.append(f"MISMATCH variant {v}, {case.describe()}: rows {diff}, out of range {got[1]} vs {want[1]}")
    what = ("launches built (fake device: bytes not compared)" if fake and after is None else
            "bytes compared with the NumPy reference" + (" (the kernels run by the CPU emulator)" if fake else ""))
    units = ", ".join(f"{v} {n}" for v, n in taken.items())
    lines.append(f"byte check: {cases} fuzzed cases x {len(variants)} variants, {sum(bad.values())} mismatches; {what} "
                 f"(cases digest_units takes: {units}: the others run digest_accumulate)")
    return [v for v in variants if bad[v] == 0]


def timing(cupy, variants: list, lines: list) -> None:
    import bench_digest as bd

    from kvcanary_cupy.devtools.bench.timing import read_bandwidth, time_graphs_interleaved

    read_bw = read_bandwidth(cupy)
    full = kc.DigestSpec.full(bd.LAYERS, records=False)
    default = kc.DigestSpec(bd.LAYERS, records=False)
    lines.append(f"read bandwidth {read_bw / 1e9:.0f} GB/s; device us a call, median of interleaved graph replays")
    lines.append(f"{'case':<14} {'target':>7} " + " ".join(f"{v:>9}" for v in variants))
    rows = (("FULL 16K", full, 16384, 5, 12), ("default 16K", default, 16384, 50, 40), ("default 4K", default, 4096, 50, 40))
    pools = {}
    for name, spec, tokens, k, rounds in rows:
        if tokens not in pools:
            pools.clear()  # one pool at a time: the 16K pool is 5.4 GB
            pools[tokens] = bd.pool(cupy, tokens)
        layout, rtt = pools[tokens]
        fns = {}
        for v in variants:
            fn = bd.digest_call(cupy, layout, rtt, tokens, spec)  # arrays of its own
            # each call inside its variant: the memo holds the last call only, so a capture after
            # another variant's call takes the checked path and reads the variable again
            fns[v] = lambda v=v, fn=fn: in_variant(v, fn)
            fns[v]()
        got = time_graphs_interleaved(cupy, fns, k=k, rounds=rounds)
        lines.append(f"{name:<14} {bd.TARGETS[name]:>7.0f} " + " ".join(f"{got[v]:>9.1f}" for v in variants))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=parse_variants, default=list(digest_cuda.DIGEST_VARIANTS))
    parser.add_argument("--cases", type=int, default=60, help="fuzzed cases of the byte check (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-timing", action="store_true", help="the byte check alone")
    parser.add_argument("--fake", action="store_true", help="on the fake device: launches built, bytes not compared")
    parser.add_argument("--emulate", action="store_true",
                        help="with --fake: run the launches on the CPU (benchmarks/digest_emulate.py, g++) and compare their bytes")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.cases < 0:
        parser.error("--cases must be >= 0")
    if args.emulate and not args.fake:
        parser.error("--emulate runs the fake device's launches: pass --fake with it")
    lines = [f"digest variants {','.join(args.variants)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    if args.fake:
        from kvcanary_cupy.devtools.fake_cupy import fake_device

        after = None
        if args.emulate:
            from digest_emulate import Emulator

            emulator = Emulator()
        with fake_device() as dev:
            import cupy

            if args.emulate:
                def after():
                    for launch in dev.launches:
                        emulator.run(launch)
                    dev.launches.clear()

            real = cupy.asarray
            cupy.asarray = lambda a, *x, **kw: a if isinstance(a, cupy.ndarray) else dev.asarray(np.asarray(a))
            try:
                ok = check(cupy, dev.to_numpy, args.variants, args.cases, args.seed, True, lines, after) == args.variants
            finally:
                cupy.asarray = real
    else:
        import cupy

        kc.warmup()
        passed = check(cupy, cupy.asnumpy, args.variants, args.cases, args.seed, False, lines)
        ok = passed == args.variants
        if not ok:
            lines.append(f"not timed (bytes differ): {', '.join(v for v in args.variants if v not in passed)}")
        if passed and not args.no_timing:
            timing(cupy, passed, lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
