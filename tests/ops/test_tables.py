"""Engine tables: plans through ReqToToken (virtual pages), BlockTable and PagedKvIndices equal the
plan through the equivalent materialised req_to_token byte for byte on every backend; worked
examples, the out-of-range rules of tables, bad input, and the planner."""

import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends.cuda import abi
from canary_builders import (
    INT64_MAX,
    assert_plan_equals_oracle,
    equivalent_req_to_token,
    host,
    linear_rtt,
    oracle_plan,
    paged_slot,
    plan_entries,
    ring_rows,
    shifted_pool,
)
from conftest import get_backend_or_skip

I32, I64 = np.int32, np.int64
NUMPY = get_backend_or_skip("numpy")


def _a(ab, x, dtype=None):
    return None if x is None else ab.asarray(np.asarray(x, dtype=dtype))


def make_table(ab, kind, t):
    """The table record of ``kind`` over the NumPy arrays of ``t`` (see equivalent_req_to_token)."""
    if kind == "rtt":
        return kc.ReqToToken(_a(ab, t["req_to_token"], I32))
    if kind == "virtual":
        return kc.ReqToToken(_a(ab, t["req_to_token"], I32), virtual_to_physical=_a(ab, t["virtual_to_physical"], I64),
                             page_size=t["page_size"])
    if kind == "block":
        return kc.BlockTable(_a(ab, t["block_table"]), t["block_size"], null_block=t.get("null_block", 0))
    return kc.PagedKvIndices(_a(ab, t["kv_indptr"]), _a(ab, t["kv_indices"]), t["page_size"])


def poisoned_out(ab, vcap, wcap):
    vp, wp = kc.VerifyPlan.allocate(vcap, like=ab.like), kc.WritePlan.allocate(wcap, like=ab.like)
    for key in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices"):
        getattr(vp, key)[...] = 0x5A5A
    return vp, wp


def plan_through(ab, rp, prefix, extend, table, *, verify_capacity=4096, write_req_capacity=None, lut=None, pool=None,
                 valid_lens=None, **kw):
    """plan on ``ab`` into poisoned buffers; returns host copies ``(vp, wp)``."""
    wcap = len(prefix) if write_req_capacity is None else write_req_capacity
    out = poisoned_out(ab, verify_capacity, wcap)
    kc.plan(_a(ab, rp, I64), _a(ab, prefix, I64), _a(ab, extend, I64), table, verify_capacity=verify_capacity,
            full_to_swa_index_mapping=_a(ab, lut, I64), req_to_verify_expected_tokens=_a(ab, pool, I32),
            req_to_verify_expected_tokens_valid_lens=_a(ab, valid_lens, I64), out=out, **kw)
    return host(ab, out[0]), host(ab, out[1])


def assert_same_plan(got, want):
    for g, w in zip(got, want):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)


# ---- worked examples ------------------------------------------------------------------------------


def test_block_table_worked_example(ab):
    """Every row is real (row 0 too); slot = block * block_size + p % block_size."""
    bt = np.array([[3, 1, 0], [2, 0, 0]], I32)
    vph, wph = plan_through(ab, [0, 1], [5, 3], [1, 1], kc.BlockTable(_a(ab, bt), 4), verify_capacity=16)
    assert plan_entries(vph) == [(12, -1, 0, -1), (13, -1, 1, 12), (14, -1, 2, 13), (15, -1, 3, 14), (4, -1, 4, 15),
                                 (8, -1, 0, -1), (9, -1, 1, 8), (10, -1, 2, 9)]
    assert wph["write_seed_slot_indices"].tolist() == [4, 10]
    assert wph["write_offsets"].tolist() == [0, 1, 2]
    assert int(vph["out_of_range_count"][0]) == 0


@pytest.mark.parametrize("dtype", [I32, I64])
def test_block_table_null_block_addresses_the_padding_slot(ab, dtype):
    bt = np.array([[5, 0, 7]], dtype)
    vph, wph = plan_through(ab, [0], [6], [1], kc.BlockTable(_a(ab, bt), 2), verify_capacity=8)
    assert vph["verify_slot_indices"][:6].tolist() == [10, 11, 0, 0, 14, 15]
    assert vph["verify_prev_slot_indices"][:6].tolist() == [-1, 10, 11, 0, 0, 14]
    assert wph["write_seed_slot_indices"].tolist() == [15]
    # another null id: block 0 is then a real block, -1 the null one
    bt = np.array([[5, 0, -1]], dtype)
    vph, _ = plan_through(ab, [0], [6], [1], kc.BlockTable(_a(ab, bt), 2, null_block=-1), verify_capacity=8)
    assert vph["verify_slot_indices"][:6].tolist() == [10, 11, 0, 1, 0, 0]


def test_paged_kv_indices_worked_example(ab):
    """Request r (the batch row) owns kv_indices[kv_indptr[r]:kv_indptr[r+1]]; the pool is indexed by batch row."""
    indptr, indices = np.array([0, 2, 3], I32), np.array([3, 1, 2], I32)
    pool = np.arange(2 * 8, dtype=I32).reshape(2, 8) + 100
    table = kc.PagedKvIndices(_a(ab, indptr), _a(ab, indices), 4)
    vph, wph = plan_through(ab, None, [5, 3], [1, 1], table, verify_capacity=16, pool=pool, valid_lens=[8, 2])
    assert plan_entries(vph) == [(12, 100, 0, -1), (13, 101, 1, 12), (14, 102, 2, 13), (15, 103, 3, 14), (4, 104, 4, 15),
                                 (8, 108, 0, -1), (9, 109, 1, 8), (10, -1, 2, 9)]
    assert wph["write_seed_slot_indices"].tolist() == [4, 10]


