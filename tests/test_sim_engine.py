"""The simulator's engine: allocator, prefix cache, tables, session shim and whole-run invariants."""

from collections import Counter

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.sim.engine import BlockAllocator, Engine, EngineConfig, OutOfBlocks, PrefixCache
from kvcanary_cupy.sim.tables import (
    ADDRESSING_MODES,
    block_table,
    csr_pages,
    materialise_block_table,
    materialise_csr,
    session_table,
)

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


def test_tables_of_every_addressing_mode_are_equivalent():
    lists = [[3, 4], [5], [0, 7, 8]]  # 0: the null block
    bt = block_table(lists, 3)
    rtt = materialise_block_table(bt, 4)
    assert rtt.shape == (4, 12) and not rtt[0].any()
    assert rtt[1, :8].tolist() == list(range(12, 20))
    assert rtt[3, :4].tolist() == [0, 0, 0, 0] and rtt[3, 4:12].tolist() == list(range(28, 36))
    assert np.array_equal(materialise_csr(*csr_pages(lists), 4), rtt)
    tokens = [np.arange(8) + 100 * r for r in range(3)]
    tables = [session_table(m, lists, tokens, [5, 2, 8], 4) for m in ADDRESSING_MODES]
    for t in tables:
        assert np.array_equal(t.table, rtt) and t.req_pool_indices.tolist() == [1, 2, 3]
        assert t.expected_tokens[1, :5].tolist() == [0, 1, 2, 3, 4] and t.expected_tokens[2, 2:].sum() == 0
    with pytest.raises(ValueError, match="addressing"):
        session_table("trtllm", lists, tokens, [0, 0, 0], 4)


def test_pool_sessions_check_real_kv_and_tokens_and_report_through_the_engine():
    engine = Engine(SMALL, seed=3, addressing="vllm", xp=np)
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
