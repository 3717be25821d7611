"""Bound launchers: an eager canary op for a few microseconds of host time.

The free functions (:func:`~kvcanary_cupy.plan`, :func:`~kvcanary_cupy.write`,
:func:`~kvcanary_cupy.verify`) check and view every argument on every call.  An engine passes the
same long-lived buffers every step (the canary buffer, the plans, the log, the real-KV pools), so a
launcher *binds* them once: it runs the free functions' own checks and views on them, packs the
kernel parameters and looks up the compiled kernels.  Per call it checks only each per-step array's
type, dtype, shape, device, contiguity and alignment, writes its address into the packed parameters
and launches on the caller's stream: nothing is allocated or read back, so calls can be captured
in a CUDA graph.  The kernels bound-check every value, as they do behind the free functions.

A per-step array outside that common case (another framework or device, another dtype, a strided
view, mismatched lengths, one of a pair missing ...) sends the call to the free function, which
copies or refuses it as it always does: the same bytes and the same errors.

NumPy and CuPy arrays cannot move their memory, and a launcher keeps the bound ones alive.  A torch
tensor can (``resize_`` past its storage, ``set_``, ``.data = ...``): the address of every bound
tensor is compared on each call (one ``data_ptr()`` each), and a change re-binds (with the full
checks).  A shape change at the same address (a shrinking ``resize_``) keeps the bound shape,
which stays inside memory the tensor still holds.  Bound read-only buffers that the free
functions would copy (not contiguous) cannot be bound: every call then takes the free function.
``KVCANARY_FULL_VALIDATION=1`` in the environment when a launcher or a
:class:`~kvcanary_cupy.CanaryPlanner` is built makes every call take the free function.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import interop, ops
from .args import PlanArgs, TableView
from .backends import get_backend
from .constants import RealKvHashMode
from .errors import public_api, trimmed_argument_error
from .interop import Array, array_module, backend_view, common_placement, import_cupy, is_torch_tensor, launch_stream
from .plans import is_clean, mark_clean, scan_state
from .tables import MAX_TABLE_TOKENS, BlockTable, PagedKvIndices, ReqToToken, TableKind
from .validation import I32, I64, bool_keyword, check_count, check_int, check_int64

if TYPE_CHECKING:
    from .plans import VerifyPlan, ViolationLog, WritePlan

FULL_VALIDATION_ENV = "KVCANARY_FULL_VALIDATION"



def full_validation_forced() -> bool:
    """Whether the environment asks every call to take the fully validating free functions."""
    return os.environ.get(FULL_VALIDATION_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# Per-step arrays, common case only.  ``vector(x, n)``: a contiguous int64 [n] array;
# ``leading(x)``: the same for the first array of a call, whose length sets n, as ``(value, n)``;
# ``indices(x, n)``: a contiguous int32 or int64 [n] array (any length when n < 0), as ``(value, n,
# is_int64)``; ``table(x, wide)``: an int32 (or, when ``wide``, int64) [rows, cols] table with
# contiguous rows, as ``(value, rows, cols, row stride in elements, is_int64)``.  The value is what
# the backend takes (a NumPy array, or a device address); None means "not the common case": the
# free function decides.  Each attribute read here costs tens of nanoseconds; the obvious
# spellings (``flags.c_contiguous``, ``len(tensor)``) cost more.

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


# ----------------------------------------------------------------------------------------------
# Streams: torch's current stream, wrapped for CuPy once per raw handle.

_CUPY_STREAMS: dict = {}


class _RawStream:
    """A raw CUDA stream handle under the CUDA stream protocol (what ``Stream.from_external`` takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _wrapped_torch_stream(handle: int):
    stream = _CUPY_STREAMS.get(handle)
    if stream is None:
        if len(_CUPY_STREAMS) >= 64:  # torch pools its streams; this only bounds a pathological caller
            _CUPY_STREAMS.clear()
        stream = _CUPY_STREAMS[handle] = import_cupy().cuda.Stream.from_external(_RawStream(handle))
    return stream


def _torch_stream_handle(device: int):
    """A function returning the raw handle of torch's current stream on ``device``."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch's own compiler calls
    if raw is not None:
        return lambda: raw(device)
    current = torch.cuda.current_stream
    return lambda: current(device).cuda_stream


def launch_stream_getter(placement):
    """A function returning the stream a launch on ``placement`` goes on, as a CuPy stream: CuPy's
    current stream on its device, or torch's current stream (wrapped once per handle) when the
    arrays are torch tensors."""
    if placement.framework == "torch":
        handle = _torch_stream_handle(placement.device)
        return lambda: _wrapped_torch_stream(handle())
    current, device = import_cupy().cuda.get_current_stream, placement.device
    return lambda: current(device)


# ----------------------------------------------------------------------------------------------


def _stamp(tensors) -> list:
    """The bound tensors' addresses: a reallocation always changes one (old and new memory coexist
    while torch copies), so comparing them keeps every launch inside live memory."""
    return list(map(sys.modules["torch"].Tensor.data_ptr, tensors)) if tensors else []


def _viewed_in_place(arrays) -> bool:
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


class _Binding:
    """Where a launcher runs, how it takes per-step arrays there, and its bound torch tensors."""

    def __init__(self, placement, named: dict):
        self.numpy = placement.backend == "numpy"
        self.tensors = tuple(a for a in named.values() if is_torch_tensor(a))
        self.stamp = _stamp(self.tensors)
        torch = placement.framework == "torch"
        if self.numpy:
            self.arrays = _TorchArrays(None) if torch else _NumpyArrays()
            return
        from .backends import cupy_backend

        self.cb = cupy_backend
        self.device = placement.device
        self.arrays = _TorchArrays(self.device) if torch else _CupyArrays(self.device)
        self._stream_handle = _torch_stream_handle(self.device) if torch else None
        self._get_device = import_cupy().cuda.runtime.getDevice
        self._functions = {}
        self.side = None  # a write's _SideStream (see WriteLauncher)
        self._overlap = cupy_backend.launch_overlap  # plain_depth read per launch
        self._overlap_supported = self._overlap.supported(self.device)  # fixed per process and device
        self._overlapped = {}  # (function, grid, block, shared_mem) -> its OverlappedLaunch

    def moved(self) -> bool:
        """Whether a bound torch tensor no longer has the address it was bound with."""
        return _stamp(self.tensors) != self.stamp

    def function(self, family: str, name: str):
        """A compiled kernel on the bound device (compiled on first use; ``kc.warmup()`` does all)."""
        fn = self._functions.get((family, name))
        if fn is None:
            from .jit import get_function

            with import_cupy().cuda.Device(self.device):
                fn = self._functions[(family, name)] = get_function(family, name).kernel
        return fn

    def pack(self, params: np.ndarray) -> None:
        """Keep a kernel parameter record and its launch arguments."""
        self.params = params
        self.arguments = self.cb.kernel_arguments(params)
        self.param_slots = self.cb.ParamSlots(params)
        self._overlapped.clear()  # they point into the record they were packed with

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

    def launch(self, fn, grid, block, shared_mem: int = 0) -> None:
        """Launch on the bound device, on the caller's stream (torch's current one when torch
        tensors are bound) or behind it on the side stream; overlapping the work before it where
        the device allows (:mod:`kvcanary_cupy.backends.cuda.launch`)."""
        overlap = self._overlap_supported and not self._overlap.plain_depth  # launch_overlap.enabled, without its calls
        if self._get_device() != self.device:
            with import_cupy().cuda.Device(self.device):
                self._launch(fn, grid, block, shared_mem, overlap)
        elif self._stream_handle is None and self.side is None and not overlap:  # nothing to look up
            fn(grid, block, self.arguments, shared_mem=shared_mem, stream=None)
        else:
            self._launch(fn, grid, block, shared_mem, overlap)

    def _launch(self, fn, grid, block, shared_mem: int, overlap: bool) -> None:
        stream = None if self._stream_handle is None else _wrapped_torch_stream(self._stream_handle())
        if self.side is not None:
            self.side.fork(import_cupy().cuda.get_current_stream() if stream is None else stream)
            stream = self.side.stream
        if not overlap:
            fn(grid, block, self.arguments, shared_mem=shared_mem, stream=stream)
            return
        key = (fn, grid, block, shared_mem)
        overlapped = self._overlapped.get(key)
        if overlapped is None:
            overlapped = self._overlapped[key] = self._overlap.OverlappedLaunch(
                fn.ptr, grid[0], block[0], shared_mem, self.cb.record_addresses(self.params))
        overlapped((import_cupy().cuda.get_current_stream() if stream is None else stream).ptr)


class _SideStream:
    """A write's side stream (what :func:`kvcanary_cupy.write` does with ``stream=``): ``fork``
    orders it behind everything queued so far on the caller's stream, ``join`` orders the caller's
    current stream behind it.  One event each, reused by every call: recording an event allocates
    nothing, so both are capture-safe."""

    def __init__(self, stream, placement):
        cupy = import_cupy()
        self.device = placement.device
        self.stream = interop._cupy_stream(stream, "stream", self.device)
        with cupy.cuda.Device(self.device):
            self._forked = cupy.cuda.Event(block=False, disable_timing=True)
            self._joined = cupy.cuda.Event(block=False, disable_timing=True)
        self._caller = launch_stream_getter(placement)

    def fork(self, caller) -> None:
        self._forked.record(caller)
        self.stream.wait_event(self._forked)

    def join(self) -> None:
        """The caller's current stream (torch's, when torch tensors are bound) waits for the side stream."""
        caller = self._caller()
        self._joined.record(self.stream)
        caller.wait_event(self._joined)


def _bound_words(launcher) -> str:
    """How a launcher's calls run, for its repr."""
    if launcher._bound is not None:
        return "bound (common-case calls skip the free function's checks)"
    if launcher._full:
        return f"not bound ({FULL_VALIDATION_ENV} is set): every call takes the free function"
    return "not bound (a buffer cannot be used in place): every call takes the free function"


