"""How a KV pool lays out its bytes: :class:`KvLayout` and its constructors for the engines' pools.

A layout maps logical coordinates (local layer, half, page, token in page, local head, byte) to
an address::

    byte(l, c, page, t, h, b) = base[l][c] + page * page_stride + t * token_stride + h * head_stride + b

with ``b < strip_bytes`` (one head's ``head_dim`` values: a *strip*, contiguous).  ``base[l][c]`` is
a tensor plus a byte offset, so per-layer tensor lists, stacked layer dims and separate K/V
tensors are all described the same way.  A position's slot (from the engine table) is
``page * page_size + t``.  The layout keeps the tensors as given (views, never copies).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import fail, public_api
from ..interop import Array, backend_view, common_placement, data_ptr, is_torch_tensor
from ..runtime import import_cupy
from ..validation import check_int
from .format import DIGEST_MAX_HEADS, DIGEST_MAX_LAYERS


def _dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _itemsize(t) -> int:
    return t.element_size() if is_torch_tensor(t) else t.dtype.itemsize


def _byte_strides(t) -> tuple:
    return tuple(s * t.element_size() for s in t.stride()) if is_torch_tensor(t) else tuple(t.strides)


def _span_bytes(t) -> int:
    """Bytes from ``t``'s first element to the end of its last (non-negative strides)."""
    if any(int(n) == 0 for n in t.shape):
        return 0
    return sum((int(n) - 1) * s for n, s in zip(t.shape, _byte_strides(t))) + _itemsize(t)


