"""The simulator's engine: allocator, prefix cache, tables, session shim and whole-run invariants."""

from collections import Counter

from dataclasses import replace

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.sim.engine import BlockAllocator, Engine, EngineConfig, OutOfBlocks, PrefixCache
from kvcanary_cupy.sim.faults import FAULTS, Episode
from kvcanary_cupy.sim.session import canary_buffers
from kvcanary_cupy.sim.tables import ADDRESSING_MODES, PageMap, session_table

SMALL = EngineConfig(num_blocks=96, max_running=6, arrival_rate=0.6)


def test_allocator_reference_counts_and_stack_order():
    a = BlockAllocator(5)
    assert [a.alloc() for _ in range(4)] == [1, 2, 3, 4]  # block 0 is the null block, never handed out
    with pytest.raises(OutOfBlocks):
        a.alloc()
    a.retain(2)
    a.release(2)
    assert a.free == [] and a.refcount[2] == 1  # still held once
    a.release(2)
    a.release(3)
    assert a.free == [2, 3] and a.alloc() == 3  # the last freed is reused first
    a.release(0)  # the null block is never freed
    a.release(2)  # over-release is ignored, not pushed twice
    assert a.free == [2] and a.refcount.tolist() == [0, 1, 0, 1, 1]


def test_allocator_rebuild_from_holders_keeps_order_and_drops_duplicates():
    a = BlockAllocator(6)
    for _ in range(5):
        a.alloc()
    a.free = [4, 2, 4, 1]  # a double free (4) and a block still held (1)
    a.rebuild(Counter({1: 2, 3: 1, 5: 1}))
    assert a.refcount.tolist() == [0, 2, 0, 1, 0, 1]
    assert a.free == [4, 2]


def test_prefix_cache_match_insert_and_lru_eviction():
    bs = 2
    a = BlockAllocator(8)
    cache = PrefixCache(bs)
    seq1 = np.array([1, 2, 3, 4, 5, 6], np.int64)
    blocks1 = [a.alloc() for _ in range(3)]
    cache.insert(seq1, blocks1, 3, a, clock=1)
    assert [a.refcount[b] for b in blocks1] == [2, 2, 2]
    seq2 = np.array([1, 2, 3, 4, 9, 9], np.int64)  # shares two blocks with seq1
    blocks2 = blocks1[:2] + [a.alloc()]
    for b in blocks1[:2]:
        a.retain(b)
    cache.insert(seq2, blocks2, 3, a, clock=2)
    for b in blocks1 + blocks2:
        a.release(b)
    assert len(cache.entries) == 4 and cache.evictable(a) == 4
    assert [e.block for e in cache.match(seq2, 3, clock=3)] == blocks2  # seq2's leaf is now the newest
    assert [e.block for e in cache.match(np.array([1, 2, 7, 7]), 2, clock=3)] == blocks1[:1]
    assert sorted(map(sorted, cache.leaf_paths())) == sorted([sorted(blocks1), sorted(blocks2)])
    assert cache.evict_one(a)  # the least recently used leaf: seq1's last block
    assert blocks1[2] in a.free and len(cache.entries) == 3
    a.retain(blocks2[2])  # held by a request: not evictable
    assert cache.evict_one(a) is False or blocks2[2] not in a.free
    assert cache.subtree_blocks({blocks1[1]}) == {blocks1[1], blocks2[2]}


LISTS = [[3, 4], [5], [6, 7, 8]]  # per request, its blocks (block size 4)


def _plan(t, prefix):
    prefix = np.asarray(prefix, np.int64)
    return kc.plan(t.req_pool_indices, prefix, np.ones(len(prefix), np.int64), t.table, verify_capacity=64,
                   req_to_verify_expected_tokens=t.expected_tokens, req_to_verify_expected_tokens_valid_lens=prefix)


def _arrays(vp, wp):
    n = int(vp.verify_num_valid[0])
    out = {k: v.tolist() for k, v in wp.arrays().items()}
    out.update({k: v[:n].tolist() if v.shape[0] > 1 else v.tolist() for k, v in vp.arrays().items()})
    return out


