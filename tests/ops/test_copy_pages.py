"""copy_pages: canary rows copied with KV pages (forks, copy-on-write, offload and reload), within one
buffer or between two, on every backend; out-of-range ids counted and skipped; capture-safe with a
workspace (tests/test_gpu_graphs-style capture below)."""

import numpy as np
import pytest

import kvcanary_cupy as kc
from canary_builders import a64

I64 = np.int64


def reference_copy(src: np.ndarray, dst: np.ndarray, src_pages, dst_pages, page_size: int) -> np.ndarray:
    """The definition on host copies: rows = src[src_slots]; dst[dst_slots] = rows, valid pairs only."""
    out = dst.copy()
    s_pages, d_pages = src.shape[0] // page_size, dst.shape[0] // page_size
    for s, d in zip(src_pages, dst_pages):
        if 0 <= s < s_pages and 0 <= d < d_pages:
            out[d * page_size : (d + 1) * page_size] = src[s * page_size : (s + 1) * page_size]
    return out


def _rows(n, seed=0):
    return np.random.default_rng(seed).integers(-(2**62), 2**62, (n, 4), dtype=I64)


def test_copy_within_one_buffer_keeps_the_source(ab):
    buf = _rows(8)
    got = ab.to_numpy(kc.copy_pages(b := ab.asarray(buf), b, a64(ab, [1]), a64(ab, [3]), page_size=2))
    assert got.tolist() == reference_copy(buf, buf, [1], [3], 2).tolist()
    assert got[2:4].tolist() == got[6:8].tolist() == buf[2:4].tolist()


def test_overlapping_pairs_copy_the_rows_from_before(ab):
    """A destination that is also a source gets that page's rows from before the call (a swap)."""
    buf = _rows(6, 1)
    b = ab.asarray(buf)
    got = ab.to_numpy(kc.copy_pages(b, b, a64(ab, [0, 2]), a64(ab, [2, 0]), page_size=2))
    assert got[:2].tolist() == buf[4:6].tolist() and got[4:6].tolist() == buf[:2].tolist()


def test_copy_between_buffers_of_different_sizes_checks_each_side(ab):
    """Source ids against the source's pages, destination ids against the destination's: pairs
    valid in one buffer only are skipped and each bad id counted once."""
    src, dst = _rows(8, 2), _rows(12, 3)
    s, d = ab.asarray(src), ab.asarray(dst)
    count = ab.asarray(np.zeros(1, I64))
    src_pages, dst_pages = [0, 3, 4, -1, 1], [5, 0, 1, 2, 6]  # src 4 and -1 out of 4 pages; dst 6 out of 6
    got = kc.copy_pages(s, d, a64(ab, src_pages), a64(ab, dst_pages), page_size=2, out_of_range_count=count)
    assert ab.to_numpy(got).tolist() == reference_copy(src, dst, src_pages, dst_pages, 2).tolist()
    assert ab.to_numpy(s).tolist() == src.tolist()
    assert int(ab.to_numpy(count)[0]) == 3


@pytest.mark.parametrize("seed", range(8))
def test_random_copies_match_the_definition(ab, seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.integers(1, 5))
    src, dst = _rows(int(rng.integers(1, 24)), seed), _rows(int(rng.integers(1, 24)), seed + 100)
    n = int(rng.integers(0, 8))
    dst_pages = rng.permutation(max(n, 12))[:n] - 1  # distinct, some out of range
    src_pages = rng.integers(-1, 8, n)
    for dtype in (np.int32, np.int64):
        d = ab.asarray(dst)
        kc.copy_pages(ab.asarray(src), d, ab.asarray(src_pages.astype(dtype)), ab.asarray(dst_pages.astype(dtype)),
                      page_size=page_size)
        assert ab.to_numpy(d).tolist() == reference_copy(src, dst, src_pages, dst_pages, page_size).tolist()


def test_a_uint8_canary_copies_its_whole_slot_stride(ab):
    buf = np.random.default_rng(4).integers(0, 256, (4, 48), dtype=np.uint8)
    b = ab.asarray(buf)
    got = ab.to_numpy(kc.copy_pages(b, b, a64(ab, [0]), a64(ab, [3])))
    assert got[3].tolist() == buf[0].tolist() and got[:3].tolist() == buf[:3].tolist()


def test_strict_names_the_first_bad_id_and_bad_arguments_are_named(ab):
    src, dst = ab.asarray(_rows(4)), ab.asarray(_rows(6))
    with pytest.raises(ValueError, match=r"^kv-canary: dst_pages\[1\] = 3 is outside \[0, 3\) \(dst_canary's 6 slots hold 3 "):
        kc.copy_pages(src, dst, a64(ab, [0, 1]), a64(ab, [0, 3]), page_size=2, strict=True)
    with pytest.raises(ValueError, match=r"^kv-canary: src_canary and dst_canary must have one slot width, got 4 and 5"):
        kc.copy_pages(src, ab.asarray(np.zeros((6, 5), I64)), a64(ab, [0]), a64(ab, [0]))
    with pytest.raises(ValueError, match=r"^kv-canary: dst_pages length must be"):
        kc.copy_pages(src, dst, a64(ab, [0, 1]), a64(ab, [0]))
    with pytest.raises(ValueError, match=r"^kv-canary: workspace must hold at least len\(src_pages\) x page_size x 4"):
        kc.copy_pages(src, dst, a64(ab, [0, 1]), a64(ab, [0, 1]), page_size=2, workspace=ab.asarray(np.zeros(3, I64)))
    with pytest.raises(ValueError, match=r"^kv-canary: page_size must be >= 1"):
        kc.copy_pages(src, dst, a64(ab, [0]), a64(ab, [0]), page_size=0)


def test_two_views_of_one_buffer_that_overlap_are_refused():
    buf = _rows(8)
    with pytest.raises(ValueError, match=r"src_canary and dst_canary overlap in memory; pass one buffer as both"):
        kc.copy_pages(buf[:6], buf[2:], np.array([0]), np.array([1]))


def test_capture_safe_with_a_workspace(gpu_ab):
    """Inside a CUDA graph capture with a workspace: nothing allocated, the replay copies."""
    cupy = pytest.importorskip("cupy")
    buf = _rows(8, 5)
    b = cupy.asarray(buf)
    src, dst = cupy.asarray(np.array([0, 1], I64)), cupy.asarray(np.array([2, 3], I64))
    workspace = cupy.zeros(2 * 2 * 4, I64)
    kc.copy_pages(b, b, src, dst, page_size=2, workspace=workspace)  # compiles and warms up outside the capture
    b[...] = cupy.asarray(buf)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        kc.copy_pages(b, b, src, dst, page_size=2, workspace=workspace)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert cupy.asnumpy(b).tolist() == reference_copy(buf, buf, [0, 1], [2, 3], 2).tolist()
