"""A prefix cache's blocks as one sweep (:meth:`CanarySession.sweep_blocks`).

A paged engine's prefix cache knows its cached blocks, not sequences: vLLM keeps a hash map from
block hashes to blocks, and a block no running request holds belongs to no table row.  Each block
is swept from a ``(block, start position, predecessor slot)`` triple: its slots ``block *
block_size + j`` must hold positions ``start + j``, the first chained to ``predecessor`` (-1: the
chain anchor, a block at position 0) and each next one to the slot before it.  Each triple is one
"sequence" of the sweep (its verify entries ``[k * block_size, (k + 1) * block_size)``), so every
block is verified once per sweep and a violation's ``batch_rows`` are indices into the triples.
"""

from __future__ import annotations

import numpy as np

from ..errors import CanaryUsageError, fail
from ..interop import backend_view, placement_of
from ..runtime import launch_stream
from ..validation import I64, check_int


def sweep_blocks(session, blocks, start_positions, prev_slots, block_size, labels) -> None:
    """:meth:`CanarySession.sweep_blocks` (its docstring says what it does)."""
    session._refuse_in_policy("sweep_blocks")
    stream = session._launch_stream("sweep_blocks")
    if session._step_open:
        fail(CanaryUsageError, "sweep_blocks() between pre_forward() and end_step() would mix the sweep's violations "
                               "with the step's; call it after end_step()")
    size = check_int(block_size, "block_size", minimum=1)
    view = backend_view(blocks, "blocks")
    if view.ndim != 1:
        fail(ValueError, f"blocks must be 1-D, got shape {tuple(view.shape)}")
    n = view.shape[0]
    if labels is not None and len(labels) < n:
        fail(ValueError, f"labels must name every block: {n} blocks, got {len(labels)} labels")
    planner = session._sweep_planner_for(n)
    with launch_stream(placement_of(planner.verify_plan.enable, "verify_plan")):  # the stream the sweep's verify takes
        fill_block_entries(planner, view, backend_view(start_positions, "start_positions"),
                           backend_view(prev_slots, "prev_slots"), size)
    session._sweep_verify()
    with session._handling:
        session._stats["sweeps"] += 1
        session._stage("sweep", session._stats["steps"] - 1, session._sweep_stager, stream, labels=labels)


def fill_block_entries(planner, blocks, starts, prevs, block_size: int) -> int:
    """Fill ``planner``'s plans with the triples' entries (host arrays or the planner's device); returns
    the entries planned (0 and ``enable = 0`` when they pass ``verify_capacity``)."""
    vp, wp = planner.verify_plan, planner.write_plan
    view = {k: backend_view(getattr(vp, k), k, writable=True) for k in
            ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
             "verify_num_valid", "enable")}
    offsets, num_reqs = backend_view(wp.verify_offsets, "verify_offsets", writable=True), \
        backend_view(wp.write_num_valid_reqs, "write_num_valid_reqs", writable=True)
    xp = np if isinstance(view["enable"], np.ndarray) else __import__("cupy")
    n = blocks.shape[0]
    for name, x in (("start_positions", starts), ("prev_slots", prevs)):
        if x.shape != (n,):
            fail(ValueError, f"{name} must be [len(blocks)={n}], got shape {tuple(x.shape)}")
    total = n * block_size
    fits = total <= planner.capacities.verify_capacity
    if fits and total:
        k = xp.arange(total, dtype=I64) // block_size
        j = xp.arange(total, dtype=I64) % block_size
        b = xp.asarray(blocks, dtype=I64)[k]
        # Ids past int64 when multiplied stay out of range (negative or huge): verify skips and counts them.
        slot = xp.where((b < 0) | (b > np.iinfo(np.int64).max // block_size - 1), -1, b * block_size + j)
        view["verify_slot_indices"][:total] = slot
        view["verify_expected_positions"][:total] = xp.asarray(starts, dtype=I64)[k] + j
        view["verify_prev_slot_indices"][:total] = xp.where(j == 0, xp.asarray(prevs, dtype=I64)[k], slot - 1)
        view["verify_expected_tokens"][:total] = -1
    view["verify_num_valid"][0] = min(total, planner.capacities.verify_capacity)
    view["enable"][0] = 1 if fits else 0
    offsets[: n + 1] = xp.arange(n + 1, dtype=I64) * block_size
    num_reqs[0] = n
    return total if fits else 0
