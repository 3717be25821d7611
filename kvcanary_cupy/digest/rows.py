"""Canary rows that ride with KV blocks between buffers: :func:`copy_pages` (offload staging and reload)."""

from __future__ import annotations

import numpy as np

from ..binding import canary_view
from ..errors import fail, public_api
from ..interop import Array, array_module, backend_view, common_placement
from ..runtime import launch_stream
from ..validation import I64, check_1d, check_disjoint, check_int, check_integer_dtype, contiguous_input, require
from . import reference


@public_api
def copy_pages(src_canary: Array, dst_canary: Array, src_pages: Array, dst_pages: Array, *, page_size: int = 1,
               out_of_range_count: Array | None = None) -> Array:
    """Copy the canary rows of KV pages from one canary buffer to another, as the KV is copied.

    Page ``p`` is rows ``[p * page_size, (p + 1) * page_size)``.  The result equals
    ``dst[dst_slots] = src[src_slots]`` over whole pages; the source keeps its rows (unlike
    :func:`move_pages`, which moves them within one buffer).  The offload path: the rows of the
    blocks being offloaded go to a staging buffer beside the KV's (then to the host with it), and
    come back into the canary of the slots a reload gives them, where the next TAIL verify checks
    them (or :func:`restamp` writes fresh ones).  Repeated destination pages are a caller bug (the
    GPU's result then depends on thread timing; the NumPy backend takes the last pair).

    Parameters
    ----------
    src_canary, dst_canary : arrays
        Two canary buffers of one width (int64 ``[num_slots, F]`` or uint8 ``[num_slots, S]``), on one
        device, not overlapping in memory; ``dst_canary`` is written in place.
    src_pages, dst_pages : int32 or int64 arrays [n] (one dtype)
        Pair i copies page ``src_pages[i]`` of ``src_canary`` to page ``dst_pages[i]`` of
        ``dst_canary``.  A pair with an id outside its buffer's whole pages is skipped.
    page_size : int
        Canary rows per page, ``>= 1``.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range page ids.

    Returns
    -------
    array
        ``dst_canary``.

    Raises
    ------
    TypeError, ValueError
        A bad argument, before anything is copied; the message names it.

    Examples
    --------
    >>> pool, staging = kc.allocate_canary_buffer(8), kc.allocate_canary_buffer(4)
    >>> pool[4:6] = 7
    >>> _ = kc.copy_pages(pool, staging, np.array([2]), np.array([1]), page_size=2)
    >>> staging[:, 0].tolist(), int(pool[4, 0])
    ([0, 0, 7, 7], 7)
    """
    size = check_int(page_size, "page_size", minimum=1)
    for key, arr in (("src_canary", src_canary), ("dst_canary", dst_canary), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        require(arr, key)
    named = {"src_canary": src_canary, "dst_canary": dst_canary, "src_pages": src_pages, "dst_pages": dst_pages,
             "out_of_range_count": out_of_range_count}
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        src = canary_view(src_canary, "src_canary", written=False)
        dst = canary_view(dst_canary, "dst_canary", written=True)
        if src.shape[1] != dst.shape[1]:
            fail(ValueError, f"src_canary and dst_canary must have one width, got {src.shape[1]} and {dst.shape[1]} int64 fields a row")
        check_disjoint({"src_canary": src, "dst_canary": dst}, "copy pages within one buffer with kc.move_pages")
        ids = {k: backend_view(named[k], k) for k in ("src_pages", "dst_pages")}
        check_integer_dtype(ids["src_pages"], "src_pages")
        check_1d(ids["src_pages"], "src_pages", ids["src_pages"].dtype)
        check_1d(ids["dst_pages"], "dst_pages", ids["src_pages"].dtype, ids["src_pages"].shape[0], length_name="len(src_pages)")
        ids = {k: contiguous_input(v, k, xp) for k, v in ids.items()}
        count = None
        if out_of_range_count is not None:
            count = backend_view(out_of_range_count, "out_of_range_count", writable=True)
            check_1d(count, "out_of_range_count", I64, 1)
        if placement.backend == "numpy":
            reference.copy_pages(src, dst, ids["src_pages"], ids["dst_pages"], size, count)
        else:
            from . import cuda

            cuda.copy_pages(src, dst, ids["src_pages"], ids["dst_pages"], size, count)
    return dst_canary
