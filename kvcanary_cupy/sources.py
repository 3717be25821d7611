"""Real-KV sources: where a slot's KV bytes lie in an engine's pool (docs/format.md section 3).

:class:`RealKvSource` describes one pool (contiguous slots, or slots spread through a row: a
strided layout) and :func:`check_num_sources` the sources one canary buffer takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .constants import MAX_PIECE_LEVELS, MAX_REAL_KV_SOURCES
from .errors import fail, public_api
from .validation import INT32_MAX, _is_int, require


@dataclass(frozen=True)
class RealKvSource:
    """A view of one live KV pool whose bytes are fingerprinted into ``real_kv_hash``.

    For canary slot ``s`` the bytes ``[(s % page_size) * num_bytes_per_token, ... + read_bytes)``
    of row ``s // page_size`` of ``tensor`` (viewed as bytes, one row per dim-0 index) are read
    (16 of them under ``RealKvHashMode.PARTIAL``) and folded as :func:`real_kv_fold` does.

    A slot whose bytes are not contiguous (vLLM's CPU layout stores K transposed, ``[D, B]`` per
    block and head) is described by the keyword fields, or built with :meth:`strided`: the slot's
    bytes are then a *stream* of ``num_bytes_per_token`` bytes made of pieces of ``piece_bytes``
    bytes each, piece ``(i, j)`` of the stream (row-major over ``pieces``' counts) lying at
    ``byte_offset + (s % page_size) * token_stride + i * stride_0 + j * stride_1`` bytes into the
    row; the fingerprint reads the stream's first ``read_bytes`` (16 under PARTIAL) bytes in
    order (docs/format.md section 3).  The defaults (``token_stride = num_bytes_per_token``, no
    offset, one piece) are the contiguous layout above, byte for byte.

    Parameters
    ----------
    tensor : array, at least 2-D
        The KV pool, kept as given, never copied; any dtype (bfloat16 and fp8 pools too).  Its
        row stride must be a multiple of 16 bytes (of the piece alignment for a strided source)
        and every byte a slot reads must lie in its row; its rows must cover every canary slot
        (``rows * page_size >= num_slots``, checked at call time).
    page_size : int
        Slots per row, ``>= 1``.
    num_bytes_per_token : int
        Bytes of one slot's stream, a positive multiple of 16.
    read_bytes : int
        Bytes read per slot under ``ALL``: a positive multiple of 16, at most
        ``num_bytes_per_token``.
    slot_offset : int
        ``>= 0``: canary slot ``s`` fingerprints pool slot ``s - slot_offset`` (above, read as
        ``s``), so an engine whose slot 0 is a real slot can keep the canary's padding slot 0
        apart: give the canary ``slot_offset`` more slots and add it to the slots its tables
        and ``out_cache_loc`` name.  Canary slots below it have no KV bytes in this source (its
        strip folds as zero).  The rows must then cover ``num_slots - slot_offset`` slots.
    token_stride : int, optional
        Bytes from one slot's first byte to the next slot's within a row; None:
        ``num_bytes_per_token``.
    byte_offset : int
        Bytes into each row where the row's first slot starts.
    piece_bytes : int, optional
        Bytes of one contiguous piece of the stream: 1, 2, 4 or a multiple of 8; None: the whole
        stream is one piece (then ``pieces`` must be empty).
    pieces : tuple of (count, stride) pairs
        One or two ``(count, stride in bytes)`` levels, outer first, whose counts multiply to
        ``num_bytes_per_token / piece_bytes``; empty: one piece.

    Raises
    ------
    ValueError
        Any of the rules above broken; the message names the field.

    Examples
    --------
    >>> k_pool = np.zeros((64, 8, 128), np.float16)  # [slots, heads, head_dim]: 2048 bytes a slot
    >>> src = kc.RealKvSource(k_pool, page_size=1, num_bytes_per_token=2048, read_bytes=256)
    >>> src.num_rows
    64
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    slot_offset: int = 0
    token_stride: int | None = None
    byte_offset: int = 0
    piece_bytes: int | None = None
    pieces: tuple = ()

    @public_api
    def __post_init__(self):
        require(self.tensor, "RealKvSource.tensor")
        p, n, r = self.page_size, self.num_bytes_per_token, self.read_bytes
        if not _is_int(self.slot_offset) or not 0 <= self.slot_offset < 2**62:
            fail(ValueError, f"RealKvSource.slot_offset must be an int in [0, 2**62), got {self.slot_offset!r}")
        if not _is_int(p) or p < 1:
            fail(ValueError, f"RealKvSource.page_size must be >= 1, got {p}")
        if not _is_int(n) or n <= 0 or n % 16:
            fail(ValueError, f"RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {n}")
        for name, value in (("page_size", p), ("num_bytes_per_token", n)):
            if value > INT32_MAX:
                fail(ValueError, f"RealKvSource.{name} must be at most {INT32_MAX} (the kernels take it as int32), got {value}")
        if not _is_int(r) or r <= 0 or r % 16 or r > n:
            fail(ValueError, f"RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token={n}], got {r}")
        shape = tuple(self.tensor.shape)
        if len(shape) < 2:
            fail(ValueError, f"RealKvSource.tensor must be at least 2-D, got shape {shape}")
        unit = self._check_layout()
        itemsize = _itemsize(self.tensor)
        row_stride = _strides(self.tensor)[0] * itemsize
        if row_stride % unit:
            fail(
                ValueError,
                f"RealKvSource.tensor row stride must be a multiple of {unit} bytes, got {row_stride} bytes "
                f"(shape={shape}, strides={_strides(self.tensor)}, dtype={self.tensor.dtype})",
            )
        row_bytes = int(np.prod(shape[1:])) * itemsize
        classic = self.token_stride is None and self.byte_offset == 0 and not self.is_strided
        if classic and row_bytes < p * n:
            fail(
                ValueError,
                f"RealKvSource row is too narrow for its slot layout: dim-1 is {row_bytes} bytes but "
                f"page_size={p} x num_bytes_per_token={n} needs {p * n}",
            )
        if not classic and row_bytes < self.span_bytes:
            fail(ValueError, f"RealKvSource row is too narrow for its layout: dim-1 is {row_bytes} bytes but the "
                             f"last byte a slot reads lies {self.span_bytes} bytes into a row (byte_offset={self.byte_offset}, "
                             f"token_stride={self.token_stride}, piece_bytes={self.piece_bytes}, pieces={self.pieces})")

    def _check_layout(self) -> int:
        """Checks the strided fields; returns the alignment in bytes the kernels' loads need."""
        n = self.num_bytes_per_token
        ts, off, pb, pieces = self.token_stride, self.byte_offset, self.piece_bytes, self.pieces
        limit = 2**62
        if ts is not None and (not _is_int(ts) or not 0 <= ts <= limit):
            fail(ValueError, f"RealKvSource.token_stride must be None or an int in [0, 2**62], got {ts!r}")
        if not _is_int(off) or not 0 <= off <= limit:
            fail(ValueError, f"RealKvSource.byte_offset must be an int in [0, 2**62], got {off!r}")
        if not isinstance(pieces, tuple) or len(pieces) > MAX_PIECE_LEVELS or not all(
                isinstance(lv, tuple) and len(lv) == 2 and all(_is_int(v) for v in lv) and lv[0] >= 1
                and 0 <= lv[1] <= limit and lv[0] <= INT32_MAX for lv in pieces):
            fail(ValueError, f"RealKvSource.pieces must be a tuple of at most {MAX_PIECE_LEVELS} (count >= 1, stride >= 0) "
                             f"int pairs, got {pieces!r}")
        if pb is None:
            if pieces:
                fail(ValueError, f"RealKvSource.pieces={pieces!r} needs piece_bytes (the bytes of one piece)")
        elif not _is_int(pb) or pb <= 0 or (pb > 4 and pb % 8) or pb == 3 or pb > n:
            fail(ValueError, f"RealKvSource.piece_bytes must be 1, 2, 4 or a multiple of 8, at most num_bytes_per_token={n}, got {pb!r}")
        elif int(np.prod([c for c, _ in pieces], dtype=object)) * pb != n:
            fail(ValueError, f"RealKvSource.pieces={pieces!r} of piece_bytes={pb} hold "
                             f"{int(np.prod([c for c, _ in pieces], dtype=object)) * pb} bytes, not num_bytes_per_token={n}")
        if not self.is_strided:
            return 16
        unit = min(8, (self.stream_piece & -self.stream_piece))
        for name, value in (("token_stride", self.token_stride), ("byte_offset", off),
                            *((f"pieces[{i}] stride", s) for i, (_, s) in enumerate(pieces))):
            if value is not None and value % unit:
                fail(ValueError, f"RealKvSource.{name} must be a multiple of {unit} bytes (pieces of {self.stream_piece} "
                                 f"bytes are read {unit} bytes at a time), got {value}")
        return unit

    @classmethod
    @public_api
    def strided(cls, tensor, page_size: int, *, token_stride: int, piece_bytes: int, pieces: tuple = (),
                byte_offset: int = 0, read_bytes: int | None = None, slot_offset: int = 0) -> "RealKvSource":
        """A source whose slot bytes are pieces spread through a row; ``num_bytes_per_token`` is
        the pieces' total and ``read_bytes`` defaults to it.

        Parameters
        ----------
        tensor, page_size, token_stride, piece_bytes, pieces, byte_offset, read_bytes, slot_offset
            As for the class (``read_bytes`` None: every byte of the stream).

        Returns
        -------
        RealKvSource

        Examples
        --------
        vLLM's CPU layout ``[blocks, heads, B, 2 * D]``: per (block, head), K transposed ``[D, B]``
        then V ``[B, D]``.

        >>> kv = np.zeros((4, 2, 32, 2 * 16), np.float32)  # 4 blocks, 2 heads, B = 32, D = 16
        >>> blocks, heads, B, D, e = 4, 2, 32, 16, 4
        >>> head = 2 * B * D * e  # bytes of one (block, head) region
        >>> k = kc.RealKvSource.strided(kv, B, token_stride=e, piece_bytes=e, pieces=((heads, head), (D, B * e)))
        >>> v = kc.RealKvSource.strided(kv, B, token_stride=D * e, byte_offset=B * D * e, piece_bytes=D * e,
        ...                             pieces=((heads, head),))
        >>> k.num_bytes_per_token, v.num_bytes_per_token
        (128, 128)
        """
        pieces = tuple(tuple(lv) for lv in pieces)
        n = int(np.prod([c for c, _ in pieces], dtype=object)) * piece_bytes if _is_int(piece_bytes) else piece_bytes
        return cls(tensor, page_size, n, n if read_bytes is None else read_bytes, slot_offset=slot_offset,
                   token_stride=token_stride, byte_offset=byte_offset, piece_bytes=piece_bytes, pieces=pieces)

    @property
    def is_strided(self) -> bool:
        """Whether the layout differs from the contiguous default (the kernels' 16-byte loads)."""
        ts = self.num_bytes_per_token if self.token_stride is None else self.token_stride
        return bool(self.pieces) or ts % 16 != 0 or self.byte_offset % 16 != 0 or (
            self.piece_bytes is not None and self.piece_bytes != self.num_bytes_per_token)

    @property
    def stream_piece(self) -> int:
        """The bytes of one contiguous piece of a slot's stream."""
        return self.num_bytes_per_token if self.piece_bytes is None else self.piece_bytes

    @property
    def levels(self) -> tuple:
        """``pieces`` padded to two ``(count, stride)`` levels, outer first."""
        return ((1, 0),) * (MAX_PIECE_LEVELS - len(self.pieces)) + tuple(self.pieces)

    @property
    def span_bytes(self) -> int:
        """One past the last byte of a row that a slot of the row reads."""
        ts = self.num_bytes_per_token if self.token_stride is None else self.token_stride
        return (self.byte_offset + (self.page_size - 1) * ts + sum((c - 1) * s for c, s in self.levels)
                + self.stream_piece)

    @property
    def num_rows(self) -> int:
        return int(self.tensor.shape[0])


def _itemsize(t) -> int:
    return t.element_size() if hasattr(t, "element_size") else t.dtype.itemsize


def _strides(t) -> tuple:
    """Strides in elements, for NumPy/CuPy arrays (bytes natively) and torch tensors."""
    if hasattr(t, "element_size"):
        return tuple(t.stride())
    return tuple(s // t.dtype.itemsize for s in t.strides)


def check_num_sources(sources) -> tuple:
    sources = tuple(sources)
    if len(sources) > MAX_REAL_KV_SOURCES:
        fail(ValueError, f"real_kv_sources must hold at most {MAX_REAL_KV_SOURCES} RealKvSource entries (the CUDA ABI's limit), got {len(sources)}")
    for i, s in enumerate(sources):
        if not isinstance(s, RealKvSource):
            fail(TypeError, f"real_kv_sources[{i}] must be a RealKvSource, got {type(s).__name__}")
    return sources