def test_virtual_pages_worked_example(ab):
    """slot = v2p[t // page_size] * page_size + t % page_size; an unbound page (-1) gives slot 0."""
    rtt = np.array([[0] * 6, [8, 9, 10, 11, 4, 5]], I32)  # virtual pages 2 and 1 (page size 4)
    v2p = np.array([0, -1, 7, 3], I64)
    table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, v2p), page_size=4)
    vph, wph = plan_through(ab, [1, 0], [6, 3], [1, 9], table, verify_capacity=8)
    assert vph["verify_slot_indices"][:6].tolist() == [28, 29, 30, 31, 0, 0]
    assert vph["verify_prev_slot_indices"][:6].tolist() == [-1, 28, 29, 30, 31, 0]
    assert wph["write_seed_slot_indices"].tolist() == [0, -1]  # row 0 stays the padding row
    assert int(vph["out_of_range_count"][0]) == 0
    vph, _ = plan_through(ab, [1], [7], [1], table, verify_capacity=8)  # rows hold 6 token ids, not 6 pages
    assert int(vph["out_of_range_count"][0]) == 1 and int(vph["verify_num_valid"][0]) == 6


def test_strict_names_a_seed_past_the_map(ab):
    """On overflow only the seed is looked up: the one position named is the seed's."""
    rtt = np.array([[0, 0, 0], [1, 9, 2]], I32)
    table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, np.array([3, 4], I64)), page_size=2)
    vph, _ = plan_through(ab, [1], [2], [1], table, verify_capacity=0)
    assert int(vph["out_of_range_count"][0]) == 1
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_token\[1, 1\] = 9 \(batch row 0\) is in virtual page 4, "):
        plan_through(ab, [1], [2], [1], table, verify_capacity=0, strict=True)


def test_a_one_page_map(ab):
    rtt = np.array([[0, 0, 0], [1, -2, 2]], I32)
    table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, np.array([3], I64)), page_size=2)
    vph, _ = plan_through(ab, [1], [3], [0], table, verify_capacity=8)
    assert vph["verify_slot_indices"][:3].tolist() == [7, -2, 0]  # id 2 lies in page 1: past the map
    assert int(vph["out_of_range_count"][0]) == 1


def test_virtual_pages_past_the_map_and_negative_ids(ab):
    rtt = np.array([[0, 0, 0], [-3, 13, 5]], I32)
    v2p = np.array([0, 2, 4], I64)  # pages 0..2 of 2 tokens: virtual ids 0..5
    table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, v2p), page_size=2)
    vph, wph = plan_through(ab, [1], [3], [1], table, verify_capacity=8)
    assert vph["verify_slot_indices"][:3].tolist() == [-3, 0, 9]  # 13 lies in page 6: past the map
    assert vph["verify_prev_slot_indices"][:3].tolist() == [-1, -3, 0]
    assert wph["write_seed_slot_indices"].tolist() == [9]
    assert int(vph["out_of_range_count"][0]) == 2  # the slot and the predecessor lookups of id 13
    rtt[1, 1] = 6  # the first id past the map: page 3 of a 3-page map
    table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, v2p), page_size=2)
    vph, _ = plan_through(ab, [1], [3], [1], table, verify_capacity=8)
    assert vph["verify_slot_indices"][:3].tolist() == [-3, 0, 9]
    assert int(vph["out_of_range_count"][0]) == 2


def test_int64_ids_saturate(ab):
    limit = INT64_MAX // 3
    indices = np.array([limit - 1, limit, -limit, 2], I64)
    table = kc.PagedKvIndices(_a(ab, np.array([0, 4])), _a(ab, indices), 3)
    vph, _ = plan_through(ab, None, [12], [0], table, verify_capacity=16)
    slots = vph["verify_slot_indices"][:12].tolist()
    assert slots[:3] == [(limit - 1) * 3, (limit - 1) * 3 + 1, (limit - 1) * 3 + 2]
    assert slots[3:9] == [INT64_MAX] * 3 + [-INT64_MAX] * 3
    assert slots[9:] == [6, 7, 8]


# ---- out-of-range rules of tables ------------------------------------------------------------------


def test_block_table_prefix_past_the_row(ab):
    bt = np.array([[1, 2], [3, 4]], I32)  # rows of 2 blocks x 4 = 8 positions
    vph, wph = plan_through(ab, [1, 0], [10, 8], [1, 1], kc.BlockTable(_a(ab, bt), 4), verify_capacity=32)
    assert [e[2] for e in plan_entries(vph)] == list(range(8)) * 2
    assert wph["write_seed_slot_indices"].tolist() == [-1, 11]
    assert int(vph["out_of_range_count"][0]) == 1


def test_paged_kv_prefix_past_its_own_row(ab):
    """L is the request's own length, (kv_indptr[r+1] - kv_indptr[r]) * page_size."""
    table = kc.PagedKvIndices(_a(ab, np.array([0, 1, 3])), _a(ab, np.array([5, 6, 7], I32)), 2)
    vph, wph = plan_through(ab, None, [3, 3], [1, 1], table, verify_capacity=16)
    assert plan_entries(vph) == [(10, -1, 0, -1), (11, -1, 1, 10), (12, -1, 0, -1), (13, -1, 1, 12), (14, -1, 2, 13)]
    assert wph["write_seed_slot_indices"].tolist() == [-1, 14]
    assert int(vph["out_of_range_count"][0]) == 1


