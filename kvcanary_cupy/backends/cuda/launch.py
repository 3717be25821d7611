"""Launch overlap: the canary's kernels launched with programmatic stream serialization.

CuPy launches through ``cuLaunchKernel``: a kernel starts once everything before it on the stream
has finished, and the launch's own latency follows that (docs/design-notes.md has the H200's
figure).  On sm_90 and later the canary's record launches (plan, plan_and_verify, verify, write; free functions and
bound launchers; a session's coverage checks) go through ``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` instead, which lets the launch overlap
the end of the work before it.  Every kernel of ``kernels/`` opens with ``wait_for_prior_grids()``
(``griddepcontrol.wait``), which holds its threads until that work has completed and its writes
are visible, so every byte is what a plain launch computes; only the launch latency is hidden.
Streams, events and CUDA graph capture work as with a plain launch (a captured launch keeps its
programmatic edge).

``KVCANARY_LAUNCH_OVERLAP=0`` in the environment (read once per process and device) launches
plainly through CuPy everywhere.

:class:`BoundLaunch` makes the overlapped-or-plain decision for both roads: a bound launcher
keeps one per parameter record, a free function builds one per call (:func:`launch_record`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

from ...interop import import_cupy
from ...runtime import torch_stream_handle, wrapped_torch_stream
from . import device
from .abi import PROGRAMMATIC_STREAM_SERIALIZATION, CuLaunchAttribute, CuLaunchConfig
from .compile import get_function
from .params import KernelLaunch, kernel_arguments, record_addresses

LAUNCH_OVERLAP_ENV = "KVCANARY_LAUNCH_OVERLAP"
MIN_COMPUTE_CAPABILITY = 90  # griddepcontrol (PTX ISA 7.8) and the launch attribute: sm_90 and later
MIN_DRIVER_VERSION = 12030  # CUDA 12.3, whose graphs first keep a captured launch's programmatic edge


def supported(device_id: int) -> bool:
    """Whether launches on ``device_id`` can overlap (sm_90 or later, a CUDA 12.3 or later driver
    with cuLaunchKernelEx) and are not turned off by KVCANARY_LAUNCH_OVERLAP=0 (asked once per
    process and device)."""
    key = ("overlap", device_id)
    found = device.cache.get(key)
    if found is None:
        found = device.cache[key] = os.environ.get(LAUNCH_OVERLAP_ENV, "1").strip() != "0" and (
            device.compute_capability(device_id) >= MIN_COMPUTE_CAPABILITY
            and device.driver_version() >= MIN_DRIVER_VERSION and device.driver_launch() is not None)
    return found


# plain_launches blocks entered and not left, read at every launch beside supported() (asked once
# per BoundLaunch).
plain_depth = 0


def enabled(device_id: int) -> bool:
    """Whether a launch on ``device_id`` made now overlaps (asked at every launch)."""
    return plain_depth == 0 and supported(device_id)


@contextlib.contextmanager
def plain_launches():
    """Within the block, launches (bound launchers' too) go through CuPy as on a device without
    launch overlap: the benchmark's and the tests' comparisons of the two."""
    global plain_depth
    plain_depth += 1
    try:
        yield
    finally:
        plain_depth -= 1


def _error_name(status: int) -> str:
    name = ctypes.c_char_p()
    lib = device.driver()
    if lib is None or lib.cuGetErrorName(status, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {status}"
    return name.value.decode()


class OverlappedLaunch:
    """One kernel's launch, packed once: its function, grid, block, dynamic shared memory and the
    addresses of its argument values (which must stay valid and in place for as long as it is
    used; the driver reads them at each call).  Calling it launches on a stream (a raw handle).
    ``grid_y``: the grid's second dimension (the digest walks its requests along it)."""

    __slots__ = ("_attribute", "_config", "_config_ref", "_function", "_arguments", "_launch")

    def __init__(self, function_ptr: int, grid: int, block: int, shared_mem: int, argument_addresses, grid_y: int = 1):
        self._attribute = CuLaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._config = CuLaunchConfig(grid, grid_y, 1, block, 1, 1, shared_mem, None, ctypes.pointer(self._attribute), 1)
        self._config_ref = ctypes.pointer(self._config)
        self._function = ctypes.c_void_p(function_ptr)
        self._arguments = (ctypes.c_void_p * len(argument_addresses))(*argument_addresses)
        self._launch = device.driver_launch()

    def __call__(self, stream_handle: int) -> None:
        self._config.hStream = stream_handle
        status = self._launch(self._config_ref, self._function, self._arguments, None)
        if status != 0:
            raise RuntimeError(f"kv-canary: cuLaunchKernelEx failed with {_error_name(status)} "
                               f"(set {LAUNCH_OVERLAP_ENV}=0 to launch through CuPy instead)")


class BoundLaunch:
    """The launches of one parameter record on one device, on the caller's stream: torch's current
    one when ``torch_stream`` (a function returning its raw handle) is given, else CuPy's; behind
    it on ``side`` (a :class:`~kvcanary_cupy.runtime.SideStream`) when given.  Overlapping the work
    before it where the device allows, else through CuPy.  ``params`` must stay alive and in place
    while this is used: the launches read the arguments at its field addresses."""

    __slots__ = ("params", "arguments", "device", "_torch_stream", "_side", "_supported", "_overlapped", "_get_device",
                 "_cupy_stream")

    def __init__(self, params, device_id: int, torch_stream=None, side=None):
        self.params, self.device = params, device_id
        self.arguments = kernel_arguments(params)
        self._torch_stream, self._side = torch_stream, side
        self._supported = supported(device_id)  # fixed per process and device
        self._overlapped = {}  # (function, grid, block, shared_mem) -> its OverlappedLaunch
        cuda = import_cupy().cuda
        self._get_device, self._cupy_stream = cuda.runtime.getDevice, cuda.get_current_stream

    def __call__(self, fn, grid: tuple, block: tuple, shared_mem: int = 0) -> None:
        """Launch the loaded kernel ``fn`` (a ``RawKernel.kernel``) with this record's arguments."""
        if self._get_device() != self.device:
            with import_cupy().cuda.Device(self.device):
                self(fn, grid, block, shared_mem)
            return
        if self._side is None and self._supported and not plain_depth:  # the common case: the stream's raw handle
            overlapped = self._overlapped.get((fn, grid, block, shared_mem)) or self._overlap(fn, grid, block, shared_mem)
            overlapped(self._cupy_stream().ptr if self._torch_stream is None else self._torch_stream())
            return
        stream = None if self._torch_stream is None else wrapped_torch_stream(self._torch_stream())
        if self._side is not None:
            self._side.fork(self._cupy_stream() if stream is None else stream)
            stream = self._side.stream
        if plain_depth or not self._supported:
            fn(grid, block, self.arguments, shared_mem=shared_mem, stream=stream)
            return
        overlapped = self._overlapped.get((fn, grid, block, shared_mem)) or self._overlap(fn, grid, block, shared_mem)
        overlapped((self._cupy_stream() if stream is None else stream).ptr)

    def _overlap(self, fn, grid: tuple, block: tuple, shared_mem: int) -> OverlappedLaunch:
        """The packed launch of ``fn`` at this grid, block and shared memory, made once."""
        launch = self._overlapped[(fn, grid, block, shared_mem)] = OverlappedLaunch(fn.ptr, grid[0], block[0], shared_mem,
                                                                                   record_addresses(self.params), *grid[1:2])
        return launch


def launch_record(launch: KernelLaunch) -> None:
    """A free function's launch of one parameter record, on CuPy's current stream and device."""
    c = launch.config
    BoundLaunch(launch.params, device.current_id())(get_function(launch.family, launch.name).kernel, c.grid_dims(),
                                                   (c.block,), c.shared_mem)


class PackedLaunches:
    """A free call's record launches packed once, to be replayed while its arguments come back
    unchanged (:mod:`kvcanary_cupy.last_call`): each record's :class:`BoundLaunch` with its kernel,
    grid, block and shared memory, on the caller's stream read at each call (torch's current one
    for torch tensors, else CuPy's on the record's device), as :func:`launch_record` launches them.
    Where the launches overlap and the record's device is current, each call reads the stream once
    and hands its handle to the packed :class:`OverlappedLaunch` records (what the BoundLaunch
    would do per launch); otherwise each goes through its BoundLaunch."""

    __slots__ = ("calls", "_lock", "_device", "_torch_stream", "_overlapped", "_get_device", "_cupy_stream")

    def __init__(self, launches, placement):
        """``launches``: :class:`KernelLaunch` records, launched in order, on the current device."""
        torch_stream = torch_stream_handle(placement.device) if placement.framework == "torch" else None
        device_id = device.current_id()
        self.calls = tuple((BoundLaunch(x.params, device_id, torch_stream), get_function(x.family, x.name).kernel,
                            x.config.grid_dims(), (x.config.block,), x.config.shared_mem) for x in launches)
        self._lock = threading.Lock()  # an overlapped launch sets its stream then launches: one thread at a time
        self._device, self._torch_stream = device_id, torch_stream
        cuda = import_cupy().cuda
        self._get_device, self._cupy_stream = cuda.runtime.getDevice, cuda.get_current_stream
        self._overlapped = tuple(OverlappedLaunch(fn.ptr, grid[0], block[0], shared_mem, record_addresses(bound.params),
                                                  *grid[1:2])
                                 for bound, fn, grid, block, shared_mem in self.calls) if supported(device_id) else None

    def current_stream(self):
        """The stream the launches go on now, as a CuPy stream; None where another device is current."""
        if self._get_device() != self._device:
            return None
        return self._cupy_stream() if self._torch_stream is None else wrapped_torch_stream(self._torch_stream())

    def __call__(self, stream=None) -> None:
        """Launch; ``stream``: :meth:`current_stream`'s answer when the caller has just asked it."""
        overlapped = self._overlapped
        if overlapped is None or plain_depth or (stream is None and self._get_device() != self._device):
            with self._lock:
                for bound, fn, grid, block, shared_mem in self.calls:
                    bound(fn, grid, block, shared_mem)
            return
        if stream is not None:
            handle = stream.ptr
        else:
            handle = self._cupy_stream().ptr if self._torch_stream is None else self._torch_stream()
        with self._lock:
            for launch in overlapped:
                launch(handle)
