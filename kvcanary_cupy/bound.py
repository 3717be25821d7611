"""What a bound launcher holds: the per-step arrays it takes without the free function's checks
(the common case of each framework) and its state, fixed when it binds (:class:`BoundState`).

Per-step arrays, common case only.  ``vector(x, n)``: a contiguous int64 [n] array;
``leading(x)``: the same for the first array of a call, whose length sets n, as ``(value, n)``;
``indices(x, n)``: a contiguous int32 or int64 [n] array (any length when n < 0), as ``(value, n,
is_int64)``; ``table(x, wide)``: an int32 (or, when ``wide``, int64) [rows, cols] table with
contiguous rows, as ``(value, rows, cols, row stride in elements, is_int64)``.  The value is what
the backend takes (a NumPy array, or a device address); None means "not the common case": the
free function decides.  Each attribute read here costs tens of nanoseconds; the obvious
spellings (``flags.c_contiguous``, ``len(tensor)``) cost more.
"""

from __future__ import annotations

import sys

import numpy as np

from . import interop
from .constants import RealKvHashMode
from .interop import import_cupy, is_torch_tensor
from .runtime import torch_stream_handle
from .validation import I32, I64
from .validation_cache import FULL_VALIDATION_ENV, full_validation_forced  # the one switch of both paths



_INDEX_DTYPES = (I32, I64)
_STRIDE_I64 = (8,)


class _NumpyArrays:
    @staticmethod
    def vector(x, n):
        if type(x) is np.ndarray and x.dtype is I64 and x.ndim == 1 and x.size == n:
            flags = x.flags
            if flags.c_contiguous and flags.aligned:
                return x
        return None

    def leading(self, x):
        value = self.vector(x, x.size) if type(x) is np.ndarray else None
        return None if value is None else (value, x.size)

    @staticmethod
    def indices(x, n):
        if type(x) is np.ndarray and x.dtype in _INDEX_DTYPES and x.ndim == 1 and (n < 0 or x.size == n):
            flags = x.flags
            if flags.c_contiguous and flags.aligned:
                return x, x.size, x.dtype is I64
        return None

    @staticmethod
    def table(x, wide=False):
        if type(x) is np.ndarray and (x.dtype is I32 or (wide and x.dtype is I64)) and x.ndim == 2 and x.flags.aligned:
            rows, cols = x.shape
            s0, s1 = x.strides
            size = x.dtype.itemsize
            if (cols <= 1 or s1 == size) and s0 >= 0 and not s0 % size or not rows * cols:  # empty: any strides
                return x, rows, cols, s0 // size, size == 8
        return None


class _CupyArrays:
    # One read of each attribute, and no helper calls: ``strides == (8,)`` also says ndim == 1.
    def __init__(self, device: int):
        self.ndarray = import_cupy().ndarray
        self.device = device

    def vector(self, x, n):
        if type(x) is self.ndarray and x.dtype is I64 and x.size == n:
            strides = x.strides
            if strides == _STRIDE_I64 or (n <= 1 and len(strides) == 1 and strides[0] >= 0):  # empty: stride 0
                mem = x.data
                ptr = mem.ptr
                if mem.device_id == self.device and not ptr % 8:
                    return ptr
        return None

    def leading(self, x):
        if type(x) is not self.ndarray:
            return None
        n = x.size
        value = self.vector(x, n)
        return None if value is None else (value, n)

    def indices(self, x, n):
        if type(x) is self.ndarray:
            dtype = x.dtype
            length = x.size
            if (dtype is I32 or dtype is I64) and (n < 0 or length == n):
                strides = x.strides
                size = dtype.itemsize
                if len(strides) == 1 and (strides[0] == size or (length <= 1 and strides[0] >= 0)):
                    mem = x.data
                    ptr = mem.ptr
                    if mem.device_id == self.device and not ptr % size:
                        return ptr, length, size == 8
        return None

    def table(self, x, wide=False):
        if type(x) is self.ndarray:
            dtype = x.dtype
            if dtype is I32 or (wide and dtype is I64):
                shape = x.shape
                if len(shape) == 2:
                    rows, cols = shape
                    s0, s1 = x.strides
                    size = dtype.itemsize
                    if (cols <= 1 or s1 == size) and s0 >= 0 and not s0 % size or not rows * cols:  # empty: any strides
                        mem = x.data
                        ptr = mem.ptr
                        if mem.device_id == self.device and not ptr % size:
                            return ptr, rows, cols, s0 // size, size == 8
        return None


