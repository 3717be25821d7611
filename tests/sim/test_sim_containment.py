"""Containment and attribution in ``kvcanary sim``: what a read of bad KV is (the ground truth the
``leaked`` figure is measured against), when a double allocation exists, and which slots a fault
explains.  Each case below is one the default run once got wrong (issue #27): 5 leaked requests
that had read their own, right KV, and 34 violations outside every blast radius."""

from dataclasses import replace

import numpy as np

from kvcanary_cupy.sim import SimConfig, simulate
from kvcanary_cupy.sim import engine as sim_engine
from kvcanary_cupy.sim.containment import _wrong_positions
from kvcanary_cupy.sim.engine import Engine, EngineConfig
from kvcanary_cupy.sim.faults import FAULTS, Episode
from kvcanary_cupy.sim.kvpool import kv_rows

SMALL = EngineConfig(num_blocks=96, max_running=6, arrival_rate=0.6)
LEAKED_BEFORE = ("late_write_after_abort", "transfer_wrong_slots", "page_move_stale_table")


def _engine(steps=12, **config):
    engine = Engine(replace(SMALL, **config), seed=3, addressing="sglang", xp=np)
    for _ in range(steps):
        engine.step()
    assert engine.take_violations() == []
    return engine


def test_a_read_is_wrong_only_where_the_bytes_are_not_the_readers_own_behind_its_own_tokens():
    engine = _engine()
    pool = engine.pools["prefill"]
    req = next(r for r in pool.running if r.computed >= 4)
    n = req.computed
    assert _wrong_positions(pool, req, n) == []  # every committed position holds its own KV, contexts included
    slots = pool.slots(req, 0, n)
    pool.kv.flip_bit(int(slots[2]), 1, 1, 3, 5)  # layer 1, V: a byte no record fingerprints
    assert _wrong_positions(pool, req, n) == [2]
    # the same token at the same position behind another prefix (context 0) is another KV: wrong
    other = kv_rows(np, req.tokens[1:2], np.array([1]), pool.kv.num_layers, pool.kv.row_bytes)
    pool.kv.data[:, :, int(slots[1])] = other[0]
    assert _wrong_positions(pool, req, n) == [1, 2]
    assert _wrong_positions(pool, req, 1) == []  # position 0 alone: still its own


def test_a_block_handed_out_twice_to_one_transfer_is_the_double_allocation():
    """A transfer allocates every destination block before the request joins the decode pool: a
    block on the free list twice lands twice in one block list, with no other holder to see."""
    engine = _engine(steps=30)
    src, dst = engine.pools["prefill"], engine.pools["decode"]
    owner = next(r for r in dst.running if r.blocks)
    block = owner.blocks[-1]
    ep = Episode(FAULTS["double_allocation"](), engine.step_index)
    ep.state.update(pool="decode", block=block)
    engine.hook = ep
    engine.release(dst, owner)  # the owner finishes: its last block is the top of the free list ...
    dst.allocator.free.append(block)  # ... and the double free pushed it once more
    for r in src.running:
        r.awaiting_transfer = False
    req = next(r for r in src.running if len(r.blocks) >= 2)
    req.awaiting_transfer = True
    engine.transfer()
    assert req.pool == "decode" and req.blocks[:2] == [block, block]
    assert ep.fired_step == engine.step_index


def test_a_block_handed_out_once_after_its_owner_left_is_not_yet_the_fault():
    engine = _engine(steps=30)
    dst = engine.pools["decode"]
    owner = next(r for r in dst.running if r.blocks)
    block = owner.blocks[-1]
    ep = Episode(FAULTS["double_allocation"](), engine.step_index)
    ep.state.update(pool="decode", block=block)
    engine.hook = ep
    engine.release(dst, owner)
    dst.allocator.free.append(block)
    probe = engine.new_request()
    assert engine.alloc(dst, probe) == block and ep.fired_step is None  # nobody else holds it: one owner
    assert engine.alloc(dst, probe) == block and ep.fired_step == engine.step_index  # held twice now


def test_a_request_holding_a_block_the_fault_wrote_stays_in_the_radius_after_it_finishes():
    """A transfer into the wrong block overwrites another request's KV and records: that request
    reads them (its next block's first slot fails the chain check) and may finish in that step."""
    engine = _engine()
    pool = engine.pools["prefill"]
    holder = next(r for r in pool.running if r.computed >= SMALL.block_size and r.total_len - r.computed >= 2)
    ep = Episode(FAULTS["transfer_wrong_slots"](), engine.step_index)
    ep.touch_blocks(pool, [holder.blocks[0]])  # the fault wrote there; the holder is no victim of its own
    ep.fire(engine)
    engine.hook = ep
    engine.protected.add(holder)  # no random abort or compaction of it in this step
    engine.step()
    slots = set(pool.block_slots(holder.blocks).tolist())
    assert holder in pool.running and slots <= engine.blast_radius("prefill", ep)
    engine.release(pool, holder)  # it finishes in the step that reads the bad record
    assert slots <= engine.blast_radius("prefill", ep)


def test_the_episodes_that_leaked_are_contained_from_the_report():
    """seed 2, 240 steps of these three classes once counted 2 + 1 + 1 leaked requests: each had
    read its own KV (the ground truth left the context hash out of the KV bytes)."""
    results, stats = simulate(SimConfig(steps=240, seed=2, rate=1.0, faults=LEAKED_BEFORE))
    assert {f.name: (f.detected, f.injected) for f in results} == {
        "late_write_after_abort": (17, 17), "transfer_wrong_slots": (22, 22), "page_move_stale_table": (16, 16)}
    assert [f.to_json()["contained"]["leaked_requests"] for f in results] == [0, 0, 0]
    assert stats.unattributed == 0, stats.unattributed_examples


def test_without_containment_the_same_episodes_leak(monkeypatch):
    """The leak figure sees what containment prevents: an engine that ignores its canary keeps
    running the requests that read bad KV."""
    monkeypatch.setattr(sim_engine.Engine, "contain", lambda self, reported: (set(), set()))
    results, _ = simulate(SimConfig(steps=240, seed=2, rate=1.0, faults=LEAKED_BEFORE))
    assert all(f.to_json()["contained"]["leaked_requests"] > 0 for f in results)


def test_a_double_allocation_inside_one_transfer_is_attributed():
    """seed 1, 300 steps: the 34 violations once outside every radius (the block landed twice in one
    transferred request's list, and the episode never fired)."""
    results, stats = simulate(SimConfig(steps=300, seed=1, rate=1.0, faults=("double_allocation",)))
    (f,) = results
    assert f.detected == f.injected == 98
    assert stats.unattributed == 0, stats.unattributed_examples


def test_a_transfer_into_another_requests_block_is_attributed():
    """seed 3, 400 steps: 2 violations once outside every radius (the wrong block's holder finished
    in the step that read the transferred records)."""
    results, stats = simulate(SimConfig(steps=400, seed=3, rate=1.0, faults=("transfer_wrong_slots",)))
    (f,) = results
    assert f.detected == f.injected == 68 and f.to_json()["contained"]["leaked_requests"] == 0
    assert stats.unattributed == 0, stats.unattributed_examples
