"""What the free functions remember of the long-lived arguments they validated.

A script calls :func:`kvcanary_cupy.plan`, :func:`~kvcanary_cupy.verify` and
:func:`~kvcanary_cupy.write` every step on the same canary buffer, plans, log and table; checking
and viewing those again each call costs far more host time than the kernels.  So a call that
passed its checks leaves its checked views behind, keyed by a *stamp* of every long-lived
argument: for each array everything its checks read (type, address, shape, strides, dtype,
device; NumPy's writeable flag; torch's ``_version`` counter (inference tensors have none),
``requires_grad``, conjugate bit and layout), for each other argument its type and value.  The
next call whose stamps match reuses the views and checks only its per-step arrays; any difference
(an in-place ``resize_``, a new address, another capacity, ...) or any argument the stamps cannot
describe takes the full path again, which is also the path every error comes from.  Nothing is
remembered of a call that copied a long-lived input (one not contiguous): the copy would go stale.

``KVCANARY_FULL_VALIDATION=1`` in the environment (read at each call; the variable that also keeps
the bound launchers from binding) turns this off: every call checks everything.

The views are kept on the call's own plan record (a few keys each), so they live as long as it.
"""

from __future__ import annotations

import os
from dataclasses import fields
from enum import Enum

import numpy as np

from .interop import Placement, is_cupy_array, is_torch_tensor, placement_of

#: Set (to anything but "" or "0") for every call to take every check: the free functions then
#: remember nothing, and the bound launchers bind nothing (each call takes the free function).
FULL_VALIDATION_ENV = "KVCANARY_FULL_VALIDATION"

_SLOT = "_kvcanary_validated"
_MAX_KEYS = 4  # per record: a few canary buffers or launch kinds per plan, not an unbounded set
_SCALARS = (bool, int, float, str, np.integer, np.bool_, Enum)


try:  # the variable's key in CPython's os.environ store (bytes on POSIX): read at each call, so read cheaply
    _ENV_KEY = os.environ.encodekey(FULL_VALIDATION_ENV)
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENV_KEY = None
_UNSET = (None, "", "0", b"", b"0")


def full_validation_forced() -> bool:
    """Whether the environment asks every call to take every check."""
    try:
        # os.environ's own dict, which its setters keep in step: one lookup, not Mapping.get's four calls
        value = os.environ._data.get(_ENV_KEY) if _ENV_KEY is not None else os.environ.get(FULL_VALIDATION_ENV)
    except AttributeError:  # os.environ replaced by another mapping
        value = os.environ.get(FULL_VALIDATION_ENV)
    return value not in _UNSET


def enabled() -> bool:
    return not full_validation_forced()


_KINDS: dict = {}  # array type -> "numpy", "cupy", "torch" or None (no array)


def _kind(x):
    cls = type(x)
    kind = _KINDS.get(cls, False)
    if kind is False:
        kind = _KINDS[cls] = ("numpy" if isinstance(x, np.ndarray) else "cupy" if is_cupy_array(x)
                              else "torch" if is_torch_tensor(x) else None)
    return kind


def array_stamp(x):
    """Everything the front door's checks and views read of array ``x``; None when it is no array."""
    kind = _kind(x)
    try:
        if kind == "numpy":
            return (type(x), x.ctypes.data, x.shape, x.strides, x.dtype, x.flags.writeable)
        if kind == "cupy":
            return (type(x), x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id)
        if kind == "torch":
            version = None if x.is_inference() else x._version  # inference tensors keep no version counter
            return (type(x), x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, version, x.requires_grad,
                    x.is_conj(), x.layout)
    except Exception:  # noqa: BLE001 - an odd array (sparse, meta, ...): the full path says what is wrong
        return None
    return None


