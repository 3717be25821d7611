"""A digest fuzz subset for compute-sanitizer: random pools of every engine shape, tables with
out-of-range entries, ranges past the rows, receiver token pools and seams out of range, canary
buffers smaller than the pool, digested on CuPy and compared with NumPy byte for byte, then
verify_digest of random records.  CuPy's memory pool is turned off so every array is its own
cudaMalloc and memcheck sees any access past it.

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


def verify_case(seed: int, numpy_ab, cupy_ab) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 700))
    a = rng.integers(-2**63, 2**63 - 1, (n, 8))
    e = a.copy()
    e[rng.random((n, 8)) < 0.1] ^= 1
    a[:, 0] = e[:, 0] = kc.to_signed(0x4744564B | 1 << 32 | 1 << 48)
    codes, rings = [], []
    for ab in (numpy_ab, cupy_ab):
        log = kc.ViolationLog.allocate(64, num_kinds=kc.DIGEST_NUM_KINDS, like=ab.like)
        ex, ac = kc.DigestBatch(ab.asarray(e), ab.asarray(np.zeros(1, np.int64))), kc.DigestBatch(ab.asarray(a), ab.asarray(np.zeros(1, np.int64)))
        codes.append(ab.to_numpy(kc.verify_digest(ex, ac, log=log)))
        taken = int(ab.to_numpy(log.write_index)[0])
        rings.append((sorted(tuple(int(x) for x in row) for row in ab.to_numpy(log.ring)[:taken]),
                      int(ab.to_numpy(log.violation_counters).sum())))
    np.testing.assert_array_equal(codes[1], codes[0], err_msg=f"verify seed {seed}")
    assert rings[0] == rings[1], f"verify seed {seed}"


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
    print(f"digest sanitizer fuzz: {args.cases} cases on CuPy == NumPy, {skipped} out-of-range items skipped and counted")


if __name__ == "__main__":
    main()
