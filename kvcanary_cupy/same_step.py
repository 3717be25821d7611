"""Same-step reads: slots one request of a step reads while another request writes them.

An engine that matches prefix blocks when it schedules (vLLM's prefix cache) lets request B of a
step read, as its cached prefix, a block that request A of the same step writes in that very
forward (each layer writes its new KV before attention reads it).  A HEAD verify run before the
HEAD write would see every such read as a violation, and B's write would continue its chain from
a record A has not written yet.  :func:`resolve_same_step_reads`, run after the plan and before the
verify and write of the step, settles both, in the library and from the step's own write inputs:

- A verify entry is **verified as written** (its slot set to 0, the padding slot verify skips, and
  counted) when a token of this step writes its slot at the entry's expected position, with the
  entry's expected token (when the plan has one) and with the entry's predecessor slot as that
  token's chain predecessor (the token before it in its request, or the request's write seed).  B
  then reads exactly the record A writes; A's records are verified by later steps like any other.
  Any other entry on a slot written this step (another position, another predecessor, another
  token: a fault) stays and is verified before the write, so it is reported.
- A request whose write seed is a slot written this step is **deferred**: it is written by the
  wave after its seed's writer.  ``write_waves[r]`` is request ``r``'s wave; the step's write runs
  once per wave ``k`` with ``write_waves=..., wave=k`` (:meth:`SameStepReads.wave_options`), each
  launch writing only its wave's requests.  The seeds are never changed, so every seed value keeps
  SGLang's meaning (any negative one is an anchor).  A chain of deferrals deeper than the waves is
  written in the last wave and counted.

Every backend computes the same bytes: the NumPy code here is the reference and
``kernels/same_step.cu`` (launched by ``backends/cuda/same_step.py``) the CUDA one.  Cost: one pass over the step's tokens and one over its
verify entries; an owner search over the batch only for the entries and seeds that hit a slot
written this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import fail, public_api
from .interop import Array, allocate, backend_view, common_placement, to_numpy
from .runtime import launch_stream
from .plans import VerifyPlan, WritePlan
from .validation import I32, I64, check_count

#: Write launches a step takes by default: a deferral chain of this many requests (A writes B's
#: seed, B writes C's, ...) is written in order; a deeper one shares the last wave (counted).
SAME_STEP_WAVES = 3
#: ``counters``: the stamp of the last resolve, entries verified as written, requests deferred
#: deeper than the waves (written in the last wave, their chain possibly continued from a record
#: not written yet).
COUNTER_FIELDS = ("stamp", "verified_as_written", "deeper_than_waves")
_STAMP_SHIFT = 32  # written_at holds stamp << 32 | token index: the latest stamp wins, then the largest token


@dataclass(frozen=True)
class SameStepReads:
    """The scratch and the outputs of :func:`resolve_same_step_reads` for one canary pool.

    Attributes
    ----------
    written_at : int64 array [num_slots]
        Per slot, ``stamp << 32 | token`` of the latest token that wrote it in a resolved step.
    write_waves : int32 array [write_req_capacity]
        Each request's write wave in the step, ``0 <= wave < waves`` (-1 past the batch): the
        ``write_waves`` of :func:`write`.
    counters : int64 array [3]
        :data:`COUNTER_FIELDS`; the counts only grow.
    waves : int
        Write launches a step takes.
    """

    written_at: Array
    write_waves: Array
    counters: Array
    waves: int = SAME_STEP_WAVES

    @classmethod
    @public_api
    def allocate(cls, num_slots: int, write_req_capacity: int, *, waves: int = SAME_STEP_WAVES,
                 like: Array | None = None) -> "SameStepReads":
        """Zeroed buffers for a pool of ``num_slots`` slots and batches of ``write_req_capacity``.

        Parameters
        ----------
        num_slots : int
            The canary's slots (``written_at`` holds one mark each).
        write_req_capacity : int
            The step's WritePlan capacity.
        waves : int
            Write launches a step takes (:data:`SAME_STEP_WAVES`).
        like : array, optional
            Allocate in this array's framework and on its device; None: NumPy.
        """
        num_slots = check_count(num_slots, "num_slots", positive=True, maximum=2**62)
        cap = check_count(write_req_capacity, "write_req_capacity")
        waves = check_count(waves, "waves", positive=True, maximum=64)
        return cls(allocate((num_slots,), np.int64, like=like, fill=0),
                   allocate((cap,), np.int32, like=like, fill=-1),
                   allocate((len(COUNTER_FIELDS),), np.int64, like=like, fill=0), waves)

    def wave_options(self) -> tuple[dict, ...]:
        """The :func:`write` (or :class:`WriteLauncher`) keywords of each wave, in the order to
        write them: ``{"write_waves": self.write_waves, "wave": k}``, with the step's own WritePlan."""
        return tuple({"write_waves": self.write_waves, "wave": k} for k in range(self.waves))

    def counts(self) -> dict:
        """The counters by name (a host read: a sync on a GPU)."""
        return dict(zip(COUNTER_FIELDS, (int(x) for x in to_numpy(self.counters))))