def _launch_words(kernel_kind, options: dict) -> str:
    """The options a verify or write launcher was built with (already checked), for its repr."""
    from .reporting import tag_name

    kinds = kernel_kind if isinstance(kernel_kind, (list, tuple)) else (kernel_kind,)
    tags = ", ".join(f"{tag_name(int(k))} ({int(k)})" for k in kinds)
    sources = len(tuple(options["real_kv_sources"]))
    mode = RealKvHashMode(options["real_kv_hash_mode"]).name
    return f"kernel_kind={tags}, real_kv_sources={sources}, real_kv_hash_mode={mode}"


def _buffers_words(canary_buf) -> str:
    bufs = canary_buf if isinstance(canary_buf, (list, tuple)) else (canary_buf,)
    shapes = ", ".join("x".join(map(str, tuple(b.shape))) for b in bufs)
    return f"canary_buf [{shapes}] on {interop.placement_of(bufs[0], 'canary_buf').describe()}"


# ----------------------------------------------------------------------------------------------


class WriteLauncher:
    """:func:`kvcanary_cupy.write` with its long-lived buffers bound once.

    ``launcher(input_ids, positions, out_cache_loc, expected_input_tokens=None,
    expected_input_positions=None)`` writes exactly what ``kc.write(canary_buf, write_plan,
    input_ids, ..., **options)`` writes, for the options given here: several canary buffers in one
    launch, and ``stream=`` (the write on a side stream; :meth:`join` or
    :func:`kvcanary_cupy.join_stream` joins it).  A call whose per-step arrays are contiguous
    int64 arrays of the buffers' framework and device checks only those arrays; any other call
    takes :func:`kvcanary_cupy.write` (the same bytes, the same errors).  Capture-safe.

    Parameters
    ----------
    canary_buf, write_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode
        As for :func:`kvcanary_cupy.write`, checked once here; ``write_plan`` is usually a
        :class:`CanaryPlanner`'s ``write_plan``, refilled in place every step.
    chain_position_assert, stream
        As for :func:`kvcanary_cupy.write`.

    Raises
    ------
    TypeError, ValueError
        A bad argument, as :func:`kvcanary_cupy.write` raises it.

    Examples
    --------
    >>> planner = kc.CanaryPlanner(kc.CanaryCapacities(verify_capacity=32, write_req_capacity=4))
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> write = kc.WriteLauncher(canary, planner.write_plan, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
    >>> _ = planner.plan(np.array([1]), np.array([0]), np.array([3]), np.arange(64, dtype=np.int32).reshape(4, 16))
    >>> write(np.array([5, 6, 7]), np.arange(3), np.array([16, 17, 18]))
    >>> canary[18, :2].tolist()
    [7, 2]
    """

    @public_api
    def __init__(self, canary_buf: Array | Sequence[Array], write_plan: WritePlan, *, log: ViolationLog,
                 kernel_kind: int | Sequence[int] = 0, real_kv_sources: Sequence[Any] = (),
                 real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE, chain_position_assert: bool = True,
                 stream: Any = None):
        self.canary_buf, self.write_plan = canary_buf, write_plan
        self.options = dict(log=log, kernel_kind=kernel_kind, real_kv_sources=real_kv_sources,
                            real_kv_hash_mode=real_kv_hash_mode, chain_position_assert=chain_position_assert,
                            stream=stream)
        self._full = full_validation_forced()
        self._side = None
        self._bind()

    def join(self) -> None:
        """Make the caller's current stream (torch's for torch tensors) wait for every write queued
        so far on the side stream: :func:`kvcanary_cupy.join_stream` with one event, reused.
        Capture-safe; nothing to do without ``stream=``."""
        if self._side is not None:
            self._side.join()

    def __repr__(self) -> str:
        o = self.options
        stream = "" if o["stream"] is None else ", on a side stream (join() joins it)"
        return (f"<WriteLauncher {_buffers_words(self.canary_buf)}, write_req_capacity={self.write_plan.capacity}, "
                f"{_launch_words(o['kernel_kind'], o)}, chain_position_assert={o['chain_position_assert']}{stream}; "
                f"{_bound_words(self)}>")

    def _bind(self) -> None:
        o = self.options
        flag = o["chain_position_assert"]
        placement, context, named = ops._write_setup(self.canary_buf, self.write_plan, o["log"], o["kernel_kind"],
                                                     o["real_kv_sources"], o["real_kv_hash_mode"], flag, {})
        self._bound = None
        if o["stream"] is not None and self._side is None and placement.backend == "cupy":
            self._side = _SideStream(o["stream"], placement)  # on the CPU the free function refuses stream=
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = ops._write_bound_args(self.write_plan, o["log"], flag, context, array_module(placement))
            if self._full or not _viewed_in_place([*self.write_plan.arrays().values(), named["chain_position_assert"]]):
                return
            b = _Binding(placement, named)
            if b.numpy:
                if o["stream"] is not None:  # the free function refuses it
                    return
                b.args = args
            else:
                cb = b.cb
                launch = cb.write_launch(args)
                b.pack(launch.params)
                b.set = b.setter("inputs.input_ids", "inputs.positions", "inputs.out_cache_loc", "inputs.num_tokens")
                b.set_expected = b.optional_setter("inputs.expected_tokens", "inputs.expected_positions")
                b.grid, b.block = (launch.config.grid,), (launch.config.block,)
                real_kv = cb.has_real_kv(args.targets, args.real_kv_hash_mode)
                b.kernels = {checked: b.function("write", cb.write_kernel(len(args.targets), checked, real_kv))
                             for checked in (False, True)}
                b.side = self._side
        self._bound = b

    def __call__(self, input_ids: Array, positions: Array, out_cache_loc: Array, expected_input_tokens: Array | None = None,
                 expected_input_positions: Array | None = None) -> None:
        try:
            b = self._bound
            if b is not None and b.tensors and b.moved():
                self._bind()
                b = self._bound
            leading = None if b is None else b.arrays.leading(input_ids)
            if leading is not None:
                vector = b.arrays.vector
                ids, n = leading
                pos, loc = vector(positions, n), vector(out_cache_loc, n)
                if expected_input_tokens is None:
                    et = ep = None
                    ok = expected_input_positions is None
                else:
                    et, ep = vector(expected_input_tokens, n), vector(expected_input_positions, n)
                    ok = et is not None and ep is not None
                if ok and pos is not None and loc is not None:
                    if b.numpy:
                        get_backend("numpy").write(b.args._replace(
                            input_ids=ids, positions=pos, out_cache_loc=loc, expected_input_tokens=et,
                            expected_input_positions=ep))
                    else:
                        b.set((ids, pos, loc, n))
                        b.set_expected(None if et is None else (et, ep))
                        b.launch(b.kernels[et is not None], b.grid, b.block)
                    return
            ops.write(self.canary_buf, self.write_plan, input_ids, positions, out_cache_loc,
                      expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions,
                      **self.options)
        except (TypeError, ValueError) as exc:  # public_api, inline: its wrapper costs ~0.15-0.3 us a call
            trimmed = trimmed_argument_error(exc)
            if trimmed is None:
                raise
            raise trimmed  # the same exception, its traceback ending here


