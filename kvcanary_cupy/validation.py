"""Argument checks shared by every public function.

Messages name the argument, what was expected and what came, and say what to pass instead.
Checks read shapes, dtypes and strides only: nothing here synchronises with a device, except
the opt-in strict value checks in :mod:`kvcanary_cupy.strict`.
"""

from __future__ import annotations

import numpy as np

from .errors import fail
from .interop import data_ptr
from .runtime import refuse_view_copy_during_capture

# The one home of the int32 bounds and the index dtypes (np.dtype objects: ``x.dtype is I64`` holds).
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
I64, I32 = np.dtype(np.int64), np.dtype(np.int32)

_CONVERT_HINT = {
    "int64": "convert with .astype(int64) (NumPy/CuPy) or .long() (torch)",
    "int32": "convert with .astype(int32) (NumPy/CuPy) or .int() (torch)",
}


def require(x, name: str) -> None:
    """A required array argument: None gets a TypeError naming it (not an AttributeError from inside)."""
    if x is None:
        fail(TypeError, f"{name} is required: pass a NumPy array, a CuPy array or a PyTorch tensor, got None")


def check_dtype(x, name: str, dtype) -> None:
    dtype = np.dtype(dtype)
    if x.dtype != dtype:
        fail(TypeError, f"{name} must have dtype {dtype.name}, got {x.dtype}; {_CONVERT_HINT.get(dtype.name, '')}".rstrip("; "))


def check_integer_dtype(x, name: str) -> None:
    """int32 or int64: the index arrays of engine tables come in either."""
    if x.dtype != np.int32 and x.dtype != np.int64:
        fail(TypeError, f"{name} must have dtype int32 or int64, got {x.dtype}")


def check_1d(x, name: str, dtype, length=None, *, length_name: str | None = None, min_length=None) -> None:
    """A 1-D array of ``dtype``; ``length`` exact (named ``length_name`` in the message)."""
    check_dtype(x, name, dtype)
    if x.ndim != 1:
        fail(ValueError, f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        expected = f"{length_name}={length}" if length_name else str(length)
        fail(ValueError, f"{name} length must be {expected}, got {x.shape[0]}")
    if min_length is not None and x.shape[0] < min_length:
        fail(ValueError, f"{name} length must be >= {min_length}, got {x.shape[0]}")


def check_2d_rows(x, name: str, dtype) -> None:
    """A 2-D table whose rows are contiguous (any row stride): ``req_to_token``-like inputs."""
    check_dtype(x, name, dtype)
    if x.ndim != 2:
        fail(ValueError, f"{name} must be 2-D, got shape {tuple(x.shape)}")
    itemsize = x.dtype.itemsize
    if x.size == 0:  # nothing is read; frameworks give empty arrays any strides
        return
    if (x.shape[1] > 1 and x.strides[1] != itemsize) or x.strides[0] < 0 or x.strides[0] % itemsize:
        fail(ValueError, f"{name} must have contiguous rows, got strides {tuple(x.strides)} bytes for shape {tuple(x.shape)}; pass a C-contiguous array")


def check_contiguous_output(x, name: str) -> None:
    if not x.flags.c_contiguous:
        fail(ValueError, f"{name} must be contiguous: kv-canary writes into it in place; got strides {tuple(x.strides)} for shape {tuple(x.shape)}")


def contiguous_input(x, name: str, xp):
    """Read-only 1-D inputs that are not contiguous are copied (a small array per request).

    Never inside a CUDA graph capture: the copy would be captured into memory the graph does not own.
    """
    if x.flags.c_contiguous:
        return x
    refuse_view_copy_during_capture(x, f"kv-canary would copy {name} (it is not contiguous: strides {tuple(x.strides)} "
                                       f"for shape {tuple(x.shape)})", f"make {name} contiguous before capturing")
    return xp.ascontiguousarray(x)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None, why: str = "") -> int:
    """An int (bools refused) in ``[minimum, maximum]``; ``why`` explains the maximum."""
    if not _is_int(value):
        fail(TypeError, f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        fail(ValueError, f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        fail(ValueError, f"{name} must be at most {maximum}{why}, got {value}")
    return value


def check_count(value, name: str, *, positive: bool = False, maximum: int = INT32_MAX) -> int:
    """A non-negative (or ``positive``) Python int (bools refused), or an error naming ``name``."""
    value = check_int(value, name)
    if value < int(positive):
        fail(ValueError, f"{name} must be {'positive' if positive else 'non-negative'}, got {value}")
    if value > maximum:
        fail(ValueError, f"{name} must be at most {maximum}, got {value}")
    return value


def bool_keyword(value, name: str, alias_value=None, alias: str | None = None) -> bool:
    """The bool keyword ``name``, or the one given under its older spelling ``alias`` (kept working).

    Each is checked under the name the caller used; both given with different values is an error."""
    if not isinstance(value, (bool, np.bool_)):
        fail(TypeError, f"{name} must be a bool, got {type(value).__name__}")
    if alias_value is None:
        return bool(value)
    if not isinstance(alias_value, (bool, np.bool_)):
        fail(TypeError, f"{alias} must be a bool, got {type(alias_value).__name__}")
    if value and not alias_value:
        fail(ValueError, f"{name}={value} and its alias {alias}={alias_value} disagree; pass {name} only")
    return bool(alias_value)


def check_int64(value, name: str, *, minimum: int = INT64_MIN) -> int:
    """An int the kernels' parameters hold as int64."""
    return check_int(value, name, minimum=minimum, maximum=INT64_MAX, why=" (the kernels take it as int64)")


def check_disjoint(views: dict, why: str) -> None:
    """No two of ``views`` (name -> NumPy/CuPy view) share memory; ``why`` ends the message."""
    spans = sorted((data_ptr(v), data_ptr(v) + v.nbytes, name) for name, v in views.items() if v is not None and v.size)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            fail(ValueError, f"{first} and {second} overlap in memory; {why}")
