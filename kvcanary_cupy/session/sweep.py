"""A session's sweep: verifying every slot of the cached sequences between steps, through plan
buffers of its own, staged like a step (and the argument helpers the session's calls share)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import CanaryUsageError, fail, public_api, trimmed_argument_error
from ..interop import Array, allocate
from ..launchers import VerifyLauncher
from ..planner import CanaryCapacities, CanaryPlanner


def _one_of(alias, value, alias_name: str, name: str):
    """An argument given under either of its two spellings (both: only if they are the same array)."""
    if alias is None:
        return value
    if value is not None and value is not alias:
        fail(ValueError, f"{alias_name} and {name} are two spellings of one argument; pass one")
    return alias


def _length(x, name: str) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        fail(TypeError, f"{name} must be a NumPy array, a CuPy array or a PyTorch tensor, got {type(x).__name__}")
    if len(shape) != 1:
        fail(ValueError, f"{name} must be 1-D, got shape {tuple(shape)}")
    return int(shape[0])


def _checked_labels(labels, n: int):
    """The labels of ``n`` batch rows (the first ``n`` of ``labels``) as a tuple (None: none given)."""
    if labels is None:
        return None
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__len__"):
        fail(TypeError, f"row_labels must be a sequence of int or str (one per batch row), got {type(labels).__name__}")
    if len(labels) < n:
        fail(ValueError, f"row_labels must name every batch row: {n} rows (len(prefix_lens)), got {len(labels)} labels")
    labels = tuple(labels[:n])
    if set(map(type, labels)) <= _PLAIN_LABELS:  # the common case, at C speed: one pass, no per-label Python
        return labels
    labels = tuple(x.item() if isinstance(x, np.generic) else x for x in labels)
    for x in labels:
        if isinstance(x, bool) or not isinstance(x, (int, str)):
            fail(TypeError, f"row_labels must be ints or strs, got {type(x).__name__} {x!r}")
    return labels


_PLAIN_LABELS = frozenset((int, str))


class SweepMixin:
    """The sweep half of :class:`~kvcanary_cupy.session.CanarySession`."""

    @public_api
    def sweep(self, req_pool_indices: Array | None, seq_lens: Array, table: Any, *, row_labels=None) -> None:
        """Verify (TAIL buffer, real KV, no token check) every slot of the given cached sequences.

        ``seq_lens`` (int64 ``[n]``, ``n <= max_batch_size``): sequence i covers positions ``[0,
        seq_lens[i])`` of table row ``req_pool_indices[i]`` (the window's end only, for SWA); ``table`` is anything :func:`plan` takes
        (``req_pool_indices`` None with a :class:`PagedKvIndices`).  Outside graphs, between
        ``end_step`` and the next ``pre_forward``; staged like a step and handled by the next
        ``end_step``/``check``.  A violation's ``batch_rows`` are indices into these sequences;
        ``row_labels`` (one per sequence, as :meth:`pre_forward`'s) name them in its ``readers``.
        """
        self._refuse_in_policy("sweep")
        stream = self._launch_stream("sweep")
        if self._step_open:
            fail(CanaryUsageError, "sweep() between pre_forward() and end_step() would mix the sweep's violations with the "
                               "step's; call it after end_step()")
        n = _length(seq_lens, "seq_lens")  # req_pool_indices is None with a PagedKvIndices table
        labels = _checked_labels(row_labels, n)
        planner = self._sweep_planner_for(n)
        renamed = None
        try:
            planner.plan(req_pool_indices, seq_lens, self._sweep_zeros[:n], table)
        except (TypeError, ValueError) as exc:  # the planner calls seq_lens prefix_lens: name the caller's
            message = str(exc).removeprefix("kv-canary: ")
            if trimmed_argument_error(exc) is None or "prefix_lens" not in message:
                raise
            renamed = type(exc), re.sub(r"\bprefix_lens\b", "seq_lens", message)
        if renamed is not None:
            fail(*renamed)  # outside the except block: no "during handling" chain
        self._sweep_verify()
        with self._handling:
            self._stats["sweeps"] += 1
            self._stage("sweep", self._stats["steps"] - 1, self._sweep_stager, stream, labels)


    @public_api
    def sweep_blocks(self, blocks: Array, start_positions: Array, prev_slots: Array, *, block_size: int,
                     labels=None) -> None:
        """Verify (TAIL buffer, real KV, no token check) each cached block from its triple.

        Block ``blocks[k]``'s slots ``blocks[k] * block_size + j`` must hold positions
        ``start_positions[k] + j``, the first chained to ``prev_slots[k]`` (-1: the chain anchor)
        and each next one to the slot before it (:mod:`kvcanary_cupy.session.blocks`).  Every block
        is verified once; ``labels[k]`` (e.g. its block id or hash) names the block in the
        violations' ``request_ids``.  Outside graphs, between ``end_step`` and the next
        ``pre_forward``; staged like a step; a sweep past ``verify_capacity`` is skipped and counted
        (``stats["verify_skipped_sweeps"]``).

        Parameters
        ----------
        blocks, start_positions, prev_slots : int64 arrays [n]
            The triples, on the session's device (NumPy arrays for a NumPy or CPU-torch session).
        block_size : int
            Slots per block, ``>= 1``.
        labels : sequence, optional
            A name per block.

        Examples
        --------
        >>> session = kc.CanarySession(16, max_batch_size=2, on_violation="ignore")
        >>> session.sweep_blocks(np.array([1, 2]), np.array([0, 4]), np.array([-1, 7]), block_size=4)
        >>> session.check(), session.stats["sweeps"], session.stats["violations"] > 0  # nothing was written there
        (0, 1, True)
        """
        from .blocks import sweep_blocks

        sweep_blocks(self, blocks, start_positions, prev_slots, block_size, labels)

    def _sweep_planner_for(self, bs: int) -> CanaryPlanner:
        """The sweep's own plan buffers, grown (to a power of two) when a sweep has more sequences."""
        planner = self._sweep_planner
        if planner is None or planner.capacities.write_req_capacity < bs:
            capacity = max(64, 1 << max(bs - 1, 0).bit_length())
            capacities = CanaryCapacities(self.planner.capacities.verify_capacity, capacity)
            grown = CanaryPlanner(capacities, like=self._like, **self._planner_options)
            if planner is not None:  # the out-of-range count carries on (on the device, in stream order)
                grown.verify_plan.out_of_range_count[...] = planner.verify_plan.out_of_range_count
            planner = self._sweep_planner = grown
            self._sweep_zeros = allocate((capacity,), np.int64, like=self._like, fill=0)
            self._sweep_stager = self._stager(planner)
            self._sweep_verify = VerifyLauncher(self.tail_canary, planner.verify_plan, log=self._group_logs["sweep"],
                                                kernel_kind=self.sweep_tag, check_holes=self.check_holes, **self._kv)
        return planner