class VerifyLauncher:
    """:func:`kvcanary_cupy.verify` with every buffer bound once: ``launcher()`` verifies exactly
    what ``kc.verify(canary_buf, verify_plan, **options)`` verifies, for the options given here
    (several canary buffers in one launch too).  Capture-safe; nothing is checked per call but
    whether a bound torch tensor moved.

    Parameters
    ----------
    canary_buf, verify_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode
        As for :func:`kvcanary_cupy.verify`, checked once here; ``verify_plan`` is usually a
        :class:`CanaryPlanner`'s ``verify_plan``, refilled in place every step.
    check_expected_tokens, check_expected_token, check_holes
        As for :func:`kvcanary_cupy.verify` (``check_expected_token`` is the older spelling).

    Raises
    ------
    TypeError, ValueError
        A bad argument, as :func:`kvcanary_cupy.verify` raises it.

    Examples
    --------
    >>> planner = kc.CanaryPlanner(kc.CanaryCapacities(verify_capacity=32, write_req_capacity=4))
    >>> canary, log = kc.allocate_canary_buffer(64), kc.ViolationLog.allocate(16)
    >>> verify = kc.VerifyLauncher(canary, planner.verify_plan, log=log, kernel_kind=kc.CanaryLaunchTag.HEAD_K_FULL)
    >>> _ = planner.plan(np.array([1]), np.array([2]), np.array([1]), np.arange(64, dtype=np.int32).reshape(4, 16))
    >>> verify()  # slots 16 and 17 were never written
    >>> log.read().counts_by_tag()
    {'HEAD_K_FULL': 2}
    """

    @public_api
    def __init__(self, canary_buf: Array | Sequence[Array], verify_plan: VerifyPlan, *, log: ViolationLog,
                 kernel_kind: int | Sequence[int] = 0, real_kv_sources: Sequence[Any] = (),
                 real_kv_hash_mode: RealKvHashMode | int = RealKvHashMode.NONE, check_expected_tokens: bool = False,
                 check_expected_token: bool | None = None, check_holes: bool = False):
        check_expected_token = bool_keyword(check_expected_tokens, "check_expected_tokens", check_expected_token,
                                            "check_expected_token")
        self.canary_buf, self.verify_plan = canary_buf, verify_plan
        self.options = dict(log=log, kernel_kind=kernel_kind, real_kv_sources=real_kv_sources,
                            real_kv_hash_mode=real_kv_hash_mode, check_expected_token=check_expected_token,
                            check_holes=check_holes)
        self._full = full_validation_forced()
        self._bind()

    def __repr__(self) -> str:
        o = self.options
        return (f"<VerifyLauncher {_buffers_words(self.canary_buf)}, verify_capacity={self.verify_plan.capacity}, "
                f"{_launch_words(o['kernel_kind'], o)}, check_expected_tokens={o['check_expected_token']}, "
                f"check_holes={o['check_holes']}; "
                f"{_bound_words(self)}>")

    def _bind(self) -> None:
        o = self.options
        placement, context, named = ops._verify_setup(self.canary_buf, self.verify_plan, o["log"], o["kernel_kind"],
                                                      o["real_kv_sources"], o["real_kv_hash_mode"],
                                                      o["check_expected_token"], check_holes=o["check_holes"])
        self._bound = None
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = ops._verify_args(self.verify_plan, o["log"], o["check_expected_token"], context, array_module(placement),
                                    o["check_holes"])
            if self._full or not _viewed_in_place(self.verify_plan.arrays().values()):
                return
            b = _Binding(placement, named)
            if b.numpy:
                b.args = args
            else:
                launch = b.cb.verify_launch(args)
                b.pack(launch.params)
                b.grid, b.block = (launch.config.grid,), (launch.config.block,)
                b.kernel = b.function("verify", launch.name)
        self._bound = b

    def __call__(self) -> None:
        try:
            b = self._bound
            if b is not None and b.tensors and b.moved():
                self._bind()
                b = self._bound
            if b is None:
                ops.verify(self.canary_buf, self.verify_plan, **self.options)
            elif b.numpy:
                get_backend("numpy").verify(b.args)
            else:
                b.launch(b.kernel, b.grid, b.block)
        except (TypeError, ValueError) as exc:  # public_api, inline: its wrapper costs ~0.15-0.3 us a call
            trimmed = trimmed_argument_error(exc)
            if trimmed is None:
                raise
            raise trimmed  # the same exception, its traceback ending here


