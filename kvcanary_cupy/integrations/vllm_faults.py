"""Faults injected into vLLM's own data structures, each modelled on a class of reported vLLM bugs.

A fault arms itself on a running engine (:meth:`VllmFault.arm`) and fires once, at the first step
its trigger holds: right after the model runner committed the step's inputs (``_prepare_inputs``),
before attention reads them, or in the scheduler (the prefix cache's hash map).  It records the
step it fired in, the requests it hurts (``victims``) and the KV slots it touched.  Nothing is
undone: the episode ends with the ``generate`` call and the next one starts from a reset prefix
cache.
"""

from __future__ import annotations

import random

import torch


class VllmFault:
    """One fault class.  Subclasses set ``name``, ``description``, ``bug_class`` and implement
    :meth:`on_inputs` (the runner's committed inputs) or :meth:`on_lookup` (a prefix-cache lookup)."""

    name = description = bug_class = ""
    detectable = True
    why_not_detectable = None

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.fired_step: int | None = None
        self.victims: set = set()
        self.slots: set = set()

    # the runner's view of the step, for subclasses
    def rows(self, runner):
        ib = runner.input_batch
        n = ib.num_reqs
        return ib, n, ib.block_table[0].block_table.cpu, ib.block_table[0].block_size

    def block_slots(self, block: int, size: int) -> set:
        return set(range(block * size, (block + 1) * size))

    def readers(self, runner, block: int) -> set:
        """Requests whose cached prefix holds ``block`` this step."""
        ib, n, table, size = self.rows(runner)
        out = set()
        for r in range(n):
            columns = int(ib.num_computed_tokens_cpu[r]) // size
            if block in table[r, :columns].tolist():
                out.add(ib.req_ids[r])
        return out

    def fired(self, slots: set, victims: set) -> bool:
        """Record the KV slots the fault touched and the requests it hurt; True, which
        :meth:`on_inputs` / :meth:`on_lookup` return when they fired."""
        self.slots |= slots
        self.victims |= victims
        return True

    def on_inputs(self, runner, step: int) -> bool:
        """Fire on the step's committed inputs if the trigger holds; True when fired."""
        return False

    def on_lookup(self, manager, request) -> bool:
        return False


def _prefix_rows(ib, n, size, min_blocks=1):
    return [r for r in range(n) if int(ib.num_computed_tokens_cpu[r]) >= min_blocks * size]


class StaleBlockTableEntry(VllmFault):
    name = "stale_block_table_entry"
    description = "a request's block-table entry points at a block it no longer owns"
    bug_class = "block table not refreshed after a block was freed and reallocated (preemption, recompute)"

    def on_inputs(self, runner, step):
        ib, n, table, size = self.rows(runner)
        rows = _prefix_rows(ib, n, size)
        used = set(table[:n].flatten().tolist())
        free = [b for b in range(1, runner.kv_cache_config.num_blocks) if b not in used]
        if not rows or not free:
            return False
        r, stale = self.rng.choice(rows), self.rng.choice(free)
        slots = self.block_slots(int(table[r, 0]), size) | self.block_slots(stale, size)  # before the entry changes
        table[r, 0] = stale
        return self.fired(slots, {ib.req_ids[r]})


class SlotMappingOffByOne(VllmFault):
    name = "slot_mapping_off_by_one"
    description = "one request's new tokens are stored one KV slot past where its block table says"
    bug_class = "slot mapping computed with a wrong offset (chunked prefill / prefix-cache boundaries)"

    def on_inputs(self, runner, step):
        ib, n, table, size = self.rows(runner)
        qsl = runner.query_start_loc.np[: n + 1]
        rows = [r for r in range(n) if qsl[r + 1] > qsl[r]]
        if step < 2 or not rows:  # a request that keeps decoding reads its shifted tokens back
            return False
        r = self.rng.choice(rows)
        mapping = ib.block_table[0].slot_mapping.cpu
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        slots = set(mapping[lo:hi].tolist()) | {s + 1 for s in mapping[lo:hi].tolist()}
        mapping[lo:hi] += 1
        return self.fired(slots, {ib.req_ids[r]})


