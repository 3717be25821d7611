"""The last eager call's launches, replayed while the same arguments come back unchanged.

A script digests, verifies and writes with the same preallocated arrays step after step;
checking them and packing the kernels' parameters again each time is most of a call's host time.
A :class:`LastCall` keeps one call's packed launches with weak references to the argument objects
and the address, shape, strides, dtype and device of each of their arrays (and a torch tensor's
``requires_grad``): a call with the very same objects whose arrays are unchanged (in place too: a
CuPy ``shape`` assignment, a torch ``resize_``, ``set_``, ``.data =`` or ``requires_grad_``)
replays them, anything else takes the checked path.  Only what the checks read (objects and array
metadata, never values) decides, so a replayed call is one the checks would pass again, and the
kernels read the values at each launch.  Weak references: the memo never keeps a caller's array
(or its memory) alive.

Users: :func:`kvcanary_cupy.digest_pages` and :func:`kvcanary_cupy.verify_digest` (digest/memo.py
says why they stay apart from validation_cache.py), :func:`kvcanary_cupy.verify` and
:func:`kvcanary_cupy.write` (ops/canary.py), :func:`kvcanary_cupy.plan` and
:func:`kvcanary_cupy.plan_and_verify` (ops/plan_cache.py), one memo per op.  The canary ops also skip it under
``KVCANARY_FULL_VALIDATION=1`` (:func:`replay_allowed`); every user skips it with ``strict``.
"""

from __future__ import annotations

import weakref
from enum import Enum

import numpy as np

from .interop import is_torch_tensor
from .validation_cache import _kind, full_validation_forced


def _stamp(x) -> tuple:
    """What the checks and the parameter records read of an array: its address, shape, strides,
    dtype and device (and a torch tensor's requires_grad, which the checks refuse for written arrays)."""
    if is_torch_tensor(x):
        return x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.requires_grad
    return x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id


class LastCall:
    """One entry: the last call's objects (compared by identity), values (by equality), arrays'
    stamps and launches.  Thread-safe: the entry is one tuple, read and replaced whole."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None

    def get(self, objects: tuple, values: tuple = ()):
        """The launches of the last call if ``objects`` and ``values`` are its own and unchanged, else None."""
        entry = self._entry
        if entry is None:
            return None
        refs, known, stamps, launches = entry
        if known != values or len(refs) != len(objects):
            return None
        for ref, obj in zip(refs, objects):
            if ref is None:
                if obj is not None:
                    return None
            elif obj is None or ref() is not obj:  # a dead reference matches nothing, None included
                return None
        for ref, stamp in stamps:
            x = ref()
            if x is None or _stamp(x) != stamp:
                return None
        return launches

    def put(self, objects: tuple, values: tuple, arrays, launches) -> None:
        """Remember a checked call: its argument ``objects``, ``values``, ``arrays`` (the caller's
        CuPy arrays and torch tensors among and inside the objects) and packed ``launches``."""
        try:
            refs = tuple(None if o is None else weakref.ref(o) for o in objects)
            stamps = tuple((weakref.ref(x), _stamp(x)) for x in arrays)
        except TypeError:  # an object without weak references: never replayed
            self._entry = None
            return
        self._entry = (refs, values, stamps, launches)

    def clear(self) -> None:
        self._entry = None


def replay_allowed(strict: bool) -> bool:
    """Whether a canary op may replay or remember a call: not with ``strict`` (its host checks run
    every call) nor under ``KVCANARY_FULL_VALIDATION=1`` (read at each call: every call checks everything)."""
    return not strict and not full_validation_forced()


_SCALARS = (bool, int, float, str, np.integer, np.bool_, Enum)


def call_parts(records: tuple, arguments: tuple):
    """A canary op's ``(objects, values)`` for :class:`LastCall`, or None where the call is never
    replayed.  ``records`` (plans, the log) count by identity (frozen: their arrays are stamped at
    put); of ``arguments``, CuPy arrays, torch tensors and None by identity, scalars by type and
    value, lists and tuples by type, length and each item.  Anything else (a NumPy array: the NumPy
    backend launches nothing; a real-KV source) means no replay."""
    objects, values = list(records), []
    for a in arguments:
        if not _add(a, objects, values):
            return None
    return tuple(objects), tuple(values)


def _add(a, objects: list, values: list) -> bool:
    if a is None:
        objects.append(None)
        return True
    kind = _kind(a)
    if kind is not None:
        objects.append(a)
        return kind != "numpy"
    if isinstance(a, _SCALARS):
        values.append((type(a), a))
        return True
    if type(a) in (tuple, list):
        values.append((type(a), len(a)))
        return all(_add(x, objects, values) for x in a)
    return False


def device_arrays(objects: tuple) -> list | None:
    """The CuPy arrays and torch tensors among ``objects`` and inside their records (each with an
    ``arrays()``: plans, the log, a table); None where one
    is not contiguous (the checked path may have launched on a copy, which a replay must not reuse)."""
    found = []
    for o in objects:
        if o is None:
            continue
        for x in (o.arrays().values() if _kind(o) is None else (o,)):  # a record (plan, log, table) or an array
            if x is None or _kind(x) not in ("cupy", "torch"):
                continue
            if not (x.is_contiguous() if is_torch_tensor(x) else x.flags.c_contiguous):
                return None
            found.append(x)
    return found


def launch_packed(parts, placement, launch: str, args, accept=None):
    """On the GPU, a checked call's launches packed, launched and returned with the arrays to stamp
    (``(packed, arrays)`` for :meth:`LastCall.put`), or None where the call launches the usual way:
    no ``parts`` (never replayed), NumPy, an argument the checks viewed through a copy (a
    non-contiguous array, or one ``accept(arrays)`` refuses).  ``launch``: the function of
    ``backends.cuda.ops`` that makes the call's :class:`KernelLaunch` records (one or a list) from ``args``."""
    if parts is None or placement.backend != "cupy":
        return None
    arrays = device_arrays(parts[0])
    if arrays is None or (accept is not None and not accept(arrays)):
        return None
    from .backends.cuda import launch as cuda_launch, ops as cuda_ops

    made = getattr(cuda_ops, launch)(args)
    packed = cuda_launch.PackedLaunches(made if isinstance(made, list) else (made,), placement)
    packed()
    return packed, arrays
