"""kc.copy_pages (issue 24): canary rows ride with KV blocks between buffers (offload staging, reload),
on every backend, with out-of-range page ids skipped and counted; an offload -> reload round trip
whose rows then verify at their new slots."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from digest_pools import Model, build_pool


def reference_copy(src, dst, s, d, page_size):
    """The rule, pair by pair: in-range pairs copy whole pages, later pairs win."""
    out = dst.copy()
    sp, dp = src.shape[0] // page_size, dst.shape[0] // page_size
    for a, b in zip(s, d):
        if 0 <= a < sp and 0 <= b < dp:
            out[b * page_size:(b + 1) * page_size] = src[a * page_size:(a + 1) * page_size]
    return out, int(sum(not 0 <= a < sp for a in s) + sum(not 0 <= b < dp for b in d))


@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_copy_pages_equals_the_rule(ab, ids_dtype):
    rng = np.random.default_rng(6)
    for page_size, src_rows, dst_rows in ((1, 10, 7), (4, 40, 24), (3, 10, 2)):
        src = rng.integers(-2**60, 2**60, (src_rows, 4))
        dst = rng.integers(-2**60, 2**60, (dst_rows, 4))
        s = rng.integers(-1, src_rows // page_size + 2, 5).astype(ids_dtype)
        d = rng.permutation(np.arange(-2, dst_rows // page_size + 3))[:5].astype(ids_dtype)  # distinct destinations
        want, bad = reference_copy(src, dst, s, d, page_size)
        count = ab.asarray(np.zeros(1, np.int64))
        got = kc.copy_pages(ab.asarray(src), ab.asarray(dst), ab.asarray(s), ab.asarray(d), page_size=page_size,
                            out_of_range_count=count)
        np.testing.assert_array_equal(ab.to_numpy(got), want)
        assert int(ab.to_numpy(count)[0]) == bad


def test_offload_and_reload_keep_the_rows_verifiable(ab):
    """Rows of a request's pages go to a staging buffer and come back into other pages: the
    request's chain then verifies through its new table, and the staging source is untouched."""
    rng = np.random.default_rng(8)
    model = Model.random(rng, [13])
    pool = build_pool("sglang", model, page_size=4, num_pages=12, rng=rng)
    pool.stamp(0, model)
    pages = (pool.table[1, ::4][:4] // 4).astype(np.int64)
    canary = ab.asarray(pool.canary)
    staging = kc.allocate_canary_buffer(4 * 4, like=canary)
    kc.copy_pages(canary, staging, ab.asarray(pages), ab.asarray(np.arange(4)), page_size=4)
    free = np.setdiff1d(np.arange(1, 12), pages)[:4]  # the reload lands in pages nobody held
    kc.copy_pages(staging, canary, ab.asarray(np.arange(4)), ab.asarray(free), page_size=4)
    table = pool.table.copy()
    pos = np.arange(13)
    table[1, :13] = free[pos // 4] * 4 + pos % 4
    vp, _ = kc.plan(ab.asarray(np.array([1])), ab.asarray(np.array([13])), ab.asarray(np.array([0])), ab.asarray(table),
                    verify_capacity=16)
    log = kc.ViolationLog.allocate(8, like=canary)
    kc.verify(canary, vp, log=log)
    assert log.read().total_violations == 0
    np.testing.assert_array_equal(ab.to_numpy(canary)[pool.table[1, :13]], pool.canary[pool.table[1, :13]])  # copied, not moved


def test_copy_pages_refuses_one_buffer_and_other_widths():
    buf = kc.allocate_canary_buffer(8)
    with pytest.raises(ValueError, match="overlap in memory; copy pages within one buffer with kc.move_pages"):
        kc.copy_pages(buf, buf, np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match="must have one width, got 4 and 8 int64 fields"):
        kc.copy_pages(buf, np.zeros((8, 8), np.int64), np.array([0]), np.array([1]))
    with pytest.raises(ValueError, match=r"dst_pages length must be len\(src_pages\)=1, got 2"):
        kc.copy_pages(buf, kc.allocate_canary_buffer(8), np.array([0]), np.array([1, 2]))