def test_each_addressing_mode_hands_the_canary_its_engines_own_table():
    page_map = PageMap(16)
    tokens = [np.arange(12) + 100 * r for r in range(3)]
    t = {m: session_table(m, LISTS, tokens, [5, 2, 8], 4, page_map) for m in ADDRESSING_MODES}
    sglang, vllm, flashinfer = t["sglang"].table, t["vllm"].table, t["flashinfer"].table
    assert isinstance(sglang, kc.ReqToToken) and sglang.page_size == 4
    assert sglang.virtual_to_physical is page_map.virtual_to_physical
    assert sglang.req_to_token.shape == (4, 12) and not sglang.req_to_token[0].any()  # row 0: padding
    assert sglang.req_to_token[1, :8].tolist() == list(range(12, 20))  # identity map: virtual = physical
    assert isinstance(vllm, kc.BlockTable) and (vllm.block_size, vllm.null_block) == (4, 0)
    assert vllm.block_table.tolist() == [[3, 4, 0], [5, 0, 0], [6, 7, 8]]
    assert isinstance(flashinfer, kc.PagedKvIndices) and flashinfer.page_size == 4
    assert flashinfer.kv_indptr.tolist() == [0, 2, 3, 6] and flashinfer.kv_indices.tolist() == [3, 4, 5, 6, 7, 8]
    # Request rows: req_to_token skips the padding row; block-table rows are all real; CSR rows are
    # batch rows.  The expected-token pool is indexed like them.
    assert t["sglang"].req_pool_indices.tolist() == [1, 2, 3] and t["vllm"].req_pool_indices.tolist() == [0, 1, 2]
    assert t["flashinfer"].req_pool_indices is None
    for m, first in (("sglang", 1), ("vllm", 0), ("flashinfer", 0)):
        pool = t[m].expected_tokens
        assert pool.shape == (first + 3, 12) and pool[first, :6].tolist() == [0, 1, 2, 3, 4, 0]
        assert pool[first + 1, :3].tolist() == [100, 101, 0] and pool[first + 2, :8].tolist() == list(range(200, 208))
    # The same slots through every table: byte-identical plans, with the hand-computed slots.
    plans = {m: _arrays(*_plan(t[m], [5, 2, 8])) for m in ADDRESSING_MODES}
    assert plans["sglang"] == plans["vllm"] == plans["flashinfer"]
    assert plans["sglang"]["verify_slot_indices"] == [12, 13, 14, 15, 16, 20, 21, *range(24, 32)]
    assert plans["sglang"]["verify_expected_tokens"][5:8] == [100, 101, 200]
    with pytest.raises(ValueError, match="addressing"):
        session_table("trtllm", LISTS, tokens, [0, 0, 0], 4, page_map)


def test_a_zeroed_entry_is_the_padding_slot_except_in_a_csr_table():
    lists = [[0, 7]]  # the null block where block 6 was
    tokens = [np.arange(8)]
    slots = {m: _plan(session_table(m, lists, tokens, [8], 4, PageMap(16)), [8])[0].verify_slot_indices[:8].tolist()
             for m in ADDRESSING_MODES}
    assert slots["sglang"] == slots["vllm"] == [0, 0, 0, 0, 28, 29, 30, 31]  # holes: the padding slot
    assert slots["flashinfer"] == [0, 1, 2, 3, 28, 29, 30, 31]  # page 0 is an ordinary page there


def test_the_page_map_rebinds_a_moved_block_and_req_to_token_keeps_its_virtual_ids():
    page_map = PageMap(8)
    tokens = [np.arange(8)]
    before = session_table("sglang", [[3, 4]], tokens, [8], 4, page_map).table.req_to_token.copy()
    page_map.rebind(4, 6)  # block 4's contents moved to the free block 6
    assert page_map.virtual_to_physical.tolist() == [0, 1, 2, 3, 6, 5, 4, 7]
    assert page_map.virtual_of.tolist() == [0, 1, 2, 3, 6, 5, 4, 7]
    t = session_table("sglang", [[3, 6]], tokens, [8], 4, page_map)
    assert np.array_equal(t.table.req_to_token, before)  # the row still names virtual page 4
    assert _plan(t, [8])[0].verify_slot_indices[:8].tolist() == [12, 13, 14, 15, 24, 25, 26, 27]


def test_pool_sessions_check_real_kv_and_tokens_and_report_through_the_engine():
    """The record's checks alone (the deep rotation would report the same flip too: test_coverage.py)."""
    engine = Engine(replace(SMALL, deep_kv=False), seed=3, addressing="vllm", xp=np)
    pool = engine.pools["prefill"]
    s = pool.session
    assert isinstance(s, kc.CanarySession) and s.real_kv_hash_mode == kc.RealKvHashMode.ALL and s.check_expected_tokens
    assert [src.tensor.shape for src in s.real_kv_sources] == [(SMALL.num_slots, SMALL.kv_row_bytes)] * 2
    for _ in range(12):
        engine.step()
    assert engine.take_violations() == []
    req = next(r for r in pool.running if r.computed > 1)
    slot = int(pool.slots(req, 0, 1)[0])
    pool.kv.flip_bit(slot, 0, 0, 0, 0)  # layer 0 K: fingerprinted
    engine.step()
    seen = engine.take_violations()
    assert seen and all(name == "prefill" for name, _ in seen)
    assert {(v.slot_idx, v.reasons) for _, v in seen} == {(slot, "verify_real_kv_hash")}
    # Read again: the session reports a distinct violation once, the engine takes every sighting.
    assert req.alive and req in pool.running
    engine.step()
    again = engine.take_violations()
    assert {(v.slot_idx, v.reasons) for _, v in again} == {(slot, "verify_real_kv_hash")}
    distinct = [v for v in s.report().violations if v.slot_idx == slot]
    assert len(distinct) == len(seen) and all(v.repeats == 2 for v in distinct)


