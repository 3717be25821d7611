"""Opt-in host-side value checks (``strict=True``): raise on the first out-of-range value.

They copy the inputs to the host, so they synchronise with the device and cannot run inside a
CUDA graph capture.  They test exactly the conditions the backends skip and count.
"""

from __future__ import annotations

import numpy as np

from .backends import PlanArgs, ScatterArgs, VerifyArgs, WriteArgs
from .backends.numpy_backend import plan_row_checks, scatter_row_checks, write_range_checks
from .errors import fail
from .interop import refuse_view_copy_during_capture, to_numpy


def _host(args):
    arrays = [x for x in args if hasattr(x, "shape")]
    if arrays:
        refuse_view_copy_during_capture(arrays[0], "strict=True copies the arguments to the host (a device sync)",
                                        "pass strict=False while capturing")
    return type(args)(*[to_numpy(x) if hasattr(x, "shape") else x for x in args])


def check_plan(a: PlanArgs) -> None:
    h = _host(a)
    rows, row_len = h.req_to_token.shape
    _, verify_len, _, seed_ok, errors = plan_row_checks(h)
    for r in np.nonzero(errors)[0]:
        rp, prefix, extend = int(h.req_pool_indices[r]), int(h.prefix_lens[r]), int(h.extend_seq_lens[r])
        if not 0 <= rp < rows:
            fail(ValueError, f"req_pool_indices[{r}] = {rp} is outside [0, {rows}) (req_to_token has {rows} rows)")
        if not 0 <= prefix <= row_len:
            fail(ValueError, f"prefix_lens[{r}] = {prefix} is outside [0, {row_len}] (req_to_token rows hold {row_len} positions)")
        if extend < 0:
            fail(ValueError, f"extend_seq_lens[{r}] = {extend} is negative")
        cols = h.expected_token_pool.shape[1]
        fail(ValueError, f"req_to_verify_expected_tokens_valid_lens[{r}] = {int(h.expected_token_valid_lens[r])} is outside [0, {cols}] (the pool rows hold {cols} tokens)")
    if h.swa_lut is None:
        return
    lut_len = h.swa_lut.shape[0]
    window = h.swa_window_size
    # verify entries are only translated when the plan fits verify_capacity (else only seeds are)
    entries = int(verify_len.sum()) <= h.out.verify_slot_indices.shape[0]
    for r in np.nonzero((verify_len > 0) & entries | seed_ok)[0]:
        rp, prefix = int(h.req_pool_indices[r]), int(h.prefix_lens[r])
        first = max(prefix - window, 0) if window > 0 else 0
        lo = max(first - 1, 0) if verify_len[r] and entries else prefix - 1
        values = h.req_to_token[rp, lo:prefix]
        bad = np.nonzero(values >= lut_len)[0]
        if bad.size:
            p = lo + int(bad[0])
            fail(ValueError, f"req_to_token[{rp}, {p}] = {int(values[bad[0]])} (batch row {r}) is outside full_to_swa_index_mapping of length {lut_len}")


def check_write(a: WriteArgs) -> None:
    h = _host(a)
    num_slots = h.canary.shape[0]
    cap = h.write_seed_slot_indices.shape[0]
    num_reqs = min(max(int(h.write_num_valid_reqs[0]), 0), cap)
    num_tokens = h.input_ids.shape[0]
    start, end, bad = write_range_checks(h.write_offsets, num_reqs, num_tokens)
    for r in np.nonzero(bad)[0]:
        fail(ValueError, f"write_plan.write_offsets[{r}:{r + 2}] = [{int(h.write_offsets[r])}, {int(h.write_offsets[r + 1])}] is not a range within the {num_tokens} tokens of input_ids")
    for r in range(num_reqs):
        seed = int(h.write_seed_slot_indices[r])
        if seed >= num_slots:
            fail(ValueError, f"write_plan.write_seed_slot_indices[{r}] = {seed} is outside canary_buf's {num_slots} slots")
        loc = h.out_cache_loc[start[r]:end[r]]
        over = np.nonzero(loc >= num_slots)[0]
        if over.size:
            i = int(start[r] + over[0])
            fail(ValueError, f"out_cache_loc[{i}] = {int(h.out_cache_loc[i])} is outside canary_buf's {num_slots} slots")


def check_verify(a: VerifyArgs) -> None:
    h = _host(a)
    if int(h.enable[0]) == 0:
        return
    num_slots = h.canary.shape[0]
    active = min(max(int(h.verify_num_valid[0]), 0), h.verify_slot_indices.shape[0])
    slots = h.verify_slot_indices[:active]
    bad = np.nonzero((slots < 0) | (slots >= num_slots))[0]
    if bad.size:
        e = int(bad[0])
        fail(ValueError, f"verify_plan.verify_slot_indices[{e}] = {int(slots[e])} is outside canary_buf's {num_slots} slots")
    prev = h.verify_prev_slot_indices[:active]
    bad = np.nonzero((prev >= num_slots) & (slots != 0))[0]
    if bad.size:
        e = int(bad[0])
        fail(ValueError, f"verify_plan.verify_prev_slot_indices[{e}] = {int(prev[e])} is outside canary_buf's {num_slots} slots")


def check_scatter(a: ScatterArgs) -> None:
    h = _host(a)
    rows = h.pool_out.shape[0]
    *_, bad = scatter_row_checks(h)
    for r in np.nonzero(bad)[0]:
        rp, lo, hi = int(h.req_pool_indices[r]), int(h.offsets[r]), int(h.offsets[r + 1])
        if not 0 <= rp < rows:
            fail(ValueError, f"req_pool_indices[{r}] = {rp} is outside [0, {rows}) (pool_out has {rows} rows)")
        fail(ValueError, f"offsets[{r}:{r + 2}] = [{lo}, {hi}] is not a range within the {h.flat_in.shape[0]} values of flat_in")