class SwappedBlockLists(VllmFault):
    name = "swapped_block_lists"
    description = "two requests' persistent-batch rows of the block table are swapped"
    bug_class = "persistent batch condensed or reordered without moving the block-table rows"

    def on_inputs(self, runner, step):
        ib, n, table, size = self.rows(runner)
        rows = _prefix_rows(ib, n, size)
        pairs = [(a, b) for a in rows for b in rows if a < b and not torch.equal(table[a], table[b])]
        if not pairs:
            return False
        a, b = self.rng.choice(pairs)
        slots = {s for r in (a, b) for blk in table[r].tolist() if blk for s in self.block_slots(blk, size)}
        table[[a, b]] = table[[b, a]].clone()
        return self.fired(slots, {ib.req_ids[a], ib.req_ids[b]})


class CachedBlockBitFlip(VllmFault):
    """A bit flipped in layer 0 of a cached block that running requests read (K or V)."""

    half = "v"
    bug_class = "a stray write into a cached KV block (an out-of-bounds kernel store, a bad copy)"

    def on_inputs(self, runner, step):
        ib, n, table, size = self.rows(runner)
        tokens = int(runner.query_start_loc.np[n])
        written = set((ib.block_table[0].slot_mapping.cpu[:tokens] // size).tolist())  # this step's forward rewrites them
        blocks = sorted({int(table[r, c]) for r in _prefix_rows(ib, n, size)
                         for c in range(int(ib.num_computed_tokens_cpu[r]) // size)} - written - {0})
        if not blocks:
            return False
        readers = {b: self.readers(runner, b) for b in blocks}
        most = max(len(v) for v in readers.values())
        block = self.rng.choice([b for b in blocks if len(readers[b]) == most])  # a shared block: every reader is hurt
        kv = runner.kv_caches[0]  # [blocks, heads, B, 2D]: per (block, head) K transposed [D, B], then V [B, D]
        heads, d = kv.shape[1], kv.shape[3] // 2
        flat = kv.view(kv.shape[0], heads, 2 * size * d)
        t = 3
        element = t if self.half == "k" else size * d + t * d  # head 0, d = 0: inside PARTIAL's 16 bytes
        bits = flat.view(torch.int16 if kv.element_size() == 2 else torch.int32)
        bits[block, 0, element] ^= 1 << 6
        return self.fired({block * size + t}, readers[block])


class CachedBlockBitFlipV(CachedBlockBitFlip):
    name = "cached_block_bit_flip_v"
    description = "a bit flips in layer 0's V of a cached block that running requests read"
    half = "v"


class CachedBlockBitFlipK(CachedBlockBitFlip):
    name = "cached_block_bit_flip_k"
    description = "a bit flips in layer 0's K (stored transposed) of a cached block that running requests read"
    half = "k"


class PrefixCacheWrongBlock(VllmFault):
    name = "prefix_cache_wrong_block"
    description = "the prefix cache's hash map sends a new request's block hash to another prompt's cached block"
    bug_class = "stale or colliding prefix-cache entries (a hit on blocks whose tokens differ)"

    def on_lookup(self, manager, request):
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        pool = manager.block_pool
        size = manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        hashes = request.block_hashes
        column = 2  # the first block of the request's own suffix (the shared prompt is 2 blocks)
        if len(hashes) <= column or request.num_tokens <= (column + 1) * size:
            return False
        key = make_block_hash_with_group_id(hashes[column], 0)
        if pool.cached_block_hash_to_block.get_one_block(key) is not None:
            return False
        ours = {make_block_hash_with_group_id(h, 0) for h in hashes}
        others = [b for k, b in pool.cached_block_hash_to_block._cache.items()
                  if k not in ours and not isinstance(b, dict) and b.block_id > 0]
        prefix = [pool.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(h, 0)) for h in hashes[:column]]
        if not others or any(b is None for b in prefix):  # the victim must hit its shared prefix, then the wrong block
            return False
        wrong = self.rng.choice(others)
        pool.cached_block_hash_to_block.insert(key, wrong)
        return self.fired(self.block_slots(wrong.block_id, size), {request.request_id})


FAULTS = {cls.name: cls for cls in (StaleBlockTableEntry, SlotMappingOffByOne, SwappedBlockLists, CachedBlockBitFlipV,
                                    CachedBlockBitFlipK, PrefixCacheWrongBlock)}
