"""How each vLLM attention backend lays out a layer's paged KV, as real-KV sources of the canary.

vLLM 0.32 hands every attention layer a 4-D view ``kv[block, head, token, content]`` of its KV
(``content`` = ``2 * head_size``; the memory order is the group's ``KVCacheLayout``).  What the
content means depends on the backend, read from its source:

- ``CPU_ATTN`` (vLLM's CPU build; ``LBHNC``): per (block, head) one contiguous region of
  ``block_size * 2 * head_size`` elements, **K transposed** ``[head_size, block_size]`` (element
  ``d`` of token ``t`` at ``d * block_size + t``) then V token-major ``[block_size, head_size]``
  (``kv.chunk(2, dim=2)`` in ``cpu_attn.py``).  Its AMX path (bfloat16 on CPUs with AMX tiles)
  packs both VNNI-style: not fingerprinted.
- ``FLASH_ATTN``, ``TRITON_ATTN``, ``FLASHINFER`` (GPU builds): per token and head, K then V
  (``kv.transpose(1, 2).split(head_size, dim=-1)`` in ``flash_attn.py`` / ``triton_attn.py``; the
  FlashInfer backend takes the same NHD/HND views), any of the layouts whose block holds a layer's
  heads (``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``), from the tensor's strides.

A slot is ``block * block_size + token``; a source's row is one block.  K of the CPU layout and
every GPU layout need a strided source (``RealKvSource.strided``); without one (a kvcanary-cupy
that lacks it) only the CPU layout's V is fingerprinted, one source per head.
"""

from __future__ import annotations

from ..constants import MAX_REAL_KV_SOURCES
from ..plans import RealKvSource

#: The attention backends whose layout an adapter reads, by vLLM's backend name.
SUPPORTED_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")


class LayoutNotCovered(Exception):
    """The layer's KV cannot be fingerprinted (a packed or unknown layout); the reason is the message."""


def has_strided_sources() -> bool:
    return hasattr(RealKvSource, "strided")


def layer_sources(backend: str, kv, block_size: int, head_size: int, *, isa: str | None = None) -> list[RealKvSource]:
    """The real-KV sources (K first, then V) of one layer's view ``kv`` ``[blocks, heads, block_size, 2 * head_size]``."""
    if backend not in SUPPORTED_BACKENDS:
        raise LayoutNotCovered(f"attention backend {backend} (the adapters read {', '.join(SUPPORTED_BACKENDS)})")
    if kv.dim() != 4 or kv.shape[2] != block_size or kv.shape[3] != 2 * head_size:
        raise LayoutNotCovered(f"a KV view of shape {tuple(kv.shape)} (expected [blocks, heads, {block_size}, {2 * head_size}])")
    e = kv.element_size()
    _, heads, n, _ = kv.shape
    s_block, s_head, s_token, s_content = (s * e for s in kv.stride())
    if backend == "CPU_ATTN":
        if isa == "amx":
            raise LayoutNotCovered("the CPU backend's AMX layout (VNNI-packed K and V)")
        if s_content != e or s_token != 2 * head_size * e:
            raise LayoutNotCovered(f"a CPU KV view with strides {tuple(kv.stride())} (each (block, head) region must be contiguous)")
        region = n * head_size * e  # K's bytes of one (block, head); V's follow
        if not has_strided_sources():
            flat = kv.reshape(kv.shape[0], heads, 2, n * head_size)  # a view: the regions are contiguous
            return [RealKvSource(flat[:, h, 1], n, head_size * e, head_size * e) for h in range(heads)]
        k = RealKvSource.strided(kv, n, token_stride=e, piece_bytes=e, pieces=((heads, s_head), (head_size, n * e)))
        v = RealKvSource.strided(kv, n, token_stride=head_size * e, byte_offset=region, piece_bytes=head_size * e,
                                 pieces=((heads, s_head),))
        return [k, v]
    if s_content != e:
        raise LayoutNotCovered(f"a KV view whose content is not contiguous (strides {tuple(kv.stride())})")
    if not has_strided_sources():
        raise LayoutNotCovered(f"{backend}'s per-token K|V layout, which needs RealKvSource.strided")
    piece = head_size * e
    return [RealKvSource.strided(kv, n, token_stride=s_token, byte_offset=half * piece, piece_bytes=piece,
                                 pieces=((heads, s_head),)) for half in (0, 1)]


def sources_for(backend: str, kv_caches, layers, block_size: int, head_size: int, *, isa=None):
    """The sources of the chosen ``layers`` that fit ``MAX_REAL_KV_SOURCES``, and the layers they cover.

    Raises LayoutNotCovered when the backend's layout cannot be fingerprinted at all.
    """
    sources, covered = [], []
    for layer in layers:
        got = layer_sources(backend, kv_caches[layer], block_size, head_size, isa=isa)
        if len(sources) + len(got) > MAX_REAL_KV_SOURCES:
            break
        sources += got
        covered.append(layer)
    return sources, tuple(covered)
