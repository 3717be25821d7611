"""Comparing digests (:func:`verify_digest`) and re-stamping canary records after a verified
receive or reload (:func:`restamp`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..binding import log_views
from ..constants import RealKvHashMode
from ..errors import fail, public_api
from ..interop import Array, allocate, array_module, backend_view, common_placement, to_numpy
from ..runtime import launch_stream, refuse_during_capture
from ..plans import ViolationLog, WritePlan
from ..tables import TableKind, as_table, table_view
from ..validation import I32, I64, check_1d, check_contiguous_output, check_int, require
from . import reference
from .format import DIGEST_NUM_KINDS, DigestLaunchTag
from ..last_call import LastCall
from .pages import DigestBatch, batch_views

_LAST_CALL = LastCall()  # verify_digest's last CUDA call, replayed when the same arguments come back (last_call.py)


@public_api
def verify_digest(expected: DigestBatch, actual: DigestBatch, *, log: ViolationLog,
                  kernel_kind: int = DigestLaunchTag.TRANSFER, out: Array | None = None, strict: bool = False) -> Array:
    """Compare the sender's digests with the receiver's, row by row, on the device: fail closed.

    Row b's verdict (:class:`DigestVerdict`) is ``MISSING`` when either record is absent (a zero
    row, no magic, no present flag) or hashed no word; ``INCOMPARABLE`` when the format version,
    signature, range or sample key differ; ``MISMATCH_KV`` when the KV sum or word count differ;
    ``MISMATCH_PROVENANCE`` when only the provenance sum differs; else ``MATCH``.  Each non-MATCH
    row logs a violation row ``[kernel_kind, -1 - b, start, end, words, actual_kv, expected_kv,
    bits]`` (bits: :class:`DigestFailReason`); the counters of ``kernel_kind`` count rows compared,
    the launch and the violations.  Nothing is read on the host: capture-safe with ``out=``.

    Parameters
    ----------
    expected : DigestBatch
        The records that arrived with the transfer (:meth:`DigestBatch.from_records`, or bytes
        copied into a batch's ``records``); its rows are compared.
    actual : DigestBatch
        The receiver's own digest of its memory after the transfer (:func:`digest_pages`), at
        least as many rows.
    log : ViolationLog
        Takes the verdicts' rows; ``num_kinds > kernel_kind`` (``ViolationLog.allocate(num_kinds=
        kc.DIGEST_NUM_KINDS)`` for the digest tags).
    kernel_kind : int
        The launch tag of the rows and counters (:class:`DigestLaunchTag`).
    out : int32 array [>= n], optional
        Where the verdict codes go; None allocates one (refused while capturing).
    strict : bool
        Raise a ValueError when any verdict is not MATCH (a host sync), after logging.

    Returns
    -------
    array
        ``out``: int32 verdict codes, one per expected row.

    Raises
    ------
    TypeError, ValueError
        A bad argument, before anything runs.

    Examples
    --------
    >>> log = kc.ViolationLog.allocate(8, num_kinds=kc.DIGEST_NUM_KINDS)
    >>> sent = kc.DigestBatch.from_records([kc.DigestRecord(3, 0, 0, 4, 11, 12, 64)])
    >>> got = kc.DigestBatch.from_records([kc.DigestRecord(3, 0, 0, 4, 11, 13, 64), ])
    >>> kc.DigestVerdict(int(kc.verify_digest(sent, got, log=log)[0])).name
    'MISMATCH_PROVENANCE'
    """
    objects = (expected, actual, log, out)
    replay = None if out is None or strict else _LAST_CALL.get(objects, (type(kernel_kind), kernel_kind))
    if replay is not None:  # the same arguments as the last call, unchanged: its checked launch
        replay()
        return out
    if not isinstance(log, ViolationLog):
        fail(TypeError, f"log must be a ViolationLog, got {type(log).__name__}")
    kind = check_int(kernel_kind, "kernel_kind")
    if not 0 <= kind < log.num_kinds:
        hint = f"; allocate it with num_kinds={DIGEST_NUM_KINDS} (kc.DIGEST_NUM_KINDS) for the digest tags" if kind < DIGEST_NUM_KINDS else ""
        fail(ValueError, f"kernel_kind must be in [0, {log.num_kinds}) (the log's num_kinds), got {kind}{hint}")
    named = {"expected.records": getattr(expected, "records", None), "actual.records": getattr(actual, "records", None),
             "log.ring": log.ring, "out": out}
    placement = common_placement({k: v for k, v in named.items() if v is not None} or {"expected": expected})
    with launch_stream(placement):
        e, _ = batch_views(expected, "expected", writable=False)
        a, _ = batch_views(actual, "actual", writable=False)
        n = e.shape[0]
        if a.shape[0] < n:
            fail(ValueError, f"actual holds {a.shape[0]} rows but expected {n}; digest every expected request")
        replayable = out is not None and not strict
        if out is None:
            refuse_during_capture(placement, "verify_digest with out=None allocates its verdict array",
                                  "pass out= (int32 [n]) allocated before capturing")
            out = allocate((n,), np.int32, like=expected.records)
        ov = backend_view(out, "out", writable=True)
        check_1d(ov, "out", I32)
        check_contiguous_output(ov, "out")
        if ov.shape[0] < n:
            fail(ValueError, f"out length must be >= {n} (expected's rows), got {ov.shape[0]}")
        lv = log_views(log)  # the log's one set of rules
        if placement.backend == "numpy":
            reference.verify(e, a, ov, lv, kind)
        else:
            from . import cuda

            launches = cuda.verify(e, a, ov, lv, kind, placement)
            launches()
            if replayable:
                arrays = [expected.records, expected.out_of_range_count, actual.records, actual.out_of_range_count, out,
                          *log.arrays().values()]
                _LAST_CALL.put(objects, (type(kernel_kind), kernel_kind), arrays, launches)
    if strict:
        codes = to_numpy(out)[:n]
        bad = np.flatnonzero(codes != 0)
        if bad.size:
            from .format import DigestVerdict

            fail(ValueError, f"strict: {bad.size} of {n} digests did not match; first: request {int(bad[0])} "
                             f"{DigestVerdict(int(codes[bad[0]])).name}")
    return out


@public_api
def restamp(canary: Array, table: Any, req_pool_indices: Array | None, starts: Array, ends: Array, tokens: Array, *,
            log: ViolationLog, seam: Array | None = None, kv_token_id_vs_position_offset: int = 0,
            kernel_kind: int = DigestLaunchTag.RELOAD, real_kv_sources: Sequence[Any] = (),
            real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE) -> int:
    """Write canary records for received or reloaded positions, chained from the seam, with
    ``real_kv_hash`` fingerprinted from the *local* KV (``real_kv_sources``).

    For each request, positions ``[starts[b], ends[b])`` get ``(tokens[row, p + offset], p,
    chain, real_kv)`` through :func:`write` (the one write path), chained from the record of the
    seam slot: ``seam[b]`` (-1: the anchor), by default the slot of position ``start - 1``
    through ``table`` (the anchor at 0).  Run it after :func:`verify_digest` said MATCH; the
    transfer's digest, not ``real_kv_hash`` (layout-dependent), covers the hop itself.

    Eager only: it reads the ranges on the host (a sync) and allocates; refused while capturing.

    Parameters
    ----------
    canary : array
        The receiver's canary buffer (int64 ``[num_slots, 4]``).
    table : ReqToToken, BlockTable, PagedKvIndices or int32 array
        The receiver's table.
    req_pool_indices : int64 array [bs], or None
        Table rows (None with PagedKvIndices).
    starts, ends : int64 arrays [bs]
        The positions received.
    tokens : int32 or int64 array [rows, C]
        The token pool (``tokens[row, p + offset]`` is position p's token).
    log : ViolationLog
        Takes the write's rows and counters (chain-position assert).
    seam : int64 array [bs], optional
        The slot whose record precedes ``start``; -1: the anchor.
    kv_token_id_vs_position_offset : int
        As in :class:`DigestSpec`.
    kernel_kind : int
        The launch tag of the write's rows and counters.
    real_kv_sources, real_kv_hash_mode
        As :func:`write` takes them.

    Returns
    -------
    int
        Positions that could not be stamped (no slot through the table, no token in the pool).

    Raises
    ------
    TypeError, ValueError
        A bad argument, or a call while capturing.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(8), kc.ViolationLog.allocate(4, num_kinds=kc.DIGEST_NUM_KINDS)
    >>> rtt = np.array([[0, 0, 0], [5, 2, 6]], np.int32)
    >>> kc.restamp(canary, rtt, np.array([1]), np.array([0]), np.array([3]), np.array([[0] * 3, [7, 8, 9]]), log=log)
    0
    >>> canary[[5, 2, 6], 0].tolist()
    [7, 8, 9]
    """
    from ..ops import write

    for key, arr in (("canary", canary), ("starts", starts), ("ends", ends), ("tokens", tokens)):
        require(arr, key)
    table = as_table(table)
    named = {"canary": canary, "req_pool_indices": req_pool_indices, "starts": starts, "ends": ends, "tokens": tokens,
             "seam": seam, **table.arrays()}
    placement = common_placement(named)
    refuse_during_capture(placement, "restamp reads the ranges on the host and allocates", "call it outside the capture")
    offset = check_int(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    xp = array_module(placement)
    with launch_stream(placement):
        v = {k: backend_view(a, k) for k, a in named.items()}
        bs = v["starts"].shape[0]
        for key in ("starts", "ends", "req_pool_indices", "seam"):
            if v[key] is not None:
                check_1d(v[key], key, I64, bs, length_name="bs (len(starts))")
        if (table.kind == TableKind.PAGED_KV) != (req_pool_indices is None):
            fail(ValueError, "req_pool_indices must be None exactly with a PagedKvIndices table")
        if v["tokens"].ndim != 2 or v["tokens"].dtype not in (I32, I64):
            fail(ValueError, f"tokens must be an int32 or int64 2-D pool [rows, C], got {v['tokens'].dtype} {tuple(v['tokens'].shape)}")
        tv = table_view(table, v, bs, xp)
        host = {k: None if v[k] is None else to_numpy(v[k]).astype(np.int64) for k in ("starts", "ends", "req_pool_indices", "seam")}
        ids, positions, slots, seeds, offsets, missed = [], [], [], [], [0], 0
        for b in range(bs):
            rp = int(host["req_pool_indices"][b]) if host["req_pool_indices"] is not None else b
            ok, base, length = reference._row_ok(tv, rp, b)
            start, end = int(host["starts"][b]), int(host["ends"][b])
            if not (ok and 0 <= start <= end <= length):
                missed += max(end - start, 0)
                offsets.append(offsets[-1])
                seeds.append(-1)
                continue
            pos = xp.arange(start, end, dtype=xp.int64)
            slot = reference.resolve_slots(tv, base, pos)
            idx = pos + offset
            pool = v["tokens"]
            known = (idx >= 0) & (idx < pool.shape[1]) & (0 <= rp < pool.shape[0])
            tok = pool[min(max(rp, 0), pool.shape[0] - 1), xp.where(known, idx, 0)].astype(xp.int64)
            slot = xp.where(known, slot, -1)
            missed += int(xp.count_nonzero(slot < 0))
            ids.append(tok)
            positions.append(pos)
            slots.append(slot)
            if host["seam"] is not None:
                seeds.append(int(host["seam"][b]))
            else:
                seeds.append(-1 if start == 0 else int(reference.resolve_slots(tv, base, xp.asarray([start - 1]))[0]))
            offsets.append(offsets[-1] + end - start)
        cat = (lambda parts: xp.concatenate(parts) if parts else xp.zeros(0, xp.int64))
        wp = WritePlan.allocate(bs, like=canary)
        wv = {k: backend_view(getattr(wp, k), k, writable=True) for k in ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")}
        wv["write_offsets"][: bs + 1] = xp.asarray(np.array(offsets, np.int64))
        wv["write_seed_slot_indices"][:bs] = xp.asarray(np.array(seeds, np.int64))
        wv["write_num_valid_reqs"][0] = bs
        flat = [cat(ids), cat(positions), cat(slots)]
    write(canary, wp, *[_like(x, canary) for x in flat], log=log, kernel_kind=kernel_kind,
          real_kv_sources=real_kv_sources, real_kv_hash_mode=real_kv_hash_mode)
    return missed


def _like(view, like):
    """A backend view handed back in the caller's framework (torch tensors stay torch)."""
    from ..interop import is_torch_tensor

    if is_torch_tensor(like):
        import torch

        return torch.from_dlpack(view)
    return view