def _byte_span(t, name: str):
    """``t``'s memory from its first element, ``uint8 [span]``, as a NumPy or CuPy view (no copy)."""
    strides = _byte_strides(t)
    if any(s < 0 for s in strides):
        fail(ValueError, f"{name} has negative strides {strides}; pass a tensor with non-negative strides")
    span = _span_bytes(t)
    if is_torch_tensor(t):
        elems = span // t.element_size()
        flat = t.detach().as_strided((elems,), (1,)).view(sys.modules["torch"].uint8)
        return backend_view(flat, name)
    view = backend_view(t, name)
    xp = np if isinstance(view, np.ndarray) else import_cupy()
    flat = xp.lib.stride_tricks.as_strided(view, (span // view.dtype.itemsize,), (view.dtype.itemsize,))
    return flat.view(np.uint8)


def _multiple_of_8(value, name: str) -> int:
    value = check_int(value, name, minimum=0)
    if value % 8:
        fail(ValueError, f"KvLayout {name} must be a multiple of 8 bytes, got {value}")
    return value


@dataclass(frozen=True, eq=False)
class KvLayout:
    """Where a KV pool's bytes are: one descriptor per pool, on each side of a transfer.

    Build one with a constructor for the engine's pool (:meth:`from_sglang`, :meth:`from_vllm`,
    :meth:`from_flashinfer`, :meth:`from_transformers`, :meth:`from_mla`) or the generic
    :meth:`from_strides`.  Every rule is checked here, from shapes and strides only.

    Parameters
    ----------
    buffers : sequence over local layers of sequences over halves of (tensor, byte_offset)
        ``buffers[l][c]``: the tensor holding layer ``l``'s half ``c`` (0 = K, 1 = V) and the byte
        offset of its page 0, token 0, head 0 in it.  Two halves (K and V) or one (MLA, K only);
        every layer the same.  All tensors on one device.
    page_stride, token_stride, head_stride : int
        Bytes between pages, tokens of a page and heads of a token; multiples of 8.
    strip_bytes : int
        Bytes of one head's values (``head_dim * itemsize``; MLA: the whole row), a positive
        multiple of 8.
    page_size : int
        Tokens per page; slot ``s`` of the engine table is page ``s // page_size``, token ``s %
        page_size``.
    num_pages : int
        Pages of the pool; every address of every page lies inside its tensor (checked).
    num_heads : int
        KV heads of this pool (this rank's shard).
    head_offset : int
        The global index of local head 0 (a tensor-parallel shard's first head).
    num_heads_total : int
        KV heads of the whole model (``head_offset + num_heads`` at most); 0 means ``num_heads``.
    layer_offset : int
        The global index of local layer 0 (a pipeline stage's first layer).
    dtype : str
        The element dtype's name (``"bfloat16"``); part of the signature, so an fp8 pool read as
        uint8 must say ``dtype="float8_e4m3fn"`` on both sides.
    name : str
        The physical layout's name (``"NHD"``, ``"HND"``...): information only.

    Raises
    ------
    TypeError, ValueError
        A stride or strip that is not a multiple of 8 bytes, a tensor too small for
        ``num_pages``, tensors on different devices, a misaligned base; the message names the field.

    Examples
    --------
    >>> k = [np.zeros((16, 2, 8), np.float16) for _ in range(3)]  # SGLang: 3 layers, 16 slots, 2 heads
    >>> layout = KvLayout.from_sglang(k, [x.copy() for x in k], page_size=4)
    >>> layout.num_layers, layout.halves, layout.num_pages, layout.strip_bytes
    (3, 2, 4, 16)
    """

    buffers: tuple
    page_stride: int
    token_stride: int
    head_stride: int
    strip_bytes: int
    page_size: int
    num_pages: int
    num_heads: int
    head_offset: int = 0
    num_heads_total: int = 0
    layer_offset: int = 0
    dtype: str = "uint8"
    name: str = "custom"
    _spans: tuple = field(default=(), init=False, repr=False)  # backend byte views [l][c] starting at each base
    _placement: Any = field(default=None, init=False, repr=False)

    @public_api
    def __post_init__(self):
        buffers = tuple(tuple((b, 0) if not isinstance(b, tuple) else b for b in layer) for layer in self.buffers)
        if not buffers or not buffers[0]:
            fail(ValueError, "KvLayout.buffers must hold at least one layer of at least one half")
        halves = len(buffers[0])
        if halves not in (1, 2) or any(len(layer) != halves for layer in buffers):
            fail(ValueError, f"KvLayout.buffers: every layer must hold the same 1 (K only, MLA) or 2 (K, V) halves, "
                             f"got {[len(layer) for layer in buffers]}")
        strip = _multiple_of_8(self.strip_bytes, "strip_bytes")  # the head size: the usual cause of the strides' misfit
        if strip == 0:
            fail(ValueError, "KvLayout strip_bytes must be positive, got 0")
        for name in ("page_stride", "token_stride", "head_stride"):
            _multiple_of_8(getattr(self, name), name)
        check_int(self.page_size, "KvLayout page_size", minimum=1, maximum=2**31 - 1)
        check_int(self.num_pages, "KvLayout num_pages", minimum=0, maximum=2**62 // max(self.page_size, 1))
        check_int(self.num_heads, "KvLayout num_heads", minimum=1, maximum=DIGEST_MAX_HEADS)
        check_int(self.head_offset, "KvLayout head_offset", minimum=0)
        total = check_int(self.num_heads_total, "KvLayout num_heads_total", minimum=0, maximum=DIGEST_MAX_HEADS) or self.num_heads
        if self.head_offset + self.num_heads > total:
            fail(ValueError, f"KvLayout head_offset ({self.head_offset}) + num_heads ({self.num_heads}) exceeds "
                             f"num_heads_total ({total})")
        check_int(self.layer_offset, "KvLayout layer_offset", minimum=0)
        if self.layer_offset + len(buffers) > DIGEST_MAX_LAYERS:
            fail(ValueError, f"KvLayout layer_offset + num_layers must be below {DIGEST_MAX_LAYERS}, "
                             f"got {self.layer_offset + len(buffers)}")
        placement = common_placement({f"buffers[{l}][{c}]": t for l, layer in enumerate(buffers) for c, (t, _) in enumerate(layer)})
        reach = 0 if self.num_pages == 0 else ((self.num_pages - 1) * self.page_stride + (self.page_size - 1) * self.token_stride
                                               + (self.num_heads - 1) * self.head_stride + strip)
        spans, seen = [], {}
        for l, layer in enumerate(buffers):
            row = []
            for c, (t, offset) in enumerate(layer):
                where = f"KvLayout buffers[{l}][{c}]"
                offset = _multiple_of_8(offset, f"buffers[{l}][{c}] byte offset")
                key = id(t)
                if key not in seen:
                    seen[key] = _byte_span(t, where)
                span = seen[key]
                if data_ptr(span) % 8:
                    fail(ValueError, f"{where} must start at a multiple of 8 bytes (words are read whole), "
                                     f"got an address {data_ptr(span) % 8} bytes past one")
                if offset + reach > span.shape[0]:
                    fail(ValueError, f"{where} is too small for the layout: {self.num_pages} pages reach byte "
                                     f"{offset + reach} but the tensor spans {span.shape[0]} bytes")
                row.append(span[offset:offset + reach] if reach else span[:0])
            spans.append(tuple(row))
        object.__setattr__(self, "buffers", buffers)
        object.__setattr__(self, "num_heads_total", total)
        object.__setattr__(self, "_spans", tuple(spans))
        object.__setattr__(self, "_placement", placement)
        if placement.backend == "cupy":  # the kernels read each (layer, half)'s base address from device memory
            cupy = import_cupy()
            with cupy.cuda.Device(placement.device):
                ptrs = np.array([data_ptr(s) for row in spans for s in row], np.uint64)
                object.__setattr__(self, "_device_pointers", cupy.asarray(ptrs))

    @property
    def num_layers(self) -> int:
        return len(self.buffers)

    @property
    def halves(self) -> int:
        return len(self.buffers[0])

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def __repr__(self) -> str:
        return (f"<KvLayout {self.name} {self.dtype}: layers {self.layer_offset}+{self.num_layers}, halves {self.halves}, "
                f"heads {self.head_offset}+{self.num_heads}/{self.num_heads_total}, strip {self.strip_bytes} B, "
                f"{self.num_pages} pages x {self.page_size} on {self._placement.describe()}>")

    # ---- constructors -------------------------------------------------------------------------

    @classmethod
    @public_api
    def from_strides(cls, buffers: Sequence[Sequence[Any]], *, page_stride: int, token_stride: int, head_stride: int,
                     strip_bytes: int, page_size: int, num_pages: int, num_heads: int, **shard: Any) -> "KvLayout":
        """The generic constructor: every stride in bytes, as the class documents.

        Parameters
        ----------
        buffers : sequence over layers of sequences over halves of tensor or (tensor, byte_offset)
            Where each layer's half starts.
        page_stride, token_stride, head_stride, strip_bytes, page_size, num_pages, num_heads : int
            As the class documents.
        shard : keywords
            ``head_offset``, ``num_heads_total``, ``layer_offset``, ``dtype``, ``name``.
        """
        return cls(tuple(tuple(layer) for layer in buffers), page_stride, token_stride, head_stride, strip_bytes,
                   page_size, num_pages, num_heads, **shard)

    @classmethod
    @public_api
    def from_sglang(cls, k_buffers: Sequence[Array], v_buffers: Sequence[Array] | None = None, *, page_size: int = 1,
                    **shard: Any) -> "KvLayout":
        """SGLang's MHA pool: ``k_buffer[l]``, ``v_buffer[l]`` of shape ``(num_slots, H, D)``, one row a slot.

        Parameters
        ----------
        k_buffers, v_buffers : sequences of arrays [num_slots, H, D]
            Per layer; ``v_buffers=None`` for a K-only pool (MLA: ``(num_slots, 1, kv_lora_rank +
            rope)``).  Rows of ``D`` values contiguous.
        page_size : int
            The pool's page size (its slot ``s`` is page ``s // page_size``).
        shard : keywords
            ``head_offset``, ``num_heads_total``, ``layer_offset``, ``name`` (``dtype`` is read
            off the tensors).
        """
        first = k_buffers[0]
        if len(first.shape) != 3:
            fail(ValueError, f"k_buffers[0] must be 3-D (num_slots, heads, head_dim), got shape {tuple(first.shape)}")
        slots, heads, dim = (int(n) for n in first.shape)
        tok, head, elem = _byte_strides(first)
        if elem != _itemsize(first):
            fail(ValueError, f"k_buffers[0] must be contiguous along head_dim, got strides {_byte_strides(first)} bytes")
        layers = [(k,) if v_buffers is None else (k, v_buffers[i]) for i, k in enumerate(k_buffers)]
        shard.setdefault("dtype", _dtype_name(first))
        shard.setdefault("name", "sglang-mla" if v_buffers is None else "sglang")
        return cls(tuple(layers), page_size * tok, tok, head, dim * elem, page_size, slots // page_size, heads, **shard)

    @classmethod
    def from_mla(cls, kv_buffers: Sequence[Array], *, page_size: int = 1, **shard: Any) -> "KvLayout":
        """An MLA (K-only) pool: ``kv_buffer[l]`` of shape ``(num_slots, 1, kv_lora_rank + rope)``.

        Parameters
        ----------
        kv_buffers : sequence of arrays [num_slots, 1, R]
            Per layer.
        page_size : int
            The pool's page size.
        shard : keywords
            As :meth:`from_sglang`.
        """
        return cls.from_sglang(kv_buffers, None, page_size=page_size, **shard)

    @classmethod
    @public_api
    def from_vllm(cls, kv_caches: Sequence[Array], *, kv_first: bool = True, name: str | None = None,
                  **shard: Any) -> "KvLayout":
        """vLLM's per-layer caches, with the logical shape ``(2, num_blocks, block_size, H, D)``.

        The physical order (NHD, HND: a stride permutation of that shape, as vLLM's
        ``kv_cache_layout`` gives it) is read off the strides, so either works as it is.

        Parameters
        ----------
        kv_caches : sequence of arrays
            One per layer, logical shape ``(2, nb, bs, H, D)`` (``kv_first=True``, FlashAttention)
            or ``(nb, 2, bs, H, D)`` (``kv_first=False``, FlashInfer backend).
        kv_first : bool
            Which of the two logical shapes ``kv_caches`` have.
        name : str, optional
            The layout's name; default ``"vllm-NHD"`` or ``"vllm-HND"`` from the strides.
        shard : keywords
            ``head_offset``, ``num_heads_total``, ``layer_offset``.
        """
        first = kv_caches[0]
        if len(first.shape) != 5:
            fail(ValueError, f"kv_caches[0] must be 5-D, got shape {tuple(first.shape)}")
        st = _byte_strides(first)
        if kv_first:
            (_, nb, bs, heads, dim), (half, page, tok, head, elem) = first.shape, st
        else:
            (nb, _, bs, heads, dim), (page, half, tok, head, elem) = first.shape, st
        if elem != _itemsize(first):
            fail(ValueError, f"kv_caches[0] must be contiguous along head_dim, got strides {st} bytes")
        shard.setdefault("dtype", _dtype_name(first))
        layers = tuple(((t, 0), (t, half)) for t in kv_caches)
        return cls(layers, page, tok, head, int(dim) * elem, int(bs), int(nb), int(heads),
                   name=name or ("vllm-HND" if head > tok else "vllm-NHD"), **shard)

    @classmethod
    @public_api
    def from_flashinfer(cls, paged_kv_cache: Sequence[Any], kv_layout: str = "NHD", **shard: Any) -> "KvLayout":
        """FlashInfer's paged caches, per layer: one tensor ``(np, 2, ps, H, D)`` (NHD) or
        ``(np, 2, H, ps, D)`` (HND), or a tuple ``(k, v)`` of ``(np, ps, H, D)`` / ``(np, H, ps, D)``.

        Parameters
        ----------
        paged_kv_cache : sequence over layers of a tensor or a (k, v) tuple
            As FlashInfer takes them.
        kv_layout : str
            ``"NHD"`` or ``"HND"``, as given to FlashInfer's wrappers.
        shard : keywords
            ``head_offset``, ``num_heads_total``, ``layer_offset``.
        """
        if kv_layout not in ("NHD", "HND"):
            fail(ValueError, f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        first = paged_kv_cache[0]
        split = isinstance(first, (tuple, list))
        t = first[0] if split else first
        shape, st = tuple(int(n) for n in t.shape), _byte_strides(t)
        if len(shape) != (4 if split else 5):
            fail(ValueError, f"paged_kv_cache[0] must be {'4-D tensors (k, v)' if split else 'a 5-D tensor'}, got shape {shape}")
        dims = shape if split else shape[:1] + shape[2:]
        strides = st if split else st[:1] + st[2:]
        np_, a, b, dim = dims
        sp, sa, sb, elem = strides
        ps, heads, tok, head = (a, b, sa, sb) if kv_layout == "NHD" else (b, a, sb, sa)
        if elem != _itemsize(t):
            fail(ValueError, f"paged_kv_cache[0] must be contiguous along head_dim, got strides {st} bytes")
        layers = tuple(((x[0], 0), (x[1], 0)) if split else ((x, 0), (x, st[1])) for x in paged_kv_cache)
        shard.setdefault("dtype", _dtype_name(t))
        return cls(layers, sp, tok, head, dim * elem, ps, np_, heads, name=f"flashinfer-{kv_layout}", **shard)

    @classmethod
    @public_api
    def from_transformers(cls, cache: Any, **shard: Any) -> "KvLayout":
        """A transformers KV cache (``DynamicCache``/``StaticCache``, or ``(keys, values)`` lists):
        per layer ``(batch, H, seq, D)``; batch row ``b`` is page ``b`` of ``seq`` tokens.

        Address it with ``kc.PagedKvIndices(kv_indptr=[0, 1, ..., B], kv_indices=[0, ..., B - 1],
        page_size=seq)`` (batch row ``b`` owns page ``b``).

        Parameters
        ----------
        cache : a transformers Cache, or a (keys, values) pair of sequences of tensors
            Its ``layers[i].keys`` / ``.values`` (transformers 4.56 and later) or
            ``key_cache`` / ``value_cache`` lists are read.
        shard : keywords
            ``head_offset``, ``num_heads_total``, ``layer_offset``.
        """
        if isinstance(cache, (tuple, list)) and len(cache) == 2:
            keys, values = cache
        elif hasattr(cache, "layers"):
            keys, values = [l.keys for l in cache.layers], [l.values for l in cache.layers]
        elif hasattr(cache, "key_cache"):
            keys, values = cache.key_cache, cache.value_cache
        else:
            fail(TypeError, f"cache must be a transformers Cache or a (keys, values) pair, got {type(cache).__name__}")
        first = keys[0]
        if len(first.shape) != 4:
            fail(ValueError, f"the cache's layer-0 keys must be 4-D (batch, heads, seq, head_dim), got shape {tuple(first.shape)}")
        batch, heads, seq, dim = (int(n) for n in first.shape)
        page, head, tok, elem = _byte_strides(first)
        if elem != _itemsize(first):
            fail(ValueError, f"the cache's keys must be contiguous along head_dim, got strides {_byte_strides(first)} bytes")
        shard.setdefault("dtype", _dtype_name(first))
        return cls(tuple((k, v) for k, v in zip(keys, values)), page, tok, head, dim * elem, seq, batch, heads,
                   name="transformers", **shard)
