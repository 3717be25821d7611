"""plan and plan_and_verify: a step's plan (and its verify fused in), from any engine table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import strict as strict_checks
from ..args import PlanArgs, PlanOutputs, PlanVerifyArgs, VERIFY_ENTRY_FIELDS, VerifyArgs
from ..backends import get_backend
from ..binding import check_type, lut_view, log_views, plan_views, record_arrays, targets, verify_setup
from ..constants import RealKvHashMode
from ..errors import fail, public_api
from ..interop import Array, array_module, backend_view, common_placement
from ..log import ViolationLog
from ..plans import RealKvSource, VerifyPlan, WritePlan, is_clean, mark_clean, scan_state
from ..runtime import launch_stream, refuse_during_capture
from ..tables import ReqToToken, TableKind, as_table, table_view
from ..validation import (I32, I64, bool_keyword, check_1d, check_2d_rows, check_count, check_int64, contiguous_input,
                          require)
from .plan_cache import note_overflow, packed_plan, plan_memo_args, remember_plan, remembered_plan, replan, replay_plan


class _PlanCall(NamedTuple):
    """A plan's arguments after the checks that need no view."""

    table: object  # ReqToToken, BlockTable or PagedKvIndices
    batch_rows: bool  # the table's rows are the batch rows (PagedKvIndices)
    window: int
    offset: int
    verify_capacity: int
    named: dict  # every input array by argument name (None where not given)


def _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
               full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
               kv_token_id_vs_position_offset, out, op: str) -> _PlanCall:
    """The checks of plan (and plan_and_verify, named ``op`` in messages) that need no view."""
    require(prefix_lens, "prefix_lens")
    require(extend_seq_lens, "extend_seq_lens")
    table = as_table(table)
    batch_rows = table.kind == TableKind.PAGED_KV  # the table's rows are the batch rows
    if batch_rows and req_pool_indices is not None:
        fail(ValueError, "req_pool_indices must be None with a PagedKvIndices table: its rows are the batch rows "
                         "(request r owns kv_indices[kv_indptr[r]:kv_indptr[r+1]])")
    if not batch_rows and req_pool_indices is None:
        fail(ValueError, f"req_pool_indices is required with a {type(table).__name__} table (only a PagedKvIndices "
                         "table, whose rows are the batch rows, takes None)")
    window = check_int64(swa_window_size, "swa_window_size", minimum=0)
    lut = full_to_swa_index_mapping
    if window > 0 and lut is None and isinstance(table, ReqToToken):
        fail(ValueError, f"{op} requires full_to_swa_index_mapping when swa_window_size > 0; pass the full->SWA slot LUT (int64)")
    pool, lens = req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens
    if pool is not None and lens is None:
        fail(ValueError, f"{op} requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set")
    if pool is None and lens is not None:
        fail(ValueError, "req_to_verify_expected_tokens_valid_lens was given without req_to_verify_expected_tokens; pass both or neither")
    offset = check_int64(kv_token_id_vs_position_offset, "kv_token_id_vs_position_offset")
    vcap = check_count(verify_capacity, "verify_capacity")
    named = {
        "req_pool_indices": req_pool_indices,
        "prefix_lens": prefix_lens,
        "extend_seq_lens": extend_seq_lens,
        **table.arrays(),
        "full_to_swa_index_mapping": lut,
        "req_to_verify_expected_tokens": pool,
        "req_to_verify_expected_tokens_valid_lens": lens,
    }
    if out is not None:
        if not (isinstance(out, tuple) and len(out) == 2):
            fail(TypeError, f"out must be a (VerifyPlan, WritePlan) tuple, got {type(out).__name__}")
        check_type(out[0], "out[0]", VerifyPlan)
        check_type(out[1], "out[1]", WritePlan)
        named.update(record_arrays("out[0]", out[0]))
        named.update(record_arrays("out[1]", out[1]))
    return _PlanCall(table, batch_rows, window, offset, vcap, named)


