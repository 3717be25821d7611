"""move_pages: canary rows move with their KV pages, permutations included, on every backend."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import a64, host, make_log, plan_entries
from fuzz_cases import make_move_case, run_move_case

I32, I64 = np.int32, np.int64


def reference_move(buf: np.ndarray, src, dst, page_size: int) -> np.ndarray:
    """The issue's definition, pair by pair validity included, on a host copy."""
    out = buf.copy()
    num_pages = buf.shape[0] // page_size
    keep = [(s, d) for s, d in zip(src, dst) if 0 <= s < num_pages and 0 <= d < num_pages]
    slots = lambda pages: np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in pages]).astype(int)
    if keep:
        src_slots, dst_slots = slots([s for s, _ in keep]), slots([d for _, d in keep])
        rows = out[src_slots].copy()
        out[src_slots] = 0
        out[dst_slots] = rows
    return out


def random_canary(rng, num_slots):
    return rng.integers(-(2**62), 2**62, (num_slots, 4), dtype=I64)


def test_swap_two_pages(ab):
    buf = np.arange(6 * 4, dtype=I64).reshape(6, 4) + 1
    got = kc.move_pages(ab.asarray(buf), a64(ab, [0, 2]), a64(ab, [2, 0]), page_size=2)
    out = ab.to_numpy(got)
    assert out[:2].tolist() == buf[4:6].tolist() and out[4:6].tolist() == buf[:2].tolist()
    assert out[2:4].tolist() == buf[2:4].tolist()


def test_strict_accepts_distinct_destinations(ab):
    buf = np.arange(4 * 4, dtype=I64).reshape(4, 4) + 1
    out = ab.to_numpy(kc.move_pages(ab.asarray(buf), a64(ab, [1, 2]), a64(ab, [2, 1]), strict=True))
    assert out.tolist() == [buf[0].tolist(), buf[2].tolist(), buf[1].tolist(), buf[3].tolist()]


def test_numpy_gives_a_repeated_destination_its_last_pair():
    buf = np.arange(4 * 4, dtype=I64).reshape(4, 4) + 1
    out = kc.move_pages(buf.copy(), np.array([1, 2, 3]), np.array([0, 0, 0]))
    assert out[0].tolist() == buf[3].tolist() and (out[1:] == 0).all()
    out = kc.move_pages(buf.copy(), np.array([1, 2, 3]), np.array([0, 0, 2]))  # the repeat first, then another
    assert out.tolist() == [buf[2].tolist(), [0] * 4, buf[3].tolist(), [0] * 4]


def test_a_move_clears_the_source(ab):
    buf = np.arange(4 * 4, dtype=I64).reshape(4, 4) + 1
    out = ab.to_numpy(kc.move_pages(ab.asarray(buf), a64(ab, [1]), a64(ab, [3])))
    assert out.tolist() == [buf[0].tolist(), [0] * 4, buf[2].tolist(), buf[1].tolist()]


@pytest.mark.parametrize("seed", range(12))
def test_random_moves_match_the_definition(ab, seed):
    case = make_move_case(seed)
    got, count = run_move_case(ab, case)
    np.testing.assert_array_equal(got, reference_move(case.canary, case.src, case.dst, case.page_size))
    num_pages = case.canary.shape[0] // case.page_size
    bad = sum(int(not 0 <= p < num_pages) for p in np.concatenate([case.src, case.dst]))
    assert int(count[0]) == 5 + bad


def test_workspace_is_used_and_checked(ab):
    rng = np.random.default_rng(1)
    buf = random_canary(rng, 12)
    canary = ab.asarray(buf)
    workspace = kc.allocate_canary_buffer(2 * 3, like=canary)
    kc.move_pages(canary, a64(ab, [0, 3]), a64(ab, [3, 1]), page_size=3, workspace=workspace)
    np.testing.assert_array_equal(ab.to_numpy(canary), reference_move(buf, [0, 3], [3, 1], 3))
    small = kc.allocate_canary_buffer(5, like=canary)
    _rejected(ab, canary, lambda: kc.move_pages(canary, a64(ab, [0, 3]), a64(ab, [3, 1]), page_size=3, workspace=small),
              ValueError, r"workspace must hold at least len\(src_pages\) x page_size x 4 int64 fields = 24 values, got 20")
    wrong = ab.asarray(np.zeros(24, I32))
    _rejected(ab, canary, lambda: kc.move_pages(canary, a64(ab, [0]), a64(ab, [1]), page_size=3, workspace=wrong),
              TypeError, "workspace must have dtype int64, got int32")


def _rejected(ab, canary, call, exc, match):
    before = ab.to_numpy(canary).copy()
    with pytest.raises(exc, match=match):
        call()
    np.testing.assert_array_equal(ab.to_numpy(canary), before)


