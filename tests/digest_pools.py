"""Engine-shaped KV pools for the digest tests, built on the host, placed on any backend.

A :class:`Model` holds each request's logical KV bytes ``[L, halves, n, H, strip]`` and tokens;
:func:`build_pool` lays them into one engine's pool (every shape :class:`kc.KvLayout` has a
constructor for), on pages of its own (a permutation of its own), over a pool prefilled with noise
(a previous owner's bytes), with canary records chained as :func:`kc.write` would store them.
Everything is written from the engines' shapes, not from the library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary_cupy as kc
from canary_builders import ANCHOR_H, hmix3, signed

KINDS = ("sglang", "vllm-NHD", "vllm-HND", "flashinfer-NHD", "flashinfer-HND", "flashinfer-tuple", "transformers")
DTYPES = {"bfloat16": (np.uint16, 2), "float32": (np.float32, 4), "fp8": (np.uint8, 1)}


@dataclass
class Model:
    num_layers: int
    halves: int
    num_heads: int
    strip: int  # bytes
    dtype: str
    kv: list  # per request: uint8 [L, halves, n, H, strip]
    tokens: list  # per request: int64 [n]

    @classmethod
    def random(cls, rng, lengths, *, num_layers=3, halves=2, num_heads=2, head_dim=8, dtype="bfloat16"):
        strip = head_dim * DTYPES[dtype][1]
        kv = [rng.integers(0, 256, (num_layers, halves, n, num_heads, strip), dtype=np.uint8) for n in lengths]
        tokens = [rng.integers(1, 30000, n).astype(np.int64) for n in lengths]
        return cls(num_layers, halves, num_heads, strip, dtype, kv, tokens)


@dataclass
class Pool:
    kind: str
    page_size: int
    num_pages: int
    physical: list  # per layer: uint8 host arrays (per half for split kinds)
    views: list  # per layer, per half: uint8 view [num_pages, page_size, H, strip] into physical
    table: np.ndarray  # int32 req_to_token-style [rows, width] of slots
    canary: np.ndarray
    rows: list = field(default_factory=list)  # per request: its table row

    def write(self, r: int, model: Model, positions=None, *, source=None):
        """Lay request r's KV (or ``source``'s bytes: [L, halves, n, H, strip]) at its slots."""
        kv = model.kv[r] if source is None else source
        pos = np.arange(kv.shape[2]) if positions is None else np.asarray(positions)
        slots = self.table[self.rows[r], pos]
        for l in range(model.num_layers):
            for c in range(model.halves):
                self.views[l][c][slots // self.page_size, slots % self.page_size] = kv[l, c, pos]

    def stamp(self, r: int, model: Model, upto=None):
        """Chained canary records for request r's positions [0, upto)."""
        prev = ANCHOR_H
        n = len(model.tokens[r]) if upto is None else upto
        for p in range(n):
            slot = int(self.table[self.rows[r], p])
            tok = int(model.tokens[r][p])
            self.canary[slot, :3] = [tok, p, signed(prev)]
            prev = hmix3(prev, tok, p)


def _zeros(kind, num_layers, halves, num_pages, ps, heads, strip, rng):
    """Physical arrays (noise-filled) and the per-(layer, half) logical views of one pool kind."""
    noise = lambda shape: rng.integers(0, 256, shape, dtype=np.uint8)
    phys, views = [], []
    for _ in range(num_layers):
        if kind == "sglang":
            p = [noise((num_pages * ps, heads, strip)) for _ in range(halves)]
            v = [x.reshape(num_pages, ps, heads, strip) for x in p]
        elif kind == "vllm-NHD":
            p = noise((2, num_pages, ps, heads, strip))
            v = [p[c] for c in range(2)]
        elif kind == "vllm-HND":
            p = noise((2, num_pages, heads, ps, strip))
            v = [p[c].transpose(0, 2, 1, 3) for c in range(2)]
        elif kind == "flashinfer-NHD":
            p = noise((num_pages, 2, ps, heads, strip))
            v = [p[:, c] for c in range(2)]
        elif kind == "flashinfer-HND":
            p = noise((num_pages, 2, heads, ps, strip))
            v = [p[:, c].transpose(0, 2, 1, 3) for c in range(2)]
        elif kind == "flashinfer-tuple":
            p = [noise((num_pages, ps, heads, strip)) for _ in range(2)]
            v = p
        elif kind == "transformers":
            p = [noise((num_pages, heads, ps, strip)) for _ in range(2)]
            v = [x.transpose(0, 2, 1, 3) for x in p]
        else:
            raise ValueError(kind)
        phys.append(p)
        views.append(v)
    return phys, views


