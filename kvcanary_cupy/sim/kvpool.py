"""A small K/V pool with real bytes, so that real-KV fingerprints apply.

The bytes a token leaves in the pool are a deterministic function of (token, position, layer) and
of the tokens before it (a context hash, :func:`prefix_contexts`): word ``w`` of layer ``l``'s K
(``h = 0``) or V (``h = 1``) row is ``mix3(token ^ context, position, (2 * l + h) * words + w)``.
A shared prefix therefore has the same bytes in every request, as a real model's KV would, and
the same token behind another prefix has other bytes.  Like SGLang, the record's fingerprint reads layer 0
only (its K and V rows); the deep fingerprints (on by default in the simulator) read every layer.
"""

from __future__ import annotations

import numpy as np

from ..hashing import splitmix64
from ..constants import SPLITMIX64_MUL1, SPLITMIX64_MUL2, SPLITMIX64_SHIFT1, SPLITMIX64_SHIFT2, SPLITMIX64_SHIFT3
from ..plans import RealKvSource


def _splitmix64(xp, x):
    x = x ^ (x >> xp.uint64(SPLITMIX64_SHIFT1))
    x = x * xp.uint64(SPLITMIX64_MUL1)
    x = x ^ (x >> xp.uint64(SPLITMIX64_SHIFT2))
    x = x * xp.uint64(SPLITMIX64_MUL2)
    return x ^ (x >> xp.uint64(SPLITMIX64_SHIFT3))


def kv_rows(xp, tokens, positions, num_layers: int, row_bytes: int, contexts=None):
    """uint8 ``[n, num_layers, 2, row_bytes]``: the K and V bytes of each (token, position,
    context); ``contexts`` (uint64, default 0) stands for the tokens before it, which a real
    model's KV depends on: the same token at the same position behind another prefix (a rejected
    draft's) has other bytes."""
    words = row_bytes // 8
    salt = xp.arange(num_layers * 2 * words, dtype=xp.uint64)[None, :]
    t = xp.asarray(tokens).astype(xp.uint64)[:, None]
    p = xp.asarray(positions).astype(xp.uint64)[:, None]
    if contexts is not None:
        t = t ^ xp.asarray(contexts).astype(xp.uint64)[:, None]
    with np.errstate(over="ignore"):
        h = _splitmix64(xp, _splitmix64(xp, _splitmix64(xp, t) ^ p) ^ salt)
    return xp.ascontiguousarray(h).view(xp.uint8).reshape(-1, num_layers, 2, row_bytes)


def prefix_contexts(tokens) -> np.ndarray:
    """uint64 ``[len(tokens) + 1]``: entry i is the context of a token at position i behind ``tokens[:i]``."""
    out = np.zeros(len(tokens) + 1, np.uint64)
    h = 0
    for i, t in enumerate(np.asarray(tokens).tolist()):
        h = splitmix64(h ^ (t & 0xFFFFFFFFFFFFFFFF))
        out[i + 1] = h
    return out


def step_contexts(committed_context: int, fed) -> list:
    """The contexts of a step's fed tokens ``fed`` behind a committed prefix of context ``committed_context``."""
    out, h = [], int(committed_context)
    for t in np.asarray(fed).tolist():
        out.append(h)
        h = splitmix64(h ^ (t & 0xFFFFFFFFFFFFFFFF))
    return out


class KvPool:
    """``data[layer, k_or_v, slot, byte]``: the KV bytes of every slot (slot 0 is padding)."""

    def __init__(self, xp, num_slots: int, *, num_layers: int = 2, row_bytes: int = 32):
        if row_bytes % 16:
            raise ValueError(f"kvcanary sim: row_bytes must be a multiple of 16, got {row_bytes}")
        self.xp = xp
        self.num_layers = num_layers
        self.row_bytes = row_bytes
        self.data = xp.zeros((num_layers, 2, num_slots, row_bytes), xp.uint8)

    def real_kv_sources(self) -> tuple:
        """Layer 0's K and V rows, fingerprinted whole (``RealKvHashMode.ALL``)."""
        return tuple(RealKvSource(self.data[0, h], 1, self.row_bytes, self.row_bytes) for h in (0, 1))

    def every_layer_sources(self) -> tuple:
        """Every layer's K and V rows (the deep fingerprints' sources), layer by layer."""
        return tuple(RealKvSource(self.data[layer, h], 1, self.row_bytes, self.row_bytes)
                     for layer in range(self.num_layers) for h in (0, 1))

    def store(self, slots, tokens, positions, contexts=None) -> None:
        """The model's KV store: the bytes of each (token, position, context) into its slot."""
        xp = self.xp
        slots = xp.asarray(slots)
        if slots.shape[0] == 0:
            return
        rows = kv_rows(xp, tokens, positions, self.num_layers, self.row_bytes, contexts)
        self.data[:, :, slots] = rows.transpose(1, 2, 0, 3)

    def copy_rows(self, src_slots, dst_slots, dst_pool: "KvPool | None" = None) -> None:
        """Copy every layer's K/V rows of ``src_slots`` to ``dst_slots`` (of ``dst_pool``)."""
        dst = self if dst_pool is None else dst_pool
        dst.data[:, :, self.xp.asarray(dst_slots)] = self.data[:, :, self.xp.asarray(src_slots)]

    def flip_bit(self, slot: int, layer: int, half: int, byte: int, bit: int) -> None:
        self.data[layer, half, slot, byte] ^= np.uint8(1 << bit)
