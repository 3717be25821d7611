"""The digest kernels' parameter structs carry everything the kernels read (issue 24): the structs of
a call, built from host arrays, are decoded back into arrays by reading the addresses and sizes they
hold, exactly as the kernels of kernels/digest.cu read them, and the NumPy reference run on the
decoded arrays writes the bytes of the call itself.  (Field widths and offsets against the C structs:
tests/test_kernels_compile.py.)"""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary_cupy as kc
from digest_pools import KINDS, Model, build_pool, layout_of
from conftest import get_backend_or_skip
from kvcanary_cupy.args import TableView
from kvcanary_cupy.digest import cuda, reference
from test_digest import tables

NUMPY = get_backend_or_skip("numpy")


def at(ptr, dtype, count):
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (dtype.itemsize * count)).from_address(int(ptr)), dtype) if count else np.zeros(0, dtype)


def strided(ptr, dtype, rows, cols, row_stride):
    flat = at(ptr, dtype, (rows - 1) * row_stride + cols if rows else 0)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (row_stride * flat.itemsize, flat.itemsize))


def decoded(t, p, q) -> reference.DigestArgs:
    """The arrays the kernels read, from the three structs alone."""
    i = lambda dtype_is_64: np.int64 if dtype_is_64 else np.int32  # noqa: E731
    bs = int(q["bs"])
    if int(t["kind"]) == kc.tables.TableKind.PAGED_KV:
        indptr = at(t["indptr"], i(t["indptr_i64"]), bs + 1)
        table = TableView(int(t["kind"]), at(t["entries"], i(t["entries_i64"]), int(t["nnz"])), indptr, None,
                          int(t["page_size"]), int(t["null_block"]), bs, "", 0)
    else:
        entries = strided(t["entries"], i(t["entries_i64"]), int(t["rows"]), int(t["cols"]), int(t["row_stride"]))
        v2p = at(t["v2p"], np.int64, int(t["v2p_len"])) if int(t["v2p"]) else None
        table = TableView(int(t["kind"]), entries, None, v2p, int(t["page_size"]), int(t["null_block"]), 0, "", 0)
    num_layers, halves, heads, words = (int(p[k]) for k in ("num_layers", "halves", "num_heads", "strip_words"))
    pages, ps = int(p["num_pages"]), int(p["page_size"])
    reach = (pages - 1) * int(p["page_stride"]) + (ps - 1) * int(p["token_stride"]) + (heads - 1) * int(p["head_stride"]) + 8 * words
    ptrs = at(p["pointers"], np.uint64, num_layers * halves)
    spans = tuple(tuple(at(ptrs[l * halves + c], np.uint8, reach) for c in range(halves)) for l in range(num_layers))
    layout = SimpleNamespace(strip_bytes=8 * words, layer_offset=int(p["layer_offset"]), num_layers=num_layers,
                             num_slots=pages * ps, page_size=ps, num_heads=heads, head_offset=int(p["head_offset"]),
                             page_stride=int(p["page_stride"]), token_stride=int(p["token_stride"]),
                             head_stride=int(p["head_stride"]), num_pages=pages, halves=halves, _spans=spans)
    opt = lambda name, dtype, n: at(q[name], dtype, n) if int(q[name]) else None  # noqa: E731
    records = strided(q["records"], np.int64, int(q["rec_num_slots"]), int(q["rec_fields"]), int(q["rec_fields"])) if int(q["records"]) else None
    expected = (strided(q["expected"], i(q["exp_i64"]), int(q["exp_rows"]), int(q["exp_cols"]), int(q["exp_row_stride"]))
                if int(q["expected"]) else None)
    return reference.DigestArgs(layout, table, opt("req_pool_indices", np.int64, bs), at(q["starts"], np.int64, bs),
                                at(q["ends"], np.int64, bs), at(q["sample_keys"], np.int64, bs), records, expected,
                                opt("valid_lens", np.int64, bs), opt("seam", np.int64, bs),
                                at(q["out"], np.int64, bs * 8).reshape(bs, 8), at(q["out_of_range"], np.int64, 1),
                                int(q["num_layers_total"]), int(q["sample_layers"]), 8 * int(q["window_words"]),
                                int(q["token_offset"]), int(q["mode"]), int(q["signature"]), int(q["header"]))


@pytest.mark.parametrize("table_kind", ["req_to_token", "block", "virtual", "paged"])
@pytest.mark.parametrize("receiver", [False, True])
def test_the_structs_carry_the_whole_call(monkeypatch, table_kind, receiver):
    rng = np.random.default_rng(31)
    model = Model.random(rng, [9, 30, 4], num_layers=3, num_heads=3, head_dim=16)
    pool = build_pool(KINDS[len(table_kind) % len(KINDS)], model, page_size=4, num_pages=16, rng=rng)
    for r in range(3):
        pool.write(r, model)
        pool.stamp(r, model)
    _, layout = layout_of(pool, model, NUMPY, layer_offset=1)
    table, rows = tables(pool, 4, table_kind)
    calls = []
    monkeypatch.setattr(reference, "digest", calls.append)  # the front door's call, not run
    spec = kc.DigestSpec(5, sample_layers=2, window_bytes=16, kv_token_id_vs_position_offset=-1)
    kw = {"expected_tokens": rng.integers(0, 99, (5, 40)).astype(np.int32), "seam": np.array([-1, 7, 3]),
          "expected_tokens_valid_lens": np.array([40, 2, 9])} if receiver else {}
    kc.digest_pages(layout, table, rows, np.array([0, 3, 1]), np.array([9, 27, 4]), spec=spec,
                    sample_keys=np.array([5, -9, 2**40]), records=pool.canary, **kw)
    (a,) = calls
    monkeypatch.undo()
    pointers = np.array([kc.interop.data_ptr(s) for row in layout._spans for s in row], np.uint64)
    structs = (cuda.table_struct(a.table)[0], cuda.pool_struct(a.layout, pointers)[0], cuda.requests_struct(a)[0])
    direct = a._replace(out=np.zeros_like(a.out), out_of_range_count=np.zeros(1, np.int64))
    reference.digest(direct)
    reference.digest(decoded(*structs))  # writes through the struct's own out pointer: a's arrays
    assert a.out.tobytes() == direct.out.tobytes() and a.out[:3].any()
    assert int(a.out_of_range_count[0]) == int(direct.out_of_range_count[0])