_REQ_TO_TOKEN, _VIRTUAL_PAGES, _BLOCK, _PAGED_KV = (TableKind.REQ_TO_TOKEN, TableKind.VIRTUAL_PAGES, TableKind.BLOCK,
                                                   TableKind.PAGED_KV)  # an enum member read costs ~0.1 us


def _step_table(arrays, table, bs_rows: int):
    """The table of one call, common case only, as ``(kind, entries, kv_indptr, virtual_to_physical,
    rows, pool_rows, row_tokens, shape)``: its kind (tables.TableKind), its arrays as the backend
    takes them, its rows (of entries), the expected-token pool rows a plan may index, the bound of
    its rows' lengths in tokens (cupy_backend.table_layout) and ``shape``, the arguments of
    :func:`cupy_backend.table_fields` (what changes only when the table's layout does; page size and
    null block first).  None when it is not the common case.

    ``bs_rows`` is the batch size for a table whose rows are the batch rows (PagedKvIndices)."""
    cls = type(table)
    if cls is BlockTable:
        entries = arrays.table(table.block_table, True)
        if entries is None:
            return None
        entries, rows, cols, stride, wide = entries
        tokens = cols * table.block_size
        if tokens > MAX_TABLE_TOKENS:
            return None
        shape = (table.block_size, table.null_block, cols, stride, wide, False, 0)
        return _BLOCK, entries, None, None, rows, rows, tokens, shape
    if cls is PagedKvIndices:
        indptr, indices = arrays.indices(table.kv_indptr, bs_rows + 1), arrays.indices(table.kv_indices, -1)
        if indptr is None or indices is None:
            return None
        (kv_indptr, _, indptr_wide), (entries, rows, wide) = indptr, indices
        tokens = rows * table.page_size
        if tokens > MAX_TABLE_TOKENS:
            return None
        return _PAGED_KV, entries, kv_indptr, None, rows, bs_rows, tokens, (table.page_size, 0, 0, 0, wide, indptr_wide, 0)
    if cls is ReqToToken:
        entries, v2p = arrays.table(table.req_to_token), table.virtual_to_physical
    else:  # a bare req_to_token
        entries, v2p = arrays.table(table), None
    if entries is None:
        return None
    entries, rows, cols, stride, _ = entries
    if v2p is None:  # a req_to_token row holds a token per column
        return _REQ_TO_TOKEN, entries, None, None, rows, rows, cols, (1, 0, cols, stride, False, False, 0)
    pages = arrays.leading(v2p)
    if pages is None or pages[1] < 1:
        return None
    shape = (table.page_size, 0, cols, stride, False, False, pages[1])
    return _VIRTUAL_PAGES, entries, None, pages[0], rows, rows, cols, shape


