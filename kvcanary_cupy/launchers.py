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

import numpy as np

from . import ops
from .backends import PlanArgs, get_backend
from .constants import RealKvHashMode
from .errors import public_api
from .interop import array_module, backend_view, common_placement, import_cupy, is_torch_tensor, launch_stream
from .plans import check_count
from .validation import check_int

FULL_VALIDATION_ENV = "KVCANARY_FULL_VALIDATION"

_I64, _I32 = np.dtype(np.int64), np.dtype(np.int32)


def full_validation_forced() -> bool:
    """Whether the environment asks every call to take the fully validating free functions."""
    return os.environ.get(FULL_VALIDATION_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------------------------
# Per-step arrays, common case only.  ``vector(x, n)``: a contiguous int64 [n] array;
# ``leading(x)``: the same for the first array of a call, whose length sets n, as ``(value, n)``;
# ``table(x)``: an int32 [rows, cols] table with contiguous rows, as ``(value, rows, cols, row
# stride in elements)``.  The value is what the backend takes (a NumPy array, or a device address);
# None means "not the common case": the free function decides.  Each attribute read here costs
# tens of nanoseconds; the obvious spellings (``flags.c_contiguous``, ``len(tensor)``) cost more.


class _NumpyArrays:
    @staticmethod
    def vector(x, n):
        if type(x) is np.ndarray and x.dtype is _I64 and x.ndim == 1 and x.size == n:
            flags = x.flags
            if flags.c_contiguous and flags.aligned:
                return x
        return None

    def leading(self, x):
        value = self.vector(x, x.size) if type(x) is np.ndarray else None
        return None if value is None else (value, x.size)

    @staticmethod
    def table(x):
        if type(x) is np.ndarray and x.dtype is _I32 and x.ndim == 2 and x.flags.aligned:
            rows, cols = x.shape
            s0, s1 = x.strides
            if (cols <= 1 or s1 == 4) and s0 >= 0 and not s0 & 3:
                return x, rows, cols, s0 >> 2
        return None


class _CupyArrays:
    def __init__(self, device: int):
        self.ndarray = import_cupy().ndarray
        self.device = device

    def vector(self, x, n):
        if (type(x) is self.ndarray and x.dtype is _I64 and x.ndim == 1 and x.size == n
                and (x.strides[0] == 8 or (n <= 1 and x.strides[0] >= 0))):  # empty arrays have stride 0
            mem = x.data
            ptr = mem.ptr
            if mem.device_id == self.device and not ptr & 7:
                return ptr
        return None

    def leading(self, x):
        value = self.vector(x, x.size) if type(x) is self.ndarray else None
        return None if value is None else (value, x.size)

    def table(self, x):
        if type(x) is self.ndarray and x.dtype is _I32 and x.ndim == 2:
            rows, cols = x.shape
            s0, s1 = x.strides
            mem = x.data
            ptr = mem.ptr
            if (cols <= 1 or s1 == 4) and s0 >= 0 and not s0 & 3 and mem.device_id == self.device and not ptr & 3:
                return ptr, rows, cols, s0 >> 2
        return None


class _TorchArrays:
    """Torch tensors on the bound device: their address on CUDA (no DLPack), a NumPy view on the CPU."""

    def __init__(self, device: int | None):
        torch = sys.modules["torch"]
        self.tensor, self.strided, self.i64, self.i32 = torch.Tensor, torch.strided, torch.int64, torch.int32
        self.device = torch.device("cpu") if device is None else torch.device("cuda", device)
        self.cuda = device is not None

    def _value(self, x, align_mask):
        if not self.cuda:
            return x.numpy()
        ptr = x.data_ptr()
        return None if ptr & align_mask else ptr

    def vector(self, x, n):
        if (type(x) is self.tensor and x.dtype is self.i64 and x.dim() == 1 and x.numel() == n
                and x.layout is self.strided and x.device == self.device and x.is_contiguous()):
            return self._value(x, 7)
        return None

    def leading(self, x):
        if type(x) is not self.tensor:
            return None
        n = x.numel()
        value = self.vector(x, n)
        return None if value is None else (value, n)

    def table(self, x):
        if (type(x) is self.tensor and x.dtype is self.i32 and x.dim() == 2 and x.layout is self.strided
                and x.device == self.device):
            rows, cols = x.shape
            s0, s1 = x.stride()
            if (cols <= 1 or s1 == 1) and s0 >= 0:
                value = self._value(x, 3)
                if value is not None:
                    return value, rows, cols, s0
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


def _cupy_stream(handle: int):
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

    def current(self) -> bool:
        """Whether every bound torch tensor still has the address it was bound with."""
        return not self.tensors or _stamp(self.tensors) == self.stamp

    def function(self, family: str, name: str):
        """A compiled kernel on the bound device (compiled on first use; ``kc.warmup()`` does all)."""
        fn = self._functions.get((family, name))
        if fn is None:
            from .jit import get_function

            with import_cupy().cuda.Device(self.device):
                fn = self._functions[(family, name)] = get_function(family, name).kernel
        return fn

    def pack(self, params: np.ndarray) -> memoryview:
        """Keep a kernel parameter record and its launch arguments; returns the record as int64
        words (a memoryview: the cheapest item writes), where per-step fields are rewritten."""
        self.params = params
        self.arguments = self.cb.kernel_arguments(params)
        return memoryview(params.view(np.int64))

    def launch(self, fn, grid, block) -> None:
        """Launch on the caller's stream (torch's current one when torch tensors are bound), on the bound device."""
        stream = None if self._stream_handle is None else _cupy_stream(self._stream_handle())
        if self._get_device() == self.device:
            fn(grid, block, self.arguments, stream=stream)
        else:
            with import_cupy().cuda.Device(self.device):
                fn(grid, block, self.arguments, stream=stream)


def _words(params, *paths) -> tuple:
    from .backends.cupy_backend import param_word

    return tuple(param_word(params, p) for p in paths)


# ----------------------------------------------------------------------------------------------


class WriteLauncher:
    """:func:`kvcanary_cupy.write` with its long-lived buffers bound once.

    ``launcher(input_ids, positions, out_cache_loc, expected_input_tokens=None,
    expected_input_positions=None)`` writes exactly what ``kc.write(canary_buf, write_plan,
    input_ids, ..., **options)`` writes, for the options given here.
    """

    @public_api
    def __init__(self, canary_buf, write_plan, *, log, kernel_kind=0, real_kv_sources=(),
                 real_kv_hash_mode=RealKvHashMode.NONE, chain_position_assert=True):
        self.canary_buf, self.write_plan = canary_buf, write_plan
        self.options = dict(log=log, kernel_kind=kernel_kind, real_kv_sources=real_kv_sources,
                            real_kv_hash_mode=real_kv_hash_mode, chain_position_assert=chain_position_assert)
        self._full = full_validation_forced()
        self._bind()

    def _bind(self) -> None:
        o = self.options
        flag = o["chain_position_assert"]
        placement, context, named = ops._write_setup(self.canary_buf, self.write_plan, o["log"], o["kernel_kind"],
                                                     o["real_kv_sources"], o["real_kv_hash_mode"], flag, {})
        self._bound = None
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = ops._write_bound_args(self.canary_buf, self.write_plan, o["log"], flag, context,
                                         array_module(placement))
            if self._full or not _viewed_in_place([*self.write_plan.arrays().values(), named["chain_position_assert"]]):
                return
            b = _Binding(placement, named)
            if b.numpy:
                b.args = args
            else:
                cb = b.cb
                launch = cb.write_launch(args)
                b.words = b.pack(launch.params)
                b.grid, b.block = (launch.config.grid,), (launch.config.block,)
                real_kv = cb.has_real_kv(args.sources, args.real_kv_hash_mode)
                b.kernels = {checked: b.function("write", cb.write_kernel(checked, real_kv)) for checked in (False, True)}
                b.slots = _words(cb.WRITE_PARAMS, "input_ids", "positions", "out_cache_loc", "num_tokens",
                                 "expected_input_tokens", "expected_input_positions")
        self._bound = b

    @public_api
    def __call__(self, input_ids, positions, out_cache_loc, expected_input_tokens=None, expected_input_positions=None):
        b = self._bound
        if b is not None and not b.current():
            self._bind()
            b = self._bound
        if b is not None:
            arrays = b.arrays
            leading = arrays.leading(input_ids)
            if leading is not None:
                vector = arrays.vector
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
                        w, (i_ids, i_pos, i_loc, i_n, i_et, i_ep) = b.words, b.slots
                        w[i_ids], w[i_pos], w[i_loc], w[i_n] = ids, pos, loc, n
                        w[i_et], w[i_ep] = (0, 0) if et is None else (et, ep)
                        b.launch(b.kernels[et is not None], b.grid, b.block)
                    return
        ops.write(self.canary_buf, self.write_plan, input_ids, positions, out_cache_loc,
                  expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions,
                  **self.options)


class VerifyLauncher:
    """:func:`kvcanary_cupy.verify` with every buffer bound once: ``launcher()`` verifies exactly
    what ``kc.verify(canary_buf, verify_plan, **options)`` verifies, for the options given here."""

    @public_api
    def __init__(self, canary_buf, verify_plan, *, log, kernel_kind=0, real_kv_sources=(),
                 real_kv_hash_mode=RealKvHashMode.NONE, check_expected_token=False):
        self.canary_buf, self.verify_plan = canary_buf, verify_plan
        self.options = dict(log=log, kernel_kind=kernel_kind, real_kv_sources=real_kv_sources,
                            real_kv_hash_mode=real_kv_hash_mode, check_expected_token=check_expected_token)
        self._full = full_validation_forced()
        self._bind()

    def _bind(self) -> None:
        o = self.options
        placement, context, named = ops._verify_setup(self.canary_buf, self.verify_plan, o["log"], o["kernel_kind"],
                                                      o["real_kv_sources"], o["real_kv_hash_mode"],
                                                      o["check_expected_token"])
        self._bound = None
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = ops._verify_args(self.canary_buf, self.verify_plan, o["log"], o["check_expected_token"], context,
                                    array_module(placement))
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

    @public_api
    def __call__(self) -> None:
        b = self._bound
        if b is not None and not b.current():
            self._bind()
            b = self._bound
        if b is None:
            ops.verify(self.canary_buf, self.verify_plan, **self.options)
        elif b.numpy:
            get_backend("numpy").verify(b.args)
        else:
            b.launch(b.kernel, b.grid, b.block)


class PlanLauncher:
    """The plan of a :class:`~kvcanary_cupy.CanaryPlanner`: its output buffers, capacities and SWA
    settings bound once.  ``launcher(...)`` plans into the buffers and returns True, or returns
    False (nothing done) when the inputs are not the common case or nothing could be bound: the
    planner then takes the free function."""

    def __init__(self, verify_plan, write_plan, *, verify_capacity, write_req_capacity, swa_window_size,
                 full_to_swa_index_mapping, kv_token_id_vs_position_offset):
        self.verify_plan, self.write_plan = verify_plan, write_plan
        self.settings = (verify_capacity, write_req_capacity, swa_window_size, full_to_swa_index_mapping,
                         kv_token_id_vs_position_offset)
        self._full = full_validation_forced()
        self._bind()

    def _bind(self) -> None:
        """Bind, or leave nothing bound when the free function must decide (e.g. a LUT on another device)."""
        self._bound = None
        vcap, wcap, window, lut, offset = self.settings
        if self._full or not _viewed_in_place([lut]):
            return
        try:
            window = check_int(window, "swa_window_size", minimum=0)
            if window > 0 and lut is None:
                return
            offset = check_int(offset, "kv_token_id_vs_position_offset")
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
        args = PlanArgs(None, None, None, None, window, lut_view, None, None, offset, False, ops.PlanOutputs(**outs))
        b = _Binding(placement, named)
        b.capacities = vcap, wcap
        if b.numpy:
            b.args = args
        else:
            b.words = b.pack(b.cb.plan_params(args))
            b.slots = _words(b.cb.PLAN_PARAMS, *(f"inputs.{k}" for k in (
                "req_pool_indices", "prefix_lens", "extend_seq_lens", "bs", "req_to_token", "rtt_rows", "rtt_cols",
                "rtt_stride", "pool", "pool_stride", "pool_cols", "valid_lens")))
            b.has_lut = lut is not None
            b.kernels = {}  # (bs, has_pool) -> ((function, grid, block), ...)
        self._bound = b

    def _kernels(self, b, bs: int, has_pool: bool) -> tuple:
        key = (bs, has_pool)
        kernels = b.kernels.get(key)
        if kernels is None:
            if len(b.kernels) > 4096:
                b.kernels.clear()
            with import_cupy().cuda.Device(b.device):  # grids are sized from the bound device's SM count
                kernels = b.kernels[key] = tuple(
                    (b.function("plan", name), (config.grid,), (config.block,))
                    for name, config in b.cb.plan_kernels(bs, b.capacities[0], b.has_lut, has_pool))
        return kernels

    def __call__(self, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
                 req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None) -> bool:
        b = self._bound
        if b is not None and not b.current():
            self._bind()
            b = self._bound
        if b is None:
            return False
        arrays = b.arrays
        leading = arrays.leading(req_pool_indices)
        if leading is None:
            return False
        rp, bs = leading
        prefix, extend = arrays.vector(prefix_lens, bs), arrays.vector(extend_seq_lens, bs)
        table = arrays.table(req_to_token)
        if prefix is None or extend is None or table is None or bs > b.capacities[1]:
            return False
        if req_to_verify_expected_tokens is None:
            if req_to_verify_expected_tokens_valid_lens is not None:
                return False
            pool, lens = (None, 0, 0, 0), None
        else:
            pool = arrays.table(req_to_verify_expected_tokens)
            lens = arrays.vector(req_to_verify_expected_tokens_valid_lens, bs)
            if pool is None or lens is None or pool[1] < table[1]:
                return False
        if b.numpy:
            get_backend("numpy").plan(b.args._replace(
                req_pool_indices=rp, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=table[0],
                expected_token_pool=pool[0], expected_token_valid_lens=lens))
            return True
        w = b.words
        i_rp, i_prefix, i_extend, i_bs, i_rtt, i_rows, i_cols, i_stride, i_pool, i_pool_stride, i_pool_cols, i_lens = b.slots
        w[i_rp], w[i_prefix], w[i_extend], w[i_bs] = rp, prefix, extend, bs
        w[i_rtt], w[i_rows], w[i_cols], w[i_stride] = table
        w[i_pool], w[i_pool_cols], w[i_pool_stride] = pool[0] or 0, pool[2], pool[3]
        w[i_lens] = lens or 0
        for fn, grid, block in self._kernels(b, bs, lens is not None):
            b.launch(fn, grid, block)
        return True