class _TorchArrays:
    """Torch tensors on the bound device: their address on CUDA (no DLPack), a NumPy view on the CPU."""

    def __init__(self, device: int | None):
        torch = sys.modules["torch"]
        self.tensor, self.strided, self.i64, self.i32 = torch.Tensor, torch.strided, torch.int64, torch.int32
        self.device = torch.device("cpu") if device is None else torch.device("cuda", device)
        self.cuda = device is not None

    def _value(self, x, size):
        if not self.cuda:
            return x.numpy()
        ptr = x.data_ptr()
        return None if ptr % size else ptr

    def _plain(self, x, ndim):
        return (type(x) is self.tensor and x.dim() == ndim and x.layout is self.strided and x.device == self.device)

    def vector(self, x, n):
        if (type(x) is self.tensor and x.dtype is self.i64 and x.dim() == 1 and x.numel() == n
                and x.layout is self.strided and x.device == self.device and x.is_contiguous()):
            if not self.cuda:
                return x.numpy()
            ptr = x.data_ptr()  # _value inline: the most frequent call
            return None if ptr % 8 else ptr
        return None

    def leading(self, x):
        if type(x) is not self.tensor:
            return None
        n = x.numel()
        value = self.vector(x, n)
        return None if value is None else (value, n)

    def indices(self, x, n):
        if self._plain(x, 1) and (x.dtype is self.i32 or x.dtype is self.i64) and x.is_contiguous():
            size = x.element_size()
            length = x.numel()
            if n < 0 or length == n:
                value = self._value(x, size)
                if value is not None:
                    return value, length, size == 8
        return None

    def table(self, x, wide=False):
        if self._plain(x, 2) and (x.dtype is self.i32 or (wide and x.dtype is self.i64)):
            rows, cols = x.shape
            s0, s1 = x.stride()
            if (cols <= 1 or s1 == 1) and s0 >= 0 or not rows * cols:  # empty: any strides
                size = x.element_size()
                value = self._value(x, size)
                if value is not None:
                    return value, rows, cols, s0, size == 8
        return None



class _TorchCpuArrays(_TorchArrays):
    """CPU torch tensors as NumPy views, and NumPy arrays as they are: the free functions take
    both among CPU tensors, so the bound path does too (an engine's own NumPy buffers need no
    torch view, which costs a microsecond to make and another to view back)."""

    def __init__(self):
        super().__init__(None)

    def vector(self, x, n):
        return _NUMPY.vector(x, n) if type(x) is np.ndarray else _TorchArrays.vector(self, x, n)

    def leading(self, x):
        return _NUMPY.leading(x) if type(x) is np.ndarray else _TorchArrays.leading(self, x)

    def indices(self, x, n):
        return _NUMPY.indices(x, n) if type(x) is np.ndarray else _TorchArrays.indices(self, x, n)

    def table(self, x, wide=False):
        return _NUMPY.table(x, wide) if type(x) is np.ndarray else _TorchArrays.table(self, x, wide)


_NUMPY = _NumpyArrays()


def _stamp(tensors) -> list:
    """The bound tensors' addresses: a reallocation always changes one (old and new memory coexist
    while torch copies), so comparing them keeps every launch inside live memory."""
    return list(map(sys.modules["torch"].Tensor.data_ptr, tensors)) if tensors else []


def viewed_in_place(arrays) -> bool:
    """Whether the free functions view these read-only arrays in place (they copy strided ones)."""
    for x in arrays:
        if x is None:
            continue
        if is_torch_tensor(x):
            if not x.is_contiguous():
                return False
        elif not x.flags.c_contiguous or any(s < 0 for s in x.strides):
            return False
    return True