@pytest.mark.parametrize("src, dst, kw, exc, match", [
    ([0, 1], [2], {}, ValueError, r"dst_pages length must be len\(src_pages\)=2, got 1"),
    ([0.0], [1], {}, TypeError, "src_pages must have dtype int32 or int64, got float64"),
    ([0], [1.0], {}, TypeError, "dst_pages must have dtype int64, got float64"),
    ([[0]], [[1]], {}, ValueError, r"src_pages must be 1-D, got shape \(1, 1\)"),
    ([0], [1], dict(page_size=0), ValueError, "page_size must be >= 1, got 0"),
    ([0], [1], dict(page_size=2.0), TypeError, "page_size must be an int, got float"),
    ([0], [1], dict(out_of_range_count=np.zeros(2, I64)), ValueError, "out_of_range_count length must be 1, got 2"),
    ([0, 9], [1, 2], dict(strict=True), ValueError, r"src_pages\[1\] = 9 is outside \[0, 8\)"),
    ([0, 1], [2, 2], dict(strict=True), ValueError, r"dst_pages\[0\] and dst_pages\[1\] are both 2"),
    ([0, 1, 3], [2, 2, 2], dict(strict=True), ValueError,
     r"^kv-canary: dst_pages\[0\] and dst_pages\[1\] are both 2; a page can receive one source only$"),
    ([0, 1], [3, 8], dict(strict=True), ValueError, r"^kv-canary: dst_pages\[1\] = 8 is outside \[0, 8\) \(canary_buf's "
                                                    r"8 slots hold 8 whole pages of page_size=1\)$"),
    ([0, 1], [3, 5], dict(strict=True, page_size=2), ValueError, r"^kv-canary: dst_pages\[1\] = 5 is outside \[0, 4\) "
                                                                 r"\(canary_buf's 8 slots hold 4 whole pages of page_size=2\)$"),
])
def test_bad_input_changes_nothing(ab, src, dst, kw, exc, match):
    canary = ab.asarray(random_canary(np.random.default_rng(0), 8))
    src_a = ab.asarray(np.asarray(src, I64 if not isinstance(src[0], float) else np.float64))
    dst_a = ab.asarray(np.asarray(dst, I64 if not isinstance(dst[0], float) else np.float64))
    kw = {k: ab.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    _rejected(ab, canary, lambda: kc.move_pages(canary, src_a, dst_a, **kw), exc, match)


def test_a_table_left_at_the_old_place_fails_verify(ab):
    """After a compaction moves a page, the canary rows move too: the updated table verifies clean,
    a stale table that still points at the old page reports every slot of it."""
    page, n = 4, 8  # one request of 8 tokens on pages 1 and 2
    bt_before = np.array([[1, 2]], I32)
    canary = kc.allocate_canary_buffer(6 * page, like=ab.like)
    log = make_log(ab)
    vp, wp = kc.plan(a64(ab, [0]), a64(ab, [0]), a64(ab, [n]), kc.BlockTable(ab.asarray(bt_before), page), verify_capacity=16)
    loc = np.concatenate([np.arange(4, 8), np.arange(8, 12)])
    kc.write(canary, wp, a64(ab, np.arange(n) + 100), a64(ab, np.arange(n)), a64(ab, loc), log=log)
    kc.move_pages(canary, a64(ab, [2]), a64(ab, [5]), page_size=page)  # the engine moves page 2 to page 5
    for table, violations in ((np.array([[1, 5]], I32), 0), (bt_before, 4)):
        vp, _ = kc.plan(a64(ab, [0]), a64(ab, [n]), a64(ab, [0]), kc.BlockTable(ab.asarray(table), page), verify_capacity=16)
        assert [e[0] for e in plan_entries(host(ab, vp))][4:] == list(range(table[0, 1] * 4, table[0, 1] * 4 + 4))
        log.reset()
        kc.verify(canary, vp, log=log)
        assert int(ab.to_numpy(log.write_index)[0]) == violations


@pytest.mark.parametrize("src, dst", [([], []), ([0, 1], [1, 0]), ([0], [2])])
def test_a_canary_smaller_than_a_page_skips_and_counts_every_pair(ab, src, dst):
    """No whole page in the canary: every id is out of range, counted, nothing moves (issue 28 #6)."""
    buf = random_canary(np.random.default_rng(3), 3)
    canary, count = ab.asarray(buf), ab.asarray(np.full(1, 5, I64))
    kc.move_pages(canary, a64(ab, src), a64(ab, dst), page_size=4, out_of_range_count=count)
    np.testing.assert_array_equal(ab.to_numpy(canary), buf)
    assert int(ab.to_numpy(count)[0]) == 5 + 2 * len(src)
    workspace = kc.allocate_canary_buffer(1, like=canary)  # nothing is staged, so any workspace fits
    kc.move_pages(canary, a64(ab, src), a64(ab, dst), page_size=2**40, workspace=workspace, out_of_range_count=count)
    np.testing.assert_array_equal(ab.to_numpy(canary), buf)
    assert int(ab.to_numpy(count)[0]) == 5 + 4 * len(src)
