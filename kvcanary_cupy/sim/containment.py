"""Containment in the simulator: what the engine does with a report, and what that leaves behind.

:func:`contain` is the engine's reaction to the violations its canary reported in a step, driven
by the report alone (:meth:`ViolationReport.victims` and :meth:`~ViolationReport.poisoned_pages`):
abort the requests that read a violating slot (their row labels are request ids) and those whose
write a write row names (the engine's own batch says who wrote that slot this step), take a
poisoned page's origin as poisoned too when the engine transferred its KV from another pool,
evict the prefix-cache blocks holding a poisoned page (and the blocks below them), abort the
running requests whose tables hold one of those blocks, and rebuild the allocators' counts from
the live tables.  Nothing about the fault is used: only the reports and the engine's own records.

:class:`Aftermaths` measures the result against the simulator's own knowledge of the fault: from
the step after a detection, every real slot the fault wrote or mis-addressed (``episode.touched``,
the null block's excepted) stays poisoned until the engine writes it again (moves and transfers
carry it along).  A read is bad when the slot's bytes are not the KV of the reader's own token at
that position behind its own tokens (every layer; the bytes depend on the context, so a slot a
fault rewrote with the reader's own KV again reads right).  A victim of the fault (``episode.victims``, bystanders excepted)
that still reads bad KV after the detection (a table hole, a swapped token), and a request that
reads a poisoned slot wrong in two steps after it (the first read is the canary's next sighting,
which containment acts on), *leaked*: it kept reading poisoned KV.  Target: none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..constants import FailReason
from ..containment import poisoned_pages, victims
from .kvpool import kv_rows, prefix_contexts
from .tables import NULL_BLOCK


def contain(engine, reported) -> tuple[set, set]:
    """React to ``reported`` ((pool name, Violation) pairs of one step) from the report alone.
    Returns ``(aborted request ids, evicted (pool, block) pairs)``."""
    bs = engine.config.block_size
    by_pool: dict = {}
    for name, v in reported:
        by_pool.setdefault(name, []).append(v)
    alive = {r.rid: r for pool in engine.pools.values() for r in pool.running} | {r.rid: r for r in engine.waiting}
    doomed, evicted, poisoned = {}, set(), {name: set() for name in engine.pools}
    for name, violations in by_pool.items():
        pool = engine.pools[name]
        read = victims(violations)
        named = [label for label, sweep in zip(read["row_label"].tolist(), read["sweep"].tolist()) if not sweep]
        # a write row (a lost store too) names the slot written: the engine's batch says who wrote it
        named += [pool.writers.get(v.slot_idx) for v in violations
                  if v.is_write or v.fail_reason_bits & FailReason.WRITE_KV_NOT_STORED]
        doomed.update((rid, alive[rid]) for rid in named if rid in alive)
        pages = set(poisoned_pages(violations, bs)["page"].tolist()) - {NULL_BLOCK}
        poisoned[name] |= pages
        for page in pages:  # a transferred block's KV came from the sender's block: that one is suspect too
            if page in pool.origin:
                src, block = pool.origin[page]
                poisoned[src].add(block)
    for name, pages in poisoned.items():
        pool = engine.pools[name]
        if pool.cache is not None and pages:
            below = pool.cache.subtree_blocks(pages)
            evicted.update((name, b) for b in below)
            pool.cache.drop(pages, pool.allocator)
            pages |= below
        if pages:  # the rotation stops re-reporting the freed KV
            pool.session.coverage.forget(pool.block_slots(sorted(pages)))
        for req in pool.running:
            if pages & set(req.blocks):
                doomed[req.rid] = req
    for rid in sorted(doomed):  # a fixed order: the free lists depend on it
        engine.abort(doomed[rid])
    for pool in engine.pools.values():
        pool.allocator.rebuild(pool.holders())
    return set(doomed), evicted


def _wrong_positions(pool, req, prefix: int) -> list:
    """Positions of ``req``'s prefix whose slot does not hold the KV bytes of its own token there
    (every layer, K and V, behind its own tokens: the bytes depend on the context): what it really reads wrong."""
    xp = pool.kv.xp
    if prefix == 0:
        return []
    if req.kv_contexts is None:
        req.kv_contexts = prefix_contexts(req.tokens)
    want = kv_rows(xp, req.tokens[:prefix], np.arange(prefix), pool.kv.num_layers, pool.kv.row_bytes,
                   req.kv_contexts[:prefix])
    have = pool.kv.data[:, :, xp.asarray(pool.slots(req, 0, prefix))].transpose(2, 0, 1, 3)
    differs = (want != have).reshape(prefix, -1).any(axis=1)
    return np.nonzero(differs.get() if hasattr(differs, "get") else differs)[0].tolist()


@dataclass
class Aftermath:
    """One detected fault after its containment."""

    fault: str
    detected_step: int
    poisoned: set  # (pool, slot) still holding the fault's bad KV (ground truth)
    victims: set  # ids of the requests the fault hurt (ground truth): none should run after the detection
    bystanders: set  # ids of requests that hold a block the fault reused but read their own, right KV there
    radius: dict  # pool -> slots: violations there within `until` are late sightings of this fault
    until: int  # last step whose violations the radius explains
    aborted: int = 0
    evicted: int = 0
    leaked: set = field(default_factory=set)  # ids of requests that kept reading poisoned KV after the detection
    leaked_reads: int = 0
    read_once: set = field(default_factory=set)  # ids of requests whose first poisoned read came after the detection


class Aftermaths:
    """Every detected fault's aftermath, followed to the end of the run."""

    def __init__(self):
        self.open: list[Aftermath] = []
        self.done: list[Aftermath] = []

    def add(self, aftermath: Aftermath) -> None:
        self.open.append(aftermath)

    def explains(self, pool_name: str, slot: int, step: int) -> bool:
        """Whether a violation is a late sighting of a contained fault (inside its radius, in time)."""
        return any(step <= a.until and slot in a.radius.get(pool_name, ()) for a in self.open + self.done)

    def on_batch(self, pool, batch) -> None:
        """A step of ``pool`` reads its requests' prefixes, then writes the batch's slots."""
        if not self.open:
            return
        for r, req in enumerate(batch.reqs):
            prefix = int(batch.prefix[r])
            read_slots = pool.slots(req, 0, prefix)
            read = {(pool.name, int(s)) for s in read_slots}
            wrong = None  # positions whose KV bytes are not this request's own (computed once, if needed)
            for a in self.open:
                if req.rid in a.bystanders or not (req.rid in a.victims or read & a.poisoned):
                    continue
                if wrong is None:
                    wrong = _wrong_positions(pool, req, prefix)
                suspect = wrong if req.rid in a.victims else [p for p in wrong if (pool.name, int(read_slots[p])) in a.poisoned]
                if not suspect:
                    continue
                # a victim read bad KV before the detection; any other request may read it once (then
                # the canary reports it); reading it again is what containment should have stopped
                if req.rid in a.victims or req.rid in a.read_once:
                    a.leaked.add(req.rid)
                    a.leaked_reads += len(suspect)
                else:
                    a.read_once.add(req.rid)
        keep = np.asarray(batch.out_cache_loc) >= 0
        keep[list(batch.kv_skip)] = False
        written = {(pool.name, int(s)) for s in np.asarray(batch.out_cache_loc)[keep]}
        for a in self.open:
            a.poisoned -= written
        self._close()

    def carry(self, src_pool: str, src_slots, dst_pool: str, dst_slots) -> None:
        """KV bytes copied (a move, a transfer): each destination slot is poisoned as its source is."""
        pairs = list(zip(np.asarray(src_slots).tolist(), np.asarray(dst_slots).tolist()))
        for a in self.open:
            bad = {(dst_pool, d) for s, d in pairs if (src_pool, s) in a.poisoned}
            a.poisoned -= {(dst_pool, d) for _, d in pairs}
            a.poisoned |= bad

    def _close(self) -> None:
        for a in [a for a in self.open if not a.poisoned and not a.victims]:
            self.open.remove(a)
            self.done.append(a)

    def all(self) -> list:
        return self.done + self.open
