"""The last eager call's launches, replayed while the same arguments come back unchanged.

A script digests, verifies and writes with the same preallocated arrays step after step;
checking them and packing the kernels' parameters again each time is most of a call's host time.
A memo keeps one call's packed launches with weak references to the argument objects and the
address, shape, strides, dtype and device of each of their arrays (and a torch tensor's
``requires_grad``): a call with the very same objects whose arrays are unchanged (in place too: a
CuPy ``shape`` assignment, a torch ``resize_``, ``set_``, ``.data =`` or ``requires_grad_``)
replays them, anything else takes the checked path.  Only what the checks read (objects and array
metadata, never values) decides, so a replayed call is one the checks would pass again, and the
kernels read the values at each launch.  Weak references: the memo never keeps a caller's array
(or its memory) alive.

Two memos: :class:`LastCall` (objects and values handed over by the caller) for
:func:`kvcanary_cupy.digest_pages` and :func:`kvcanary_cupy.verify_digest` (digest/memo.py says
why they stay apart from validation_cache.py), and :class:`LastOpCall`, which takes an op's whole
argument tuple and matches it in a few C-level comparisons, for :func:`kvcanary_cupy.verify` and
:func:`kvcanary_cupy.write` (ops/canary.py), :func:`kvcanary_cupy.plan` and
:func:`kvcanary_cupy.plan_and_verify` (ops/plan_cache.py), one memo per op.  The canary ops also skip it under
``KVCANARY_FULL_VALIDATION=1`` (:func:`replay_allowed`); every user skips it with ``strict``.
"""

from __future__ import annotations

import sys
import weakref
from enum import Enum
from operator import itemgetter

import numpy as np

from .interop import is_torch_tensor
from .validation_cache import _kind, full_validation_forced


def _stamp(x) -> tuple:
    """What the checks and the parameter records read of an array: its address, shape, strides,
    dtype and device (and a torch tensor's requires_grad, which the checks refuse for written arrays);
    of a cupy.ndarray of the exact class its shape and strides, the rest being its own for life
    (:meth:`LastOpCall.commit` says why)."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and type(x) is cupy.ndarray:
        return x.shape, x.strides
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


#: The most checked calls in a row that launch plainly while remembered calls go unreplayed (LastOpCall.packing).
MAX_PLAIN_RUN = 64


def _picker(positions: list):
    """A C-level function of an argument tuple returning the items at ``positions`` as a tuple."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    return itemgetter(slice(positions[0], positions[0] + 1) if positions else slice(0, 0))


