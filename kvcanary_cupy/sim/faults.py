"""Fault classes: the KV bugs serving engines have had, injected into the simulated engine.

Each class names the real bug class it models, and says whether the canary can see it by design
(and why not, when it cannot).  A fault is *armed* by :meth:`Fault.inject` and *fires* at the step
its corruption first exists (a double free corrupts nothing until the block is handed out again);
latency is counted from the firing step.  Everything a fault writes or mis-addresses is recorded
in ``episode.touched`` as ``(pool, slot)`` pairs and the requests it hurts in ``episode.victims``:
the runner attributes violations through them and the engine repairs them afterwards.
"""

from __future__ import annotations

import numpy as np

from .engine import NULL_BLOCK, Batch, Engine, NoHook, Pool, Request


class Episode(NoHook):
    """One injection of one fault: the engine's hook while the fault is armed."""

    def __init__(self, fault: "Fault", step: int):
        self.fault = fault
        self.armed_step = step
        self.fired_step: int | None = None
        self.touched: set = set()  # (pool, slot) the fault wrote or mis-addressed
        self.victims: set = set()  # requests it hurt
        self.held: set = set()  # (pool, block) its victims wrote into while it was live
        self.bystanders: set = set()  # victims whose own KV is right (they only hold a block the fault reuses)
        self.read: set = set()  # (pool, block) its victims' tables named while it was live
        self.state: dict = {}

    def fire(self, engine: Engine) -> None:
        if self.fired_step is None:
            self.fired_step = engine.step_index

    def touch(self, pool: Pool, slots) -> None:
        self.touched.update((pool.name, int(s)) for s in np.asarray(slots).reshape(-1))

    def touch_blocks(self, pool: Pool, blocks) -> None:
        self.touch(pool, pool.block_slots([b for b in blocks if b != NULL_BLOCK]))

    def hurt(self, engine: Engine, *reqs: Request) -> None:
        self.victims.update(reqs)
        engine.protected.update(reqs)
        for req in reqs:
            self._note_writes(engine, req.pool, req)

    def _note_writes(self, engine, pool_name, req):
        """Blocks from ``req``'s write frontier on: where its records (chained, perhaps, from a
        corrupted one) land from now on; and every block it reads (kept for the blast radius after
        it finishes, perhaps in the very step that reads a bad record)."""
        self.held.update((pool_name, b) for b in req.blocks[req.computed // engine.config.block_size:])
        self.read.update((pool_name, b) for b in req.blocks)

    def on_copy(self, src_pool, src_slots, dst_pool, dst_slots):
        """KV copied (a transfer, a compaction) carries what the fault did to it: the copies are touched too."""
        self.touch(dst_pool, [d for s, d in zip(np.asarray(src_slots).tolist(), np.asarray(dst_slots).tolist())
                              if (src_pool.name, s) in self.touched])

    # Hooks: only an armed (not yet fired) fault acts; where victims write is always recorded, and
    # what any request reads whose table holds a block the fault touched (another request's block a
    # fault wrote into: it reads the fault's records, and may finish in the very step it does).
    def on_batch(self, engine, pool, batch):
        bs = engine.config.block_size
        touched = {s // bs for p, s in self.touched if p == pool.name} - {NULL_BLOCK}
        for req in batch.reqs:
            if req in self.victims:
                self._note_writes(engine, pool.name, req)
            elif touched and touched.intersection(req.blocks):
                self.read.update((pool.name, b) for b in req.blocks)
        if self.fired_step is None:
            self.fault.on_batch(engine, self, pool, batch)

    def on_alloc(self, engine, pool, req, block):
        if self.fired_step is None:
            self.fault.on_alloc(engine, self, pool, req, block)

    def on_cache_hit(self, engine, pool, req, blocks):
        if self.fired_step is None:
            self.fault.on_cache_hit(engine, self, pool, req, blocks)

    def on_transfer(self, engine, req, dst_blocks):
        if self.fired_step is None:
            return self.fault.on_transfer(engine, self, req, dst_blocks)
        return dst_blocks

    def on_step_end(self, engine):
        if self.fired_step is None:
            self.fault.on_step_end(engine, self)


class Fault:
    name = ""
    description = ""
    poisons_kv = True  # its touched slots hold bad KV (False: only canary rows are wrong, the KV is right)
    detectable = True
    why_not_detectable: str | None = None
    visible_with: tuple = ()  # addressing modes whose tables let the canary see a class blind elsewhere
    visible_by: str | None = None  # the EngineConfig coverage option (deep_kv, lost_stores) that lets the canary see it

    @classmethod
    def detectable_with(cls, addressing: str, engine=None) -> bool:
        """Whether the canary can see this class by design when the engine hands it ``addressing``'s
        tables and runs the session with ``engine``'s coverage options (None: EngineConfig's defaults)."""
        if engine is None:
            from .engine import EngineConfig

            engine = EngineConfig()
        return cls.detectable or addressing in cls.visible_with or bool(cls.visible_by and getattr(engine, cls.visible_by))

    def inject(self, engine: Engine, ep: Episode) -> bool:
        """Arm (or fire) the fault; False when the engine offers no target right now."""
        return True

    def on_batch(self, engine, ep, pool, batch): pass
    def on_alloc(self, engine, ep, pool, req, block): pass
    def on_cache_hit(self, engine, ep, pool, req, blocks): pass
    def on_transfer(self, engine, ep, req, dst_blocks): return dst_blocks
    def on_step_end(self, engine, ep): pass


def _pick(engine: Engine, items: list):
    return items[int(engine.fault_rng.integers(len(items)))] if items else None


def _running(engine: Engine, *, transferable=True) -> list:
    """(pool, request) of running requests no fault depends on, with a step still to run."""
    return [(pool, r) for pool in engine.pools.values() for r in pool.running
            if r not in engine.protected and r.total_len - r.computed >= 2
            and (transferable or not (r.disagg and pool.cache is not None))]


def _exclusive_block(engine: Engine, *, transferable=True):
    """(pool, request, block index) of a block only one request holds, with content of its own."""
    return _pick(engine, [(pool, r, i) for pool, r in _running(engine, transferable=transferable)
                          for i in engine.exclusive_blocks(pool, r)])


def _batch_token(engine: Engine, batch: Batch, count: int = 1) -> list:
    """Batch rows of ``count`` different requests whose first token this step lies past any shared
    prompt, is committed (a speculative step always accepts its first token) and is read again by a
    later step."""
    rows = [r for r, req in enumerate(batch.reqs)
            if req not in engine.protected and batch.extend[r] > 0 and batch.prefix[r] >= req.shared_len
            and req.total_len - (req.computed + int(batch.accept[r])) >= 1]
    if len(rows) < count:
        return []
    chosen = engine.fault_rng.choice(len(rows), count, replace=False)
    return [rows[int(i)] for i in chosen]


class _BatchFault(Fault):
    """A fault in one token of a forward batch (what the model and the canary are handed)."""

    tokens = 1

    def on_batch(self, engine, ep, pool, batch):
        rows = _batch_token(engine, batch, self.tokens)
        if not rows or not self.corrupt(engine, ep, pool, batch, [int(batch.offsets[r]) for r in rows]):
            return
        ep.hurt(engine, *(batch.reqs[r] for r in rows))
        ep.fire(engine)

    def corrupt(self, engine, ep, pool, batch, idx) -> bool:
        raise NotImplementedError


class OffByOneWriteSlot(_BatchFault):
    name = "off_by_one_write_slot"
    description = ("A token's KV (and canary record) is stored one slot past the slot its table names, as "
                   "when out_cache_loc is computed with an off-by-one offset; the named slot keeps stale data.")

    def corrupt(self, engine, ep, pool, batch, idx):
        i = idx[0]
        slot = int(batch.out_cache_loc[i])
        if slot + 1 >= engine.config.num_slots:
            return False
        batch.out_cache_loc[i] = slot + 1
        ep.touch(pool, [slot, slot + 1])
        return True


class LostWrite(_BatchFault):
    name = "lost_write"
    description = ("A token's KV store is dropped together with its canary record (a masked or skipped "
                   "out_cache_loc entry): its slot keeps the previous owner's data.")

    def corrupt(self, engine, ep, pool, batch, idx):
        ep.touch(pool, [batch.out_cache_loc[idx[0]]])
        batch.out_cache_loc[idx[0]] = -1
        return True


class KvStoreDropped(_BatchFault):
    name = "kv_store_dropped"
    description = ("The model's KV store for one token is lost while the canary's own write happens (the "
                   "attention kernel skipped the store): the slot holds a former owner's KV.")
    detectable = False  # with SGLang's coverage; the lost-store check (EngineConfig.lost_stores) sees it
    visible_by = "lost_stores"
    why_not_detectable = ("The TAIL write fingerprints whatever KV bytes are in the slot after the forward, "
                          "stale ones included, so record and bytes agree; without the lost-store check the "
                          "canary never knows the bytes did not change.")

    def corrupt(self, engine, ep, pool, batch, idx):
        batch.kv_skip.add(idx[0])
        ep.touch(pool, [batch.out_cache_loc[idx[0]]])
        return True


class OffByOnePosition(_BatchFault):
    name = "off_by_one_position"
    description = ("A token is written with position p + 1 (misaligned positions, as in speculative draft "
                   "bugs such as SGLang PR 25015): wrong rotary position in the KV and in the record.")

    def corrupt(self, engine, ep, pool, batch, idx):
        batch.positions[idx[0]] += 1
        ep.touch(pool, [batch.out_cache_loc[idx[0]]])
        return True


class TokenSwap(_BatchFault):
    name = "token_swap"
    description = ("Two requests' sampled tokens are swapped when scattered into the next batch: each "
                   "request's KV is computed from the other's token (sampler / batch-index bugs). Caught by "
                   "the expected-token check against the engine's own token history.")
    tokens = 2

    def corrupt(self, engine, ep, pool, batch, idx):
        i, j = idx
        if batch.input_ids[i] == batch.input_ids[j]:
            return False
        batch.input_ids[[i, j]] = batch.input_ids[[j, i]]
        ep.touch(pool, batch.out_cache_loc[[i, j]])
        return True


class StalePrefixAfterEviction(Fault):
    name = "stale_prefix_after_eviction"
    description = ("The prefix cache evicts a block to the free list but keeps its entry; a later request "
                   "hits the stale entry and reads a block another request now writes (stale prefix-cache "
                   "hits, e.g. vLLM issue 38715).")

    def inject(self, engine, ep):
        pool = engine.pools["prefill"]
        entry = _pick(engine, [e for e in pool.cache.entries.values() if pool.allocator.refcount[e.block] == 1])
        if entry is None or not pool.allocator.free:
            return False
        pool.allocator.refcount[entry.block] = 0  # the bug: freed, but the entry stays
        pool.allocator.free.append(entry.block)
        path = pool.cache.path(entry.key)
        head = np.concatenate([np.asarray(e.tokens, np.int64) for e in path])
        probe = engine.new_request(prompt_head=head, shared_len=len(head))
        engine.waiting.appendleft(probe)
        ep.state.update(block=entry.block, hit=False, reused=False)
        ep.touch_blocks(pool, [entry.block])
        ep.hurt(engine, probe)
        return True

    def _maybe_fire(self, engine, ep):
        if ep.state["hit"] and ep.state["reused"]:
            ep.fire(engine)

    def on_alloc(self, engine, ep, pool, req, block):
        if pool.name == "prefill" and block == ep.state["block"]:
            ep.state["reused"] = True
            ep.hurt(engine, req)
            ep.bystanders.add(req)  # it writes its own KV there; the stale entry's readers get it wrong
            self._maybe_fire(engine, ep)

    def on_cache_hit(self, engine, ep, pool, req, blocks):
        if ep.state["block"] in blocks:
            ep.state["hit"] = True
            ep.hurt(engine, req)
            self._maybe_fire(engine, ep)


class DoubleAllocation(Fault):
    name = "double_allocation"
    description = ("A block still held by a live request is freed a second time and handed to another "
                   "request: one slot, two live owners (double free / refcount bugs, e.g. vLLM issue 37164).")

    def inject(self, engine, ep):
        target = _exclusive_block(engine)
        if target is None:
            return False
        pool, req, i = target
        pool.allocator.free.append(req.blocks[i])  # the bug: pushed back while still referenced
        ep.state.update(pool=pool.name, block=req.blocks[i])
        ep.touch_blocks(pool, [req.blocks[i]])
        ep.hurt(engine, req)
        return True

    def on_alloc(self, engine, ep, pool, req, block):
        if pool.name == ep.state["pool"] and block == ep.state["block"]:
            ep.hurt(engine, req)
            ep.bystanders.add(req)  # its own writes land there; the first owner reads them as its KV
            # the corruption exists once the block is held twice: a live request's list, the prefix
            # cache (the first owner finished and cached it) or an earlier hand-out not yet in a list (a
            # transfer allocates all its blocks before the request joins the pool: it may get this block
            # twice) already holds it, so the count this hand-out raised is above 1; when nobody held
            # it, this hand-out is the block's only one, and the next is the bug
            if pool.allocator.refcount[block] > 1:
                ep.fire(engine)


class BlockTableSwap(Fault):
    name = "block_table_swap"
    description = ("Two requests' block-table entries are swapped (a bad gather or scatter when the "
                   "persistent batch is reordered): each reads the other's KV.")

    def inject(self, engine, ep):
        options = [(p, r, i) for p, r in _running(engine) for i in engine.exclusive_blocks(p, r)]
        pairs = [(a, b) for a in options for b in options
                 if a[0] is b[0] and a[1] is not b[1] and a[2] != b[2] and a[1].rid < b[1].rid]
        pair = _pick(engine, pairs)
        if pair is None:
            return False
        (pool, r1, i1), (_, r2, i2) = pair
        r1.blocks[i1], r2.blocks[i2] = r2.blocks[i2], r1.blocks[i1]
        ep.touch_blocks(pool, [r1.blocks[i1], r2.blocks[i2]])
        ep.hurt(engine, r1, r2)
        ep.fire(engine)
        return True


class ZeroedTableEntry(Fault):
    name = "zeroed_table_entry"
    description = ("A request's block-table entry is reset to 0 (the null block / padding slot), as by a "
                   "table cleared too early or a padding fill that hits a live row. Seen by the hole check "
                   "(verify_table_hole): a position read through the padding slot; a CSR table, with no null "
                   "block, reads page 0, whose other slots also hold no record of the request.")
    poisons_kv = False  # the KV is right; the victim reads the padding slot (it is the episode's victim)

    def inject(self, engine, ep):
        target = _exclusive_block(engine, transferable=False)
        if target is None:
            return False
        pool, req, i = target
        ep.touch_blocks(pool, [req.blocks[i]])
        ep.touch(pool, pool.block_slots([NULL_BLOCK]))  # what it now addresses (all of page 0 in a CSR table)
        req.blocks[i] = NULL_BLOCK
        ep.hurt(engine, req)
        ep.fire(engine)
        return True


class _CachedBlockBitFlip(Fault):
    fingerprinted_layer = True  # layer 0, which the real-KV fingerprints read; else a deeper one

    def inject(self, engine, ep):
        pool = engine.pools["prefill"]
        entry = _pick(engine, list(pool.cache.entries.values()))
        if entry is None:
            return False
        c, rng = engine.config, engine.fault_rng
        slot = entry.block * c.block_size + int(rng.integers(c.block_size))
        layer = 0 if self.fingerprinted_layer else int(rng.integers(1, c.num_layers))
        pool.kv.flip_bit(slot, layer, int(rng.integers(2)), int(rng.integers(c.kv_row_bytes)), int(rng.integers(8)))
        ep.touch(pool, [slot])
        ep.fire(engine)
        return True


class CachedPrefixBitFlip(_CachedBlockBitFlip):
    name = "cached_prefix_bitflip"
    description = ("A bit flips (or a stray write lands) in the KV bytes of a prefix-cache block, shared or "
                   "not: memory errors, out-of-bounds stores of another kernel. Seen by the real-KV "
                   "fingerprints (TAIL verify of a reader, or the sweep of the cache).")


class UnfingerprintedLayerBitFlip(_CachedBlockBitFlip):
    name = "unfingerprinted_layer_bitflip"
    description = "A bit flips in a layer other than layer 0 of a prefix-cache block's KV."
    detectable = False  # with SGLang's coverage; deep fingerprints (EngineConfig.deep_kv) see it
    visible_by = "deep_kv"
    why_not_detectable = ("Real-KV fingerprints read layer 0 only (as SGLang's do): without deep fingerprints "
                          "the bytes of deeper layers are outside every check.")
    fingerprinted_layer = False


class LateWriteAfterAbort(Fault):
    name = "late_write_after_abort"
    description = ("An aborted request's in-flight write (a delayed kernel or KV transfer) lands in a slot "
                   "that has since been reused by another request.")

    def inject(self, engine, ep):
        bs = engine.config.block_size
        target = _pick(engine, [(p, r) for p, r in _running(engine)
                                if r.computed > (len(r.blocks) - 1) * bs and r.blocks and
                                (len(r.blocks) - 1) * bs >= r.shared_len and p.allocator.refcount[r.blocks[-1]] == 1])
        if target is None:
            return False
        pool, req = target
        block = req.blocks[-1]
        slot = block * bs
        ep.state.update(pool=pool.name, block=block, slot=slot, owner=None,
                        canary=engine.canary_rows(pool, slot), kv=pool.kv.data[:, :, slot].copy())
        engine.abort(req)
        ep.touch(pool, [slot])
        return True

    def on_alloc(self, engine, ep, pool, req, block):
        if pool.name == ep.state["pool"] and block == ep.state["block"]:
            ep.state["owner"] = req

    def on_step_end(self, engine, ep):
        owner = ep.state["owner"]
        if owner is None:
            return
        if not owner.alive or ep.state["block"] not in owner.blocks:  # handed out and given back again
            ep.state["owner"] = None
            return
        pool = engine.pools[ep.state["pool"]]
        engine.set_canary_rows(pool, ep.state["slot"], ep.state["canary"])
        pool.kv.data[:, :, ep.state["slot"]] = ep.state["kv"]
        ep.hurt(engine, owner)
        ep.fire(engine)


class _PageMove(Fault):
    """Compaction moves a block's KV to another block; the subclasses leave one piece behind."""

    update_table = move_canary = True

    def inject(self, engine, ep):
        target = _exclusive_block(engine)
        if target is None:
            return False
        pool, req, i = target
        moved = engine.move_block(pool, req, i, move_canary=self.move_canary, update_table=self.update_table)
        if moved is None:
            return False
        ep.touch_blocks(pool, moved)
        ep.hurt(engine, req)
        ep.fire(engine)
        return True


class PageMoveStaleTable(_PageMove):
    name = "page_move_stale_table"
    description = ("Compaction moves a block (KV and canary rows) but the request's table (with SGLang "
                   "addressing, the unified pool's virtual-to-physical page map) still names the old place, "
                   "which is freed: the request reads a vacated, soon reused block.")
    update_table = False


class PageMoveWithoutCanary(_PageMove):
    name = "page_move_without_canary"
    description = ("Compaction moves a block's KV and updates the table (or SGLang's page map) but not the "
                   "canary rows (a move path that forgets the side buffers): the new place holds another "
                   "block's records.")
    move_canary = False
    poisons_kv = False  # the KV moved right: only the canary rows are stale


class TransferWrongSlots(Fault):
    name = "transfer_wrong_slots"
    description = ("A prefill-to-decode KV transfer writes one page into the wrong destination block (an "
                   "off-by-one in the destination page list); the intended block keeps stale data.")

    def on_transfer(self, engine, ep, req, dst_blocks):
        if req in engine.protected:
            return dst_blocks
        pool = engine.pools["decode"]
        i = len(dst_blocks) - 1
        right = dst_blocks[i]
        wrong = right + 1 if right + 1 < engine.config.num_blocks else right - 1
        copy_to = list(dst_blocks)
        copy_to[i] = wrong
        ep.touch_blocks(pool, [right, wrong])
        ep.hurt(engine, req)
        ep.fire(engine)
        return copy_to


FAULTS = {cls.name: cls for cls in (
    StalePrefixAfterEviction, DoubleAllocation, OffByOneWriteSlot, LostWrite, CachedPrefixBitFlip, TokenSwap,
    OffByOnePosition, BlockTableSwap, LateWriteAfterAbort, PageMoveStaleTable, PageMoveWithoutCanary,
    TransferWrongSlots, ZeroedTableEntry, KvStoreDropped, UnfingerprintedLayerBitFlip,
)}
