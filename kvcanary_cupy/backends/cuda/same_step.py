"""The CUDA launches of :func:`kvcanary_cupy.resolve_same_step_reads` (kernels/same_step.cu)."""

from __future__ import annotations

import numpy as np

from .compile import get_function, kernel_name

THREADS = 256
MAX_BLOCKS = 1024  # grid-stride loops cover the rest


def _blocks(n: int) -> int:
    return max(1, min(MAX_BLOCKS, (n + THREADS - 1) // THREADS))


def resolve(v: dict, waves: int) -> None:
    """Four launches in the current stream (CuPy's): begin, mark, entries, seeds (``write_waves``)."""
    cap = v["write_waves"].shape[0]
    vcap = v["verify_slot_indices"].shape[0]
    args = (v["written_at"], v["write_waves"], v["counters"], v["verify_slot_indices"], v["verify_expected_tokens"],
            v["verify_expected_positions"], v["verify_prev_slot_indices"], v["verify_num_valid"], v["enable"],
            v["write_offsets"], v["write_seed_slot_indices"], v["write_num_valid_reqs"], v["input_ids"], v["positions"],
            v["out_cache_loc"], np.int64(v["written_at"].shape[0]), np.int64(waves), np.int64(cap), np.int64(vcap),
            np.int64(v["input_ids"].shape[0]))
    for name, blocks in (("same_step_begin", 1), ("same_step_mark", max(1, min(MAX_BLOCKS, cap))),
                         ("same_step_entries", _blocks(vcap)), ("same_step_seeds", _blocks(cap))):
        get_function("same_step", kernel_name(name))((blocks,), (THREADS,), args)
