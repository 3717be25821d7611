"""The CUDA runtime as the package meets it: importing CuPy, the streams a launch goes on, CUDA
graph capture.  Every stream a kernel is queued on and every capture query is decided here, for the
free functions, the bound launchers and the session alike.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .errors import fail

if TYPE_CHECKING:
    from .interop import Placement

GPU_EXTRAS_HINT = (
    "install CuPy with `pip install kvcanary-cupy[cu12]` (CUDA 12 driver) or "
    "`pip install kvcanary-cupy[cu13]` (CUDA 13 driver)"
)


def import_cupy():
    """Import CuPy, or raise an ImportError that says which extra to install."""
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - exercised only without CuPy
        raise ImportError(f"kv-canary: this needs CuPy, which is not installed: {GPU_EXTRAS_HINT}") from exc
    return cupy


def cuda_unavailable_reason() -> str | None:
    """None when CuPy is installed and sees a CUDA GPU; otherwise one line saying what is missing."""
    try:
        import cupy
    except ImportError:
        return f"CuPy is not installed: {GPU_EXTRAS_HINT}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver or device
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"no CUDA GPU found (CuPy {cupy.__version__}: {detail})"
    return None if count > 0 else f"no CUDA GPU found (CuPy {cupy.__version__} sees 0 devices)"



class _CupyPlacement(NamedTuple):
    """What :func:`is_capturing` reads of a placement (interop.Placement has the same fields)."""

    backend: str
    framework: str
    device: int


# ---- CUDA graph capture ----------------------------------------------------------------------


def is_capturing(placement: Placement) -> bool:
    """Whether the stream kv-canary launches on for ``placement`` is capturing a CUDA graph.

    A driver query: ask only right before a copy or an allocation, never on the plain path.
    """
    if placement.backend != "cupy":
        return False
    if placement.framework == "torch":
        torch = sys.modules["torch"]
        with torch.cuda.device(placement.device):
            return torch.cuda.is_current_stream_capturing()
    return stream_is_capturing(import_cupy().cuda.get_current_stream(placement.device))


def stream_is_capturing(stream) -> bool:
    """Whether a CuPy stream (a wrapped torch stream too) is capturing a CUDA graph: one driver query."""
    try:
        return stream.is_capturing()
    except import_cupy().cuda.runtime.CUDARuntimeError:
        return True  # the legacy stream cannot be queried while another stream captures in global mode


def refuse_during_capture(placement: Placement, what: str, fix: str) -> None:
    """Refuse a copy or an allocation while the launch stream captures a CUDA graph.

    The graph would record the copy into (or the kernels' reads of) memory that goes back to
    CuPy's or torch's pool when the call returns: a replay would then write into whatever array
    gets that memory next.
    """
    if is_capturing(placement):
        fail(ValueError, f"{what}, but the current stream is capturing a CUDA graph; {fix}")


def refuse_view_copy_during_capture(view, what: str, fix: str) -> None:
    """:func:`refuse_during_capture` for a NumPy/CuPy view made inside :func:`launch_stream`.

    There CuPy's current stream is the launch stream (torch's current stream when torch tensors
    are involved), so CuPy's query covers torch graphs too.
    """
    if not isinstance(view, np.ndarray):
        refuse_during_capture(_CupyPlacement("cupy", "cupy", view.device.id), what, fix)



# ---- streams ---------------------------------------------------------------------------------


@contextlib.contextmanager
def launch_stream(placement: Placement, torch_device_hint=None):
    """Run CuPy launches on the caller's stream: torch's current stream when torch is used."""
    if placement.backend != "cupy":
        yield
        return
    cupy = import_cupy()
    with cupy.cuda.Device(placement.device):
        if placement.framework == "torch":  # the raw handle: torch.cuda.current_stream looks the device up again
            with wrapped_torch_stream(torch_stream_handle(placement.device)()):
                yield
        else:
            yield


def _is_torch_stream(stream) -> bool:
    return "torch" in sys.modules and isinstance(stream, sys.modules["torch"].cuda.Stream)


def cupy_stream(stream, name: str, device: int | None):
    """``stream`` (a CuPy stream or a torch CUDA stream) as a CuPy stream, checked to be on ``device``."""
    cupy = import_cupy()
    if _is_torch_stream(stream):
        stream_device = stream.device.index
        stream = cupy.cuda.Stream.from_external(stream)
    elif type(stream).__module__.split(".", 1)[0] == "cupy" and hasattr(stream, "wait_event"):
        stream_device = getattr(stream, "device_id", -1)  # -1: unknown (an external stream)
    else:
        fail(TypeError, f"{name} must be a CuPy stream or a torch.cuda.Stream, got {type(stream).__module__}.{type(stream).__name__}")
    if device is not None and stream_device not in (-1, device):
        fail(ValueError, f"{name} is on cuda:{stream_device} but the arrays are on cuda:{device}; pass a stream of their device")
    return stream


@contextlib.contextmanager
def side_stream(stream, placement: Placement):
    """Launch on ``stream`` (when given) behind all work queued so far on the current stream.

    An event recorded on the current stream orders the side stream after it (in a CUDA graph
    capture this forks the capture onto the side stream; join_stream joins it back).
    """
    if stream is None:
        yield
        return
    if placement.backend != "cupy":
        fail(ValueError, "stream is for CUDA arrays; the arrays of this call are on the CPU, pass stream=None")
    cupy = import_cupy()
    side = cupy_stream(stream, "stream", placement.device)
    fork = cupy.cuda.Event(block=False, disable_timing=True)
    fork.record(cupy.cuda.get_current_stream())
    side.wait_event(fork)
    with side:
        yield


def join_stream(stream: Any) -> None:
    """Make the caller's current stream wait for all work queued so far on ``stream``.

    Records one event on ``stream`` and makes the current stream wait for it; nothing waits on
    the host.  Capture-safe: inside a CUDA graph capture it joins the branch that
    ``write(..., stream=...)`` forked onto the side stream (join before the capture ends).

    Parameters
    ----------
    stream : cupy.cuda.Stream or torch.cuda.Stream
        The side stream given to :func:`kvcanary_cupy.write` (or :class:`WriteLauncher`).  The
        current stream is torch's for a torch stream and CuPy's for a CuPy stream.

    Raises
    ------
    TypeError
        ``stream`` is neither a CuPy nor a torch CUDA stream.

    Examples
    --------
    >>> side = cupy.cuda.Stream(non_blocking=True)                    # doctest: +SKIP
    >>> kc.write(canary, wp, ids, pos, loc, log=log, stream=side)     # doctest: +SKIP
    >>> kc.join_stream(side)  # before anything reads canary or log  # doctest: +SKIP
    """
    if _is_torch_stream(stream):
        sys.modules["torch"].cuda.current_stream(stream.device).wait_stream(stream)
        return
    cupy = import_cupy()
    side = cupy_stream(stream, "stream", None)
    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record(side)
    cupy.cuda.get_current_stream().wait_event(done)



# torch's current stream, wrapped for CuPy once per raw handle.

_CUPY_STREAMS: dict = {}


class _RawStream:
    """A raw CUDA stream handle under the CUDA stream protocol (what ``Stream.from_external`` takes)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def wrapped_torch_stream(handle: int):
    stream = _CUPY_STREAMS.get(handle)
    if stream is None:
        if len(_CUPY_STREAMS) >= 64:  # torch pools its streams; this only bounds a pathological caller
            _CUPY_STREAMS.clear()
        stream = _CUPY_STREAMS[handle] = import_cupy().cuda.Stream.from_external(_RawStream(handle))
    return stream


def torch_stream_handle(device: int):
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
        handle = torch_stream_handle(placement.device)
        return lambda: wrapped_torch_stream(handle())
    current, device = import_cupy().cuda.get_current_stream, placement.device
    return lambda: current(device)



class SideStream:
    """A write's side stream (what :func:`kvcanary_cupy.write` does with ``stream=``): ``fork``
    orders it behind everything queued so far on the caller's stream, ``join`` orders the caller's
    current stream behind it.  One event each, reused by every call: recording an event allocates
    nothing, so both are capture-safe."""

    def __init__(self, stream, placement):
        cupy = import_cupy()
        self.device = placement.device
        self.stream = cupy_stream(stream, "stream", self.device)
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


