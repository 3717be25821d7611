"""Where transformers' continuous batching keeps its KV, version by version (5.17 .. 5.22 and 5.23 on).

Everything the canary needs from a ``PagedAttentionCache`` goes through one :class:`Layout`: the full
attention group's KV views (one row per engine index), how an engine block id maps to canary pages,
its block tables, its complete (hashed) blocks and their predecessors, and the methods that copy
blocks (forks).  docs/engines.md ("Hugging Face transformers") describes both layouts.

Canary slots are engine indices shifted by ``slot_offset``: 5.17 hands out block 0 (index 0) first,
so its canary keeps one block of slots in front (``slot_offset = block_size``) and slot 0 stays the
padding slot; 5.23 keeps its first sectors as trash (index 0 is never allocated), so its offset is 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: The transformers versions whose internals this module reads (inclusive lower, exclusive upper).
SUPPORTED = ((5, 17), (5, 26))
FLAT_CACHE = (5, 23)  # one flat uint8 cache tensor, interleaved K/V pages, per-allocator ledgers


def parse_version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


@dataclass
class Layout:
    """The canary's view of one full-attention KV group of a ``PagedAttentionCache``."""

    version: tuple[int, int]
    cache: Any
    group: int  # the group's index in the batch's read_index / write_index lists
    layers: tuple  # model layer indices of the group
    block_size: int  # tokens per block
    page_stride: int  # canary pages (of block_size slots) between two engine block ids
    page_base: int  # canary page of engine block 0
    num_slots: int  # canary slots: every engine index plus slot_offset
    kv: dict = field(default_factory=dict)  # layer -> (K view, V view), one row per engine index
    parents: dict = field(default_factory=dict)  # block -> (depth, parent, parent's hash, own hash), as hashed

    @property
    def slot_offset(self) -> int:
        return self.page_base * self.block_size

    def canary_page(self, block: int) -> int:
        return block * self.page_stride + self.page_base

    # -- the engine's bookkeeping ----------------------------------------------------------------

    def block_tables(self) -> dict:
        """request id -> list of block ids (the allocator's own dict, read only)."""
        if self.version >= FLAT_CACHE:
            return self.cache.cache_allocators["full_attention"].block_table
        return self.cache.group_cache_managers[self.group].block_table

    def hashed_blocks(self) -> dict:
        """Complete blocks: block id -> hash."""
        if self.version >= FLAT_CACHE:
            return self.cache.cache_allocators["full_attention"].ledger.block_to_hash
        manager = self.cache._block_manager
        return {b: h for h, b in manager._hash_to_id.items()}

    def is_complete(self, block: int) -> bool:
        if self.version >= FLAT_CACHE:
            return block in self.hashed_blocks()
        b = self.cache._block_manager._id_to_block.get(block)
        return b is not None and b.is_complete

    def parent(self, block: int, hashed: dict):
        """``(depth, parent block or None)`` of a complete block whose place is known and still holds:
        its hash and its parent's are the ones recorded when it became complete (an evicted and reused
        parent leaves the block unreachable from the root, as the engine's own prefix search finds it)."""
        rec = self.parents.get(block)
        if rec is None:
            return None
        depth, parent, parent_hash, own_hash = rec
        if hashed.get(block) != own_hash or (parent is not None and hashed.get(parent) != parent_hash):
            return None
        return depth, parent

    def record_parents(self, request_id: str) -> None:
        """Remember each complete block's place in ``request_id``'s table, with its and its parent's hash."""
        table = self.block_tables().get(request_id, ())
        hashed = self.hashed_blocks()
        for i, block in enumerate(table):
            own = hashed.get(block)
            if own is None:
                break
            parent = table[i - 1] if i else None
            self.parents[block] = (i, parent, hashed.get(parent) if i else None, own)


def layout_of(cache, version: tuple[int, int]) -> Layout:
    """The layout of ``cache``'s full-attention group (the only group: sliding windows are refused)."""
    if version >= FLAT_CACHE:
        allocator = cache.cache_allocators["full_attention"]
        views = {layer: allocator._kv_token_views[layer] for layer in allocator.layer_indices}
        rows = min(min(k.shape[0], v.shape[0]) for k, v in views.values())
        block = allocator.tokens_per_page
        return Layout(version, cache, allocator.index, tuple(allocator.layer_indices), block,
                      allocator.block_physical_stride // block, 0, rows, views)
    layers = sorted(cache.layer_index_to_group_indices)
    views = {layer: (cache.key_cache[cache.layer_index_to_group_indices[layer][1]],
                     cache.value_cache[cache.layer_index_to_group_indices[layer][1]]) for layer in layers}
    block = cache.block_size
    rows = cache.key_cache[0].shape[0]
    return Layout(version, cache, 0, tuple(layers), block, 1, 1, rows + block, views)


def wrap(obj, name: str, make: Callable[[Callable], Callable], undo: list) -> None:
    """Set ``obj.name`` to ``make(original bound method)`` on the instance; ``undo`` gets its reversal."""
    had = name in vars(obj)
    original = getattr(obj, name)
    setattr(obj, name, make(original))

    def restore():
        if had:
            setattr(obj, name, original)
        else:
            delattr(obj, name)

    undo.append(restore)


def hook_cache(layout: Layout, on_copy: Callable[[list, list], None], undo: list) -> None:
    """Call ``on_copy(src_blocks, dst_blocks)`` after each fork copy, and record the place (depth,
    parent, hashes) of newly complete blocks for the prefix-cache sweep."""
    cache = layout.cache
    if layout.version >= FLAT_CACHE:
        def perform_cache_copy(original):
            def hooked(copy_src_and_dst):
                original(copy_src_and_dst)
                src, dst = copy_src_and_dst.get("full_attention", ((), ()))
                if src:
                    on_copy(list(src), list(dst))
            return hooked

        wrap(cache, "perform_cache_copy", perform_cache_copy, undo)
        allocator = cache.cache_allocators["full_attention"]

        def mark_complete_blocks(original):
            def hooked(request_id, token_ids, new_new_blocks):
                original(request_id, token_ids, new_new_blocks)
                layout.record_parents(request_id)
            return hooked

        wrap(allocator, "mark_complete_blocks", mark_complete_blocks, undo)
    else:
        def copy_cache(original):
            def hooked(list_source_blocks, list_forked_blocks):
                original(list_source_blocks, list_forked_blocks)
                on_copy(list(list_source_blocks), list(list_forked_blocks))
            return hooked

        def mark(original):
            def hooked(state, num_complete_blocks):
                original(state, num_complete_blocks)
                layout.record_parents(state.request_id)
            return hooked

        wrap(cache, "copy_cache", copy_cache, undo)
        wrap(cache, "mark_shareable_blocks_as_complete", mark, undo)