@pytest.mark.parametrize("indptr", [[0, 3, 2], [0, 2, 9], [-1, 2, 3]])
def test_paged_kv_rows_outside_kv_indices(ab, indptr):
    """A kv_indptr range that is not within kv_indices: no verify entries, seed -1, write kept, one count."""
    table = kc.PagedKvIndices(_a(ab, np.array(indptr)), _a(ab, np.array([5, 6, 7], I32)), 2)
    vph, wph = plan_through(ab, None, [2, 1], [1, 2], table, verify_capacity=16)
    bad = [r for r in range(2) if not 0 <= indptr[r] <= indptr[r + 1] <= 3]
    assert wph["write_offsets"].tolist() == [0, 1, 3]
    for r in range(2):
        assert (wph["write_seed_slot_indices"][r] == -1) == (r in bad)
        assert (wph["verify_offsets"][r + 1] == wph["verify_offsets"][r]) == (r in bad)
    # a bad row is 0 tokens long: its positive prefix is out of range too
    assert int(vph["out_of_range_count"][0]) == 2 * len(bad)


def test_req_pool_index_outside_a_block_table(ab):
    bt = np.array([[1, 2]], I32)
    vph, wph = plan_through(ab, [1, -1, 0], [2, 2, 2], [1, 1, 1], kc.BlockTable(_a(ab, bt), 2), verify_capacity=8)
    assert int(vph["out_of_range_count"][0]) == 2  # row 0 is real: only 1 and -1 are out of range
    assert wph["write_seed_slot_indices"].tolist() == [-1, -1, 3]


def test_window_without_lut_through_block_tables(ab):
    """A vLLM sliding-window group's block table addresses its own pages: no LUT needed."""
    bt = np.array([[0, 0, 3, 4]], I32)  # out-of-window blocks point at the null block
    vph, wph = plan_through(ab, [0], [8], [1], kc.BlockTable(_a(ab, bt), 2), verify_capacity=8, swa_window_size=3)
    assert plan_entries(vph) == [(7, -1, 5, 6), (8, -1, 6, 7), (9, -1, 7, 8)]
    assert wph["write_seed_slot_indices"].tolist() == [9]


# ---- equivalence with the materialised req_to_token -------------------------------------------------


def random_table(rng, kind, rows, bs):
    """A random table of ``kind`` with ``rows`` rows (CSR: ``bs``), its row lengths in tokens and the
    NumPy arrays, ids kept small enough for an int32 equivalent."""
    ps = int(rng.choice([1, 2, 3, 4, 5, 16]))
    if kind == "rtt":
        cols = int(rng.integers(1, 40))
        return {"req_to_token": rng.integers(-2, 400, (rows, cols)).astype(I32)}, np.full(rows, cols)
    if kind == "virtual":
        pages = int(rng.integers(1, 30))
        v2p = rng.permutation(pages * 2)[:pages].astype(I64)
        v2p[rng.random(pages) < 0.2] = -1
        cols = int(rng.integers(1, 40))
        rtt = rng.integers(-1, pages * ps, (rows, cols)).astype(I32)  # within the map: nothing counted
        return {"req_to_token": rtt, "virtual_to_physical": v2p, "page_size": ps}, np.full(rows, cols)
    if kind == "block":
        width = int(rng.integers(1, 8))
        bt = rng.integers(-3, 200, (rows, width)).astype(rng.choice([I32, I64]))
        null = int(rng.choice([0, 0, -1, 7]))
        bt[rng.random(bt.shape) < 0.15] = null
        return {"block_table": bt, "block_size": ps, "null_block": null}, np.full(rows, width * ps)
    pages = rng.integers(0, 6, bs)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(rng.choice([I32, I64]))
    indices = rng.integers(-3, 200, int(indptr[-1])).astype(rng.choice([I32, I64]))
    return {"kv_indptr": indptr, "kv_indices": indices, "page_size": ps}, pages * ps


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", ["virtual", "block", "csr"])
def test_plan_through_a_table_equals_the_materialised_req_to_token(ab, kind, seed):
    rng = np.random.default_rng(1000 * seed + len(kind))
    bs = int(rng.integers(1, 24))
    rows = int(rng.integers(2, 12))
    t, lengths = random_table(rng, kind, rows, bs)
    rp = None if kind == "csr" else rng.integers(0, rows, bs)
    if rp is not None and kind == "virtual":
        rp[rng.random(bs) < 0.2] = 0  # padding rows of a req_to_token
    row_len = lengths if kind == "csr" else lengths[rp]
    prefix = rng.integers(0, row_len + 1)
    extend = rng.integers(0, 4, bs)
    kw = {}
    window = int(rng.choice([0, 0, 2, 9]))
    if window or rng.random() < 0.3:
        kw = dict(swa_window_size=window, lut=rng.integers(0, 900, int(rng.integers(1, 600))))
    pool_rows = bs if kind == "csr" else rows
    if rng.random() < 0.5:
        kw.update(pool=rng.integers(0, 5000, (pool_rows + int(rng.integers(0, 2)), int(rng.integers(1, 50)))).astype(I32),
                  valid_lens=rng.integers(-1, 50, bs), kv_token_id_vs_position_offset=int(rng.integers(-1, 2)))
    vcap = int(rng.integers(0, int(np.sum(np.minimum(prefix, row_len))) + 4))
    wcap = bs + int(rng.integers(0, 3))
    got = plan_through(ab, rp, prefix, extend, make_table(ab, kind, t), verify_capacity=vcap, write_req_capacity=wcap, **kw)

    rtt_eq, rp_eq = equivalent_req_to_token(kind, t, rp, bs)
    kw_eq = dict(kw, pool=shifted_pool(kw.get("pool")) if kind in ("block", "csr") else kw.get("pool"))
    want = plan_through(ab, rp_eq, prefix, extend, kc.ReqToToken(_a(ab, rtt_eq)), verify_capacity=vcap,
                        write_req_capacity=wcap, **kw_eq)
    assert_same_plan(got, want)
    oracle = oracle_plan(rp_eq, prefix, extend, rtt_eq, verify_capacity=vcap, write_req_capacity=wcap, window=window,
                         lut=kw.get("lut"), pool=kw_eq.get("pool"), valid_lens=kw.get("valid_lens"),
                         offset=kw.get("kv_token_id_vs_position_offset", 0))
    assert_plan_equals_oracle(got[0], got[1], oracle)


