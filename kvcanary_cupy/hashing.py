"""Hash primitives of the canary chain (docs/format.md §2-3), for Python ints and NumPy arrays.

All arithmetic is modulo 2**64.  Python ints come back as unsigned ints in ``[0, 2**64)``;
NumPy arrays come back as ``uint64`` arrays.  Canary buffers store hashes as the int64 with the
same bit pattern: use :func:`to_signed` / :func:`to_unsigned` to move between the two.
"""

from __future__ import annotations

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
    """Reinterpret an int64 (or any int) as its uint64 bit pattern."""
    return int(value) & _MASK64


def to_signed(value: int) -> int:
    """Reinterpret a uint64 bit pattern as the int64 a canary buffer stores."""
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
    return x.view(np.uint64) if x.dtype == np.int64 else x.astype(np.uint64)


def splitmix64_array(x) -> np.ndarray:
    """Element-wise SplitMix64 finaliser of a NumPy integer array (int64 read as uint64)."""
    x = _as_u64(x).copy()
    with np.errstate(over="ignore"):
        x ^= x >> _U64_S1
        x *= _U64_MUL1
        x ^= x >> _U64_S2
        x *= _U64_MUL2
        x ^= x >> _U64_S3
    return x


def mix3_array(a, b, c) -> np.ndarray:
    """Element-wise ``mix3`` of NumPy integer arrays; returns ``uint64``."""
    h = splitmix64_array(a)
    h = splitmix64_array(h ^ _as_u64(b))
    return splitmix64_array(h ^ _as_u64(c))


def splitmix64(x):
    """SplitMix64 finaliser (no golden-ratio increment): ``splitmix64(0) == 0``.

    Takes a Python int (returns an unsigned int) or a NumPy array (returns ``uint64``).
    """
    if isinstance(x, (int, np.integer)):
        return _splitmix64_int(int(x))
    return splitmix64_array(x)


def mix3(a, b, c):
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)``: the chain step ``mix3(prev, token, pos)``."""
    if all(isinstance(v, (int, np.integer)) for v in (a, b, c)):
        h = _splitmix64_int(int(a))
        h = _splitmix64_int(h ^ (int(b) & _MASK64))
        return _splitmix64_int(h ^ (int(c) & _MASK64))
    return mix3_array(a, b, c)


#: ``splitmix64(CANARY_CHAIN_ANCHOR)``, the prev_hash of every chain head.
ANCHOR_HASH = _splitmix64_int(CANARY_CHAIN_ANCHOR)


def real_kv_fold(strips) -> int:
    """Real-KV fingerprint (docs/format.md §3) of one slot, from one ``bytes`` strip per source.

    Each strip is read as little-endian uint64 words folded with ``acc = splitmix64(acc ^ w)``;
    the per-source hashes are folded the same way in source order.  No source gives 0.
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