def _plan_args(c: _PlanCall, write_req_capacity, out, placement, xp, entry_capacity, op: str, why_entries: str = "") -> tuple:
    """``(PlanArgs, VerifyPlan, WritePlan)``, every view checked; inside ``launch_stream(placement)``.

    ``entry_capacity(bs)`` is the number of verify entries out[0] must hold (and an allocated
    VerifyPlan gets); None: any (plan_and_verify stores none), and one of capacity 0 is allocated.
    ``why_entries`` ends the message of a mismatch.
    """
    named, table = c.named, c.table
    v = {k: backend_view(a, k) for k, a in named.items() if not k.startswith("out")}
    first = "prefix_lens" if c.batch_rows else "req_pool_indices"
    bs = v[first].shape[0] if v[first].ndim == 1 else -1
    for key in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        if v[key] is not None:
            check_1d(v[key], key, I64, bs, length_name=f"bs (len({first}))")
            v[key] = contiguous_input(v[key], key, xp)
    tv = table_view(table, v, bs, xp)
    if v["full_to_swa_index_mapping"] is not None:
        v["full_to_swa_index_mapping"] = lut_view(v["full_to_swa_index_mapping"], xp)
    if v["req_to_verify_expected_tokens"] is not None:
        check_2d_rows(v["req_to_verify_expected_tokens"], "req_to_verify_expected_tokens", I32)
        if v["req_to_verify_expected_tokens"].shape[0] < tv.pool_rows:
            fail(ValueError, f"req_to_verify_expected_tokens must have at least {tv.pool_rows_why}, got {v['req_to_verify_expected_tokens'].shape[0]}")
        key = "req_to_verify_expected_tokens_valid_lens"
        check_1d(v[key], key, I64, bs, length_name=f"bs (len({first}))")
        v[key] = contiguous_input(v[key], key, xp)

    entries = entry_capacity(bs)
    if out is None:
        wcap = bs if write_req_capacity is None else check_count(write_req_capacity, "write_req_capacity")
    else:
        wcap = out[1].capacity if write_req_capacity is None else check_count(write_req_capacity, "write_req_capacity")
        if entries is not None and out[0].capacity != entries:
            fail(ValueError, f"{op} verify_capacity={entries} does not match out[0].verify_slot_indices.shape[0]={out[0].capacity}"
                             + why_entries)
        if out[1].capacity != wcap:
            fail(ValueError, f"{op} write_req_capacity={wcap} does not match out[1].write_seed_slot_indices.shape[0]={out[1].capacity}")
    if bs > wcap:
        fail(ValueError, f"bs={bs} exceeds write_req_capacity={wcap}; size the WritePlan for the largest batch "
                         "(CanaryCapacities.from_engine(max_running_requests=...) for a CanaryPlanner)")

    if out is None:
        refuse_during_capture(placement, f"{op} with out=None allocates its VerifyPlan and WritePlan",
                              "pass out=(VerifyPlan, WritePlan) allocated before capturing (a CanaryPlanner holds such a pair)")
        like = named[next(iter(table.arrays()))]
        vp, wp = VerifyPlan.allocate(entries or 0, like=like), WritePlan.allocate(wcap, like=like)
    else:
        vp, wp = out
    ov = plan_views("out[0]", vp, writable=True) | plan_views("out[1]", wp, wcap, writable=True)
    args = PlanArgs(
        req_pool_indices=v["req_pool_indices"],
        prefix_lens=v["prefix_lens"],
        extend_seq_lens=v["extend_seq_lens"],
        table=tv,
        swa_window_size=c.window,
        swa_lut=v["full_to_swa_index_mapping"],
        expected_token_pool=v["req_to_verify_expected_tokens"],
        expected_token_valid_lens=v["req_to_verify_expected_tokens_valid_lens"],
        token_offset=c.offset,
        clear_whole_capacity=not is_clean(wp),
        out=PlanOutputs(**ov),
        scan_state=backend_view(scan_state(wp), "out[1]'s scan state", writable=True),
    )
    return args, vp, wp