def test_a_bare_array_means_req_to_token(ab):
    rtt = np.arange(4 * 8, dtype=I32).reshape(4, 8)
    bare = plan_through(ab, [2, 0], [5, 3], [1, 1], _a(ab, rtt))
    boxed = plan_through(ab, [2, 0], [5, 3], [1, 1], kc.ReqToToken(_a(ab, rtt)))
    assert_same_plan(bare, boxed)


def test_planner_takes_every_table(ab):
    planner = kc.CanaryPlanner.from_engine(kv_pool_size=64, max_running_requests=4, like=ab.like)
    bt = np.array([[3, 1, 0], [2, 0, 0]], I32)
    vp, wp = planner.plan(_a(ab, [0, 1], I64), _a(ab, [5, 3], I64), _a(ab, [1, 1], I64), kc.BlockTable(_a(ab, bt), 4))
    assert ab.to_numpy(wp.write_seed_slot_indices)[:2].tolist() == [4, 10]
    table = kc.PagedKvIndices(_a(ab, np.array([0, 2, 3], I32)), _a(ab, np.array([3, 1, 2], I32)), 4)
    vp, wp = planner.plan(None, _a(ab, [5, 3], I64), _a(ab, [1, 1], I64), table)
    assert ab.to_numpy(wp.write_seed_slot_indices)[:3].tolist() == [4, 10, -1]
    assert int(ab.to_numpy(vp.verify_num_valid)[0]) == 8


# ---- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, exc, match", [
    (lambda a: kc.BlockTable(a, 0), ValueError, "BlockTable.block_size must be >= 1, got 0"),
    (lambda a: kc.BlockTable(a, 2.0), TypeError, "BlockTable.block_size must be an int, got float"),
    (lambda a: kc.BlockTable(a, 2**31), ValueError, "BlockTable.block_size must be at most 2147483647"),
    (lambda a: kc.BlockTable(a, 4, null_block=None), TypeError, "BlockTable.null_block must be an int"),
    (lambda a: kc.PagedKvIndices(a, a, -1), ValueError, "PagedKvIndices.page_size must be >= 1, got -1"),
    (lambda a: kc.ReqToToken(a, page_size=0), ValueError, "ReqToToken.page_size must be >= 1, got 0"),
    (lambda a: kc.ReqToToken(a, page_size=4), ValueError, "ReqToToken.page_size=4 applies to virtual_to_physical, which is None"),
])
def test_table_scalars_are_checked_when_built(make, exc, match):
    with pytest.raises(exc, match=match):
        make(np.zeros((2, 2), I32))


class TableCall:
    """A valid plan call through a table; a test replaces pieces and checks nothing is written."""

    def __init__(self, ab):
        self.ab = ab
        self.out = poisoned_out(ab, 32, 2)

    def __call__(self, table, rp=(0, 1), prefix=(3, 2), **kw):
        a = self.ab
        rp = None if rp is None else _a(a, rp, I64)
        return kc.plan(rp, _a(a, prefix, I64), _a(a, [1, 1], I64), table, verify_capacity=32, out=self.out, **kw)


def _rejected(ab, call, table, exc, match, **kw):
    before = [ab.to_numpy(x).copy() for rec in call.out for x in rec.arrays().values()]
    with pytest.raises(exc, match=match):
        call(table, **kw)
    after = [ab.to_numpy(x) for rec in call.out for x in rec.arrays().values()]
    assert all(np.array_equal(b, c) for b, c in zip(before, after))