class BoundState:
    """What every bound launcher holds, fixed when it binds: where it runs, how it takes per-step
    arrays there (``arrays``), its bound torch tensors and their addresses, the NumPy backend's
    record (``args``) or, on a GPU, the GPU wing's face (``gpu``: backends/cuda/ops.py), its kernel
    parameter record, the record's field slots and its launch (on the caller's stream, or behind it
    on ``side``).  Each launcher adds what it keeps
    per call in a subclass; the slots make every read on the per-call path a fixed offset."""

    __slots__ = ("numpy", "tensors", "stamp", "arrays", "args", "gpu", "device", "side", "_torch_stream", "_functions",
                 "params", "param_slots", "launch")

    def __init__(self, placement, named: dict, side=None):
        self.numpy = placement.backend == "numpy"
        self.tensors = tuple(a for a in named.values() if is_torch_tensor(a))
        self.stamp = _stamp(self.tensors)
        torch = placement.framework == "torch"
        if self.numpy:
            self.arrays = _TorchCpuArrays() if torch else _NUMPY
            return
        from .backends.cuda import ops as cuda_ops

        self.gpu = cuda_ops
        self.device = placement.device
        self.arrays = _TorchArrays(self.device) if torch else _CupyArrays(self.device)
        self._torch_stream = torch_stream_handle(self.device) if torch else None
        self._functions = {}
        self.side = side  # a write's SideStream (see WriteLauncher)

    def moved(self) -> bool:
        """Whether a bound torch tensor no longer has the address it was bound with."""
        return _stamp(self.tensors) != self.stamp

    def function(self, family: str, name: str):
        """A compiled kernel on the bound device (compiled on first use; ``kc.warmup()`` does all)."""
        fn = self._functions.get((family, name))
        if fn is None:
            with import_cupy().cuda.Device(self.device):
                fn = self._functions[(family, name)] = self.gpu.get_function(family, name).kernel
        return fn

    def pack(self, params: np.ndarray) -> None:
        """Keep a kernel parameter record, its field slots and its launch (:class:`~kvcanary_cupy.backends.cuda.launch.BoundLaunch`:
        on the bound device, on the caller's stream or behind it on ``side``)."""
        self.params = params
        self.param_slots = self.gpu.ParamSlots(params)
        self.launch = self.gpu.BoundLaunch(params, self.device, self._torch_stream, self.side)

    def setter(self, *names: str):
        """A function writing the record's fields ``names`` from a sequence of values in that order."""
        slots = tuple((*self.param_slots(name), i) for i, name in enumerate(names))

        def set_fields(values) -> None:
            for view, index, i in slots:  # the cheapest spelling of this loop (zip costs 1.5x)
                view[index] = values[i]

        return set_fields

    def optional_setter(self, *names: str):
        """:meth:`setter` for fields that are 0 in the common case: ``set_fields(None)`` zeroes them,
        writing only when the previous call wrote values."""
        set_fields, zeros, written = self.setter(*names), (0,) * len(names), [True]

        def set_optional(values) -> None:
            if values is not None:
                set_fields(values)
                written[0] = True
            elif written[0]:
                set_fields(zeros)
                written[0] = False

        return set_optional


def bound_words(launcher) -> str:
    """How a launcher's calls run, for its repr."""
    if launcher._bound is not None:
        return "bound (common-case calls skip the free function's checks)"
    if launcher._full:
        return f"not bound ({FULL_VALIDATION_ENV} is set): every call takes the free function"
    return "not bound (a buffer cannot be used in place): every call takes the free function"


def launch_words(kernel_kind, options: dict) -> str:
    """The options a verify or write launcher was built with (already checked), for its repr."""
    from .reporting import tag_name

    kinds = kernel_kind if isinstance(kernel_kind, (list, tuple)) else (kernel_kind,)
    tags = ", ".join(f"{tag_name(int(k))} ({int(k)})" for k in kinds)
    sources = len(tuple(options["real_kv_sources"]))
    mode = RealKvHashMode(options["real_kv_hash_mode"]).name
    return f"kernel_kind={tags}, real_kv_sources={sources}, real_kv_hash_mode={mode}"


def buffers_words(canary_buf) -> str:
    bufs = canary_buf if isinstance(canary_buf, (list, tuple)) else (canary_buf,)
    shapes = ", ".join("x".join(map(str, tuple(b.shape))) for b in bufs)
    return f"canary_buf [{shapes}] on {interop.placement_of(bufs[0], 'canary_buf').describe()}"


