"""A digest fuzz subset for compute-sanitizer: random pools of every engine shape, tables with
out-of-range entries, ranges past the rows, receiver token pools and seams out of range, canary
buffers smaller than the pool, digested on CuPy and compared with NumPy byte for byte, then
verify_digest of random records, then kc.copy_pages with ids past both buffers.  CuPy's memory
pool is turned off so every array is its own cudaMalloc and memcheck sees any access past it.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/sanitizer_digest.py --cases 12
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import cupy  # noqa: E402

import kvcanary_cupy as kc  # noqa: E402
from conftest import get_backend_or_skip  # noqa: E402
from digest_pools import KINDS, Model, build_pool, layout_of  # noqa: E402


def case(seed: int, numpy_ab, cupy_ab) -> int:
    rng = np.random.default_rng(seed)
    lengths = list(rng.integers(1, 50, rng.integers(1, 6)))
    model = Model.random(rng, lengths, num_layers=int(rng.integers(1, 4)), num_heads=int(rng.integers(1, 4)),
                         dtype=["bfloat16", "fp8", "float32"][seed % 3], head_dim=16)
    ps = int(rng.choice([1, 4, 16]))
    pool = build_pool(KINDS[seed % len(KINDS)], model, page_size=ps, num_pages=sum(-(-n // ps) for n in lengths) + 2, rng=rng)
    for r in range(len(lengths)):
        pool.write(r, model)
        pool.stamp(r, model)
    bs = len(lengths)
    pool.table[rng.integers(0, pool.table.shape[0], 4), rng.integers(0, pool.table.shape[1], 4)] = rng.integers(-9, 10**7, 4)
    rows = rng.integers(-1, pool.table.shape[0] + 1, bs)
    starts = rng.integers(-2, 20, bs)
    ends = starts + rng.integers(-2, pool.table.shape[1] + 4, bs)
    keys = rng.integers(-2**63, 2**63 - 1, bs)
    canary = pool.canary[: int(rng.integers(1, pool.canary.shape[0] + 1))]  # may be smaller than the pool
    tokens = rng.integers(0, 999, (int(rng.integers(1, pool.table.shape[0] + 1)), int(rng.integers(1, pool.table.shape[1] + 2))))
    seam = rng.integers(-3, canary.shape[0] + 3, bs)
    valid_lens = rng.integers(-2, 60, bs)
    spec = kc.DigestSpec(model.num_layers, sample_layers=int(rng.integers(0, 3)), window_bytes=int(rng.choice([0, 8, 16])))
    outs = []
    for ab in (numpy_ab, cupy_ab):
        _, layout = layout_of(pool, model, ab)
        for receiver in (False, True):
            kw = {"expected_tokens": ab.asarray(tokens.astype(np.int32)), "seam": ab.asarray(seam),
                  "expected_tokens_valid_lens": ab.asarray(valid_lens)} if receiver else {}
            out = kc.DigestBatch.allocate(bs, like=ab.like)
            kc.digest_pages(layout, ab.asarray(pool.table), ab.asarray(rows), ab.asarray(starts), ab.asarray(ends), spec=spec,
                            sample_keys=ab.asarray(keys), records=ab.asarray(canary), out=out, **kw)
            outs.append((ab.to_numpy(out.records), ab.to_numpy(out.out_of_range_count)))
    for want, got in zip(outs[:2], outs[2:]):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"seed {seed}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"seed {seed}")
    return int(outs[0][1][0])


def _verify_log(ab, expected, actual, capacity: int):
    """verify_digest of two record arrays on ``ab`` into a fresh log: the codes, the ring's rows and the counters."""
    log = kc.ViolationLog.allocate(capacity, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
    ex, ac = (kc.DigestBatch(ab.asarray(x), ab.asarray(np.zeros(1, np.int64))) for x in (expected, actual))
    codes = ab.to_numpy(kc.verify_digest(ex, ac, log=log))
    taken = int(ab.to_numpy(log.write_index)[0])
    ring = [tuple(int(x) for x in row) for row in ab.to_numpy(log.ring)[:taken]]
    counters = [ab.to_numpy(getattr(log, k)).tolist() for k in ("violation_counters", "slot_run_counters", "kernel_run_counters")]
    return codes, ring, counters


def verify_case(seed: int, numpy_ab, cupy_ab) -> None:
    """Random records, 10% of their words flipped: the same codes and counters on both backends.  A
    ring that holds every violation holds the same rows (in the GPU's atomic order); a 64-row ring
    that overflows holds 64 distinct rows of the full set, which ones depending on that order."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 700))
    a = rng.integers(-2**63, 2**63 - 1, (n, 8))
    e = a.copy()
    e[rng.random((n, 8)) < 0.1] ^= 1
    a[:, 0] = e[:, 0] = kc.to_signed(0x4744564B | 1 << 32 | 1 << 48)
    codes, ring, counters = _verify_log(numpy_ab, e, a, 1024)
    every = sorted(ring)
    assert len(every) == counters[0][kc.DigestLaunchTag.TRANSFER] == int(np.count_nonzero(codes)), f"verify seed {seed}"
    for capacity in (1024, 64):
        got_codes, got_ring, got_counters = _verify_log(cupy_ab, e, a, capacity)
        np.testing.assert_array_equal(got_codes, codes, err_msg=f"verify seed {seed}")
        assert got_counters == counters, f"verify seed {seed}, ring of {capacity}"
        assert len(got_ring) == min(len(every), capacity), f"verify seed {seed}, ring of {capacity}"
        if capacity >= len(every):
            assert sorted(got_ring) == every, f"verify seed {seed}"
        else:
            assert len(set(got_ring)) == len(got_ring) and set(got_ring) <= set(every), f"verify seed {seed}, ring of {capacity}"


def copy_case(seed: int, numpy_ab, cupy_ab) -> None:
    """kc.copy_pages with ids past both buffers, between two buffers or within one, through an
    exactly sized workspace: CuPy writes NumPy's bytes and counts, nothing out of bounds."""
    rng = np.random.default_rng(seed)
    ps = int(rng.integers(1, 5))
    src = rng.integers(-2**40, 2**40, (int(rng.integers(1, 40)), 4))
    dst = rng.integers(-2**40, 2**40, (int(rng.integers(1, 40)), 4))
    n = int(rng.integers(0, 12))
    s_ids, d_ids = rng.integers(-3, 15, n), rng.permutation(np.arange(-3, 15))[:n]  # distinct destinations
    outs = []
    for ab in (numpy_ab, cupy_ab):
        for one_buffer in (False, True):
            count = ab.asarray(np.zeros(1, np.int64))
            s = ab.asarray((dst if one_buffer else src).copy())
            d = s if one_buffer else ab.asarray(dst.copy())
            workspace = ab.asarray(np.zeros(max(1, n * ps * 4), np.int64))
            kc.copy_pages(s, d, ab.asarray(s_ids), ab.asarray(d_ids), page_size=ps, workspace=workspace,
                          out_of_range_count=count)
            outs.append((ab.to_numpy(s), ab.to_numpy(d), ab.to_numpy(count)))
    for want, got in zip(outs[:2], outs[2:]):
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w, err_msg=f"copy seed {seed}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--first", type=int, default=7000)
    args = parser.parse_args()
    cupy.cuda.set_allocator(None)
    numpy_ab, cupy_ab = get_backend_or_skip("numpy"), get_backend_or_skip("cupy")
    skipped = 0
    for seed in range(args.first, args.first + args.cases):
        skipped += case(seed, numpy_ab, cupy_ab)
        verify_case(seed, numpy_ab, cupy_ab)
        copy_case(seed, numpy_ab, cupy_ab)
    print(f"digest sanitizer fuzz: {args.cases} cases on CuPy == NumPy, {skipped} out-of-range items skipped and counted")


if __name__ == "__main__":
    main()