def build_pool(kind, model: Model, *, page_size, num_pages, rng, rows=None, noise=True):
    """A pool of ``kind`` holding nothing yet: pages of its own for each request (random ones),
    a req_to_token-style table of slots (row 0 the padding row), a zeroed canary."""
    phys, views = _zeros(kind, model.num_layers, model.halves, num_pages, page_size, model.num_heads, model.strip, rng)
    if not noise:
        for layer in phys:
            for p in (layer if isinstance(layer, list) else [layer]):
                p[...] = 0
    lengths = [len(t) for t in model.tokens]
    width = max(lengths) + page_size
    need = sum(-(-n // page_size) for n in lengths)
    assert need <= num_pages - 1, "pool too small"
    pages = rng.permutation(np.arange(1, num_pages))[:need]  # page 0 holds the padding slot
    table = np.zeros((len(lengths) + 1, -(-width // page_size) * page_size), np.int32)
    at = 0
    for r, n in enumerate(lengths):
        own = pages[at: at + -(-n // page_size)]
        at += len(own)
        pos = np.arange(n)
        table[r + 1, :n] = own[pos // page_size] * page_size + pos % page_size
    canary = np.zeros((num_pages * page_size, 4), np.int64)
    return Pool(kind, page_size, num_pages, phys, views, table, canary, rows=list(range(1, len(lengths) + 1)))


def _as(ab, x, dtype_name):
    """A uint8 host array as the backend's tensor of the element dtype (bf16 as torch.bfloat16)."""
    np_dtype = DTYPES[dtype_name][0]
    typed = np.ascontiguousarray(x).view(np_dtype)
    out = ab.asarray(typed)
    if dtype_name == "bfloat16" and ab.name.startswith("torch"):
        import torch

        out = out.view(torch.bfloat16)
    return out


def _permute(x, axes):
    return x.permute(*axes) if hasattr(x, "permute") else x.transpose(axes)


def layout_of(pool: Pool, model: Model, ab, **shard) -> tuple:
    """The pool's tensors on ``ab`` and the KvLayout its engine's constructor gives them."""
    dtype = "bfloat16" if model.dtype == "bfloat16" else model.dtype
    name_dtype = {"fp8": "float8_e4m3fn"}.get(model.dtype) or dtype
    if not ab.name.startswith("torch") or model.dtype != "bfloat16":
        shard.setdefault("dtype", name_dtype)
    t = [[_as(ab, p, model.dtype) for p in (layer if isinstance(layer, list) else [layer])] for layer in pool.physical]
    kind, ps = pool.kind, pool.page_size
    if kind == "sglang":
        v = [layer[1] for layer in t] if model.halves == 2 else None
        return t, kc.KvLayout.from_sglang([layer[0] for layer in t], v, page_size=ps, **shard)
    if kind == "vllm-NHD":
        return t, kc.KvLayout.from_vllm([layer[0] for layer in t], **shard)
    if kind == "vllm-HND":
        return t, kc.KvLayout.from_vllm([_permute(layer[0], (0, 1, 3, 2, 4)) for layer in t], **shard)
    if kind in ("flashinfer-NHD", "flashinfer-HND"):
        return t, kc.KvLayout.from_flashinfer([layer[0] for layer in t], kind[-3:], **shard)
    if kind == "flashinfer-tuple":
        return t, kc.KvLayout.from_flashinfer([tuple(layer) for layer in t], "NHD", **shard)
    return t, kc.KvLayout.from_transformers(([layer[0] for layer in t], [layer[1] for layer in t]), **shard)
