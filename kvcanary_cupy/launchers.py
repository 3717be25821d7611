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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import binding, ops
from .backends import get_backend
from .bound import FULL_VALIDATION_ENV  # noqa: F401  (the variable this module's docstring names)
from .bound import BoundState, bound_words, buffers_words, full_validation_forced, launch_words, viewed_in_place
from .constants import RealKvHashMode
from .errors import public_api, trimmed_argument_error
from .interop import Array, array_module
from .runtime import SideStream, launch_stream
from .validation import bool_keyword

if TYPE_CHECKING:
    from .log import ViolationLog
    from .plans import VerifyPlan, WritePlan


class _BoundWrite(BoundState):
    """A write launcher's state: the setters of its per-step fields, its grid and its two kernels
    (without and with the expected-input check)."""

    __slots__ = ("set_tokens", "set_expected", "grid", "block", "kernels")


class _BoundVerify(BoundState):
    """A verify launcher's state: its grid and kernel (nothing changes per call)."""

    __slots__ = ("grid", "block", "kernel")


class WriteLauncher:
    """:func:`kvcanary_cupy.write` with its long-lived buffers bound once.

    ``launcher(input_ids, positions, out_cache_loc, expected_input_tokens=None,
    expected_input_positions=None)`` writes exactly what ``kc.write(canary_buf, write_plan,
    input_ids, ..., **options)`` writes, for the options given here: several canary buffers in one
    launch, and ``stream=`` (the write on a side stream; :meth:`join` or
    :func:`kvcanary_cupy.join_stream` joins it).  A call whose per-step arrays are contiguous
    arrays of the buffers' framework and device (the tokens, positions and slots int32 or int64
    each, the write-input assert's int64) checks only those arrays; any other call
    takes :func:`kvcanary_cupy.write` (the same bytes, the same errors).  Capture-safe.

    Parameters
    ----------
    canary_buf, write_plan, log, kernel_kind, real_kv_sources, real_kv_hash_mode
        As for :func:`kvcanary_cupy.write`, checked once here; ``write_plan`` is usually a
        :class:`CanaryPlanner`'s ``write_plan``, refilled in place every step.
    chain_position_assert, stream, write_waves, wave
        As for :func:`kvcanary_cupy.write` (``write_waves``, like ``write_plan``, is read in
        place at every call; ``wave`` is fixed here).

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
                 stream: Any = None, write_waves: Array | None = None, wave: int = 0):
        self.canary_buf, self.write_plan = canary_buf, write_plan
        self.options = dict(log=log, kernel_kind=kernel_kind, real_kv_sources=real_kv_sources,
                            real_kv_hash_mode=real_kv_hash_mode, chain_position_assert=chain_position_assert,
                            stream=stream, write_waves=write_waves, wave=wave)
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
        wave = "" if o["write_waves"] is None else f", wave {o['wave']} of write_waves"
        return (f"<WriteLauncher {buffers_words(self.canary_buf)}, write_req_capacity={self.write_plan.capacity}, "
                f"{launch_words(o['kernel_kind'], o)}, chain_position_assert={o['chain_position_assert']}{wave}{stream}; "
                f"{bound_words(self)}>")

    def _bind(self) -> None:
        o = self.options
        flag = o["chain_position_assert"]
        placement, context, named = binding.write_setup(self.canary_buf, self.write_plan, o["log"], o["kernel_kind"],
                                                     o["real_kv_sources"], o["real_kv_hash_mode"], flag, {},
                                                     o["write_waves"], o["wave"])
        self._bound = None
        if o["stream"] is not None and self._side is None and placement.backend == "cupy":
            self._side = SideStream(o["stream"], placement)  # on the CPU the free function refuses stream=
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = binding.write_bound_args(self.write_plan, o["log"], flag, context, array_module(placement),
                                            o["write_waves"], o["wave"])
            if self._full or not viewed_in_place([*self.write_plan.arrays().values(), named["chain_position_assert"],
                                                  o["write_waves"]]):
                return
            b = _BoundWrite(placement, named, side=self._side)
            if b.numpy:
                if o["stream"] is not None:  # the free function refuses it
                    return
                b.args = args
            else:
                gpu = b.gpu
                launch = gpu.write_launch(args)
                b.pack(launch.params)
                b.set_tokens = b.setter("inputs.input_ids", "inputs.positions", "inputs.out_cache_loc", "inputs.num_tokens",
                                        "inputs.input_widths")
                b.set_expected = b.optional_setter("inputs.expected_tokens", "inputs.expected_positions")
                b.grid, b.block = (launch.config.grid,), (launch.config.block,)
                real_kv = gpu.has_real_kv(args.targets, args.real_kv_hash_mode)
                b.kernels = {checked: b.function("write", gpu.write_kernel(len(args.targets), checked, real_kv))
                             for checked in (False, True)}
        self._bound = b

    def __call__(self, input_ids: Array, positions: Array, out_cache_loc: Array, expected_input_tokens: Array | None = None,
                 expected_input_positions: Array | None = None) -> None:
        try:
            b = self._bound
            if b is not None and b.tensors and b.moved():
                self._bind()
                b = self._bound
            # the step's tokens, positions and slots int32 or int64, each its own (transformers builds int32 ones)
            first = None if b is None else b.arrays.indices(input_ids, -1)
            if first is not None:
                arrays = b.arrays
                ids, n, ids64 = first
                pos, loc = arrays.indices(positions, n), arrays.indices(out_cache_loc, n)
                if expected_input_tokens is None:
                    et = ep = None
                    ok = expected_input_positions is None
                else:
                    et, ep = arrays.vector(expected_input_tokens, n), arrays.vector(expected_input_positions, n)
                    ok = et is not None and ep is not None
                if ok and pos is not None and loc is not None:
                    if b.numpy:
                        get_backend("numpy").write(b.args._replace(
                            input_ids=ids, positions=pos[0], out_cache_loc=loc[0], expected_input_tokens=et,
                            expected_input_positions=ep))
                    else:
                        b.set_tokens((ids, pos[0], loc[0], n, ids64 | pos[2] << 1 | loc[2] << 2))
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
        return (f"<VerifyLauncher {buffers_words(self.canary_buf)}, verify_capacity={self.verify_plan.capacity}, "
                f"{launch_words(o['kernel_kind'], o)}, check_expected_tokens={o['check_expected_token']}, "
                f"check_holes={o['check_holes']}; {bound_words(self)}>")

    def _bind(self) -> None:
        o = self.options
        placement, context, named = binding.verify_setup(self.canary_buf, self.verify_plan, o["log"], o["kernel_kind"],
                                                      o["real_kv_sources"], o["real_kv_hash_mode"],
                                                      o["check_expected_token"], check_holes=o["check_holes"])
        self._bound = None
        with launch_stream(placement):  # on the bound device: grids are sized from its SM count
            args = binding.verify_args(self.verify_plan, o["log"], o["check_expected_token"], context, array_module(placement),
                                       o["check_holes"])
            if self._full or not viewed_in_place(self.verify_plan.arrays().values()):
                return
            b = _BoundVerify(placement, named)
            if b.numpy:
                b.args = args
            else:
                launch = b.gpu.verify_launch(args)
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


class WriteWaves:
    """Write launchers called in order as one (a session's waves of writes within a step), joined as one."""

    def __init__(self, launchers):
        self.launchers = launchers

    def __call__(self, *args) -> None:
        for launcher in self.launchers:
            launcher(*args)

    def join(self) -> None:
        self.launchers[-1].join()  # one side stream: the last wave's join covers the others
