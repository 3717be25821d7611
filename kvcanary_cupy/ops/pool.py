"""move_pages, copy_pages and scatter_req_token_ids: the ops that follow an engine's KV pool (pages
moved or copied, the expected-token pool filled)."""

from __future__ import annotations

import numpy as np

from .. import strict as strict_checks
from ..args import CopyArgs, MoveArgs, ScatterArgs
from ..backends import get_backend
from ..binding import canary_view
from ..errors import fail, public_api
from ..interop import Array, array_module, backend_view, common_placement
from ..runtime import launch_stream, refuse_during_capture
from ..validation import (I32, I64, check_1d, check_2d_rows, check_contiguous_output, check_disjoint, check_dtype, check_int,
                          check_integer_dtype, contiguous_input, require)


@public_api
def move_pages(canary_buf: Array, src_pages: Array, dst_pages: Array, *, page_size: int = 1,
               workspace: Array | None = None, out_of_range_count: Array | None = None, strict: bool = False) -> Array:
    """Move the canary rows of KV pages with the pages (compaction, defragmentation, cell moves).

    Page ``p`` is canary rows ``[p * page_size, (p + 1) * page_size)``.  The result equals
    ``rows = canary[src_slots].copy(); canary[src_slots] = 0; canary[dst_slots] = rows`` over whole
    pages, so a table that still points at a page's old place fails verify, and permutations
    (sources and destinations overlapping) move correctly.  Repeated destination pages are a
    caller bug: which source lands there then depends on GPU thread timing (the NumPy backend
    takes the last).

    Parameters
    ----------
    canary_buf : array
        One canary buffer (int64 ``[num_slots, 4]`` or uint8 ``[num_slots, S]``), moved in place.
    src_pages, dst_pages : int32 or int64 arrays [n] (one dtype)
        Pair i moves page ``src_pages[i]`` to page ``dst_pages[i]``.  A pair with a page id
        outside ``[0, num_slots // page_size)`` is skipped.
    page_size : int
        Canary rows per page, ``>= 1``.
    workspace : int64 array, optional
        The GPU's staging area for the moved rows: contiguous, at least ``n * page_size`` rows of
        the canary's width (``kc.allocate_canary_buffer(max_pages * page_size, like=canary_buf)``
        fits).  Pass one allocated once to stay capture-safe; without it each GPU call allocates
        one, which is refused inside a CUDA graph capture.  Unused on the CPU.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range page ids.
    strict : bool
        Raise a ValueError on the first out-of-range page id instead (a device sync).

    Returns
    -------
    array
        ``canary_buf``.

    Raises
    ------
    TypeError, ValueError
        A bad argument, before anything is moved; the message names it.

    Examples
    --------
    >>> canary = kc.allocate_canary_buffer(8)
    >>> canary[2:4] = 7
    >>> _ = kc.move_pages(canary, np.array([1]), np.array([3]), page_size=2)
    >>> canary[:, 0].tolist()
    [0, 0, 0, 0, 0, 0, 7, 7]
    """
    size = check_int(page_size, "page_size", minimum=1)
    for key, arr in (("canary_buf", canary_buf), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        require(arr, key)
    named = {
        "canary_buf": canary_buf,
        "src_pages": src_pages,
        "dst_pages": dst_pages,
        "workspace": workspace,
        "out_of_range_count": out_of_range_count,
    }
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        canary = canary_view(canary_buf, "canary_buf", written=True)
        v = {k: backend_view(named[k], k, writable=k in ("workspace", "out_of_range_count"))
             for k in ("src_pages", "dst_pages", "workspace", "out_of_range_count")}
        check_integer_dtype(v["src_pages"], "src_pages")
        check_1d(v["src_pages"], "src_pages", v["src_pages"].dtype)
        check_1d(v["dst_pages"], "dst_pages", v["src_pages"].dtype, v["src_pages"].shape[0], length_name="len(src_pages)")
        for key in ("src_pages", "dst_pages"):
            v[key] = contiguous_input(v[key], key, xp)
        # Nothing is staged when the canary holds no whole page (every pair is then skipped).
        need = v["src_pages"].shape[0] * size * canary.shape[1] if canary.shape[0] >= size else 0
        v["workspace"] = _staging_workspace(v["workspace"], need, canary.shape[1], placement, xp, "move_pages")
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = MoveArgs(canary, v["src_pages"], v["dst_pages"], size, v["workspace"], v["out_of_range_count"])
        if strict:
            strict_checks.check_move(args)
        get_backend(placement.backend).move(args)
    return canary_buf


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
        dst = canary_view(dst_canary, "dst_canary", written=True)
        src = dst if src_canary is dst_canary else canary_view(src_canary, "src_canary", written=False)
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
        v["workspace"] = _staging_workspace(v["workspace"], need, src.shape[1], placement, xp, "copy_pages")
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = CopyArgs(src, dst, v["src_pages"], v["dst_pages"], size, v["workspace"], v["out_of_range_count"])
        if strict:
            strict_checks.check_copy(args)
        get_backend(placement.backend).copy(args)
    return dst_canary


@public_api
def scatter_req_token_ids(flat_in: Array, offsets: Array, req_pool_indices: Array, pool_out: Array, *,
                          out_of_range_count: Array | None = None, strict: bool = False) -> Array:
    """Fill the expected-token pool: ``pool_out[rp, :n] = flat_in[start:start+n]`` per request.

    For batch row r, ``rp = req_pool_indices[r]``, ``start = offsets[r]`` and ``n =
    min(offsets[r+1] - offsets[r], pool_out.shape[1])``; rows not addressed are untouched.  Batch
    rows sharing a pool row: for each column, the largest batch row writing it wins.  The pool is
    what :func:`plan` takes as ``req_to_verify_expected_tokens``.

    Parameters
    ----------
    flat_in : int64 array [N]
        Every request's tokens, concatenated.
    offsets : int64 array [bs + 1]
        Request r's tokens are ``flat_in[offsets[r]:offsets[r+1]]``.
    req_pool_indices : int64 array [bs]
        The pool row each request fills.
    pool_out : int32 array [R, C]
        The pool, rows contiguous; written in place.
    out_of_range_count : int64 array [1], optional
        Adds the number of skipped out-of-range values (a pool row outside ``[0, R)``, a negative
        length, a source range outside ``flat_in``).
    strict : bool
        Raise a ValueError on the first out-of-range value instead (a device sync).

    Returns
    -------
    array
        ``pool_out``.

    Raises
    ------
    TypeError, ValueError
        A bad dtype or shape (``offsets`` not ``bs + 1`` long, ...), before anything is written.

    Examples
    --------
    >>> pool = np.zeros((3, 4), np.int32)
    >>> _ = kc.scatter_req_token_ids(np.array([5, 6, 7]), np.array([0, 2, 3]), np.array([2, 1]), pool)
    >>> pool.tolist()
    [[0, 0, 0, 0], [7, 0, 0, 0], [5, 6, 0, 0]]
    """
    for key, arr in (("flat_in", flat_in), ("offsets", offsets), ("req_pool_indices", req_pool_indices), ("pool_out", pool_out)):
        require(arr, key)
    named = {
        "flat_in": flat_in,
        "offsets": offsets,
        "req_pool_indices": req_pool_indices,
        "pool_out": pool_out,
        "out_of_range_count": out_of_range_count,
    }
    placement = common_placement(named)
    xp = array_module(placement)
    with launch_stream(placement):
        v = {k: backend_view(a, k, writable=k in ("pool_out", "out_of_range_count")) for k, a in named.items()}
        for key in ("flat_in", "offsets", "req_pool_indices"):
            if v[key].dtype != np.int64:
                fail(TypeError, f"scatter_req_token_ids {key} must be int64, got {v[key].dtype}")
            if v[key].ndim != 1:
                fail(ValueError, f"scatter_req_token_ids {key} must be 1-D, got shape {tuple(v[key].shape)}")
            v[key] = contiguous_input(v[key], key, xp)
        if v["pool_out"].dtype != np.int32:
            fail(TypeError, f"scatter_req_token_ids pool_out must be int32, got {v['pool_out'].dtype}")
        check_2d_rows(v["pool_out"], "scatter_req_token_ids pool_out", I32)
        bs = v["req_pool_indices"].shape[0]
        if v["offsets"].shape[0] != bs + 1:
            fail(ValueError, f"scatter_req_token_ids offsets length {v['offsets'].shape[0]} != bs+1 ({bs + 1})")
        if out_of_range_count is not None:
            check_1d(v["out_of_range_count"], "out_of_range_count", I64, 1)
        args = ScatterArgs(**v)
        if strict:
            strict_checks.check_scatter(args)
        get_backend(placement.backend).scatter(args)
    return pool_out


def _staging_workspace(workspace, need: int, width: int, placement, xp, op: str):
    """The staging area of a page move or copy: the caller's ``workspace`` checked to hold ``need``
    values, or (no workspace, on the GPU, not capturing) one allocated for this call."""
    if workspace is not None:
        check_dtype(workspace, "workspace", I64)
        check_contiguous_output(workspace, "workspace")
        if workspace.size < need:
            fail(ValueError, f"workspace must hold at least len(src_pages) x page_size x {width} int64 fields "
                             f"= {need} values, got {workspace.size}")
    elif placement.backend == "cupy" and need:
        refuse_during_capture(placement, f"{op} would allocate its staging area (no workspace= was given)",
                              "pass workspace= allocated before capturing")
        workspace = xp.empty(need, I64)
    return workspace
