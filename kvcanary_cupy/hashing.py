"""Hash primitives of the canary chain (docs/format.md §2-3), for Python ints and NumPy arrays.

All arithmetic is modulo 2**64.  Python ints come back as unsigned ints in ``[0, 2**64)``;
NumPy arrays come back as ``uint64`` arrays.  Canary buffers store hashes as the int64 with the
same bit pattern: use :func:`to_signed` / :func:`to_unsigned` to move between the two.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .constants import (
    CANARY_CHAIN_ANCHOR,
    SPLITMIX64_MUL1,
    SPLITMIX64_MUL2,
    SPLITMIX64_SHIFT1,
    SPLITMIX64_SHIFT2,
    SPLITMIX64_SHIFT3,
)

_MASK64 = (1 << 64) - 1


def to_unsigned(value: int) -> int:
    """Reinterpret an int64 (or any int) as its uint64 bit pattern.

    Parameters
    ----------
    value : int
        Any integer (a Python int or a NumPy integer scalar); only its low 64 bits count.

    Returns
    -------
    int
        The unsigned int in ``[0, 2**64)`` with those bits.

    Examples
    --------
    >>> to_unsigned(-1)
    18446744073709551615
    """
    return int(value) & _MASK64


def to_signed(value: int) -> int:
    """Reinterpret a uint64 bit pattern as the int64 a canary buffer stores.

    Parameters
    ----------
    value : int
        Any integer; only its low 64 bits count.

    Returns
    -------
    int
        The int in ``[-2**63, 2**63)`` with those bits (what ``canary_buf[s, 2]`` holds for a hash).

    Examples
    --------
    >>> to_signed(2**64 - 1)
    -1
    """
    value = int(value) & _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _splitmix64_int(x: int) -> int:
    x &= _MASK64
    x ^= x >> SPLITMIX64_SHIFT1
    x = (x * SPLITMIX64_MUL1) & _MASK64
    x ^= x >> SPLITMIX64_SHIFT2
    x = (x * SPLITMIX64_MUL2) & _MASK64
    x ^= x >> SPLITMIX64_SHIFT3
    return x


_U64_MUL1 = np.uint64(SPLITMIX64_MUL1)
_U64_MUL2 = np.uint64(SPLITMIX64_MUL2)
_U64_S1 = np.uint64(SPLITMIX64_SHIFT1)
_U64_S2 = np.uint64(SPLITMIX64_SHIFT2)
_U64_S3 = np.uint64(SPLITMIX64_SHIFT3)


def _as_u64(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.uint64:
        return x
    return x.view(np.uint64) if x.dtype == np.int64 else x.astype(np.uint64)


# The constants as 0-d arrays: a ufunc converts a scalar operand on every call (about half a
# microsecond each, which the per-step host time of the NumPy backend feels).
_A_MUL1, _A_MUL2, _A_S1, _A_S2, _A_S3 = (np.array(c) for c in (_U64_MUL1, _U64_MUL2, _U64_S1, _U64_S2, _U64_S3))


def splitmix64_inplace(x: np.ndarray, scratch: np.ndarray | None = None, first: bool = True) -> np.ndarray:
    """SplitMix64 of the uint64 array ``x`` in place (array ufuncs wrap modulo 2**64 and never warn),
    its shifts into ``scratch`` (an array like ``x``; a new one when None); ``first=False``: the
    caller did the first xorshift."""
    t = np.empty_like(x) if scratch is None else scratch  # an array even when x is 0-d
    if first:
        np.right_shift(x, _A_S1, out=t)
        np.bitwise_xor(x, t, out=x)
    np.multiply(x, _A_MUL1, out=x)
    np.right_shift(x, _A_S2, out=t)
    np.bitwise_xor(x, t, out=x)
    np.multiply(x, _A_MUL2, out=x)
    np.right_shift(x, _A_S3, out=t)
    np.bitwise_xor(x, t, out=x)
    return x


def splitmix64_array(x) -> np.ndarray:
    """Element-wise SplitMix64 finaliser of a NumPy integer array (int64 read as uint64)."""
    x = np.asarray(x)
    return splitmix64_inplace(x.view(np.uint64).copy() if x.dtype == np.int64 else x.astype(np.uint64))


def splitmix64_xor(acc: np.ndarray, x) -> np.ndarray:
    """``splitmix64(acc ^ x)`` into ``acc`` (a uint64 array the caller owns; ``x`` broadcasts to it)."""
    np.bitwise_xor(acc, _as_u64(x), out=acc)
    return splitmix64_inplace(acc)


def mix3_array(a, b, c) -> np.ndarray:
    """Element-wise ``mix3`` of NumPy integer arrays; returns ``uint64``."""
    a, b, c = _as_u64(a), _as_u64(b), _as_u64(c)
    shape = a.shape if a.shape == b.shape == c.shape else np.broadcast_shapes(a.shape, b.shape, c.shape)
    h = np.empty(shape, np.uint64)
    np.copyto(h, a)
    scratch = np.empty_like(h)  # one scratch for the three rounds
    splitmix64_inplace(h, scratch)
    np.bitwise_xor(h, b, out=h)
    splitmix64_inplace(h, scratch)
    np.bitwise_xor(h, c, out=h)
    return splitmix64_inplace(h, scratch)


def splitmix64(x: int | np.ndarray) -> int | np.ndarray:
    """SplitMix64 finaliser (no golden-ratio increment): ``splitmix64(0) == 0``.

    Parameters
    ----------
    x : int or numpy.ndarray
        A Python int (any sign, read modulo 2**64) or a NumPy integer array (int64 is read as
        its uint64 bit pattern).

    Returns
    -------
    int or numpy.ndarray
        An unsigned int in ``[0, 2**64)`` for an int; a new ``uint64`` array of ``x``'s shape
        for an array.

    Examples
    --------
    >>> hex(splitmix64(1))
    '0x5692161d100b05e5'
    >>> splitmix64(np.array([0, 1], np.int64)).dtype
    dtype('uint64')
    """
    if isinstance(x, (int, np.integer)):
        return _splitmix64_int(int(x))
    return splitmix64_array(x)


def mix3(a: int | np.ndarray, b: int | np.ndarray, c: int | np.ndarray) -> int | np.ndarray:
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)``: the chain step ``mix3(prev, token, pos)``.

    A record's ``prev_hash`` is ``mix3`` of the record before it: ``a`` its prev_hash, ``b`` its
    token, ``c`` its position (docs/format.md section 2).

    Parameters
    ----------
    a, b, c : int or numpy.ndarray
        Python ints (read modulo 2**64), or NumPy integer arrays that broadcast together.

    Returns
    -------
    int or numpy.ndarray
        An unsigned int when ``a``, ``b`` and ``c`` are all ints, else a ``uint64`` array.

    Examples
    --------
    The prev_hash of the record after a chain head holding token 42 at position 0:

    >>> hex(mix3(ANCHOR_HASH, 42, 0))
    '0x1b798564098041c9'
    """
    if all(isinstance(v, (int, np.integer)) for v in (a, b, c)):
        h = _splitmix64_int(int(a))
        h = _splitmix64_int(h ^ (int(b) & _MASK64))
        return _splitmix64_int(h ^ (int(c) & _MASK64))
    return mix3_array(a, b, c)