def copy_free(stamp) -> bool:
    """Whether the front door views the stamped array without a copy (C-contiguous, no negative stride)."""
    shape, strides = stamp[2], stamp[3]
    if any(s < 0 for s in strides):
        return False
    expected = 1 if _KINDS[stamp[0]] == "torch" else stamp[4].itemsize  # torch counts strides in items, others in bytes
    for size, stride in zip(reversed(shape), reversed(strides)):
        if size == 0:
            return True
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class Stamps:
    """Builds a call's key; ``arrays`` collects the stamp of every array in it."""

    __slots__ = ("arrays",)

    def __init__(self):
        self.arrays: list = []

    def value(self, v):
        """A hashable stamp of a non-array argument (type and value), of a tuple/list of them, or
        of an array; None when it cannot be described (the call then takes the full path)."""
        if _kind(v) is not None:
            s = array_stamp(v)
            if s is not None:
                self.arrays.append(s)
            return s
        if v is None:
            return (None,)
        if isinstance(v, _SCALARS):
            return (type(v), v)
        if isinstance(v, (tuple, list)):
            parts = tuple(self.value(x) for x in v)
            return None if None in parts else (type(v), parts)
        return None

    def record(self, record):
        """A stamp of a frozen record (plan, log, table): its type and each field's stamp."""
        cls = type(record)
        names = _FIELD_NAMES.get(cls)
        if names is None:
            try:
                names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(record))
            except TypeError:  # not a dataclass
                return None
        parts = [cls]
        for name in names:
            s = self.value(getattr(record, name))
            if s is None:
                return None
            parts.append(s)
        return tuple(parts)


_FIELD_NAMES: dict = {}


def remember(owner, key, stamps: Stamps, value) -> None:
    """Keep ``value`` on ``owner`` for calls with ``key`` (unless a long-lived input was copied)."""
    if key is None or not enabled() or not all(copy_free(s) for s in stamps.arrays):
        return
    slot = owner.__dict__.setdefault(_SLOT, {})
    if len(slot) >= _MAX_KEYS:
        slot.clear()
    slot[key] = value


class CachedCall(Stamps):
    """One free call's round trip through the cache, the same for plan, verify and write: build
    the call's key from these stamps, :meth:`recall` what an earlier call left under it, and where
    nothing usable was left, run the full checks and :meth:`keep` what they built.

    What is kept is ``(placement of the long-lived arrays, the op's checked arguments, *extra)``;
    :attr:`hit` holds it after a usable recall, else None (the full path's signal).
    """

    __slots__ = ("owner", "key", "hit")

    def __init__(self):
        self.arrays = []  # Stamps' one field, set here: the call of its __init__ would cost as much
        self.owner = self.key = self.hit = None

    def recall(self, owner, key, step_arrays: dict | None = None, usable: bool = True) -> Placement | None:
        """This call's placement, from what a call with ``key`` left on ``owner`` joined by the
        per-step ``step_arrays`` (none: the long-lived arrays' placement); None where the full
        checks must run: nothing left, the per-step arrays placed elsewhere, or ``usable`` False
        (the op's own rule for its per-step arrays; what the full path checks is still kept)."""
        self.owner, self.key = owner, key
        if not usable or key is None or not enabled():
            return None
        hit = owner.__dict__.get(_SLOT, {}).get(key)
        if hit is None:
            return None
        placement = hit[0] if step_arrays is None else joined_placement(hit[0], step_arrays)
        if placement is not None:
            self.hit = hit
        return placement

    def keep(self, placement: Placement, args, *extra) -> None:
        """Remember the full path's ``args`` (and ``extra``) on the recalled owner under its key."""
        remember(self.owner, self.key, self, (placement, args, *extra))


def joined_placement(long_lived: Placement, step_arrays: dict) -> Placement | None:
    """The placement ``common_placement`` would find for the long-lived arrays (``long_lived``)
    joined by the per-step ones, or None where they disagree (the full path then reports it)."""
    torch_seen = long_lived.framework == "torch"
    for name, arr in step_arrays.items():
        if arr is None:
            continue
        try:
            p = placement_of(arr, name)
        except (TypeError, ValueError):
            return None
        if p.backend != long_lived.backend or p.device != long_lived.device:
            return None
        torch_seen |= p.framework == "torch"
    if torch_seen and long_lived.framework != "torch":
        return Placement(long_lived.backend, "torch", long_lived.device)
    return long_lived


def call_key(*parts):
    """A call's key from the stamps of its long-lived arguments; None when one cannot be stamped."""
    return None if None in parts else parts
