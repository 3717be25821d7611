"""Copying canary rows with the KV pages an engine copies: forks, copy-on-write, offload and reload.

:func:`copy_pages` is :func:`~kvcanary_cupy.move_pages` without the clearing, between two canary
buffers (or within one): the copied pages keep their records, so a table that names either copy
verifies, and the source pages stay as they were.
"""

from __future__ import annotations

from . import strict as strict_checks
from .args import CopyArgs
from .backends import get_backend
from .errors import fail, public_api
from .interop import Array, array_module, backend_view, common_placement, launch_stream, refuse_during_capture
from .ops import _canary_view
from .validation import I64, check_1d, check_contiguous_output, check_disjoint, check_dtype, check_int, check_integer_dtype, contiguous_input, require


@public_api
def copy_pages(src_canary: Array, dst_canary: Array, src_pages: Array, dst_pages: Array, *, page_size: int = 1,
               workspace: Array | None = None, out_of_range_count: Array | None = None, strict: bool = False) -> Array:
    """Copy the canary rows of KV pages to other pages, of the same buffer or of another one.

    Page ``p`` is canary rows ``[p * page_size, (p + 1) * page_size)``.  The result equals ``rows =
    src_canary[src_slots].copy(); dst_canary[dst_slots] = rows`` over whole pages: a destination
    that is also a source receives that page's rows from before the call.  Repeated destination
    pages are a caller bug (which source lands there then depends on GPU thread timing; the NumPy
    backend takes the last).

    Parameters
    ----------
    src_canary, dst_canary : arrays
        Canary buffers of one width (int64 ``[num_slots, 4]`` or uint8 ``[num_slots, S]``) on one
        device; the same buffer, or two that do not overlap.  ``dst_canary`` is written in place.
    src_pages, dst_pages : int32 or int64 arrays [n] (one dtype)
        Pair i copies page ``src_pages[i]`` of ``src_canary`` to page ``dst_pages[i]`` of
        ``dst_canary``.  A pair with a source id outside ``src_canary``'s whole pages, or a
        destination id outside ``dst_canary``'s, is skipped.
    page_size : int
        Canary rows per page, ``>= 1``.
    workspace : int64 array, optional
        The GPU's staging area: contiguous, at least ``n * page_size`` rows of the canary's width.
        Pass one allocated once to stay capture-safe; without it each GPU call allocates one, which
        is refused inside a CUDA graph capture.  Unused on the CPU.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range page ids (each bad id once).
    strict : bool
        Raise a ValueError on the first out-of-range page id instead (a device sync).

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
    >>> canary = kc.allocate_canary_buffer(8)
    >>> canary[2:4] = 7
    >>> _ = kc.copy_pages(canary, canary, np.array([1]), np.array([3]), page_size=2)
    >>> canary[:, 0].tolist()
    [0, 0, 7, 7, 0, 0, 7, 7]
    """
    size = check_int(page_size, "page_size", minimum=1)
    for key, arr in (("src_canary", src_canary), ("dst_canary", dst_canary), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        require(arr, key)
    named = {"src_canary": src_canary, "dst_canary": dst_canary, "src_pages": src_pages, "dst_pages": dst_pages,
             "workspace": workspace, "out_of_range_count": out_of_range_count}
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        dst = _canary_view(dst_canary, "dst_canary", written=True)
        src = dst if src_canary is dst_canary else _canary_view(src_canary, "src_canary", written=False)
        if src.shape[1] != dst.shape[1]:
            fail(ValueError, f"src_canary and dst_canary must have one slot width, got {src.shape[1]} and {dst.shape[1]} int64 fields")
        if src is not dst:
            check_disjoint({"src_canary": src, "dst_canary": dst}, "pass one buffer as both, or two apart")
        v = {k: backend_view(named[k], k, writable=k in ("workspace", "out_of_range_count"))
             for k in ("src_pages", "dst_pages", "workspace", "out_of_range_count")}
        check_integer_dtype(v["src_pages"], "src_pages")
        check_1d(v["src_pages"], "src_pages", v["src_pages"].dtype)
        check_1d(v["dst_pages"], "dst_pages", v["src_pages"].dtype, v["src_pages"].shape[0], length_name="len(src_pages)")
        for key in ("src_pages", "dst_pages"):
            v[key] = contiguous_input(v[key], key, xp)
        whole = src.shape[0] >= size and dst.shape[0] >= size  # else every pair is skipped: nothing staged
        need = v["src_pages"].shape[0] * size * src.shape[1] if whole else 0
        if workspace is not None:
            check_dtype(v["workspace"], "workspace", I64)
            check_contiguous_output(v["workspace"], "workspace")
            if v["workspace"].size < need:
                fail(ValueError, f"workspace must hold at least len(src_pages) x page_size x {src.shape[1]} int64 fields "
                                 f"= {need} values, got {v['workspace'].size}")
        elif placement.backend == "cupy" and need:
            refuse_during_capture(placement, "copy_pages would allocate its staging area (no workspace= was given)",
                                  "pass workspace= allocated before capturing")
            v["workspace"] = xp.empty(need, I64)
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = CopyArgs(src, dst, v["src_pages"], v["dst_pages"], size, v["workspace"], v["out_of_range_count"])
        if strict:
            strict_checks.check_copy(args)
        get_backend(placement.backend).copy(args)
    return dst_canary