@public_api
def resolve_same_step_reads(reads: SameStepReads, verify_plan: VerifyPlan, write_plan: WritePlan, input_ids: Array,
                            positions: Array, out_cache_loc: Array) -> None:
    """Verify as written the entries of ``verify_plan`` that read what this step writes, and fill the
    write waves' seeds (module docstring).  After :func:`plan`, before :func:`verify` / :func:`write`.

    Capture-safe (no allocation, no host read); changes ``verify_plan.verify_slot_indices`` (to 0
    for the entries verified as written) and ``reads``; ``write_plan`` is only read.

    Parameters
    ----------
    reads : SameStepReads
        Sized for the canary pool (``written_at``) and ``write_plan``'s capacity.
    verify_plan, write_plan : VerifyPlan, WritePlan
        The step's plan.
    input_ids, positions, out_cache_loc : int64 arrays [T]
        The step's write inputs, as for :func:`write`.

    Raises
    ------
    TypeError, ValueError
        A bad argument; the message names it.

    Examples
    --------
    Request 0 writes positions 0-3 into block 1; request 1, in the same step, reads them as its
    prefix and writes position 4 into block 2:

    >>> table = kc.BlockTable(np.array([[1, 0], [1, 2]], np.int32), 4)
    >>> vp, wp = kc.plan(np.arange(2), np.array([0, 4]), np.array([4, 1]), table, verify_capacity=8)
    >>> reads = kc.SameStepReads.allocate(12, 2)
    >>> kc.resolve_same_step_reads(reads, vp, wp, np.arange(5), np.arange(5), np.arange(4, 9))
    >>> vp.verify_slot_indices[:4].tolist(), reads.counts()["verified_as_written"]
    ([0, 0, 0, 0], 4)
    >>> reads.write_waves.tolist()  # request 1 continues from slot 7, which request 0 writes in wave 0
    [0, 1]
    """
    if not isinstance(reads, SameStepReads):
        fail(TypeError, f"reads must be a SameStepReads, got {type(reads).__name__}")
    named = {"written_at": reads.written_at, "write_waves": reads.write_waves, "counters": reads.counters,
             **{k: getattr(verify_plan, k) for k in ("verify_slot_indices", "verify_expected_tokens",
                                                      "verify_expected_positions", "verify_prev_slot_indices",
                                                      "verify_num_valid", "enable")},
             **{k: getattr(write_plan, k) for k in ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")},
             "input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc}
    placement = common_placement(named)
    written = ("written_at", "write_waves", "counters", "verify_slot_indices")
    waves = reads.waves
    if type(waves) is not int or not 1 <= waves <= 64:
        fail(ValueError, f"reads.waves must be an int in [1, 64], got {waves!r}")
    with launch_stream(placement):
        v = {k: backend_view(x, k, writable=k in written) for k, x in named.items()}
        tokens = v["input_ids"].shape[0]
        for k in ("input_ids", "positions", "out_cache_loc"):
            if v[k].ndim != 1 or v[k].dtype != I64 or v[k].shape[0] != tokens:
                fail(ValueError, f"{k} must be int64 [len(input_ids)={tokens}], got {v[k].dtype} {tuple(v[k].shape)}")
        if tokens >= 1 << _STAMP_SHIFT:
            fail(ValueError, f"resolve_same_step_reads takes fewer than 2**32 tokens a step, got {tokens}")
        cap = v["write_seed_slot_indices"].shape[0]
        ww = v["write_waves"]
        if ww.ndim != 1 or ww.dtype != I32 or ww.shape[0] != cap:
            fail(ValueError, f"reads.write_waves must be int32 [write_req_capacity={cap}], got {ww.dtype} {tuple(ww.shape)}")
        if placement.backend == "numpy":
            _resolve_numpy(v, waves)
        else:
            from .backends.cuda import same_step as cuda_same_step

            cuda_same_step.resolve(v, waves)


def _owners(i: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per token index: the largest request whose clamped range holds it (-1: none)."""
    if i.size == 0 or start.size == 0:
        return np.full(i.shape, -1, I64)
    if np.all(start[1:] >= end[:-1]):  # ranges in order, not overlapping (every engine's plan)
        r = np.searchsorted(start, i, side="right") - 1
        # Among empty ranges starting at the same token, the largest index is the one found.
        return np.where((r >= 0) & (i < end[np.maximum(r, 0)]), r, -1).astype(I64)
    out = np.full(i.shape, -1, I64)
    for lo in range(0, i.size, 4096):  # bounded memory for a malformed plan
        chunk = i[lo : lo + 4096]
        inside = (start[None, :] <= chunk[:, None]) & (chunk[:, None] < end[None, :])
        last = start.size - 1 - np.argmax(inside[:, ::-1], axis=1)
        out[lo : lo + 4096] = np.where(inside.any(axis=1), last, -1)
    return out


def _resolve_numpy(v: dict, waves: int) -> None:
    written_at, write_waves, counters = v["written_at"], v["write_waves"], v["counters"]
    num_slots = written_at.shape[0]
    cap = write_waves.shape[0]
    loc = v["out_cache_loc"]
    tokens = loc.shape[0]
    stamp = int(counters[0]) + 1
    counters[0] = stamp
    bs = min(max(int(v["write_num_valid_reqs"][0]), 0), cap)
    offsets = np.asarray(v["write_offsets"], I64)
    start = np.clip(offsets[:bs], 0, tokens)
    end = np.clip(offsets[1 : bs + 1], start, tokens)
    seeds = np.asarray(v["write_seed_slot_indices"][:bs], I64)

    # Mark every slot this step writes (the latest stamp wins, then the largest token index).
    lengths = end - start
    idx = np.repeat(start, lengths) + (np.arange(int(lengths.sum()), dtype=I64) - np.repeat(np.cumsum(lengths) - lengths, lengths))
    slot = loc[idx]
    ok = (slot > 0) & (slot < num_slots)
    np.maximum.at(written_at, slot[ok], (np.int64(stamp) << _STAMP_SHIFT) | idx[ok])

    def writer_token(s: np.ndarray) -> np.ndarray:
        """The token of this step that wrote slot ``s`` (-1: none)."""
        inside = (s > 0) & (s < num_slots)
        mark = written_at[np.where(inside, s, 0)]
        fresh = inside & ((mark >> _STAMP_SHIFT) == stamp)
        return np.where(fresh, mark & ((1 << _STAMP_SHIFT) - 1), -1)

    # Entries verified as written.
    if int(v["enable"][0]) != 0:
        slots = v["verify_slot_indices"]
        n = min(max(int(v["verify_num_valid"][0]), 0), slots.shape[0])
        i = writer_token(np.asarray(slots[:n], I64))
        e = np.nonzero(i >= 0)[0]
        i = i[e]
        w = _owners(i, start, end)
        has = w >= 0
        e, i, w = e[has], i[has], w[has]
        first = i == start[w]
        before = loc[np.maximum(i - 1, 0)]
        seed = seeds[w]
        pred = np.where(first, np.where(seed > 0, seed, -1), np.where(before > 0, before, -3))
        want_tok = np.asarray(v["verify_expected_tokens"][e], I64)
        match = ((v["positions"][i] == v["verify_expected_positions"][e])
                 & ((want_tok == -1) | (v["input_ids"][i] == want_tok))
                 & (np.asarray(v["verify_prev_slot_indices"][e], I64) == pred))
        slots[e[match]] = 0
        counters[1] += int(np.count_nonzero(match))

    # Write waves: a request waits for the request that writes its seed.
    def seed_writer(r: np.ndarray) -> np.ndarray:
        i = writer_token(seeds[r])
        w = _owners(np.maximum(i, 0), start, end)
        return np.where((i >= 0) & (w >= 0) & (w != r), w, -1)

    depth = np.zeros(bs, I64)
    cur = np.arange(bs, dtype=I64)
    live = np.ones(bs, bool)
    for _ in range(waves):
        nxt = seed_writer(cur)
        live &= nxt >= 0
        depth += live
        cur = np.where(live, nxt, cur)
    deeper = depth >= waves
    counters[2] += int(np.count_nonzero(deeper))
    depth = np.minimum(depth, waves - 1)
    write_waves[:bs] = depth
    write_waves[bs:] = -1
