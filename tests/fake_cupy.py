"""A CuPy "device" over host memory, for checking the CuPy launch path without a GPU.

Arrays are real ``cupy.ndarray`` objects whose device pointers are host addresses (never
dereferenced: nothing runs on a device; ``cupy.empty``/``cupy.full`` make them too, so
``allocate(..., like=)`` works), the device calls the launch path makes are answered on the
host, and every kernel launch is recorded with its name, grid, block, stream and the bytes
of each argument.  Streams and events are stand-ins too: ``timeline`` lists, in call order,
every launch, event record and stream wait, so stream ordering can be checked without a GPU.
Used by ``tests/test_launchers.py``, ``tests/test_session_launchers.py`` and
``benchmarks/host_profile.py``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np


class Launch(NamedTuple):
    name: str
    grid: tuple
    block: tuple
    stream: object
    args: tuple  # bytes of each argument


class FakeStream:
    """A named stream: ``with stream:`` makes it current, as with CuPy's."""

    __module__ = "cupy.cuda.stream"  # kv-canary recognises CuPy streams by their module

    def __init__(self, device, name):
        self.device, self.name, self.ptr, self.device_id = device, name, id(self), 0

    def wait_event(self, event):
        self.device.timeline.append(("wait", self.name, event.name))

    def synchronize(self):
        pass

    def is_capturing(self):
        return False

    def __enter__(self):
        self.device.current.append(self)
        return self

    def __exit__(self, *exc):
        self.device.current.pop()
        return False

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, device, name):
        self.device, self.name, self.done = device, name, True

    def record(self, stream=None):
        stream = self.device.current[-1] if stream is None else stream
        self.device.timeline.append(("record", self.name, stream.name))

    def synchronize(self):
        pass


class FakeDevice:
    """Install with :meth:`install` (a ``pytest.MonkeyPatch``); ``launches`` records every launch
    and ``timeline`` every launch (by kernel name), event record and stream wait, in call order
    (``("launch", kernel, stream)``, ``("record", event, stream)``, ``("wait", stream, event)``;
    streams and events by name: the current stream at install is ``"main"``, the others are
    numbered in creation order, ``"stream1"``, ``"event1"`` ...)."""

    SM_COUNT = 132

    def __init__(self, record_bytes: bool = True):
        import cupy

        self.cupy = cupy
        self.record_bytes = record_bytes
        self.launches: list[Launch] = []
        self.timeline: list[tuple] = []
        self.current = [FakeStream(self, "main")]
        self._created = {"stream": 0, "event": 0}
        self._keep = []

    def _name(self, kind: str) -> str:
        self._created[kind] += 1
        return f"{kind}{self._created[kind]}"

    def asarray(self, host: np.ndarray):
        """A CuPy array sharing ``host``'s memory (a copy of it, kept alive here)."""
        cupy = self.cupy
        host = np.array(host, copy=True)
        self._keep.append(host)
        mem = cupy.cuda.UnownedMemory(host.ctypes.data, max(host.nbytes, 1), host, device_id=0)
        return cupy.ndarray(host.shape, host.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def to_numpy(self, x) -> np.ndarray:
        """The host bytes behind a fake CuPy array."""
        import ctypes

        nbytes = x.nbytes
        buf = (ctypes.c_char * nbytes).from_address(x.data.ptr) if nbytes else b""
        return np.frombuffer(bytes(buf), x.dtype).reshape(x.shape)

    def install(self, monkeypatch) -> None:
        from kvcanary_cupy import interop, jit
        from kvcanary_cupy.backends import cupy_backend

        device = self

        class Device:
            def __init__(self, device_id=None):
                self.id = 0 if device_id is None else device_id
                self.attributes = {"MultiProcessorCount": FakeDevice.SM_COUNT}

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

        class Function:
            def __init__(self, name):
                self.name = name

            def __call__(self, grid, block, args, stream=None, **kwargs):
                args = tuple(bytes(np.asarray(a).tobytes()) for a in args) if device.record_bytes else ()
                stream = device.current[-1] if stream is None else stream
                device.launches.append(Launch(self.name, tuple(grid), tuple(block), stream, args))
                device.timeline.append(("launch", self.name, stream.name))

        class RawKernel(Function):
            @property
            def kernel(self):
                return Function(self.name)

        monkeypatch.setattr(self.cupy, "empty", lambda shape, dtype=float: self.asarray(np.zeros(shape, dtype)))
        monkeypatch.setattr(self.cupy, "full", lambda shape, fill, dtype=None: self.asarray(np.full(shape, fill, dtype)))
        monkeypatch.setattr(self.cupy.cuda, "Device", Device)
        monkeypatch.setattr(self.cupy.cuda, "Stream", lambda *a, **k: FakeStream(self, self._name("stream")))
        monkeypatch.setattr(self.cupy.cuda, "Event", lambda *a, **k: FakeEvent(self, self._name("event")))
        monkeypatch.setattr(self.cupy.cuda, "get_current_stream", lambda device_id=-1: self.current[-1])
        import ctypes

        import cupyx

        monkeypatch.setattr(cupyx, "empty_pinned", lambda shape, dtype=float: np.zeros(shape, dtype))
        monkeypatch.setattr(self.cupy.cuda.runtime, "memcpyAsync",
                            lambda dst, src, size, kind, stream: ctypes.memmove(dst, src, size))  # host addresses
        monkeypatch.setattr(self.cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setattr(interop, "is_capturing", lambda placement: False)  # no stream to ask
        monkeypatch.setattr(jit, "get_function", lambda family, name: RawKernel(name))
        monkeypatch.setattr(cupy_backend, "get_function", lambda family, name: RawKernel(name))
        monkeypatch.setattr(cupy_backend, "_sm_count", lambda device_id: FakeDevice.SM_COUNT)
        monkeypatch.setattr(cupy_backend, "resident_blocks_per_sm", lambda device_id, family, name, block: 4)
        if self.record_bytes:  # the arguments as one-element NumPy views, whose bytes can be read back
            monkeypatch.setattr(cupy_backend, "_CPointer", None)


@contextlib.contextmanager
def fake_device(record_bytes: bool = True):
    """A :class:`FakeDevice` installed for the duration of the block."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        dev = FakeDevice(record_bytes)
        dev.install(mp)
        yield dev
