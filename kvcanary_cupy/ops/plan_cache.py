"""What a free plan remembers of its long-lived arguments (kvcanary_cupy.validation_cache), a
remembered plan's per-step checks (the same checks, in the same order, as a plan's first call), its
last CUDA call replayed (kvcanary_cupy.last_call; plan_and_verify's too) and the overflow note every
GPU plan leaves."""

from __future__ import annotations

import warnings
from enum import Enum

import numpy as np

from ..args import PlanArgs
from ..errors import CanaryCapacityWarning, fail
from ..interop import backend_view, common_placement, import_cupy, is_torch_tensor
from ..last_call import LastOpCall, launch_packed, replay_allowed
from ..plans import VerifyPlan, WritePlan, is_clean, mark_clean, scan_state
from ..runtime import launch_stream, stream_is_capturing
from ..tables import BlockTable, PagedKvIndices, ReqToToken
from ..validation import I64, check_1d, contiguous_input
from ..validation_cache import CachedCall, Stamps, call_key


def remembered_plan(table, out, step: dict, *scalars) -> tuple:
    """``(the call's CachedCall, this call's placement)``; the placement None (and the call's
    ``hit`` None) where the full checks must run.  ``scalars``: verify_capacity, write_req_capacity,
    swa_window_size, full_to_swa_index_mapping, req_to_verify_expected_tokens,
    kv_token_id_vs_position_offset."""
    call = CachedCall()
    key = plan_key(call, table, out, *scalars)
    if key is None:  # out is no plan pair (or the call is never remembered): out[1] is no owner
        return call, None
    return call, call.recall(out[1], key, step, usable=step_complete(step, scalars[4] is not None))


def remember_plan(call: CachedCall, named: dict, step: dict, args: PlanArgs, verify_capacity: int) -> None:
    """Keep a checked plan's arguments on its WritePlan, with the placement of its long-lived arrays alone."""
    if call.key is not None:
        long_lived = common_placement({k: a for k, a in named.items() if k not in step})
        call.keep(long_lived, args, verify_capacity)


def plan_key(stamps: Stamps, table, out, *scalars):
    """The stamps of a free plan's long-lived arguments (table, LUT, expected-token pool, out plans,
    scalars), or None for a call not remembered: ``out=None`` (fresh plans each call) or a
    PagedKvIndices table (its checks depend on the batch size)."""
    if not (isinstance(out, tuple) and len(out) == 2 and type(out[0]) is VerifyPlan and type(out[1]) is WritePlan):
        return None
    if isinstance(table, PagedKvIndices):
        return None
    table_stamp = stamps.record(table) if isinstance(table, (ReqToToken, BlockTable)) else ("bare", stamps.value(table))
    return call_key(table_stamp, stamps.record(out[0]), stamps.record(out[1]), stamps.value(scan_state(out[1])),
                    *(stamps.value(v) for v in scalars))