@pytest.mark.parametrize("addressing", ADDRESSING_MODES)
def test_compaction_moves_canary_rows_with_move_pages_and_rebinds_the_page_map(addressing):
    engine = Engine(SMALL, seed=3, addressing=addressing, xp=np)
    for _ in range(12):
        engine.step()
    pool, req, i = next((p, r, i) for p in engine.pools.values() for r in p.running
                        for i in engine.exclusive_blocks(p, r))
    bs, old = SMALL.block_size, req.blocks[i]
    virtual = pool.page_map.virtual_of[old]
    before = [buf[old * bs: (old + 1) * bs].copy() for buf in canary_buffers(pool.session)]
    assert all(rows[:, 1].tolist() == list(range(i * bs, (i + 1) * bs)) for rows in before)  # positions of block i
    workspace = pool.move_workspace
    moved = engine.move_block(pool, req, i)
    assert moved is not None and moved[0] == old
    new = moved[1]
    assert req.blocks[i] == new and new != old and pool.move_workspace is workspace
    assert pool.page_map.virtual_of[new] == virtual and pool.page_map.virtual_to_physical[virtual] == new
    for buf, rows in zip(canary_buffers(pool.session), before):
        assert np.array_equal(buf[new * bs: (new + 1) * bs], rows) and not buf[old * bs: (old + 1) * bs].any()
    engine.step()  # the request reads its block at the new place through the new table / page map
    assert engine.take_violations() == []


def test_a_finished_victims_blocks_stay_in_the_blast_radius():
    engine = Engine(SMALL, seed=3, addressing="sglang", xp=np)
    for _ in range(12):
        engine.step()
    pool = engine.pools["prefill"]
    req = next(r for r in pool.running if r.computed >= 2 * SMALL.block_size)  # blocks before its write frontier
    ep = Episode(FAULTS["block_table_swap"](), engine.step_index)
    ep.hurt(engine, req)
    slots = set(pool.block_slots(req.blocks).tolist())
    assert slots <= engine.blast_radius("prefill", ep)
    engine.release(pool, req)  # it finishes in the step that reads a bad record
    assert slots <= engine.blast_radius("prefill", ep)


def _check_allocator_invariants(engine):
    for pool in engine.pools.values():
        holders = pool.holders()
        ref = pool.allocator.refcount
        assert {b: int(ref[b]) for b in np.nonzero(ref)[0]} == {b: n for b, n in holders.items() if b}
        free = pool.allocator.free
        assert len(free) == len(set(free)) and 0 not in free
        assert set(free) == {b for b in range(1, ref.shape[0]) if ref[b] == 0}


def test_clean_engine_keeps_invariants_and_leaks_nothing_when_drained():
    engine = Engine(SMALL, seed=3, addressing="sglang", xp=np)
    for _ in range(40):
        engine.step()
        _check_allocator_invariants(engine)
    assert engine.counters["compactions"] >= 1
    engine.arrivals = lambda: None  # no more requests: run everything to the end
    for _ in range(400):
        if not any(p.running for p in engine.pools.values()) and not engine.waiting:
            break
        engine.step()
    assert not any(p.running for p in engine.pools.values()) and not engine.waiting
    _check_allocator_invariants(engine)
    prefill, decode = engine.pools["prefill"], engine.pools["decode"]
    assert len(decode.allocator.free) == SMALL.num_blocks - 1  # decode pool: nothing held
    cached = {e.block for e in prefill.cache.entries.values()}
    assert cached and all(prefill.allocator.refcount[b] == 1 for b in cached)
    while prefill.cache.evict_one(prefill.allocator):
        pass
    assert len(prefill.allocator.free) == SMALL.num_blocks - 1 and not prefill.cache.entries
    assert engine.take_violations() == []
    stats = prefill.session.stats
    assert stats["sweeps"] >= 1 and stats["violations"] == 0 and stats["verify_skipped_steps"] == 0