def test_table_arrays_are_checked_by_plan(ab):
    call = TableCall(ab)
    a = lambda x, d=I32: _a(ab, x, d)
    bt = a(np.ones((2, 3)))
    call(kc.BlockTable(bt, 2))  # valid
    _rejected(ab, call, kc.BlockTable(a(np.ones((2, 3)), np.float32), 2), TypeError,
              "block_table must have dtype int32 or int64, got float32")
    _rejected(ab, call, kc.BlockTable(a(np.ones(6)), 2), ValueError, r"block_table must be 2-D, got shape \(6,\)")
    _rejected(ab, call, kc.BlockTable(a(np.ones((2, 6)))[:, ::2], 2), ValueError, "block_table must have contiguous rows")
    indptr, indices = a([0, 1, 3]), a([1, 2, 3])
    call(kc.PagedKvIndices(indptr, indices, 2), rp=None)  # valid
    _rejected(ab, call, kc.PagedKvIndices(indptr, indices, 2), ValueError,
              "^" + re.escape("kv-canary: req_pool_indices must be None with a PagedKvIndices table: its rows are the "
                              "batch rows (request r owns kv_indices[kv_indptr[r]:kv_indptr[r+1]])") + "$")
    _rejected(ab, call, kc.PagedKvIndices(a([0, 1]), indices, 2), ValueError,
              r"kv_indptr length must be bs \+ 1=3, got 2", rp=None)
    _rejected(ab, call, kc.PagedKvIndices(a([0.0, 1, 3], np.float64), indices, 2), TypeError,
              "kv_indptr must have dtype int32 or int64, got float64", rp=None)
    _rejected(ab, call, kc.PagedKvIndices(indptr, a([[1, 2, 3]]), 2), ValueError,
              r"kv_indices must be 1-D, got shape \(1, 3\)", rp=None)
    _rejected(ab, call, kc.BlockTable(bt, 2), ValueError,
              "^" + re.escape("kv-canary: req_pool_indices is required with a BlockTable table (only a PagedKvIndices "
                              "table, whose rows are the batch rows, takes None)") + "$", rp=None)
    v2p = a([0, 1], I32)
    _rejected(ab, call, kc.ReqToToken(a(np.ones((2, 3))), virtual_to_physical=v2p, page_size=2), TypeError,
              "virtual_to_physical must have dtype int64, got int32")
    pool = a(np.zeros((1, 4)))
    _rejected(ab, call, kc.PagedKvIndices(indptr, indices, 2), ValueError,
              r"req_to_verify_expected_tokens must have at least bs=2 rows \(one per batch row", rp=None,
              req_to_verify_expected_tokens=pool, req_to_verify_expected_tokens_valid_lens=_a(ab, [1, 1], I64))
    if ab.name == "numpy":  # a row of 2**32 blocks, never read: the check reads the shape only
        wide = np.lib.stride_tricks.as_strided(np.zeros(1, I32), (2, 2**32), (0, 4))
        _rejected(ab, call, kc.BlockTable(wide, 2**31 - 1), ValueError,
                  r"block_table width 4294967296 x block_size 2147483647 = \d+ tokens exceeds 2\*\*62")
    with pytest.raises(TypeError, match="table must be a ReqToToken, BlockTable or PagedKvIndices"):
        call([[1, 2]])


def test_strided_inputs_plan_as_contiguous_ones(ab):
    """Read-only 1-D inputs that are not contiguous (every second item of a larger array) plan the
    same bytes as contiguous ones: they are copied before a kernel reads them."""
    def strided(x, dtype=I64):
        return ab.asarray(np.repeat(np.asarray(x, dtype), 2))[::2]

    def both(rp, prefix, extend, make_table, window=0, lut=None):
        (vp0, wp0), (vp1, wp1) = poisoned_out(ab, 8, len(prefix)), poisoned_out(ab, 8, len(prefix))
        for a, out in ((lambda x: _a(ab, x, I64), (vp0, wp0)), (strided, (vp1, wp1))):
            kc.plan(None if rp is None else a(rp), a(prefix), a(extend), make_table(a), verify_capacity=8, out=out,
                    swa_window_size=window, full_to_swa_index_mapping=None if lut is None else a(lut))
        got, want = (host(ab, vp1), host(ab, wp1)), (host(ab, vp0), host(ab, wp0))
        assert_same_plan(got, want)
        return want

    # request 0 owns page 1 (slots 2, 3), request 1 pages 2 and 3 (slots 4-7)
    vph, wph = both(None, [2, 3], [1, 1], lambda a: kc.PagedKvIndices(a([0, 1, 3]), a([1, 2, 3]), 2))
    assert plan_entries(vph) == [(2, -1, 0, -1), (3, -1, 1, 2), (4, -1, 0, -1), (5, -1, 1, 4), (6, -1, 2, 5)]
    assert wph["write_seed_slot_indices"].tolist() == [3, 6]
    # virtual token ids 0-3 on virtual pages 0, 1 -> physical pages 5, 7
    vph, _ = both([1], [3], [1], lambda a: kc.ReqToToken(_a(ab, [[0, 0, 0, 0], [0, 1, 2, 3]], I32),
                                                         virtual_to_physical=a([5, 7]), page_size=2))
    assert plan_entries(vph) == [(10, -1, 0, -1), (11, -1, 1, 10), (14, -1, 2, 11)]
    # the SWA LUT: positions 3 and 4 of row 1 (slots 11, 12) -> 111, 112
    vph, _ = both([1], [5], [1], lambda a: kc.ReqToToken(_a(ab, linear_rtt(2, 8), I32)), window=2,
                  lut=100 + np.arange(16))
    assert plan_entries(vph) == [(111, -1, 3, 110), (112, -1, 4, 111)]


