"""What a free plan remembers of its long-lived arguments (kvcanary_cupy.validation_cache), and a
remembered plan's per-step checks: the same checks, in the same order, as a plan's first call."""

from __future__ import annotations

from ..args import PlanArgs
from ..errors import fail
from ..interop import backend_view, common_placement
from ..plans import VerifyPlan, WritePlan, is_clean, scan_state
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