#: ``splitmix64(CANARY_CHAIN_ANCHOR)``, the prev_hash of every chain head.
ANCHOR_HASH = _splitmix64_int(CANARY_CHAIN_ANCHOR)


def real_kv_fold(strips: Iterable[bytes]) -> int:
    """Real-KV fingerprint (docs/format.md section 3) of one slot, from one byte strip per source.

    Each strip is read as little-endian uint64 words folded with ``acc = splitmix64(acc ^ w)``;
    the per-source hashes are folded the same way in source order.  No source gives 0.

    Parameters
    ----------
    strips : iterable of bytes-like
        The bytes a :class:`RealKvSource` reads for the slot, one strip per source, in source
        order (16 bytes each under ``RealKvHashMode.PARTIAL``, ``read_bytes`` under ``ALL``).

    Returns
    -------
    int
        The unsigned 64-bit ``real_kv_hash`` (stored as :func:`to_signed` of it).

    Raises
    ------
    ValueError
        A strip whose length is not a multiple of 8.

    Examples
    --------
    >>> hex(real_kv_fold([bytes([1, 2, 4, 8, 16, 32, 64, 128, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])]))
    '0x6041580849e6407d'
    """
    acc = 0
    for strip in strips:
        strip = bytes(strip)
        if len(strip) % 8:
            raise ValueError(f"kv-canary: real-KV strip length must be a multiple of 8, got {len(strip)}")
        src = 0
        for (word,) in np.frombuffer(strip, dtype="<u8").reshape(-1, 1):
            src = _splitmix64_int(src ^ int(word))
        acc = _splitmix64_int(acc ^ src)
    return acc