class LastOpCall:
    """One op's last packed call, matched against the op's whole argument tuple (its records and
    arguments, always in the op's order): the ids of its objects (records and arrays, each alive
    while the entry is: a weak reference's callback drops the entry when one dies, so an equal id
    is the same object), the types and values of its scalars (None and empty sequences too), and
    each array's stamp (a record's arrays too), read inline: a torch tensor's address, shape,
    strides, dtype, device and requires_grad, a cupy.ndarray's shape and strides (its memory and
    dtype are fixed for its life; a subclass's are stamped too).  A non-empty list or tuple
    (several buffers, one launch kind per buffer) is compared item by item as :func:`call_parts`
    walks it.  Thread-safe: the entry is one tuple, read and replaced whole."""

    __slots__ = ("_entry", "_hit", "_committed", "_wasted", "_skip")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self._entry = None
        self._hit = self._committed = False
        self._wasted = self._skip = 0

    def packing(self) -> bool:
        """Whether a checked call should pack its launches and remember them.  Not always: where
        the remembered calls are never replayed (a caller whose per-step arrays are new objects
        each step), packing and remembering cost a checked call more than its launch, so after two
        such calls in a row the next few launch plainly (the same launches), twice as many after
        each further one, at most :data:`MAX_PLAIN_RUN`; a replay starts over."""
        if self._skip:
            self._skip -= 1
            return False
        return True

    def recall(self, args: tuple):
        """What :meth:`commit` kept for the last call if ``args`` are its own and unchanged, else None."""
        entry = self._entry
        if entry is None:
            return None
        _, objects_of, ids, values_of, types, known, nested, cupy_arrays, other_arrays, torch_arrays, kept, _ = entry
        if tuple(map(id, objects_of(args))) != ids:
            return None
        values = values_of(args)
        if tuple(map(type, values)) != types or values != known:  # types first: == of an array is elementwise
            return None
        if nested is not None:
            parts = call_parts((), nested[0](args))
            if parts is None or tuple(map(id, parts[0])) != nested[1] or parts[1] != nested[2]:
                return None
        for ref, shape, strides in cupy_arrays:  # a cupy.ndarray's memory and dtype are its own for life
            x = ref()
            if x is None or x.shape != shape or x.strides != strides:
                return None
        for ref, stamp in other_arrays:
            x = ref()
            if x is None or (x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id) != stamp:
                return None
        for ref, stamp in torch_arrays:  # any of these can change in place (.data =, set_, resize_, requires_grad_)
            x = ref()
            if x is None or (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.requires_grad) != stamp:
                return None
        self._hit = True
        return kept

    def pending(self, args: tuple, records=(0, 1)):
        """What :meth:`commit` needs to remember a checked call of ``args`` (``records``: the positions
        that hold a record of arrays: plans, the log, a table), or None where it is never replayed:
        a NumPy array (the NumPy backend launches nothing), a non-contiguous one (the checked path
        may have launched on a copy), an argument of another kind (a real-KV source, say)."""
        obj_pos, val_pos, nest_pos, holders = [], [], [], []
        arrays = {"cupy": [], "torch": []}  # by kind: what is stamped, and how
        for p, a in enumerate(args):
            kind = _kind(a)
            if kind is not None:
                if kind == "numpy":
                    return None
                obj_pos.append(p)
                holders.append(a)
                arrays[kind].append(a)
            elif a is None or isinstance(a, _SCALARS) or (type(a) in (tuple, list) and not a):
                val_pos.append(p)
            elif type(a) in (tuple, list):
                parts = call_parts((), (a,))
                if parts is None:
                    return None
                nest_pos.append(p)
                for x in parts[0]:
                    if x is not None:
                        holders.append(x)
                        arrays[_kind(x)].append(x)
            elif p in records and callable(getattr(a, "arrays", None)):
                obj_pos.append(p)
                holders.append(a)
                for x in a.arrays().values():
                    kind = _kind(x)
                    if kind in arrays:
                        holders.append(x)
                        arrays[kind].append(x)
            else:
                return None
        if not (all(x.flags.c_contiguous for x in arrays["cupy"]) and all(x.is_contiguous() for x in arrays["torch"])):
            return None
        return args, obj_pos, val_pos, nest_pos, holders, arrays["cupy"], arrays["torch"]

    def commit(self, pending, kept) -> None:
        """Remember the call ``pending`` describes (``pending`` from :meth:`pending`), to be recalled with ``kept``."""
        args, obj_pos, val_pos, nest_pos, holders, cupy_found, torch_found = pending
        self._wasted = self._wasted + 1 if self._committed and not self._hit else 0  # the last commit never replayed
        self._skip = min(1 << (self._wasted - 1), MAX_PLAIN_RUN) if self._wasted >= 2 else 0
        self._hit, self._committed = False, True
        token = object()

        def dead(_ref, memo=self, token=token):  # one of the call's objects is gone: its id may be reused
            entry = memo._entry
            if entry is not None and entry[0] is token:
                memo._entry = None

        try:
            refs = {id(x): weakref.ref(x, dead) for x in holders}
        except TypeError:  # an object without weak references: never replayed
            self._entry = None
            return
        objects_of, values_of = _picker(obj_pos), _picker(val_pos)
        # an empty list kept as a fresh one: the caller's, filled in place, would still compare equal to itself
        values = tuple([] if type(v) is list else v for v in values_of(args))
        nested = None
        if nest_pos:
            nested_of = _picker(nest_pos)
            objects, nested_values = call_parts((), nested_of(args))
            nested = (nested_of, tuple(map(id, objects)), nested_values)
        # A cupy.ndarray's data (its MemoryPointer: address and device) and dtype cannot be assigned and
        # __init__ does not redo them: only its shape and strides change in place (a shape assignment).
        # Subclasses, which could make them properties, are stamped whole.
        exact = sys.modules["cupy"].ndarray if cupy_found else None
        cupy_arrays = tuple((refs[id(x)], x.shape, x.strides) for x in cupy_found if type(x) is exact)
        other_arrays = tuple((refs[id(x)], (x.data.ptr, x.shape, x.strides, x.dtype, x.data.device_id))
                             for x in cupy_found if type(x) is not exact)
        torch_arrays = tuple((refs[id(x)], (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
                             for x in torch_found)
        # the weak references last: kept with the entry (a dropped reference calls back no more)
        self._entry = (token, objects_of, tuple(map(id, objects_of(args))), values_of, tuple(map(type, values)), values,
                       nested, cupy_arrays, other_arrays, torch_arrays, kept, tuple(refs.values()))


def launch_packed(memo: LastOpCall, args: tuple, placement, launch: str, launch_args, records=(0, 1), accept=None,
                  extra: tuple | None = None) -> bool:
    """On the GPU, a checked call's launches packed, launched and remembered in ``memo`` under the
    op's ``args`` (with ``extra`` after the packed launches, when given); False where the call
    launches the usual way: NumPy, a run of unreplayed calls (:meth:`LastOpCall.packing`), an
    argument never replayed (:meth:`LastOpCall.pending`), one the checks viewed through a copy (a
    non-contiguous array, or arrays ``accept(arrays)`` refuses).  ``launch``: the function of
    ``backends.cuda.ops`` that makes the call's :class:`KernelLaunch` records (one or a list) from
    ``launch_args``."""
    if placement.backend != "cupy" or not memo.packing():
        return False
    pending = memo.pending(args, records)
    if pending is None or (accept is not None and not accept(pending[5] + pending[6])):
        return False
    from .backends.cuda import launch as cuda_launch, ops as cuda_ops

    made = getattr(cuda_ops, launch)(launch_args)
    packed = cuda_launch.PackedLaunches(made if isinstance(made, list) else (made,), placement)
    packed()
    memo.commit(pending, packed if extra is None else (packed, *extra))
    return True
