"""Array interop: which framework an argument comes from, and zero-copy views for the backends.

The backends see two array types only: NumPy arrays (CPU) and CuPy arrays (CUDA).  PyTorch
tensors are viewed through DLPack without a copy (CPU tensors as NumPy arrays, CUDA tensors as
CuPy arrays); kernels launch on torch's current stream when any argument is a torch tensor.
Neither CuPy nor PyTorch is imported unless the caller already passed one of their objects.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import fail
# CuPy's import and the capture check of a copy live with the streams; examples and engines ask
# interop for cuda_unavailable_reason, so it stays importable from here.
from .runtime import cuda_unavailable_reason, import_cupy, refuse_view_copy_during_capture  # noqa: F401

#: What a type hint names for an array argument: a NumPy or CuPy array or a PyTorch tensor.
Array = Any

def _module_name(x) -> str:
    return type(x).__module__.split(".", 1)[0]


def is_torch_tensor(x) -> bool:
    return _module_name(x) == "torch" and "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor)


def is_cupy_array(x) -> bool:
    return _module_name(x) == "cupy" and "cupy" in sys.modules and isinstance(x, sys.modules["cupy"].ndarray)


@dataclass(frozen=True)
class Placement:
    """Where a call runs: ``backend`` is "numpy" or "cupy"; ``framework`` is what the caller uses."""

    backend: str
    framework: str  # "numpy", "cupy" or "torch"
    device: int | None  # CUDA device ordinal for the cupy backend

    def describe(self) -> str:
        return self.framework if self.device is None else f"{self.framework} on cuda:{self.device}"


def placement_of(x, name: str) -> Placement:
    """The placement of one array argument; TypeError for anything that is not an array."""
    if isinstance(x, np.ndarray):
        return Placement("numpy", "numpy", None)
    if is_cupy_array(x):
        return Placement("cupy", "cupy", x.device.id)
    if is_torch_tensor(x):
        if x.device.type == "cpu":
            return Placement("numpy", "torch", None)
        if x.device.type == "cuda":
            return Placement("cupy", "torch", x.device.index if x.device.index is not None else 0)
        fail(TypeError, f"{name} is a torch tensor on device {x.device}; pass a CPU or CUDA tensor")
    fail(
        TypeError,
        f"{name} must be a NumPy array, a CuPy array or a PyTorch tensor, got {type(x).__module__}.{type(x).__name__}",
    )


def common_placement(named_arrays: dict) -> Placement:
    """One placement for all non-None arrays of a call, or an error naming the odd one out."""
    first_name, first = None, None
    seen_torch = False
    for name, arr in named_arrays.items():
        if arr is None:
            continue
        p = placement_of(arr, name)
        seen_torch |= p.framework == "torch"
        if first is None:
            first_name, first = name, p
            continue
        if p.backend != first.backend or p.device != first.device:
            fail(
                ValueError,
                f"{name} is a {p.describe()} array but {first_name} is a {first.describe()} array; "
                "pass every array of one call on the same device",
            )
    if first is None:
        fail(ValueError, "no array arguments were given")
    return Placement(first.backend, "torch" if seen_torch else first.framework, first.device)


def backend_view(x, name: str, *, writable: bool = False):
    """A NumPy or CuPy view of ``x`` sharing its memory (no copy for any supported input).

    Negative strides are refused for written arrays (a view cannot be written back) and copied
    for read-only ones, because DLPack exports of them are broken (cupy#10172, pytorch#188023).
    Every array must start aligned to its item size: the kernels read whole items.  A written
    NumPy array must be writeable (CuPy arrays carry no read-only flag, so any is accepted).
    """
    if x is None:
        return None
    if is_torch_tensor(x):
        if x.requires_grad:
            if writable:
                fail(ValueError, f"{name} is a torch tensor that requires grad; kv-canary writes into it, pass {name}.detach()")
            x = x.detach()
        if x.is_conj() or x.layout != sys.modules["torch"].strided:
            fail(TypeError, f"{name} must be a plain strided torch tensor, got layout {x.layout}")
        if _numpy_dtype(x.dtype) is None:  # DLPack would fail with a bare RuntimeError
            fail(TypeError, f"{name} is a torch tensor of dtype {x.dtype}, which kv-canary cannot read: it takes integer "
                            "tensors here (see the array conventions); convert with .long() or .int()")
        if x.device.type == "cpu":
            view = np.from_dlpack(x)
        else:
            cupy = import_cupy()
            with cupy.cuda.Device(x.device.index):
                view = cupy.from_dlpack(x)
        check_aligned(view, name)
        return view
    check_aligned(x, name)
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        fail(ValueError, f"{name} is a read-only array: kv-canary writes into it in place; pass a writable array")
    if any(s < 0 for s in x.strides):
        if writable:
            fail(ValueError, f"{name} has negative strides; kv-canary writes into it, pass a contiguous array")
        xp = np if isinstance(x, np.ndarray) else import_cupy()
        refuse_view_copy_during_capture(x, f"kv-canary would copy {name} (it has negative strides)",
                                        f"pass {name} contiguous (copy it before capturing)")
        return xp.ascontiguousarray(x)
    return x


# torch dtypes that DLPack hands to NumPy and CuPy as the NumPy dtype of the same name.  A name
# lookup in NumPy is not enough: with ml_dtypes installed NumPy knows bfloat16 and the fp8 kinds,
# but DLPack still refuses them.
_DLPACK_DTYPES = frozenset(
    ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
     "float16", "float32", "float64", "complex64", "complex128")
)


@functools.lru_cache(maxsize=None)
def _numpy_dtype(torch_dtype):
    """The NumPy dtype of a torch dtype DLPack can export, or None (bfloat16, fp8, quantised)."""
    name = str(torch_dtype).removeprefix("torch.")
    return np.dtype(name) if name in _DLPACK_DTYPES else None


def check_aligned(view, name: str, alignment: int | None = None, why: str | None = None) -> None:
    """``view`` starts at a multiple of ``alignment`` bytes (its item size by default).

    Misaligned typed loads fault the GPU (cudaErrorMisalignedAddress, which ends the process);
    the NumPy backend refuses the same arrays so every backend accepts the same inputs.
    """
    alignment = alignment or view.dtype.itemsize
    if alignment == 1 or (isinstance(view, np.ndarray) and alignment <= view.dtype.alignment and view.flags.aligned):
        return  # NumPy's flag is ~40 ns where reading the address is ~1.4 us
    offset = data_ptr(view) % alignment
    if offset:
        why = why or f"its {view.dtype} items are read whole"
        fail(ValueError, f"{name} must start at a multiple of {alignment} bytes ({why}), got an address {offset} "
                         "bytes past one; pass a freshly allocated array or a copy")


def array_module(placement: Placement):
    return np if placement.backend == "numpy" else import_cupy()


def allocate(shape, dtype, *, like=None, fill=None):
    """A new array of the framework and device of ``like`` (NumPy when ``like`` is None).

    ``fill=None`` leaves it uninitialised.
    """
    dtype = np.dtype(dtype)
    if like is None or isinstance(like, np.ndarray):
        out = np.empty(shape, dtype) if fill is None else np.full(shape, fill, dtype)
    elif is_cupy_array(like):
        cupy = import_cupy()
        with cupy.cuda.Device(like.device.id):
            out = cupy.empty(shape, dtype) if fill is None else cupy.full(shape, fill, dtype)
    elif is_torch_tensor(like):
        torch = sys.modules["torch"]
        tdtype = getattr(torch, dtype.name)
        out = torch.empty(shape, dtype=tdtype, device=like.device)
        if fill is not None:
            out.fill_(fill)
    else:
        placement_of(like, "like")  # raises the TypeError
    return out


def data_ptr(view) -> int:
    """Address of the first element of a NumPy or CuPy view."""
    return view.ctypes.data if isinstance(view, np.ndarray) else view.data.ptr


def to_numpy(x) -> np.ndarray:
    """A host copy (or view, for CPU arrays) of any supported array; synchronises for device arrays."""
    if isinstance(x, np.ndarray):
        return x
    if is_cupy_array(x):
        return x.get()
    if is_torch_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _trailing_contiguous(shape, strides_elems) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides_elems[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def byte_rows_view(x, name: str):
    """``x`` seen as ``uint8 [shape[0], bytes per dim-0 row]`` without a copy (any dtype).

    Dims 1.. must be C-contiguous; dim 0 may have any non-negative stride.
    """
    if is_torch_tensor(x):
        x = x.detach()
        strides = tuple(x.stride())
        shape = tuple(x.shape)
        if strides[0] < 0 or not _trailing_contiguous(shape, strides):
            fail(ValueError, f"{name} must be contiguous within each dim-0 row, got strides {strides} for shape {shape}")
        row_elems = int(np.prod(shape[1:]))
        torch = sys.modules["torch"]
        rows = x.as_strided((shape[0], row_elems), (strides[0], 1)).view(torch.uint8)
        return backend_view(rows, name)
    itemsize = x.dtype.itemsize
    shape = tuple(x.shape)
    strides = tuple(s // itemsize for s in x.strides)
    if x.strides[0] < 0 or not _trailing_contiguous(shape, strides):
        fail(ValueError, f"{name} must be contiguous within each dim-0 row, got strides {tuple(x.strides)} bytes for shape {shape}")
    row_elems = int(np.prod(shape[1:]))
    xp = np if isinstance(x, np.ndarray) else import_cupy()
    rows = xp.lib.stride_tricks.as_strided(x, (shape[0], row_elems), (x.strides[0], itemsize))
    return rows.view(np.uint8)