class PlanLauncher:
    """The plan of a :class:`~kvcanary_cupy.CanaryPlanner`: its output buffers, capacities and SWA
    settings bound once.  ``launcher(...)`` plans into the buffers and returns True, or returns
    False (nothing done) when the inputs are not the common case or nothing could be bound: the
    planner then takes the free function.  Every table kind is taken: a bare req_to_token,
    :class:`~kvcanary_cupy.ReqToToken` (virtual pages too), :class:`~kvcanary_cupy.BlockTable` and
    :class:`~kvcanary_cupy.PagedKvIndices`."""

    def __init__(self, verify_plan, write_plan, *, verify_capacity, write_req_capacity, swa_window_size,
                 full_to_swa_index_mapping, kv_token_id_vs_position_offset):
        self.verify_plan, self.write_plan = verify_plan, write_plan
        self.settings = (verify_capacity, write_req_capacity, swa_window_size, full_to_swa_index_mapping,
                         kv_token_id_vs_position_offset)
        self._full = full_validation_forced()
        self._bind()

    def __repr__(self) -> str:
        vcap, wcap, window, lut, offset = self.settings
        where = interop.placement_of(self.verify_plan.verify_slot_indices, "verify_plan").describe()
        lut_words = "none" if lut is None else "x".join(map(str, tuple(lut.shape)))
        return (f"<PlanLauncher verify_capacity={vcap}, write_req_capacity={wcap} on {where}, "
                f"swa_window_size={window}, full_to_swa_index_mapping={lut_words}, "
                f"kv_token_id_vs_position_offset={offset}; {_bound_words(self)}>")

    def _bind(self) -> None:
        """Bind, or leave nothing bound when the free function must decide (e.g. a LUT on another device)."""
        self._bound = None
        vcap, wcap, window, lut, offset = self.settings
        if self._full or not _viewed_in_place([lut]):
            return
        try:
            window = check_int64(window, "swa_window_size", minimum=0)
            offset = check_int64(offset, "kv_token_id_vs_position_offset")
            vcap, wcap = check_count(vcap, "verify_capacity"), check_count(wcap, "write_req_capacity")
            named = {**ops._record_arrays("out[0]", self.verify_plan), **ops._record_arrays("out[1]", self.write_plan),
                     "full_to_swa_index_mapping": lut}
            placement = common_placement(named)
            xp = array_module(placement)
            with launch_stream(placement):
                lut_view = None if lut is None else ops._lut_view(backend_view(lut, "full_to_swa_index_mapping"), xp)
                outs = ops._plan_views("out[0]", self.verify_plan, vcap, writable=True) | ops._plan_views(
                    "out[1]", self.write_plan, wcap, writable=True)
        except (TypeError, ValueError):
            return
        state = backend_view(scan_state(self.write_plan), "write_plan's scan state", writable=True)
        args = PlanArgs(None, None, None, None, window, lut_view, None, None, offset, False, ops.PlanOutputs(**outs), state)
        b = _Binding(placement, named)
        b.capacities, b.window, b.has_lut = (vcap, wcap), window, lut is not None
        if b.numpy:
            b.args = args
        else:
            b.pack(b.cb.plan_params(args))
            b.set = b.setter(*(f"inputs.{k}" for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens", "bs", "table",
                                                       "table_rows")), "outputs.clear_whole_capacity")
            # what only some tables (kv_indptr, virtual_to_physical) and expected tokens use
            b.set_optional = b.optional_setter(*(f"inputs.{k}" for k in (
                "kv_indptr", "virtual_to_physical", "pool", "pool_stride", "pool_cols", "valid_lens")))
            b.table_shape = b.table_kind = None  # the table_fields last written, and the table's kind
            b.narrow_row_tokens, b.narrow_layout = -1, None  # cupy_backend.narrow_layout of that shape
            b.kernels = {}  # (layout, bs, has_pool) -> ((function, grid, block, shared_mem), ...)
        self._bound = b

    @staticmethod
    def _kernels(b, key: tuple) -> tuple:
        """The launches of ``key`` = ``(layout, bs, has_pool)``, looked up once (the call reads ``b.kernels`` first)."""
        if len(b.kernels) > 4096:
            b.kernels.clear()
        layout, bs, has_pool = key
        with import_cupy().cuda.Device(b.device):  # grids are sized from the bound device's SM count
            kernels = b.kernels[key] = tuple(
                (b.function(family, name), (config.grid,), (config.block,), config.shared_mem)
                for family, name, config in b.cb.plan_kernels(layout, bs, b.capacities[0], b.has_lut, has_pool))
        return kernels

    @staticmethod
    def _write_table_shape(b, kind, shape: tuple) -> None:
        """Writes the table fields of ``shape`` and keeps the part of the layout choice that they decide."""
        for name, value in b.cb.table_fields(*shape):
            view, index = b.param_slots(f"inputs.{name}")
            view[index] = value
        page_size, null_block, _, _, entries_int64, kv_indptr_int64, _ = shape
        b.narrow_row_tokens, b.narrow_layout = b.cb.narrow_layout(kind, page_size, null_block, entries_int64, kv_indptr_int64)
        b.table_shape, b.table_kind = shape, kind

    def __call__(self, req_pool_indices, prefix_lens, extend_seq_lens, table,
                 req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None) -> bool:
        b = self._bound
        if b is not None and b.tensors and b.moved():
            self._bind()
            b = self._bound
        if b is None:
            return False
        arrays = b.arrays
        if req_pool_indices is None:  # only a PagedKvIndices table, whose rows are the batch rows
            if type(table) is not PagedKvIndices:
                return False
            leading, rp = arrays.leading(prefix_lens), None
        else:
            leading = arrays.leading(req_pool_indices)
            rp = None if leading is None else leading[0]
        if leading is None or (rp is not None and type(table) is PagedKvIndices):
            return False
        bs = leading[1]
        prefix, extend = arrays.vector(prefix_lens, bs), arrays.vector(extend_seq_lens, bs)
        t = _step_table(arrays, table, bs)
        if prefix is None or extend is None or t is None or bs > b.capacities[1]:
            return False
        kind, entries, kv_indptr, v2p, rows, pool_rows, row_tokens, shape = t
        if b.window > 0 and not b.has_lut and kind in (_REQ_TO_TOKEN, _VIRTUAL_PAGES):
            return False
        if req_to_verify_expected_tokens is None:
            if req_to_verify_expected_tokens_valid_lens is not None:
                return False
            pool, lens = (None, 0, 0, 0), None
        else:
            pool = arrays.table(req_to_verify_expected_tokens)
            lens = arrays.vector(req_to_verify_expected_tokens_valid_lens, bs)
            if pool is None or lens is None or pool[1] < pool_rows:
                return False
        wp = self.write_plan
        clear = not is_clean(wp)
        if b.numpy:
            view = TableView(kind, entries, kv_indptr, v2p, shape[0], shape[1], pool_rows, "", row_tokens)
            get_backend("numpy").plan(b.args._replace(
                req_pool_indices=rp, prefix_lens=prefix, extend_seq_lens=extend, table=view,
                expected_token_pool=pool[0], expected_token_valid_lens=lens, clear_whole_capacity=clear))
        else:
            if shape != b.table_shape or kind is not b.table_kind:
                self._write_table_shape(b, kind, shape)
            b.set((rp or 0, prefix, extend, bs, entries, rows, clear))
            b.set_optional(None if kv_indptr is None and v2p is None and lens is None else
                           (kv_indptr or 0, v2p or 0, pool[0] or 0, pool[3], pool[2], lens or 0))
            key = (b.narrow_layout if row_tokens <= b.narrow_row_tokens else kind, bs, lens is not None)  # table_layout
            for fn, grid, block, shared_mem in b.kernels.get(key) or self._kernels(b, key):
                b.launch(fn, grid, block, shared_mem)
        if clear:
            mark_clean(wp)
        return True