def step_complete(step: dict, has_pool: bool) -> bool:
    """Whether this step's arrays can join a remembered plan; False where the full checks must
    run and report (a missing array, a pool without its lengths or the reverse)."""
    if any(step[k] is None for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")):
        return False
    return (step["req_to_verify_expected_tokens_valid_lens"] is None) != has_pool


def replan(args: PlanArgs, step: dict, wp: WritePlan, xp) -> PlanArgs:
    """A remembered plan's arguments with this step's arrays, checked as ``planning._plan_args`` checks them."""
    v = {k: backend_view(a, k) for k, a in step.items()}
    first = "req_pool_indices"
    bs = v[first].shape[0] if v[first].ndim == 1 else -1
    keys = ("req_pool_indices", "prefix_lens", "extend_seq_lens")
    if args.expected_token_pool is not None:
        keys += ("req_to_verify_expected_tokens_valid_lens",)
    for key in keys:
        check_1d(v[key], key, I64, bs, length_name=f"bs (len({first}))")
        v[key] = contiguous_input(v[key], key, xp)
    wcap = args.out.write_seed_slot_indices.shape[0]
    if bs > wcap:
        fail(ValueError, f"bs={bs} exceeds write_req_capacity={wcap}; size the WritePlan for the largest batch "
                         "(CanaryCapacities.from_engine(max_running_requests=...) for a CanaryPlanner)")
    return args._replace(req_pool_indices=v["req_pool_indices"], prefix_lens=v["prefix_lens"],
                         extend_seq_lens=v["extend_seq_lens"],
                         expected_token_valid_lens=v["req_to_verify_expected_tokens_valid_lens"],
                         clear_whole_capacity=not is_clean(wp))


# The last CUDA call of the free plan and of plan_and_verify, each replayed while the same
# arguments come back unchanged.
_PLAN, _PLAN_VERIFY = LastOpCall(), LastOpCall()


def plan_memo_args(arguments: tuple, out, strict: bool):
    """A free plan's argument tuple for its memo (``arguments``: plan's, in order, the table fourth,
    then plan_and_verify's own; the log last), or None: never replayed (strict,
    KVCANARY_FULL_VALIDATION=1, out no plan pair; a PagedKvIndices table is refused when
    remembered).  The WritePlan's scan state and cleanliness (which the launch's
    clear_whole_capacity reads) are part of it."""
    if not replay_allowed(strict) or type(out) is not tuple or len(out) != 2:
        return None
    vp, wp = out
    if type(vp) is not VerifyPlan or type(wp) is not WritePlan:
        return None
    state = wp.__dict__
    return (vp, wp, *arguments, state.get("_kvcanary_scan_state"), state.get("_kvcanary_clean", False))


def replay_plan(memo_args, out, fused: bool = False) -> bool:
    """Replay the memo's launches (plan's, or plan_and_verify's when ``fused``) if ``memo_args`` are
    its call's, then what every such call does after them (mark the WritePlan clean; the free plan's
    overflow note); False where the checked path must run."""
    hit = (_PLAN_VERIFY if fused else _PLAN).recall(memo_args)
    if hit is None:
        return False
    packed, placement, capacity, enable_address = hit
    if fused:  # plan_and_verify leaves no note: its launches read the stream themselves
        packed()
        out[1].__dict__["_kvcanary_clean"] = True  # mark_clean
        return True
    stream = packed.current_stream()
    if stream is None:  # another device is current: the launch stream's way
        with launch_stream(placement):
            packed()
            mark_clean(out[1])
            note_overflow(out[0], out[0].enable, placement, capacity, stacklevel=5)
        return True
    packed(stream)
    out[1].__dict__["_kvcanary_clean"] = True  # mark_clean
    _note_gpu_overflow(out[0], enable_address, stream, capacity, 5)
    return True


def packed_plan(memo_args, placement, args, capacity: int, fused: bool = False) -> bool:
    """On the GPU, launch a checked plan's kernels packed and remember them to be replayed (where
    every view it launches with is one of the caller's arrays: nothing copied); False: the usual
    launch.  ``args``: the PlanArgs, or with ``fused`` plan_and_verify's PlanVerifyArgs;
    ``capacity``: what the replay's overflow note names."""
    if memo_args is None or placement.backend != "cupy":
        return False
    launch, memo = ("plan_verify_launches", _PLAN_VERIFY) if fused else ("plan_launches", _PLAN)
    table = memo_args[5]
    records = (0, 1, 5) if isinstance(table, (ReqToToken, BlockTable)) else (0, 1)
    if fused:
        records += (len(memo_args) - 3,)  # the log, after it the scan state and cleanliness
    return launch_packed(memo, memo_args, placement, launch, args, records,
                         accept=lambda arrays: _views_of(args, {_address(x) for x in arrays}),
                         extra=(placement, capacity, _address(memo_args[0].enable)))


def _address(x) -> int:
    return x.data_ptr() if is_torch_tensor(x) else x.data.ptr


def _views_of(value, addresses: set) -> bool:
    """Whether every array in ``value`` (the plan's arguments, nested records) starts at one of ``addresses``."""
    if value is None or isinstance(value, (bool, int, float, str, np.integer, Enum)):
        return True
    if isinstance(value, tuple):  # PlanArgs, the table view, PlanOutputs: named tuples
        return all(_views_of(v, addresses) for v in value)
    return hasattr(value, "data") and getattr(value.data, "ptr", None) in addresses


def note_overflow(vp: VerifyPlan, enable, placement, verify_capacity: int, stacklevel: int = 4) -> None:
    """Warn once per VerifyPlan record when a free plan into it overflowed ``verify_capacity``.

    Host memory is read at once.  A GPU plan never syncs: an eager call queues a copy of ``enable``
    (a CuPy view or the caller's torch tensor) into pinned memory behind an event, which the next
    free plan into the same record reads if the event has completed.  Nothing is allocated or
    queued while capturing.  ``stacklevel``: the warning's, pointing at the caller of plan."""
    state = vp.__dict__
    if state.get("_kvcanary_overflow_warned"):
        return
    if placement.backend == "numpy":
        if int(enable[0]) == 0:
            _warn_overflow(state, verify_capacity, stacklevel + 1)
        return
    cupy = import_cupy()
    _note_gpu_overflow(vp, _address(enable), cupy.cuda.get_current_stream(), verify_capacity, stacklevel + 1)


def _note_gpu_overflow(vp: VerifyPlan, enable_address: int, stream, verify_capacity: int, stacklevel: int) -> None:
    """:func:`note_overflow` on the GPU, ``enable`` at ``enable_address``, on ``stream`` (the launch
    stream, a CuPy stream: torch's current one wrapped when the plan's arrays are torch tensors);
    ``stacklevel`` counted from here."""
    state = vp.__dict__
    if state.get("_kvcanary_overflow_warned") or stream_is_capturing(stream):  # a query would invalidate a capture
        return
    pending = state.get("_kvcanary_overflow_copy")
    if pending is not None and pending[1].done and int(pending[0][0]) == 0:
        _warn_overflow(state, verify_capacity, stacklevel + 1)
        return
    if pending is None:  # the pinned buffer, its event and what each copy needs, once per record
        import cupyx

        runtime = import_cupy().cuda.runtime
        host = cupyx.empty_pinned((1,), dtype=np.int32)
        pending = state["_kvcanary_overflow_copy"] = (host, import_cupy().cuda.Event(disable_timing=True),
                                                      host.ctypes.data, runtime.memcpyAsync, runtime.memcpyDeviceToHost)
    pending[3](pending[2], enable_address, 4, pending[4], stream.ptr)
    pending[1].record(stream)


def _warn_overflow(state: dict, verify_capacity: int, stacklevel: int) -> None:
    """The overflow warning, once per record; ``stacklevel`` counted from here."""
    state["_kvcanary_overflow_warned"] = True
    warnings.warn(f"kv-canary: a free plan overflowed verify_capacity={verify_capacity}: its verify is skipped "
                  "(enable == 0); WritePlan.verify_entries_needed() says how many entries it asked for",
                  CanaryCapacityWarning, stacklevel=stacklevel)  # the caller of plan, past public_api's wrapper
