"""The fault classes ``kvcanary hf`` injects into transformers' real continuous-batching engine.

Each is injected the way the real bug would happen: inside the engine's own batch preparation,
allocator, prefix cache or KV tensors, never in the canary.  A fault waits (armed) until the
engine state it needs exists (a decoding request, a cached block, a prefix hit), fires once and
records the session step it fired in; :mod:`kvcanary_cupy.hf.runner` then measures whether and
when the canary reports it.
"""

from __future__ import annotations

from ..integrations._hf_layout import FLAT_CACHE
from .config import HfEngineConfig


class Fault:
    name = ""
    description = ""
    #: Why the canary cannot see this class without the coverage option ``visible_by`` (None: it can).
    why_not_detectable: str | None = None
    #: The HfEngineConfig coverage option (deep_kv_layers, check_lost_stores) that lets the canary see it.
    visible_by: str | None = None
    #: ContinuousBatchingConfig overrides of this class's runs (the engine state the fault needs).
    overrides: dict = {}

    def __init__(self):
        self.fired_step: int | None = None
        self.victims: tuple = ()

    @classmethod
    def detectable_with(cls, addressing: str = "", engine=None) -> bool:
        """Whether the canary can see this class by design with ``engine``'s coverage options
        (an HfEngineConfig; None: its defaults)."""
        if cls.why_not_detectable is None:
            return True
        if engine is None:
            engine = HfEngineConfig()
        return bool(cls.visible_by and getattr(engine, cls.visible_by) not in (None, False, "none", ()))

    # hooks, called by the harness with its context (kvcanary_cupy.hf.runner.Harness)
    def before_prepare(self, h) -> None:
        """Between two steps: the engine's state may be edited."""

    def after_prepare(self, h) -> None:
        """After the batch's tensors are built, before the forward reads them."""

    def around_compute(self, h, compute) -> None:
        compute()

    def prefix_blocks(self, h, blocks: list) -> list:
        """The blocks a prefix-cache hit hands out."""
        return blocks

    def fire(self, h, *victims) -> None:
        self.fired_step, self.victims = h.step, tuple(str(v) for v in victims)


def _decoding(h):
    """(batch row, FutureRequestState, index of its token) of the batch's single-token rows, after prepare."""
    rows, start = [], 0
    for i, fs in enumerate(h.io.requests_in_batch):
        if fs.query_length == 1 and fs.state.position_offset > h.layout.block_size:
            rows.append((i, fs, start))
        start += fs.query_length
    return rows


class WriteIndexOffByOne(Fault):
    name = "write_index_off_by_one"
    description = "One decoding token's write_index names the slot after its own: its KV lands one slot off."

    def after_prepare(self, h):
        rows = _decoding(h)
        if self.fired_step is None and rows and not h.io.use_block_table:
            _, fs, t = rows[h.rng.integers(len(rows))]
            h.io.write_index_storage[h.layout.group, t] += 1
            self.fire(h, fs.state.request_id)


class ReadIndexOtherRequest(Fault):
    name = "read_index_other_request"
    description = "A step's read_index gathers one block of another request in place of the request's own first block."

    def after_prepare(self, h):
        rows = _decoding(h)
        if self.fired_step is not None or len(rows) < 2 or h.io.max_kv_read == 0:
            return
        a, b = (rows[i] for i in h.rng.permutation(len(rows))[:2])
        cu = h.io.cumulative_seqlens_k["full_attention"]
        start_a, start_b = int(cu[a[0]]), int(cu[b[0]])
        size = h.layout.block_size
        read = h.io.read_index_storage[h.layout.group]
        if int(read[start_a]) // size == int(read[start_b]) // size:  # both hold the same (shared) block
            return
        read[start_a : start_a + size] = read[start_b : start_b + size].clone()
        self.fire(h, a[1].state.request_id)


