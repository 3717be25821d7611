"""scatter_req_token_ids and its out-of-range rules."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import a64, i64, linear_rtt, plan_entries, run_plan
from conftest import get_backend_or_skip

POISON = -7


def oracle_scatter(flat, offsets, rp, pool):
    """Per-request loop: returns the out-of-range count; mutates ``pool``."""
    rows, cols = pool.shape
    n = len(flat)
    bad = 0
    for r in range(len(rp)):
        start, length = int(offsets[r]), int(offsets[r + 1]) - int(offsets[r])
        width = min(max(length, 0), cols)
        if not 0 <= rp[r] < rows:
            bad += 1
            continue
        if length < 0 or (width > 0 and (start < 0 or start + width > n)):
            bad += 1
        for c in range(width):
            if 0 <= start + c < n:
                pool[rp[r], c] = np.int64(flat[start + c]).astype(np.int32)
    return bad


def scatter(ab, flat, offsets, rp, pool_np, *, counter=True, **kw):
    pool = ab.asarray(pool_np)
    count = ab.asarray(np.zeros(1, np.int64)) if counter else None
    ret = kc.scatter_req_token_ids(a64(ab, flat), a64(ab, offsets), a64(ab, rp), pool, out_of_range_count=count, **kw)
    assert ret is pool
    return ab.to_numpy(pool), (int(ab.to_numpy(count)[0]) if counter else None)


def poisoned(rows, cols):
    return np.full((rows, cols), POISON, np.int32)


def test_mixed_batch(ab):
    flat = [10, 11, 12, 20, 30, 31, 32, 33]
    got, bad = scatter(ab, flat, [0, 3, 4, 8], [3, 1, 5], poisoned(6, 6))
    want = poisoned(6, 6)
    want[3, :3] = [10, 11, 12]
    want[1, :1] = [20]
    want[5, :4] = [30, 31, 32, 33]
    assert np.array_equal(got, want) and bad == 0


def test_empty_batch_is_a_no_op(ab):
    got, bad = scatter(ab, [1, 2, 3], [0], [], poisoned(3, 4))
    assert (got == POISON).all() and bad == 0
    got, bad = scatter(ab, [], [0, 0], [1], poisoned(3, 4))
    assert (got == POISON).all() and bad == 0


def test_single_request(ab):
    got, _ = scatter(ab, [5, 6, 7], [0, 3], [2], poisoned(3, 4))
    assert got[2].tolist() == [5, 6, 7, POISON]
    assert (got[[0, 1]] == POISON).all()


def test_truncation_at_row_width(ab):
    flat = list(range(100, 110))
    got, bad = scatter(ab, flat, [0, 7, 10], [1, 2], poisoned(4, 5))
    assert got[1].tolist() == [100, 101, 102, 103, 104]  # truncated, no spill into row 2
    assert got[2].tolist() == [107, 108, 109, POISON, POISON]
    assert bad == 0  # truncation is the rule, not an out-of-range value


def test_zero_length_middle_request(ab):
    got, bad = scatter(ab, [1, 2, 3], [0, 2, 2, 3], [1, 2, 3], poisoned(4, 3))
    assert got[1].tolist() == [1, 2, POISON]
    assert (got[2] == POISON).all()
    assert got[3].tolist() == [3, POISON, POISON]
    assert bad == 0


def test_values_are_narrowed_to_int32(ab):
    got, _ = scatter(ab, [0x7FFFFFFF, -1, 2**31, 2**32 + 5], [0, 4], [0], poisoned(1, 4))
    assert got[0].tolist() == [0x7FFFFFFF, -1, -(2**31), 5]


def test_counter_is_optional(ab):
    got, _ = scatter(ab, [1, 2], [0, 2], [1], poisoned(2, 2), counter=False)
    assert got[1].tolist() == [1, 2]


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_oracle(ab, seed):
    rng = np.random.default_rng(seed)
    rows, cols, bs = 9, int(rng.integers(1, 40)), int(rng.integers(0, 8))
    lens = rng.integers(0, 50, size=bs)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    flat = rng.integers(0, 2**31 - 1, size=int(offsets[-1]))
    rp = rng.permutation(rows)[:bs]
    got, bad = scatter(ab, flat, offsets, rp, poisoned(rows, cols))
    want = poisoned(rows, cols)
    assert oracle_scatter(flat, offsets, rp, want) == bad == 0
    assert np.array_equal(got, want)


# ---- batch rows sharing a pool row: per column, the largest batch row writing it wins -----------


def test_repeated_pool_rows_last_writer_wins_per_column(ab):
    #        row 0 -> 1    row 1 -> 2  row 2 -> 1  row 3 -> 2    row 4 -> 1  row 5 -> 3       row 6 -> 3
    flat = [1, 2, 3] + [20, 21] + [9] + [30, 31, 32] + [] + list(range(40, 47)) + [50, 51]
    lens = [3, 2, 1, 3, 0, 7, 2]
    offsets = np.concatenate([[0], np.cumsum(lens)])
    got, bad = scatter(ab, flat, offsets, [1, 2, 1, 2, 1, 3, 3], poisoned(4, 5))
    want = poisoned(4, 5)
    want[1, :3] = [9, 2, 3]  # row 2 takes column 0 only; the empty row 4 takes nothing
    want[2, :3] = [30, 31, 32]  # row 3 covers all of row 1's columns
    want[3] = [50, 51, 42, 43, 44]  # row 5 was truncated to 5 columns; row 6 takes two
    assert np.array_equal(got, want) and bad == 0


def test_repeated_pool_rows_with_a_source_before_flat_in(ab):
    """A later row whose source starts before flat_in takes only the columns it writes."""
    flat = [1, 2, 3, 4, 5, 6, 7]
    # row 0: flat[0:5] -> pool row 1, columns 0-4; row 1: negative length, writes nothing;
    # row 2: start -2, length 4 -> columns 2, 3 get flat[0], flat[1]; row 3: flat[2] -> column 0
    got, bad = scatter(ab, flat, [0, 5, -2, 2, 3], [1, 0, 1, 1], poisoned(2, 6))
    assert got[1].tolist() == [3, 2, 1, 2, 5, POISON]
    assert (got[0] == POISON).all() and bad == 2


@pytest.mark.parametrize("seed", range(12))
def test_random_batches_with_repeated_pool_rows_match_the_oracle(ab, seed):
    """The oracle loops over batch rows in order, so its last write is the rule's winner."""
    rng = np.random.default_rng(100 + seed)
    rows, cols, bs = 3, int(rng.integers(1, 12)), int(rng.integers(1, 16))
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 14, size=bs))]) - int(rng.integers(0, 3))
    flat = rng.integers(-(2**31), 2**31 - 1, size=int(offsets[-1]) + 1)
    rp = rng.integers(0, rows, size=bs)
    got, bad = scatter(ab, flat, offsets, rp, poisoned(rows, cols))
    want = poisoned(rows, cols)
    assert oracle_scatter(flat, offsets, rp, want) == bad
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bs", [3000, 20_000])
def test_repeated_pool_rows_match_numpy_on_the_gpu(gpu_ab, bs):
    """Thousands of batch rows racing for 7 pool rows, with earlier rows longer than later ones and
    a few sources starting before flat_in: the GPU writes NumPy's bytes, twice in a row.  20,000
    rows exceed the device's resident blocks, so blocks take several rows each."""
    rng = np.random.default_rng(bs)
    rows, cols = 7, 512
    lens = np.maximum(0, 700 - np.arange(bs) * 700 // bs + rng.integers(-50, 50, size=bs)) if bs < 10_000 else rng.integers(0, 40, size=bs)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    offsets[rng.integers(0, bs, size=8)] = -5  # sources before flat_in (counted, written in part)
    flat = rng.integers(-(2**31), 2**31 - 1, size=int(offsets[-1]))
    rp = rng.integers(0, rows, size=bs)
    pool0 = rng.integers(-(2**31), 2**31 - 1, size=(rows, cols)).astype(np.int32)
    want, want_bad = scatter(get_backend_or_skip("numpy"), flat, offsets, rp, pool0)
    for _ in range(2):
        got, bad = scatter(gpu_ab, flat, offsets, rp, pool0)
        assert bad == want_bad
        np.testing.assert_array_equal(got, want)


# ---- out-of-range values ------------------------------------------------------------------------


@pytest.mark.parametrize("name, flat, offsets, rp, bad", [
    ("pool row past the end", [1, 2, 3], [0, 1, 3], [4, 1], 1),
    ("negative pool row", [1, 2, 3], [0, 1, 3], [-1, 1], 1),
    ("negative length", [1, 2, 3, 4], [0, 3, 1, 4], [1, 2, 3], 1),
    ("source past flat_in", [1, 2, 3, 4, 5], [3, 8], [1], 1),
    ("source before flat_in", [1, 2, 3, 4, 5], [-2, 2], [2], 1),
    ("every kind at once", [1, 2, 3, 4, 5], [0, 2, 1, 4, 9], [9, 1, 2, 3], 3),
    ("empty range out of bounds is fine", [1, 2], [5, 5], [1], 0),
    ("one value just past flat_in", [1, 2, 3, 4, 5], [5, 6], [1], 1),
    ("a single value", [7], [0, 1], [2], 0),
])
def test_out_of_range_rows(ab, name, flat, offsets, rp, bad):
    got, count = scatter(ab, flat, offsets, rp, poisoned(4, 5))
    want = poisoned(4, 5)
    assert oracle_scatter(flat, offsets, rp, want) == bad
    assert count == bad, name
    assert np.array_equal(got, want), name
    if bad:  # strict=True raises exactly when a value is skipped
        with pytest.raises(ValueError, match="is outside|is not a range"):
            scatter(ab, flat, offsets, rp, poisoned(4, 5), strict=True)
    else:
        scatter(ab, flat, offsets, rp, poisoned(4, 5), strict=True)


def test_partial_source_writes_only_in_range_elements(ab):
    got, count = scatter(ab, [1, 2, 3, 4, 5], [3, 8, 10], [1, 2], poisoned(3, 6))
    assert got[1].tolist() == [4, 5, POISON, POISON, POISON, POISON]
    assert (got[2] == POISON).all()  # [8, 10) lies wholly past flat_in
    assert count == 2
    got, count = scatter(ab, [1, 2, 3, 4, 5], [-2, 2], [2], poisoned(3, 6))
    assert got[2].tolist() == [POISON, POISON, 1, 2, POISON, POISON]
    assert count == 1


def test_counter_accumulates(ab):
    count = ab.asarray(np.array([5], np.int64))
    pool = ab.asarray(poisoned(2, 2))
    kc.scatter_req_token_ids(a64(ab, [1]), a64(ab, [0, 1]), a64(ab, [7]), pool, out_of_range_count=count)
    assert int(ab.to_numpy(count)[0]) == 6


@pytest.mark.parametrize("offsets, rp, message", [
    ([0, 1, 3], [4, 1], r"req_pool_indices\[0\] = 4 is outside \[0, 4\) \(pool_out has 4 rows\)"),
    ([0, 3, 1], [1, 2], r"offsets\[1:3\] = \[3, 1\] is not a range within the 3 values of flat_in"),
    ([0, 1, 9], [1, 2], r"offsets\[1:3\] = \[1, 9\] is not a range within the 3 values of flat_in"),
    ([0, 9, 9], [0, 2], r"offsets\[0:2\] = \[0, 9\] is not a range"),  # pool row 0 is a row like any other
])
def test_strict_scatter(ab, offsets, rp, message):
    pool = ab.asarray(poisoned(4, 5))
    count = ab.asarray(np.zeros(1, np.int64))
    with pytest.raises(ValueError, match=message):
        kc.scatter_req_token_ids(a64(ab, [1, 2, 3]), a64(ab, offsets), a64(ab, rp), pool, out_of_range_count=count,
                                 strict=True)
    assert (ab.to_numpy(pool) == POISON).all() and int(ab.to_numpy(count)[0]) == 0


def test_strict_scatter_accepts_truncation(ab):
    got, count = scatter(ab, list(range(9)), [0, 9], [1], poisoned(2, 4), strict=True)
    assert got[1].tolist() == [0, 1, 2, 3] and count == 0


def test_scatter_feeds_the_plan(ab):
    """The scattered pool is the plan's expected-token source of truth."""
    history = {1: [11, 12, 13, 14], 2: [21, 22]}
    flat = history[1] + history[2]
    pool, _ = scatter(ab, flat, [0, 4, 6], [1, 2], np.zeros((3, 8), np.int32))
    _, _, vph, _ = run_plan(ab, [1, 2], [4, 2], [1, 1], linear_rtt(3, 8), verify_capacity=16, pool=pool,
                            valid_lens=i64([4, 2]))
    assert [e[1] for e in plan_entries(vph)] == flat
