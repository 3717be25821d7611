"""write and verify: the canary ops on canary buffers, through a WritePlan or a VerifyPlan."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import strict as strict_checks
from ..backends import get_backend
from ..binding import check_type, verify_args, verify_setup, write_bound_args, write_setup
from ..constants import RealKvHashMode
from ..errors import fail, public_api
from ..interop import Array, array_module, backend_view, common_placement
from ..last_call import LastOpCall, launch_packed, replay_allowed
from ..log import ViolationLog
from ..plans import VerifyPlan, WritePlan
from ..runtime import launch_stream, side_stream
from ..validation import I64, bool_keyword, check_1d, check_integer_dtype, contiguous_input, require
from ..validation_cache import CachedCall, Stamps, call_key

#: The per-token inputs of a write that may be int32 as well as int64 (each its own dtype).
TOKEN_INPUTS = ("input_ids", "positions", "out_cache_loc")

# Each op's last CUDA call, replayed while the same arguments come back unchanged (last_call.py).
_WRITE, _VERIFY = LastOpCall(), LastOpCall()


@public_api
def write(
    canary_buf: Array | Sequence[Array],
    write_plan: WritePlan,
    input_ids: Array,
    positions: Array,
    out_cache_loc: Array,
    *,
    log: ViolationLog,
    kernel_kind: int | Sequence[int] = 0,
    real_kv_sources: Sequence[Any] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    expected_input_tokens: Array | None = None,
    expected_input_positions: Array | None = None,
    chain_position_assert: bool = True,
    strict: bool = False,
    stream: Any = None,
    write_waves: Array | None = None,
    wave: int = 0,
) -> None:
    """Write fresh canary records for the step's new tokens, chained along each request.

    Slot ``out_cache_loc[i]`` gets ``(input_ids[i], positions[i], running_hash, real_kv_hash)``
    and the running hash of its request advances by :func:`mix3`.  A negative (or out-of-range)
    slot is skipped without advancing the chain.  Several buffers (``canary_buf`` a sequence) are
    written by one launch; each gets the bytes, rows and counters a call of its own would give it.

    Parameters
    ----------
    canary_buf : array or sequence of arrays
        The canary buffer: int64 ``[num_slots, 4]`` (:func:`allocate_canary_buffer`), or uint8
        ``[num_slots, S]`` with ``S >= 32`` and ``S % 8 == 0``; contiguous, 8-byte aligned.  Slot
        0 is the padding slot.  A sequence of up to ``MAX_CANARY_BUFFERS`` buffers of equal
        ``num_slots`` (the K and V halves, say) shares one launch; they must not overlap.
    write_plan : WritePlan
        The step's write metadata, from :func:`plan` (or a :class:`CanaryPlanner`).
    input_ids, positions, out_cache_loc : int64 or int32 arrays [T] (each its own)
        The step's new tokens, their positions and their KV slots, flat over the batch (request r
        owns ``[write_offsets[r], write_offsets[r+1])``; T may include padded tokens).
    log : ViolationLog
        Where violations go (its ring) and what is counted (its counters, per ``kernel_kind``).
    kernel_kind : int or CanaryLaunchTag, or a sequence of them
        The launch tag recorded in each violation row and counter index, ``0 <= kind <
        log.num_kinds``; one per buffer when ``canary_buf`` is a sequence.
    real_kv_sources : sequence of RealKvSource, or a sequence of such sequences
        Up to ``MAX_REAL_KV_SOURCES`` views of the live KV pools whose bytes are fingerprinted
        into ``real_kv_hash`` (one tuple per buffer when ``canary_buf`` is a sequence, or empty).
    real_kv_hash_mode : RealKvHashMode
        ``NONE`` (no fingerprint: 0), ``PARTIAL`` (the first 16 bytes of each slot) or ``ALL``
        (``read_bytes`` bytes of each slot).
    expected_input_tokens, expected_input_positions : int64 arrays [T], optional
        A second copy of the tokens and positions (given together): a written token or position
        that differs logs a ``WRITE_TOKEN_MISMATCH`` / ``WRITE_POSITION_MISMATCH`` row.
    chain_position_assert : bool
        Log a ``WRITE_POSITION_MISMATCH`` row where a seeded request's positions do not rise by 1.
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.
    stream : cupy.cuda.Stream or torch.cuda.Stream, optional
        Run the write there, after everything queued so far on the caller's current stream, so
        a long prefill chain overlaps what the caller queues next; call :func:`join_stream`
        before anything reads the canary buffers or the log, and keep the arguments alive and
        unchanged until then.  Capture-safe (join before the capture ends).  GPU only.
    write_waves : int32 array [write_req_capacity], optional
        Each request's write wave: a step written in several launches (``SameStepReads``) writes
        in each only the requests whose entry equals ``wave``; the others are skipped as if absent
        (nothing written or counted, their seeds unread).  None: every request.
    wave : int
        The wave this launch writes (non-negative; non-zero only with ``write_waves``).

    Returns
    -------
    None
        The buffers and ``log`` are written in place.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan(np.array([1]), np.array([0]), np.array([3]), req_to_token, verify_capacity=0)
    >>> kc.write(canary, wp, np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]), log=log)
    >>> canary[17, :2].tolist()  # (token, position)
    [6, 1]
    """
    memo_args = None
    if stream is None and replay_allowed(strict):  # a side stream forks per call: always checked
        memo_args = (write_plan, log, canary_buf, input_ids, positions, out_cache_loc, expected_input_tokens,
                     expected_input_positions, write_waves, chain_position_assert, kernel_kind, real_kv_sources,
                     real_kv_hash_mode, wave)
        replay = _WRITE.recall(memo_args)
        if replay is not None:  # the last call's arguments, unchanged: its checked launches
            replay()
            return
    for key, arr in (("input_ids", input_ids), ("positions", positions), ("out_cache_loc", out_cache_loc)):
        require(arr, key)
    if (expected_input_tokens is None) != (expected_input_positions is None):
        fail(ValueError, "expected_input_tokens and expected_input_positions enable the write-input assert together; pass both or neither")
    tokens = {
        "input_ids": input_ids,
        "positions": positions,
        "out_cache_loc": out_cache_loc,
        "expected_input_tokens": expected_input_tokens,
        "expected_input_positions": expected_input_positions,
    }
    call = CachedCall()
    key = call_key(*_long_lived_stamps(call, canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode),
                   call.record(write_plan), call.value(chain_position_assert), call.value(write_waves), call.value(wave))
    placement = call.recall(write_plan, key, tokens)
    if placement is None:  # first sight, a change, or tokens placed elsewhere: the full checks
        placement, context, named = write_setup(canary_buf, write_plan, log, kernel_kind, real_kv_sources,
                                                real_kv_hash_mode, chain_position_assert, tokens, write_waves, wave)
    xp = array_module(placement)

    with launch_stream(placement):
        if call.hit is None:
            args = write_bound_args(write_plan, log, chain_position_assert, context, xp, write_waves, wave)
            call.keep(common_placement(named), args)
        else:
            args = call.hit[1]
        views = {}
        for key, arr in tokens.items():
            if arr is not None:
                view = backend_view(arr, key)
                # the step's own tokens, positions and slots may be int32 (as transformers builds them): read as they are
                if key in TOKEN_INPUTS:
                    check_integer_dtype(view, key)
                dtype = view.dtype if key in TOKEN_INPUTS else I64
                check_1d(view, key, dtype, views["input_ids"].shape[0] if views else None, length_name="len(input_ids)")
                views[key] = view
        # On a side stream, strided inputs are copied there too: the copies' memory then returns to
        # the side stream's pool, so nothing queued on the caller's stream reuses it before the write.
        with side_stream(stream, placement):
            args = args._replace(**{key: contiguous_input(view, key, xp) for key, view in views.items()})
            if strict:
                strict_checks.check_write(args)
            if memo_args is None or not launch_packed(_WRITE, memo_args, placement, "write_launch", args):
                get_backend(placement.backend).write(args)


@public_api
def verify(
    canary_buf: Array | Sequence[Array],
    verify_plan: VerifyPlan,
    *,
    log: ViolationLog,
    kernel_kind: int | Sequence[int] = 0,
    real_kv_sources: Sequence[Any] = (),
    real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE,
    check_expected_tokens: bool = False,
    check_expected_token: bool | None = None,
    strict: bool = False,
    check_holes: bool = False,
) -> None:
    """Verify the canary records of every planned slot; violations go to ``log``'s ring.

    Each of the first ``verify_num_valid`` entries is checked: the stored position against the
    expected one, the stored prev_hash against :func:`mix3` of the predecessor's record (the
    anchor hash for a chain head; skipped when the predecessor is unknown), the real-KV
    fingerprint (with sources) and, with ``check_expected_tokens``, the stored token.  Each failing
    slot logs one row whose ``fail_reason_bits`` OR the :class:`FailReason` bits.  A plan that
    overflowed (``enable`` = 0) verifies nothing.

    Parameters
    ----------
    canary_buf : array or sequence of arrays
        The canary buffer: int64 ``[num_slots, 4]`` (:func:`allocate_canary_buffer`), or uint8
        ``[num_slots, S]`` with ``S >= 32`` and ``S % 8 == 0``; contiguous, 8-byte aligned.  Slot
        0 is the padding slot.  A sequence of up to ``MAX_CANARY_BUFFERS`` buffers of equal
        ``num_slots`` (the K and V halves, say) shares one launch; they must not overlap.
        The entries are read once for all of them.
    verify_plan : VerifyPlan
        The step's verify entries, from :func:`plan` (or a :class:`CanaryPlanner`).
    log : ViolationLog
        Where violations go (its ring) and what is counted (its counters, per ``kernel_kind``).
    kernel_kind : int or CanaryLaunchTag, or a sequence of them
        The launch tag recorded in each violation row and counter index, ``0 <= kind <
        log.num_kinds``; one per buffer when ``canary_buf`` is a sequence.
    real_kv_sources : sequence of RealKvSource, or a sequence of such sequences
        Up to ``MAX_REAL_KV_SOURCES`` views of the live KV pools whose bytes are fingerprinted
        into ``real_kv_hash`` (one tuple per buffer when ``canary_buf`` is a sequence, or empty).
    real_kv_hash_mode : RealKvHashMode
        ``NONE`` (no fingerprint: 0), ``PARTIAL`` (the first 16 bytes of each slot) or ``ALL``
        (``read_bytes`` bytes of each slot).
    check_expected_tokens : bool
        Also compare each stored token with the entry's expected token (where it is not -1),
        logging ``VERIFY_TOKEN_MISMATCH``.  Needs ``req_to_verify_expected_tokens`` at plan time.
    check_expected_token : bool, optional
        The older spelling of ``check_expected_tokens``, still accepted (pass one of them).
    strict : bool
        False: out-of-range values are skipped and counted (capture-safe, no sync).  True: they
        are first copied to the host (a device sync, not capture-safe) and the first one raises a
        ValueError naming the array, the row and the value.

    check_holes : bool
        False (SGLang's rule): an entry whose slot is the padding slot is skipped.  True: it is a
        hole (a position the step reads whose table entry is zeroed or the null block) and logs
        a ``VERIFY_TABLE_HOLE`` row (docs/format.md, sections 5 and 6).  Out-of-window positions of a
        sliding-window group are never planned, so they are never holes.

    Returns
    -------
    None
        ``log`` is written in place; read it with :meth:`ViolationLog.read`.

    Raises
    ------
    TypeError, ValueError
        A bad argument (dtype, shape, device, alignment, capacity, a missing pair), before
        anything is written; the message names the argument, what was expected and what came.

    Examples
    --------
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> req_to_token = np.arange(64, dtype=np.int32).reshape(4, 16)
    >>> vp, wp = kc.plan(np.array([1]), np.array([2]), np.array([0]), req_to_token, verify_capacity=8)
    >>> kc.verify(canary, vp, log=log)  # slots 16 and 17 were never written: two violations
    >>> log.read().total_violations
    2
    """
    memo_args = None
    if replay_allowed(strict):
        # both spellings as given: a replayed call is one whose checks (bool_keyword's too) passed with these values
        memo_args = (verify_plan, log, canary_buf, kernel_kind, real_kv_sources, real_kv_hash_mode,
                     check_expected_tokens, check_expected_token, check_holes)
        replay = _VERIFY.recall(memo_args)
        if replay is not None:  # the last call's arguments, unchanged: its checked launches
            replay()
            return
    check_type(verify_plan, "verify_plan", VerifyPlan)  # None would mean plan_and_verify's call below
    check_expected_token = bool_keyword(check_expected_tokens, "check_expected_tokens", check_expected_token,
                                        "check_expected_token")
    call = CachedCall()
    key = call_key(*_long_lived_stamps(call, canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode),
                   call.record(verify_plan), call.value(check_expected_token), call.value(check_holes))
    placement = call.recall(verify_plan, key)
    if placement is None:  # first sight or a change: the full checks
        placement, context, _ = verify_setup(canary_buf, verify_plan, log, kernel_kind, real_kv_sources,
                                             real_kv_hash_mode, check_expected_token, check_holes=check_holes)
    with launch_stream(placement):
        if call.hit is None:
            args = verify_args(verify_plan, log, check_expected_token, context, array_module(placement), check_holes)
            call.keep(placement, args)
        else:
            args = call.hit[1]
        if strict:
            strict_checks.check_verify(args)
        if memo_args is None or not launch_packed(_VERIFY, memo_args, placement, "verify_launch", args):
            get_backend(placement.backend).verify(args)


def _long_lived_stamps(stamps: Stamps, canary_buf, log, kernel_kind, real_kv_sources, real_kv_hash_mode) -> tuple:
    """The stamps of what write and verify share: the canary buffers, the log, the launch kinds,
    the real-KV sources (a call with sources is not remembered: they stamp as None) and the mode."""
    return (stamps.value(canary_buf), stamps.record(log), stamps.value(kernel_kind), stamps.value(real_kv_sources),
            stamps.value(real_kv_hash_mode))