class BlockListsSwapped(Fault):
    name = "block_lists_swapped"
    description = "Two running requests' block lists are swapped in the allocator's table."

    def before_prepare(self, h):
        if self.fired_step is not None:
            return
        tables = h.layout.block_tables()
        running = [r for r, s in h.active().items() if s.position_offset > h.layout.block_size and r in tables]
        by_len = {}
        for r in running:
            by_len.setdefault(len(tables[r]), []).append(r)
        pairs = [ids for ids in by_len.values() if len(ids) >= 2 and tables[ids[0]] != tables[ids[1]]]
        if pairs:
            a, b = pairs[0][:2]
            tables[a], tables[b] = tables[b], tables[a]
            self.fire(h, a, b)


def _flip(h, layer: int, slot: int) -> None:
    """Flip one bit of the K bytes of canary slot ``slot`` in ``layer`` (an index into the group's layers)."""
    k = h.layout.kv[h.layout.layers[layer]][0]
    k[slot - h.layout.slot_offset].reshape(-1).view(h.torch.uint8)[1:2].bitwise_xor_(0x10)


class _KvFlip(Fault):
    layer = 0

    def before_prepare(self, h):
        if self.fired_step is not None:
            return
        tables = h.layout.block_tables()
        running = [(r, s) for r, s in h.active().items() if s.position_offset > 2 and tables.get(r)]
        if running:
            r, state = running[h.rng.integers(len(running))]
            p = int(h.rng.integers(state.position_offset - 1))
            slot = h.layout.canary_page(tables[r][p // h.layout.block_size]) * h.layout.block_size + p % h.layout.block_size
            _flip(h, self.layer if self.layer >= 0 else len(h.layout.layers) + self.layer, slot)
            self.fire(h, r)


class BitFlipFingerprinted(_KvFlip):
    name = "bitflip_fingerprinted_layer"
    description = "One bit of a live request's cached K flips in layer 0, a layer the canary fingerprints."


class BitFlipUnfingerprinted(_KvFlip):
    name = "bitflip_unfingerprinted_layer"
    layer = -1
    description = ("One bit of a live request's cached K flips in the last layer, outside the record's fingerprinted "
                   "layers (seen by the deep fingerprints of every layer, deep_kv_layers).")
    visible_by = "deep_kv_layers"
    why_not_detectable = ("without deep_kv_layers only the fingerprinted layers' bytes are hashed (fingerprint_layers; "
                          "the sessions' MAX_REAL_KV_SOURCES sources hold four layers' K and V; the job's model has five)")


class StalePrefixHit(Fault):
    name = "stale_prefix_hit"
    description = ("A prefix-cache hit hands out another complete block than the one its hash names (an entry "
                   "left stale after the block was evicted and reused).")

    def prefix_blocks(self, h, blocks):
        if self.fired_step is not None or not blocks:
            return blocks
        others = [b for b in h.layout.hashed_blocks() if b not in blocks]
        if not others:
            return blocks
        self.fire(h, f"block {blocks[0]}")
        return [others[h.rng.integers(len(others))]] + list(blocks[1:])


class DoubleFree(Fault):
    name = "double_free"
    description = "A block a running request still writes is freed a second time and handed to the next allocation."

    def before_prepare(self, h):
        if self.fired_step is not None or not h.waiting():
            return
        tables = h.layout.block_tables()
        running = [(r, s) for r, s in h.active().items() if tables.get(r) and s.position_offset % h.layout.block_size > 1
                   and not h.layout.is_complete(tables[r][-1])]
        if not running:
            return
        r, _ = running[h.rng.integers(len(running))]
        block = tables[r][-1]
        cache = h.layout.cache
        if h.version >= FLAT_CACHE:
            cache.pool.free_blocks(cache.cache_allocators["full_attention"].index, [block])
        else:
            cache._block_manager._uninit_block_ids.appendleft(block)
        self.fire(h, r)


class SampledTokensSwapped(Fault):
    name = "sampled_tokens_swapped"
    description = "Two decoding requests' sampled tokens are swapped when copied into the next batch's input_ids."

    def after_prepare(self, h):
        rows = _decoding(h)
        if self.fired_step is not None or len(rows) < 2:
            return
        (_, fa, ta), (_, fb, tb) = rows[0], rows[1]
        ids = h.io.input_ids
        if int(ids[ta]) == int(ids[tb]):
            return
        ids[ta], ids[tb] = ids[tb].clone(), ids[ta].clone()
        self.fire(h, fa.state.request_id, fb.state.request_id)


class ZeroedBlockTableEntry(Fault):
    name = "zeroed_block_table_entry"
    description = "One entry of a running request's block list is zeroed (block id 0)."

    def before_prepare(self, h):
        if self.fired_step is not None:
            return
        tables = h.layout.block_tables()
        running = [r for r, s in h.active().items() if len(tables.get(r, ())) >= 2 and 0 not in tables[r]
                   and s.position_offset > h.layout.block_size]
        if running:
            r = running[h.rng.integers(len(running))]
            tables[r][0] = 0
            self.fire(h, r)


class LostKvStore(Fault):
    name = "lost_kv_store"
    description = ("The model's KV store of one decoding token into a reused slot is lost (the slot keeps its former "
                   "owner's bytes); the canary's write happens (seen by the lost-store check, check_lost_stores).")
    visible_by = "check_lost_stores"
    overrides = {"num_blocks": 20}  # a cache that reuses blocks while requests decode: slots with former owners
    why_not_detectable = ("without check_lost_stores the TAIL write fingerprints whatever bytes are in the slot after the "
                          "forward, so the lost store's old bytes become the expected ones")

    def __init__(self):
        super().__init__()
        self._positions: dict = {}  # engine index -> the position last written there this run

    def around_compute(self, h, compute):
        now = [] if h.io.use_block_table else h.io.write_index_storage[h.layout.group].tolist()
        armed = self.fired_step is None and bool(now)
        # a decoding token whose slot last held another position: a former owner's bytes, another record
        rows = [r for r in _decoding(h) if self._positions.get(now[r[2]], r[1].state.position_offset - 1)
                != r[1].state.position_offset - 1] if armed else []
        start = 0
        for fs in h.io.requests_in_batch if now else ():
            past = fs.state.position_offset - fs.query_length
            for i in range(fs.query_length):
                self._positions[now[start + i]] = past + i
            start += fs.query_length
        if not rows:
            compute()
            return
        _, fs, t = rows[0]
        slot = now[t]
        saved = [(k[slot].clone(), v[slot].clone()) for k, v in h.layout.kv.values()]
        compute()
        for (k, v), (ks, vs) in zip(h.layout.kv.values(), saved):
            k[slot], v[slot] = ks, vs
        self.fire(h, fs.state.request_id)


class FlipInUnheldCachedBlock(Fault):
    name = "flip_in_unheld_cached_block"
    description = "One bit flips in layer 0 of a complete block the prefix cache keeps but no request holds (found by the sweep)."

    def before_prepare(self, h):
        if self.fired_step is not None:
            return
        cache = h.layout.cache
        if h.version >= FLAT_CACHE:
            unheld = list(cache.cache_allocators["full_attention"].ledger.cached_blocks)
        else:
            unheld = list(cache._block_manager._init_block_ids)
        hashed = h.layout.hashed_blocks()
        unheld = [b for b in unheld if h.layout.parent(b, hashed) is not None]
        if unheld:
            block = unheld[h.rng.integers(len(unheld))]
            _flip(h, 0, h.layout.canary_page(block) * h.layout.block_size)
            self.fire(h, f"block {block}")


FAULTS = {cls.name: cls for cls in (
    WriteIndexOffByOne, ReadIndexOtherRequest, BlockListsSwapped, BitFlipFingerprinted, BitFlipUnfingerprinted,
    StalePrefixHit, DoubleFree, SampledTokensSwapped, ZeroedBlockTableEntry, LostKvStore, FlipInUnheldCachedBlock)}
