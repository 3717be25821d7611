"""The CUDA backend of the digest: fills the kernels' parameter structs (NumPy mirrors of the
structs of ``kernels/digest.cu``; ``devtools/abi_check.py`` pins their layout) into the kernels'
parameter records, launched as every canary op's are: packed once (``backends/cuda/launch.py``'s
:class:`PackedLaunches`, overlapping the work before them where the device allows) on the caller's
stream (torch's current stream for torch tensors).  The records hold addresses, never an array:
they stay valid while the caller's arrays live (:mod:`.memo` checks that)."""

from __future__ import annotations

import numpy as np

from ..backends.cuda import device as cuda_device
from ..backends.cuda.compile import kernel_name
from ..backends.cuda.configs import LaunchConfig, resident_blocks_per_sm
from ..backends.cuda.abi import LAUNCH_LOG
from ..backends.cuda.launch import PackedLaunches
from ..backends.cuda.params import KernelLaunch, log_struct
from ..interop import data_ptr
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

# The kernels' parameter records (field i = parameter i).
DIGEST_PARAMS = np.dtype([("table", DIGEST_TABLE), ("pool", DIGEST_POOL), ("requests", DIGEST_REQUESTS)], align=True)
VERIFY_PARAMS = np.dtype([("expected", "u8"), ("actual", "u8"), ("n", "i8"), ("out", "u8"), ("log", LAUNCH_LOG),
                          ("kind", "i4")], align=True)

THREADS = 256  # kDigestThreads
MAX_GRID_Y = 65535
UNIT_MAX_UNITS, UNIT_MAX_WORDS = 512, 8  # kUnitMaxUnits, kUnitMaxWords

def _ptr(x) -> int:
    return 0 if x is None else data_ptr(x)


def table_struct(t) -> np.ndarray:
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


def pool_struct(layout, pointers=None) -> np.ndarray:
    """DigestPool of ``layout``; ``pointers``: the array of base addresses (default the layout's
    device copy, and the struct is then made once per layout: a layout never changes)."""
    if pointers is None and "_digest_pool" in layout.__dict__:
        return layout.__dict__["_digest_pool"]
    s = np.zeros(1, DIGEST_POOL)
    s["pointers"] = _ptr(layout._device_pointers if pointers is None else pointers)
    for k in ("page_stride", "token_stride", "head_stride", "num_pages", "page_size", "num_heads", "num_layers", "halves",
              "layer_offset", "head_offset"):
        s[k] = getattr(layout, k)
    s["strip_words"] = layout.strip_bytes // 8
    if pointers is None:
        layout.__dict__["_digest_pool"] = s  # a frozen dataclass: its __dict__ holds the cache
    return s


def requests_struct(a) -> np.ndarray:
    """DigestRequests of a call, made in one step from its values in field order."""
    rec, exp = a.records, a.expected_tokens
    v = {k: _ptr(x) for k, x in (("req_pool_indices", a.req_pool_indices), ("starts", a.starts), ("ends", a.ends),
                                 ("sample_keys", a.sample_keys), ("records", rec), ("expected", exp),
                                 ("valid_lens", a.valid_lens), ("seam", a.seam), ("out", a.out),
                                 ("out_of_range", a.out_of_range_count))}
    v.update(bs=a.starts.shape[0], rec_num_slots=0, rec_fields=0, exp_rows=0, exp_cols=0, exp_row_stride=0, exp_i64=0,
             token_offset=a.token_offset, header=a.header, signature=a.signature, mode=a.mode,
             num_layers_total=a.num_layers_total, sample_layers=a.sample_layers, window_words=a.window_bytes // 8)
    if rec is not None:
        v["rec_num_slots"], v["rec_fields"] = rec.shape
    if exp is not None:
        v["exp_rows"], v["exp_cols"], v["exp_i64"] = exp.shape[0], exp.shape[1], int(exp.dtype.itemsize == 8)
        v["exp_row_stride"] = exp.strides[0] // exp.dtype.itemsize if exp.shape[0] > 1 else exp.shape[1]
    return np.array([tuple(v[k] for k in DIGEST_REQUESTS.names)], DIGEST_REQUESTS)


def unit_words(layout, num_layers_total: int, sample_layers: int, window_bytes: int) -> int:
    """The words digest_units hashes per (layer, half, head) of a position under this spec, or 0
    where it does not take the spec (more units than its table holds, or a window past
    kUnitMaxWords words)."""
    strip_words = layout.strip_bytes // 8
    all_layers = sample_layers == 0 or sample_layers >= num_layers_total
    candidates = layout.num_layers if all_layers else sample_layers
    window = window_bytes // 8
    nw = window if 0 < window < strip_words else strip_words
    units = candidates * layout.halves * layout.num_heads
    return nw if 0 < units <= UNIT_MAX_UNITS and 0 < nw <= UNIT_MAX_WORDS else 0


def _packed(placement, launches) -> PackedLaunches:
    """``launches``: (kernel name, grid, parameter record) of the family's kernels, in order."""
    return PackedLaunches([KernelLaunch("digest", name, LaunchConfig(grid[0], THREADS, 0, *grid[1:]), record)
                           for name, grid, record in launches], placement)


def digest(a, placement) -> PackedLaunches:
    """digest_init (each request's header and zero sums) then the accumulating kernel on a grid of
    one wave (x spreads a request's positions over the SMs, y walks the requests): digest_units
    where it takes the spec (a lane a sampled window), else digest_accumulate."""
    bs = a.starts.shape[0]
    if bs == 0:
        return _packed(placement, ())
    record = np.zeros(1, DIGEST_PARAMS)
    record["table"], record["pool"], record["requests"] = table_struct(a.table), pool_struct(a.layout), requests_struct(a)
    sms = cuda_device.sm_count(cuda_device.current_id())
    grid_y = min(bs, MAX_GRID_Y)
    nw = unit_words(a.layout, a.num_layers_total, a.sample_layers, a.window_bytes)
    name = kernel_name("digest_units", 4 if nw == 4 else 0) if nw else "kvcanary::digest_accumulate"
    # One wave: the blocks its registers let the SMs hold at once (a larger grid ran in waves,
    # each warp paying its block's set-up and atomics for a position or two).
    grid_x = max(1, sms * resident_blocks_per_sm("digest", name, THREADS) // grid_y)
    return _packed(placement, (("kvcanary::digest_init", (-(-bs // THREADS),), record), (name, (grid_x, grid_y), record)))


def verify(expected, actual, out, log, kind: int, placement) -> PackedLaunches:
    n = expected.shape[0]
    record = np.zeros(1, VERIFY_PARAMS)
    record["expected"], record["actual"], record["n"], record["out"] = data_ptr(expected), data_ptr(actual), n, data_ptr(out)
    record["log"], record["kind"] = log_struct(log), kind
    return _packed(placement, (("kvcanary::digest_verify", (max(1, -(-n // THREADS)),), record),))
