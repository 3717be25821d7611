"""The CUDA backend of the digest: fills the kernels' parameter structs (NumPy mirrors of the
structs of ``kernels/digest.cu``; ``devtools/abi_check.py`` pins their layout) and launches them
on CuPy's current stream (the caller's: torch's current stream for torch tensors)."""

from __future__ import annotations

import numpy as np

from ..backends.cuda import device as cuda_device
from ..backends.cuda.compile import get_function
from ..backends.cuda.params import log_struct
from ..tables import TableKind

DIGEST_TABLE = np.dtype([("entries", "u8"), ("indptr", "u8"), ("v2p", "u8"), ("rows", "i8"), ("cols", "i8"),
                         ("row_stride", "i8"), ("nnz", "i8"), ("v2p_len", "i8"), ("page_size", "i8"), ("null_block", "i8"),
                         ("kind", "i4"), ("entries_i64", "i4"), ("indptr_i64", "i4"), ("pad", "i4")], align=True)
DIGEST_POOL = np.dtype([("pointers", "u8"), ("page_stride", "i8"), ("token_stride", "i8"), ("head_stride", "i8"),
                        ("num_pages", "i8"), ("page_size", "i8"), ("strip_words", "i4"), ("num_heads", "i4"),
                        ("num_layers", "i4"), ("halves", "i4"), ("layer_offset", "i4"), ("head_offset", "i4")], align=True)
DIGEST_REQUESTS = np.dtype([*((k, "u8") for k in ("req_pool_indices", "starts", "ends", "sample_keys", "records", "expected",
                                                 "valid_lens", "seam", "out", "out_of_range")),
                            *((k, "i8") for k in ("bs", "rec_num_slots", "exp_rows", "exp_cols", "exp_row_stride",
                                                 "token_offset")),
                            ("header", "u8"), ("signature", "u8"),
                            *((k, "i4") for k in ("rec_fields", "exp_i64", "mode", "num_layers_total", "sample_layers",
                                                 "window_words"))], align=True)

THREADS = 256  # kDigestThreads
WARPS_PER_SM = 64  # resident warps aimed at per SM, spread over the batch's requests
MAX_GRID_Y = 65535


def _ptr(x) -> int:
    return 0 if x is None else int(x.data.ptr)


def _table_struct(t) -> np.ndarray:
    s = np.zeros(1, DIGEST_TABLE)
    e = t.entries
    s["entries"], s["kind"], s["entries_i64"] = _ptr(e), int(t.kind), int(e.dtype.itemsize == 8)
    if t.kind == TableKind.PAGED_KV:
        s["indptr"], s["indptr_i64"], s["nnz"] = _ptr(t.kv_indptr), int(t.kv_indptr.dtype.itemsize == 8), e.shape[0]
    else:
        s["rows"], s["cols"] = e.shape
        s["row_stride"] = e.strides[0] // e.dtype.itemsize if e.shape[0] > 1 else e.shape[1]
    if t.virtual_to_physical is not None:
        s["v2p"], s["v2p_len"] = _ptr(t.virtual_to_physical), t.virtual_to_physical.shape[0]
    s["page_size"], s["null_block"] = t.page_size, t.null_block
    return s


def _pool_struct(layout) -> np.ndarray:
    s = np.zeros(1, DIGEST_POOL)
    s["pointers"] = _ptr(layout._device_pointers)
    for k in ("page_stride", "token_stride", "head_stride", "num_pages", "page_size", "num_heads", "num_layers", "halves",
              "layer_offset", "head_offset"):
        s[k] = getattr(layout, k)
    s["strip_words"] = layout.strip_bytes // 8
    return s


def _requests_struct(a) -> np.ndarray:
    s = np.zeros(1, DIGEST_REQUESTS)
    for k, v in (("req_pool_indices", a.req_pool_indices), ("starts", a.starts), ("ends", a.ends), ("sample_keys", a.sample_keys),
                 ("records", a.records), ("expected", a.expected_tokens), ("valid_lens", a.valid_lens), ("seam", a.seam),
                 ("out", a.out), ("out_of_range", a.out_of_range_count)):
        s[k] = _ptr(v)
    s["bs"] = a.starts.shape[0]
    if a.records is not None:
        s["rec_num_slots"], s["rec_fields"] = a.records.shape
    if a.expected_tokens is not None:
        x = a.expected_tokens
        s["exp_rows"], s["exp_cols"], s["exp_i64"] = x.shape[0], x.shape[1], int(x.dtype.itemsize == 8)
        s["exp_row_stride"] = x.strides[0] // x.dtype.itemsize if x.shape[0] > 1 else x.shape[1]
    s["token_offset"], s["header"], s["signature"] = a.token_offset, a.header, a.signature
    s["mode"], s["num_layers_total"], s["sample_layers"] = a.mode, a.num_layers_total, a.sample_layers
    s["window_words"] = a.window_bytes // 8
    return s


def digest(a) -> None:
    bs = a.starts.shape[0]
    if bs == 0:
        return
    params = (_table_struct(a.table), _pool_struct(a.layout), _requests_struct(a))
    get_function("digest", "kvcanary::digest_init")((-(-bs // THREADS),), (THREADS,), params)
    sms = cuda_device.sm_count(cuda_device.current_id())
    grid_y = min(bs, MAX_GRID_Y)
    grid_x = max(1, min(1024, -(-sms * WARPS_PER_SM // (THREADS // 32) // grid_y)))
    get_function("digest", "kvcanary::digest_accumulate")((grid_x, grid_y), (THREADS,), params)


def verify(expected, actual, out, log, kind: int) -> None:
    n = expected.shape[0]
    get_function("digest", "kvcanary::digest_verify")((max(1, -(-n // THREADS)),), (THREADS,),
                                                      (expected, actual, np.int64(n), out, log_struct(log), np.int32(kind)))