# ---- the kernels' division by the page size ----------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2, 3, 5, 7, 16, 48, 1000, 2**20 + 1, 2**31 - 1])
def test_page_division_is_exact_below_2_62(page_size):
    """The kernels divide positions (< 2**62) by the page size with a shift or a multiply-high."""
    from kvcanary_cupy.backends.cuda.configs import page_division

    shift, magic, magic_shift = page_division(page_size)
    rng = np.random.default_rng(page_size)
    edges = [0, 1, page_size - 1, page_size, page_size + 1, 2**31, 2**62 - 1, 2**62 - page_size]
    values = edges + [int(v) for v in rng.integers(0, 2**62, 2000, dtype=np.int64)]
    values += [k * page_size + d for k in (1, 2**20, (2**62 - 1) // page_size) for d in (-1, 0, 1)]
    for value in values:
        if not 0 <= value < 2**62:
            continue
        got = value >> shift if shift >= 0 else ((value * magic) >> 64) >> magic_shift
        assert got == value // page_size, (value, page_size)
    assert 0 <= magic < 2**64 and (shift >= 0) == (page_size & (page_size - 1) == 0)


# ---- the narrow and the general layouts of block and page tables ------------------------------------------


L = abi.TableLayout
BIG_PAGE = 2**30  # rows of 1 and 2 such pages: 2**30 and 2**31 tokens, the second past the narrow layout's bound
_BT = np.array([[5, 0, 7, -(2**31)], [2**31 - 1, 3, 0, 1]])
_INDICES = np.array([9, -3, 2**31 - 1, 0, 4])

LAYOUT_CASES = {  # name: (table, req_pool_indices, prefix_lens, swa_window_size, the layout configs.table_layout picks)
    "block int32, size 4": (dict(block_table=_BT.astype(I32), block_size=4), [1, 0, 2, -1], [16, 9, 3, 4], 0, L.BLOCK_NARROW),
    "block int32, null block int32 min": (dict(block_table=_BT.astype(I32), block_size=4, null_block=-(2**31)), [0, 1],
                                          [16, 17], 0, L.BLOCK_NARROW),
    "block int32, null block past int32": (dict(block_table=_BT.astype(I32), block_size=4, null_block=2**31), [0, 1],
                                           [16, 16], 0, L.BLOCK),
    "block int64": (dict(block_table=_BT * 3, block_size=4), [1, 0], [16, 9], 0, L.BLOCK),
    "block int32, size 3": (dict(block_table=_BT.astype(I32), block_size=3), [1, 0], [12, 7], 0, L.BLOCK),
    "block int32, rows of 2**31 tokens": (dict(block_table=np.array([[4, 2**31 - 1]], I32), block_size=BIG_PAGE), [0, 0],
                                          [2**31 - 1, BIG_PAGE + 1], 3, L.BLOCK),
    "block int32, rows of 2**30 tokens": (dict(block_table=np.array([[2**31 - 1]], I32), block_size=BIG_PAGE), [0, 0],
                                          [BIG_PAGE, 2], 3, L.BLOCK_NARROW),
    "csr int32, page 16": (dict(kv_indptr=np.array([0, 2, 2, 5], I32), kv_indices=_INDICES.astype(I32), page_size=16), None,
                           [32, 0, 41], 0, L.PAGED_KV_NARROW),
    "csr int32, rows outside kv_indices": (dict(kv_indptr=np.array([-1, 3, 2, 6], I32), kv_indices=_INDICES.astype(I32),
                                                page_size=16), None, [3, 3, 5], 0, L.PAGED_KV_NARROW),
    "csr int64 kv_indptr": (dict(kv_indptr=np.array([0, 2, 2, 5], I64), kv_indices=_INDICES.astype(I32), page_size=16), None,
                            [32, 0, 40], 0, L.PAGED_KV),
    "csr int64 kv_indices": (dict(kv_indptr=np.array([0, 2, 2, 5], I32), kv_indices=_INDICES * 5, page_size=16), None,
                             [32, 0, 40], 0, L.PAGED_KV),
    "csr int32, page 48": (dict(kv_indptr=np.array([0, 2, 2, 5], I32), kv_indices=_INDICES.astype(I32), page_size=48), None,
                           [96, 0, 20], 0, L.PAGED_KV),
    "csr int32, 2**31 tokens": (dict(kv_indptr=np.array([0, 2], I32), kv_indices=np.array([7, 2**31 - 1], I32),
                                     page_size=BIG_PAGE), None, [2**31 - 1], 3, L.PAGED_KV),
    "csr int32, 2**30 tokens": (dict(kv_indptr=np.array([0, 1, 1], I32), kv_indices=np.array([2**31 - 1], I32),
                                     page_size=BIG_PAGE), None, [BIG_PAGE, 0], 3, L.PAGED_KV_NARROW),
}


K, INT32_MAX = kc.tables.TableKind, 2**31 - 1

LAYOUT_BOUNDS = [  # (kind, row_tokens, page_size, null_block, int64 ids, int64 kv_indptr), the layout
    ((K.BLOCK, INT32_MAX, 1, 0, False, False), L.BLOCK_NARROW),
    ((K.BLOCK, 2**31, 1, 0, False, False), L.BLOCK),
    ((K.BLOCK, 2**31 - 16, 16, 0, False, False), L.BLOCK_NARROW),
    ((K.BLOCK, 2**31, 16, 0, False, False), L.BLOCK),
    ((K.BLOCK, 2**30, 2**30, 0, False, False), L.BLOCK_NARROW),
    ((K.BLOCK, 0, 16, 0, False, False), L.BLOCK_NARROW),  # a table of no columns
    ((K.BLOCK, 48, 3, 0, False, False), L.BLOCK),
    ((K.BLOCK, 2**30 - 1, 2**30 - 1, 0, False, False), L.BLOCK),
    ((K.BLOCK, 64, 16, 0, True, False), L.BLOCK),
    ((K.BLOCK, 64, 16, 0, False, True), L.BLOCK_NARROW),  # a block table has no kv_indptr
    ((K.BLOCK, 64, 16, -(2**31), False, False), L.BLOCK_NARROW),
    ((K.BLOCK, 64, 16, -(2**31) - 1, False, False), L.BLOCK),
    ((K.BLOCK, 64, 16, INT32_MAX, False, False), L.BLOCK_NARROW),
    ((K.BLOCK, 64, 16, 2**31, False, False), L.BLOCK),
    ((K.PAGED_KV, INT32_MAX, 1, 0, False, False), L.PAGED_KV_NARROW),
    ((K.PAGED_KV, 2**31, 1, 0, False, False), L.PAGED_KV),
    ((K.PAGED_KV, 2**31, 2**30, 0, False, False), L.PAGED_KV),
    ((K.PAGED_KV, 2**30, 2**30, 0, False, False), L.PAGED_KV_NARROW),
    ((K.PAGED_KV, 96, 48, 0, False, False), L.PAGED_KV),
    ((K.PAGED_KV, 64, 16, 0, True, False), L.PAGED_KV),
    ((K.PAGED_KV, 64, 16, 0, False, True), L.PAGED_KV),
    ((K.REQ_TO_TOKEN, 64, 1, 0, False, False), L.REQ_TO_TOKEN),
    ((K.VIRTUAL_PAGES, 64, 16, 0, False, False), L.VIRTUAL_PAGES),
]


@pytest.mark.parametrize("args, layout", LAYOUT_BOUNDS)
def test_the_layout_choice_at_its_bounds(args, layout):
    """configs.table_layout: the narrow layout takes a block table of int32 ids, a power-of-two
    block size, an int32 null block and rows of at most 2**31 - 1 tokens, and a CSR table of int32
    kv_indptr and kv_indices, a power-of-two page size and at most 2**31 - 1 tokens of kv_indices;
    any other table, and every req_to_token, its kind's general layout.  narrow_layout, which a
    planner keeps per table shape, gives the same."""
    from kvcanary_cupy.backends.cuda import configs

    kind, row_tokens, *shape = args
    assert configs.table_layout(*args) == layout
    max_row_tokens, narrow = configs.narrow_layout(kind, *shape)
    assert (narrow if row_tokens <= max_row_tokens else kind) == layout
    assert narrow in (kind, kind | abi.TABLE_NARROW) and (max_row_tokens < 0) == (narrow == kind)


def _table_slot(t, r, rp, p):
    """The slot of position p of batch row r (req_pool_indices ``rp``) of table ``t``, by hand."""
    if "block_table" in t:
        block = int(t["block_table"][rp[r], p // t["block_size"]])
        return 0 if block == t.get("null_block", 0) else paged_slot(block, t["block_size"], p % t["block_size"])
    page = int(t["kv_indices"][int(t["kv_indptr"][r]) + p // t["page_size"]])
    return paged_slot(page, t["page_size"], p % t["page_size"])


def _table_row(t, r, rp):
    """``(inside, length)``: whether batch row r's table row lies in the table, and its length in
    tokens, the bound of its prefix (a block table's width x block size; 0 for a CSR row outside)."""
    if "block_table" in t:
        rows, cols = t["block_table"].shape
        return 0 <= rp[r] < rows, cols * t["block_size"]
    lo, hi = int(t["kv_indptr"][r]), int(t["kv_indptr"][r + 1])
    inside = 0 <= lo <= hi <= len(t["kv_indices"])
    return inside, (hi - lo) * t["page_size"] if inside else 0


def _layouts_launched(monkeypatch) -> list:
    """The table layouts the CuPy backend plans through from now on, one per plan (plan_kernels or
    plan_verify_kernel: the free functions, a planner and plan_and_verify alike)."""
    from kvcanary_cupy.backends.cuda import ops as cuda_ops

    seen = []
    for name in ("plan_kernels", "plan_verify_kernel"):
        def spy(layout, *args, _choose=getattr(cuda_ops, name)):
            seen.append(L(layout))
            return _choose(layout, *args)

        monkeypatch.setattr(cuda_ops, name, spy)
    return seen


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_narrow_and_general_layouts_plan_as_numpy_does(ab, case, monkeypatch):
    """A block or page table of int32 ids (and kv_indptr), a power-of-two page size, an int32 null
    block and rows of at most 2**31 - 1 tokens plans through the narrow layout on the GPU; any
    other through the general one, at the bounds of that choice too: the free plan, a planner and
    plan_and_verify all equal NumPy's byte for byte and the slots by hand (ids at both ends of
    int32, positions just below 2**31 through a window, rows outside the table)."""
    t, rp, prefix, window, layout = LAYOUT_CASES[case]
    kind = "block" if "block_table" in t else "csr"
    bs, vcap = len(prefix), 128
    extend = [1] * bs
    launched = _layouts_launched(monkeypatch)
    got = plan_through(ab, rp, prefix, extend, make_table(ab, kind, t), verify_capacity=vcap, swa_window_size=window)
    want = plan_through(NUMPY, rp, prefix, extend, make_table(NUMPY, kind, t), verify_capacity=vcap, swa_window_size=window)
    assert_same_plan(got, want)

    vph, wph = want
    rows = rp if rp is not None else list(range(bs))
    offsets = wph["verify_offsets"]
    assert int(vph["enable"][0]) == 1
    for e, (slot, token, p, prev) in enumerate(plan_entries(vph)):
        r = int(np.searchsorted(offsets[1:bs + 1], e, side="right"))
        assert offsets[r] <= e < offsets[r + 1] and token == -1
        assert slot == _table_slot(t, r, rows, p)
        assert prev == (_table_slot(t, r, rows, p - 1) if p > 0 else -1)
    table_rows = [_table_row(t, r, rows) for r in range(bs)]
    assert wph["write_seed_slot_indices"][:bs].tolist() == [
        _table_slot(t, r, rows, prefix[r] - 1) if inside and 0 < prefix[r] <= length else -1
        for r, (inside, length) in enumerate(table_rows)]
    assert int(vph["out_of_range_count"][0]) == sum((not inside) + (prefix[r] > length) for r, (inside, length) in enumerate(table_rows))

    planner = kc.CanaryPlanner(kc.CanaryCapacities(vcap, bs), like=ab.like, swa_window_size=window)
    vp, wp = planner.plan(_a(ab, rp, I64), _a(ab, prefix, I64), _a(ab, extend, I64), make_table(ab, kind, t))
    assert plan_entries(host(ab, vp)) == plan_entries(vph)
    assert_same_plan((host(ab, wp),), (wph,))

    fused = []
    for backend in (ab, NUMPY):  # a canary of 32 zeroed slots: the slots inside it violate
        canary, log = backend.asarray(np.zeros((32, 4), I64)), kc.ViolationLog.allocate(64, like=backend.like)
        vp, wp = kc.plan_and_verify(_a(backend, rp, I64), _a(backend, prefix, I64), _a(backend, extend, I64),
                                    make_table(backend, kind, t), canary, log=log, verify_capacity=vcap,
                                    swa_window_size=window)
        vp_host, log_host = host(backend, vp), host(backend, log)
        fused.append(({k: vp_host[k] for k in ("verify_num_valid", "enable", "out_of_range_count")}, host(backend, wp),
                      {k: v for k, v in log_host.items() if k != "ring"}, ring_rows(log_host)))
    got_counts, got_wp, got_log, got_rows = fused[0]
    assert_same_plan((got_counts, got_wp, got_log), fused[1][:3])
    assert got_rows == fused[1][3]
    assert launched == ([layout] * 3 if ab.is_gpu else [])


# ---- strict=True -----------------------------------------------------------------------------------------


def _csr(ab, indptr, indices, ps=2):
    return kc.PagedKvIndices(_a(ab, np.array(indptr)), _a(ab, np.array(indices, I32)), ps)


STRICT_TABLE_CASES = [  # (table kind, change, message)
    ("block", dict(rp=[0, 5]), r"req_pool_indices\[1\] = 5 is outside \[0, 2\) \(block_table has 2 rows\)"),
    ("block", dict(prefix=[2, 9]),
     r"prefix_lens\[1\] = 9 is outside \[0, 8\] \(block_table rows hold 2 blocks x block_size 4 = 8 positions\)"),
    ("csr", dict(indptr=[0, 4, 3]), r"kv_indptr\[0:2\] = \[0, 4\] is not a range within the 3 entries of kv_indices"),
    ("csr", dict(prefix=[2, 5]),
     r"prefix_lens\[1\] = 5 is outside \[0, 4\] \(request 1 holds 2 pages x page_size 2 = 4 positions\)"),
    ("virtual", dict(rtt_value=40), r"req_to_token\[1, 1\] = 40 \(batch row 0\) is in virtual page 10, outside virtual_to_physical of length 4"),
    ("virtual", dict(rtt_value=16), r"req_to_token\[1, 1\] = 16 \(batch row 0\) is in virtual page 4, outside virtual_to_physical of length 4"),
    ("block", dict(lut=np.arange(20)), r"slot 20 of batch row 1, position 0 \(block_table\) is outside full_to_swa_index_mapping of length 20"),
]


@pytest.mark.parametrize("kind, change, message", STRICT_TABLE_CASES)
def test_strict_names_the_table_value(ab, kind, change, message):
    args = dict(rp=[0, 1], prefix=[2, 3], indptr=[0, 1, 3], rtt_value=None, lut=None)
    args.update(change)
    if kind == "block":
        table = kc.BlockTable(_a(ab, np.array([[1, 2], [5, 6]], I32)), 4)
    elif kind == "csr":
        table = _csr(ab, args["indptr"], [3, 4, 5])
        args["rp"] = None
    else:
        rtt = np.array([[0, 0, 0, 0], [0, 1, 2, 3], [4, 5, 6, 7]], I32)
        rtt[1, 1] = args["rtt_value"]
        table = kc.ReqToToken(_a(ab, rtt), virtual_to_physical=_a(ab, np.array([0, 3, 1, 2], I64)), page_size=4)
        args["rp"] = [1, 2]
    call = TableCall(ab)
    kw = dict(rp=args["rp"], prefix=args["prefix"], full_to_swa_index_mapping=_a(ab, args["lut"], I64))
    _rejected(ab, call, table, ValueError, message, strict=True, **kw)
    call(table, **kw)  # without strict: skipped and counted
    assert int(ab.to_numpy(call.out[0].out_of_range_count)[0]) >= 1


# ---- CanarySession ---------------------------------------------------------------------------------------


def test_a_session_through_a_csr_table_reports_what_it_reports_through_req_to_token(ab):
    """The session test's schedule and stale table entry, once through req_to_token and once
    through the equivalent CSR table (page size 1, no req_pool_indices): the same report."""
    from session_engine import ToyEngine
    from test_session import FAULT_STEP, SCHEDULE

    reports = []
    for kind in ("rtt", "csr"):
        engine = ToyEngine()
        session = kc.CanarySession(engine.num_slots, max_batch_size=engine.bs, like=ab.like, on_violation="ignore")
        for step, rows in enumerate(SCHEDULE):
            arrays = {k: ab.asarray(v) for k, v in engine.step(rows).items()}
            if step == FAULT_STEP:
                engine.rtt[1, 2] = engine.rtt[2, 4]
            rp = ab.to_numpy(arrays["rp"])
            if kind == "rtt":
                table, rp_arg = ab.asarray(engine.rtt), arrays["rp"]
            else:  # padding batch rows own no pages
                width = np.where(rp != 0, engine.rtt.shape[1], 0)
                indptr = np.concatenate([[0], np.cumsum(width)])
                table, rp_arg = kc.PagedKvIndices(ab.asarray(indptr), ab.asarray(engine.rtt[rp[rp != 0]].reshape(-1)), 1), None
            session.pre_forward(rp_arg, arrays["prefix"], arrays["extend"], table, arrays["ids"], arrays["pos"], arrays["loc"])
            session.post_forward()
            ab.synchronize()
            session.end_step()
        session.check()
        reports.append(session.report())
    assert [v.key for v in reports[1].violations] == [v.key for v in reports[0].violations] != []
    assert reports[1].total_violations == reports[0].total_violations