@public_api
def plan(
    req_pool_indices: Array | None,
    prefix_lens: Array,
    extend_seq_lens: Array,
    table: Any,
    *,
    verify_capacity: int,
    write_req_capacity: int | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Array | None = None,
    req_to_verify_expected_tokens: Array | None = None,
    req_to_verify_expected_tokens_valid_lens: Array | None = None,
    kv_token_id_vs_position_offset: int = 0,
    out: tuple[VerifyPlan, WritePlan] | None = None,
    strict: bool = False,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step: the verify entries of every slot the step reads and the write metadata.

    Request r reads positions ``[0, prefix_lens[r])`` (a sliding window's last
    ``swa_window_size`` of them): each becomes one verify entry (its slot, expected position,
    predecessor slot and expected token).  It writes ``extend_seq_lens[r]`` new tokens, chained
    from its seed (the slot of its last prefix token, or -1 = the chain anchor).  Out-of-range
    values (a pool row past the table, a prefix past the row, ...) are skipped and counted in the
    VerifyPlan's ``out_of_range_count``; nothing is read out of bounds.

    Parameters
    ----------
    req_pool_indices : int64 array [bs], or None
        Each batch row's row of ``table`` (in a ``req_to_token``, pool row 0 is a CUDA-graph
        padding request: nothing planned).  None with a :class:`PagedKvIndices` table, whose rows
        are the batch rows.
    prefix_lens : int64 array [bs]
        Tokens already cached per request: positions ``[0, prefix_lens[r])`` are read (verified).
    extend_seq_lens : int64 array [bs]
        New tokens per request this step: the write of request r covers the flat tokens
        ``[write_offsets[r], write_offsets[r+1])``, chained from its last prefix slot.
    table : ReqToToken, BlockTable, PagedKvIndices or int32 array [R, L]
        The engine's own slot table (a bare 2-D int32 array means ``ReqToToken(array)``).
    verify_capacity : int
        The most verify entries one step may plan, ``>= 0``.  A step with more skips its whole
        verify (``enable`` = 0), never part of it; :meth:`CanaryPlanner.verify_overflowed` says
        so.  ``CanaryCapacities.from_engine`` sizes it at 3 x the KV pool (radix sharing lets a
        batch's summed prefixes exceed the pool).
    write_req_capacity : int, optional
        The most requests one step may hold (the batch limit), ``>= 0``.  None: the batch size
        (``out=None``) or ``out[1]``'s capacity.
    swa_window_size : int
        0 for a full-attention group; ``> 0`` for a sliding-window group, which reads only
        positions ``[max(prefix - window, 0), prefix)`` and records SWA launch tags.
    full_to_swa_index_mapping : int64 array [lut_len >= 1], optional
        The full -> SWA slot LUT applied to the table's slots; required when
        ``swa_window_size > 0`` with a :class:`ReqToToken` table.  Values past the end clamp to
        the last entry (counted as out of range).
    req_to_verify_expected_tokens : int32 array [>= R, C], optional
        The expected-token pool: the token each pool row (each batch row with a
        :class:`PagedKvIndices`) must hold at each position (see :func:`scatter_req_token_ids`).
        Planned into ``verify_expected_tokens``; -1 where there is no truth.
    req_to_verify_expected_tokens_valid_lens : int64 array [bs], optional
        How many positions of each batch row's pool row are valid; given if and only if the
        pool is.
    kv_token_id_vs_position_offset : int
        Position ``p``'s expected token is the pool's column ``p + offset``.
    out : (VerifyPlan, WritePlan), optional
        Plans to fill in place (capacities ``verify_capacity`` and ``write_req_capacity``), as a
        :class:`CanaryPlanner` holds; required inside a CUDA graph capture.  None allocates new
        ones in the framework and on the device of ``table``.
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.

    Returns
    -------
    (VerifyPlan, WritePlan)
        ``out`` when given.  The VerifyPlan's first ``verify_num_valid`` entries are valid (the
        rest unspecified); the WritePlan holds -1 / 0 past the batch.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.
        ``bs > write_req_capacity`` is one of them.

    Examples
    --------
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)  # pool row r: slots 16r ... 16r+15
    >>> vp, wp = kc.plan(np.array([2]), np.array([7]), np.array([1]), req_to_token, verify_capacity=32)
    >>> int(vp.verify_num_valid[0]), vp.verify_slot_indices[:3].tolist(), wp.write_seed_slot_indices.tolist()
    (7, [32, 33, 34], [38])
    """
    memo_args = plan_memo_args((req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity,
                                write_req_capacity, swa_window_size, full_to_swa_index_mapping,
                                req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                                kv_token_id_vs_position_offset), out, strict)
    if memo_args is not None and replay_plan(memo_args, out):  # the last call's arguments, unchanged: its launches
        return out
    step = {"req_pool_indices": req_pool_indices, "prefix_lens": prefix_lens, "extend_seq_lens": extend_seq_lens,
            "req_to_verify_expected_tokens_valid_lens": req_to_verify_expected_tokens_valid_lens}
    call, placement = remembered_plan(table, out, step, verify_capacity, write_req_capacity, swa_window_size,
                                      full_to_swa_index_mapping, req_to_verify_expected_tokens,
                                      kv_token_id_vs_position_offset)
    if placement is None:  # first sight, a change, or per-step arrays the full checks must report on
        c = _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
                       full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                       kv_token_id_vs_position_offset, out, "plan")
        placement = common_placement(c.named)
    with launch_stream(placement):
        if call.hit is None:
            args, vp, wp = _plan_args(c, write_req_capacity, out, placement, array_module(placement),
                                      lambda bs: c.verify_capacity, "plan")
            remember_plan(call, c.named, step, args, c.verify_capacity)
        else:
            vp, wp = out
            args = replan(call.hit[1], step, wp, array_module(placement))
        if strict:
            strict_checks.check_plan(args)
        capacity = c.verify_capacity if call.hit is None else call.hit[2]
        if not packed_plan(memo_args, placement, args, capacity):
            get_backend(placement.backend).plan(args)
        mark_clean(wp)
        note_overflow(vp, args.out.enable, placement, capacity)
    return vp, wp


@public_api
def plan_and_verify(
    req_pool_indices: Array | None,
    prefix_lens: Array,
    extend_seq_lens: Array,
    table: Any,
    canary_buf: Array,
    *,
    log: ViolationLog,
    verify_capacity: int,
    write_req_capacity: int | None = None,
    kernel_kind: int = 0,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    check_expected_tokens: bool = False,
    check_expected_token: bool | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Array | None = None,
    req_to_verify_expected_tokens: Array | None = None,
    req_to_verify_expected_tokens_valid_lens: Array | None = None,
    kv_token_id_vs_position_offset: int = 0,
    out: tuple[VerifyPlan, WritePlan] | None = None,
    strict: bool = False,
    check_holes: bool = False,
) -> tuple[VerifyPlan, WritePlan]:
    """Plan one step and verify the slots it reads, in one launch: the fused decode step.

    Equals ``vp, wp = plan(...); verify(canary_buf, vp, ...)`` with the same arguments in every
    observable byte (the WritePlan, the VerifyPlan's ``verify_num_valid``, ``enable`` and
    ``out_of_range_count``, the log's ring rows as a multiset and its counters), except that the
    verify entries are checked as they are planned and never stored: out[0]'s entry arrays are
    left as they are, so out[0] may be a ``VerifyPlan.allocate(0)``.  More than
    ``verify_capacity`` entries skip the verify (``enable`` = 0), as in :func:`plan`.  A GPU batch
    of more than 4,096 requests (two plan launches) takes plan + verify through
    out[0]'s arrays, which must then hold ``verify_capacity`` entries.  One canary buffer.

    Parameters
    ----------
    req_pool_indices : int64 array [bs], or None
        Each batch row's row of ``table`` (in a ``req_to_token``, pool row 0 is a CUDA-graph
        padding request: nothing planned).  None with a :class:`PagedKvIndices` table, whose rows
        are the batch rows.
    prefix_lens : int64 array [bs]
        Tokens already cached per request: positions ``[0, prefix_lens[r])`` are read (verified).
    extend_seq_lens : int64 array [bs]
        New tokens per request this step: the write of request r covers the flat tokens
        ``[write_offsets[r], write_offsets[r+1])``, chained from its last prefix slot.
    table : ReqToToken, BlockTable, PagedKvIndices or int32 array [R, L]
        The engine's own slot table (a bare 2-D int32 array means ``ReqToToken(array)``).
    canary_buf : array
        One canary buffer: int64 ``[num_slots, 4]`` or uint8 ``[num_slots, S]`` (as :func:`verify`).
    log, kernel_kind, real_kv_sources, real_kv_hash_mode, check_expected_tokens, check_expected_token, check_holes
        As for :func:`verify` (one buffer: one kind, one tuple of sources).
    verify_capacity : int
        The most verify entries one step may plan, ``>= 0``.  A step with more skips its whole
        verify (``enable`` = 0), never part of it; :meth:`CanaryPlanner.verify_overflowed` says
        so.  ``CanaryCapacities.from_engine`` sizes it at 3 x the KV pool (radix sharing lets a
        batch's summed prefixes exceed the pool).
    write_req_capacity : int, optional
        The most requests one step may hold (the batch limit), ``>= 0``.  None: the batch size
        (``out=None``) or ``out[1]``'s capacity.
    swa_window_size : int
        0 for a full-attention group; ``> 0`` for a sliding-window group, which reads only
        positions ``[max(prefix - window, 0), prefix)`` and records SWA launch tags.
    full_to_swa_index_mapping : int64 array [lut_len >= 1], optional
        The full -> SWA slot LUT applied to the table's slots; required when
        ``swa_window_size > 0`` with a :class:`ReqToToken` table.  Values past the end clamp to
        the last entry (counted as out of range).
    req_to_verify_expected_tokens : int32 array [>= R, C], optional
        The expected-token pool: the token each pool row (each batch row with a
        :class:`PagedKvIndices`) must hold at each position (see :func:`scatter_req_token_ids`).
        Planned into ``verify_expected_tokens``; -1 where there is no truth.
    req_to_verify_expected_tokens_valid_lens : int64 array [bs], optional
        How many positions of each batch row's pool row are valid; given if and only if the
        pool is.
    kv_token_id_vs_position_offset : int
        Position ``p``'s expected token is the pool's column ``p + offset``.
    out : (VerifyPlan, WritePlan), optional
        As for :func:`plan`; out[0] may have capacity 0 (its entries are not stored).
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.

    Returns
    -------
    (VerifyPlan, WritePlan)
        ``out`` when given; then :func:`write` with the WritePlan completes the step (stream
        order puts it after the verify's reads).

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan_and_verify(np.array([1]), np.array([0]), np.array([3]), req_to_token, canary,
    ...                             log=log, verify_capacity=0)
    >>> kc.write(canary, wp, np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]), log=log)
    """
    # both spellings as given: a replayed call is one whose checks (bool_keyword's too) passed with these values
    memo_args = plan_memo_args((req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity,
                                write_req_capacity, swa_window_size, full_to_swa_index_mapping,
                                req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                                kv_token_id_vs_position_offset, canary_buf, kernel_kind, real_kv_sources,
                                real_kv_hash_mode, check_expected_tokens, check_expected_token, check_holes, log),
                               out, strict)
    if memo_args is not None and replay_plan(memo_args, out, fused=True):  # the last call's arguments, unchanged: its launches
        return out
    check_expected_token = bool_keyword(check_expected_tokens, "check_expected_tokens", check_expected_token,
                                        "check_expected_token")
    c = _plan_call(req_pool_indices, prefix_lens, extend_seq_lens, table, verify_capacity, swa_window_size,
                   full_to_swa_index_mapping, req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                   kv_token_id_vs_position_offset, out, "plan_and_verify")
    if isinstance(canary_buf, (list, tuple)):
        fail(TypeError, "plan_and_verify verifies one canary buffer, got a sequence; verify several with kc.plan + kc.verify")
    placement, context, named = verify_setup(canary_buf, None, log, kernel_kind, real_kv_sources, real_kv_hash_mode,
                                              check_expected_token, c.named, check_holes)
    xp = array_module(placement)
    with launch_stream(placement):
        backend = get_backend(placement.backend)

        def entry_capacity(bs):  # only a GPU batch past one plan launch stores its entries
            return c.verify_capacity if backend.plan_verify_stores_entries(bs) else None

        args, vp, wp = _plan_args(c, write_req_capacity, out, placement, xp, entry_capacity, "plan_and_verify",
                                  "; a batch too large for one plan launch on this GPU takes plan + verify through "
                                  "out[0]'s entry arrays, which must hold verify_capacity entries")
        fused_verify = VerifyArgs(targets=targets(context.buffers, context.mode, written=False),
                                  **dict.fromkeys(VERIFY_ENTRY_FIELDS),
                                  verify_num_valid=args.out.verify_num_valid, enable=args.out.enable,
                                  check_expected_token=bool(check_expected_token), check_holes=bool(check_holes),
                                  real_kv_hash_mode=context.mode, log=log_views(log))
        if strict:
            strict_checks.check_plan(args, verify_capacity=c.verify_capacity)
        step_args = PlanVerifyArgs(args, fused_verify, c.verify_capacity)
        if not packed_plan(memo_args, placement, step_args, c.verify_capacity, fused=True):
            backend.plan_verify(step_args)
        mark_clean(wp)
    return vp, wp
