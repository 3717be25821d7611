"""A CuPy "device" over host memory, for checking the CuPy launch path without a GPU.

Arrays are real ``cupy.ndarray`` objects whose device pointers are host addresses (never
dereferenced: nothing runs on a device; ``cupy.empty``/``cupy.full`` make them too, so
``allocate(..., like=)`` works), the device calls the launch path makes are answered on the
host, and every kernel launch is recorded with its name, grid, block, stream and the bytes
of each argument.  Streams, events, pinned memory and copies are stand-ins too: ``timeline``
lists, in call order, every launch, event record, stream wait, copy and event query (and
``capture_queries`` counts capture queries), so stream ordering and the device calls of an op
can be checked without a GPU.  A copy happens at once; an event completes at once unless
``hold_events`` is set, in which case it stays pending until it is synchronised or
:meth:`FakeDevice.complete` runs (the host running ahead of the device).
:meth:`FakeDevice.emulate_session_staging` runs the NumPy reference of the session's staging
kernels at their launch, so a session's end_step computes real records.
Of the library it replaces only its seam, ``backends/cuda/device.py`` (the cache of the device's
answers and loaded kernels, module loading, occupancy, cuLaunchKernelEx and the host-to-device copy
of a construction-time table); the rest is CuPy's.
Used by the tests and by ``benchmarks/host_profile.py`` (which is why it ships here rather than
in ``tests/``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import NamedTuple

import numpy as np


class Launch(NamedTuple):
    name: str
    grid: tuple
    block: tuple
    stream: object
    args: tuple  # bytes of each argument
    shared_mem: int  # dynamic shared memory, bytes


class FakeStream:
    """A named stream: ``with stream:`` makes it current, as with CuPy's."""

    __module__ = "cupy.cuda.stream"  # kv-canary recognises CuPy streams by their module

    def __init__(self, device, name):
        self.device, self.name, self.ptr, self.device_id = device, name, id(self), 0
        self.capturing = False
        device.streams[self.ptr] = self

    def wait_event(self, event):
        self.device.timeline.append(("wait", self.name, event.name))

    def synchronize(self):
        self.device.timeline.append(("sync", self.name, "host"))
        for event in self.device.events:
            if event.stream is self:
                event.pending = False

    def is_capturing(self):
        self.device.capture_queries += 1
        return self.capturing

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
        self.device, self.name, self.stream, self.pending = device, name, None, False
        device.events.append(self)

    def record(self, stream=None):
        stream = self.device.current[-1] if stream is None else stream
        self.stream, self.pending = stream, self.device.hold_events
        self.device.timeline.append(("record", self.name, stream.name))

    @property
    def done(self):
        self.device.timeline.append(("query", self.name, "pending" if self.pending else "done"))
        return not self.pending

    def synchronize(self):
        self.device.timeline.append(("sync", self.name, "host"))
        self.pending = False


class FakeDevice:
    """Install with :meth:`install` (a ``pytest.MonkeyPatch``); ``launches`` records every launch
    and ``timeline`` every device call, in call order: ``("launch", kernel, stream)``, ``("record",
    event, stream)``, ``("wait", stream, event)``, ``("copy", "d2h", stream)``, ``("query", event,
    "done" or "pending")`` and ``("sync", event or stream, "host")``; ``capture_queries`` counts
    capture queries, which answer ``capturing`` of the stream asked (False unless set);
    streams and events by name: the current stream at install is ``"main"``, the others are
    numbered in creation order, ``"stream1"``, ``"event1"`` ...  ``hold_events``: events
    recorded while it is set stay pending (``done`` False) until synchronised or :meth:`complete`.
    ``emulated``: kernel name -> a function of the launch's argument bytes run at the launch
    (needs ``record_bytes``); ``on_copy``: a function of ``(dst, src, nbytes)`` run after each
    copy (a stand-in for what the device would have written).  Kernels are loaded through the
    library's own ``compile.get_function`` (a fake module per family, a cache of this device's own);
    ``attributes_set`` lists each kernel attribute the driver was asked to set, as ``(kernel,
    attribute, value, whether the current stream was capturing)``.  ``overlap``: the device is an
    sm_90 one whose driver (version ``driver_version``, 13.0 unless set) has cuLaunchKernelEx, so
    record launches go through the library's launch overlap (recorded like a CuPy launch, each
    argument's bytes read at the address the library handed the driver; ``overlapped`` lists those
    addresses per launch); without it, an sm_80 one, launched through CuPy."""

    SM_COUNT = 132
    SHARED_MEM_OPTIN = 232_448  # an H200's MaxSharedMemoryPerBlockOptin
    STATIC_SHARED_MEM = 2_000  # every kernel's static shared memory, bytes

    def __init__(self, record_bytes: bool = True, overlap: bool = False):
        import cupy

        self.cupy = cupy
        self.record_bytes = record_bytes
        self.overlap = overlap
        self.driver_version = 13000  # cuda.h's CUDA_VERSION encoding: 13.0
        self.launches: list[Launch] = []
        self.timeline: list[tuple] = []
        self.streams: dict = {}  # pointer -> FakeStream
        self.events: list = []
        self.hold_events = False
        self.capture_queries = 0
        self.emulated: dict = {}
        self.kernels: list[str] = []  # kernel name by function pointer
        self.attributes_set: list[tuple] = []
        self.on_copy = None
        self.overlapped: list[tuple] = []  # the argument addresses of each overlapped launch
        self.current = [FakeStream(self, "main")]
        self._created = {"stream": 0, "event": 0}
        self._keep = []

    def _name(self, kind: str) -> str:
        self._created[kind] += 1
        return f"{kind}{self._created[kind]}"

    def complete(self) -> None:
        """Everything queued so far has run: every pending event completes."""
        for event in self.events:
            event.pending = False

    def emulate_session_staging(self) -> None:
        """Run the NumPy reference of session_stage (staging and attribution both) at each launch
        of session_stage, on host views of the addresses in its SessionStage argument."""
        assert self.record_bytes, "emulation reads the argument bytes"
        self.emulated["kvcanary::session_stage"] = _session_stage_on_host

    def asarray(self, host: np.ndarray):
        """A CuPy array sharing ``host``'s memory (a copy of it, kept alive here)."""
        cupy = self.cupy
        host = np.array(host, copy=True)
        self._keep.append(host)
        mem = cupy.cuda.UnownedMemory(host.ctypes.data, max(host.nbytes, 1), host, device_id=0)
        return cupy.ndarray(host.shape, host.dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def record_launch(self, name, grid, block, stream, args, shared_mem) -> None:
        self.launches.append(Launch(name, grid, block, stream, args, shared_mem))
        self.timeline.append(("launch", name, stream.name))
        emulate = self.emulated.get(name)
        if emulate is not None:
            emulate(args)

    def to_numpy(self, x) -> np.ndarray:
        """The host bytes behind a fake CuPy array."""
        nbytes = x.nbytes
        buf = (ctypes.c_char * nbytes).from_address(x.data.ptr) if nbytes else b""
        return np.frombuffer(bytes(buf), x.dtype).reshape(x.shape)

    def install(self, monkeypatch) -> None:
        from kvcanary_cupy.backends.cuda import abi, device as cuda_device

        device = self

        class Device:
            def __init__(self, device_id=None):
                self.id = 0 if device_id is None else device_id
                self.compute_capability = "90" if device.overlap else "80"
                self.attributes = {"MultiProcessorCount": FakeDevice.SM_COUNT,
                                   "MaxSharedMemoryPerBlockOptin": FakeDevice.SHARED_MEM_OPTIN}

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                device.complete()

        class Function:
            def __init__(self, name):
                self.name, self.ptr = name, len(device.kernels)
                device.kernels.append(name)

            def __call__(self, grid, block, args, stream=None, **kwargs):
                args = device.argument_bytes(self.name, args) if device.record_bytes else ()
                device.record_launch(self.name, tuple(grid), tuple(block), device.current[-1] if stream is None else stream, args,
                                     kwargs.get("shared_mem", 0))

        class RawKernel(Function):
            @functools.cached_property
            def kernel(self):
                return Function(self.name)

        class RawModule:
            get_function = RawKernel

        def set_attribute(fn, attribute, value):
            self.attributes_set.append((self.kernels[fn], attribute, value, self.current[-1].capturing))

        def get_attribute(attribute, fn):
            assert attribute == self.cupy.cuda.driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, attribute
            return FakeDevice.STATIC_SHARED_MEM

        monkeypatch.setattr(self.cupy, "empty", lambda shape, dtype=float: self.asarray(np.zeros(shape, dtype)))
        monkeypatch.setattr(self.cupy, "full", lambda shape, fill, dtype=None: self.asarray(np.full(shape, fill, dtype)))
        monkeypatch.setattr(self.cupy.cuda, "Device", Device)
        monkeypatch.setattr(self.cupy.cuda, "Stream", lambda *a, **k: FakeStream(self, self._name("stream")))
        monkeypatch.setattr(self.cupy.cuda, "Event", lambda *a, **k: FakeEvent(self, self._name("event")))
        monkeypatch.setattr(self.cupy.cuda, "get_current_stream", lambda device_id=-1: self.current[-1])
        import cupyx

        monkeypatch.setattr(cupyx, "empty_pinned", lambda shape, dtype=float: np.zeros(shape, dtype))

        def memcpy_async(dst, src, size, kind, stream):
            assert kind == self.cupy.cuda.runtime.memcpyDeviceToHost  # the only copy the session makes
            ctypes.memmove(dst, src, size)  # host addresses
            self.timeline.append(("copy", "d2h", self.streams[stream].name))
            if self.on_copy is not None:
                self.on_copy(dst, src, size)

        monkeypatch.setattr(self.cupy.cuda.runtime, "memcpyAsync", memcpy_async)
        monkeypatch.setattr(self.cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setattr(self.cupy.cuda.runtime, "getDeviceCount", lambda: 1)  # warmup asks first
        monkeypatch.setattr(self.cupy.cuda.runtime, "driverGetVersion", lambda: self.driver_version)
        monkeypatch.setattr(self.cupy.cuda.driver, "funcSetAttribute", set_attribute)
        monkeypatch.setattr(self.cupy.cuda.driver, "funcGetAttribute", get_attribute)

        def launch_kernel_ex(config, function, arguments, extra):
            """cuLaunchKernelEx: recorded like a CuPy launch (each argument's bytes read at its address)."""
            c = config.contents
            assert c.numAttrs == 1 and c.attrs[0].id == abi.PROGRAMMATIC_STREAM_SERIALIZATION and c.attrs[0].value == 1
            assert (c.gridDimZ, c.blockDimY, c.blockDimZ, extra) == (1, 1, 1, None)
            addresses = tuple(arguments)
            self.overlapped.append(addresses)
            name = self.kernels[function.value]
            args = self.argument_bytes(name, addresses) if self.record_bytes else ()
            grid = (c.gridDimX,) if c.gridDimY == 1 else (c.gridDimX, c.gridDimY)  # as a CuPy launch gives it
            self.record_launch(name, grid, (c.blockDimX,), self.streams[c.hStream], args, c.sharedMemBytes)
            return 0

        # The library's own seam (backends/cuda/device.py): a cache of this device's answers and
        # kernels, fake modules, an occupancy of 4 blocks per SM, cuLaunchKernelEx on sm_90 and
        # construction-time host-to-device copies (host addresses: a memmove).
        monkeypatch.setattr(cuda_device, "cache", {})
        monkeypatch.setattr(cuda_device, "load_module", lambda code, options, name_expressions: RawModule())
        monkeypatch.setattr(cuda_device, "max_active_blocks_per_sm", lambda fn, block: 4)
        monkeypatch.setattr(cuda_device, "driver_launch", lambda: launch_kernel_ex if self.overlap else None)
        monkeypatch.setattr(cuda_device, "copy_from_host",
                            lambda view, host: ctypes.memmove(view.data.ptr, np.ascontiguousarray(host).ctypes.data, host.nbytes))

    def argument_bytes(self, name: str, args) -> tuple:
        """The bytes of each launch argument: a NumPy value's own, or, for an address (a CuPy
        CPointer or a driver argument pointer), as many bytes there as the kernel's parameter takes."""
        record = _parameter_record(name)
        out = []
        for i, a in enumerate(args):
            if isinstance(a, int) or type(a).__name__ == "CPointer":
                address = a if isinstance(a, int) else a.ptr
                out.append(ctypes.string_at(address, record.fields[record.names[i]][0].itemsize))
            else:
                out.append(bytes(np.asarray(a).tobytes()))
        return tuple(out)


def _parameter_record(name: str):
    """The parameter record dtype of a kernel of the library (what a driver reads from its signature)."""
    from kvcanary_cupy.backends.cuda import abi
    from kvcanary_cupy.backends.cuda.compile import kernel_of

    from kvcanary_cupy.digest import cuda as digest_cuda

    kernel = kernel_of(name)
    if kernel in abi.COVERAGE_PARAMS:
        return abi.COVERAGE_PARAMS[kernel]
    if kernel.startswith("plan_verify"):
        return abi.PLAN_VERIFY_PARAMS
    return {"canary_write": abi.WRITE_PARAMS, "canary_verify": abi.VERIFY_PARAMS, "session_stage": abi.STAGE_PARAMS,
            "session_attribute": abi.STAGE_PARAMS, "digest_init": digest_cuda.DIGEST_PARAMS,
            "digest_accumulate": digest_cuda.DIGEST_PARAMS, "digest_units": digest_cuda.DIGEST_PARAMS,
            "digest_verify": digest_cuda.VERIFY_PARAMS,
            }.get(kernel, abi.PLAN_PARAMS if kernel.startswith("plan_") else None)


def host_view(ptr: int, dtype, count: int) -> np.ndarray:
    """A writable NumPy view of ``count`` items at the host address ``ptr`` (a fake device array)."""
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (dtype.itemsize * count)).from_address(ptr), dtype) if count else np.zeros(0, dtype)


def _session_stage_on_host(args) -> None:
    from kvcanary_cupy.args import LogViews, StageArgs, StageLayout
    from kvcanary_cupy.backends import numpy_backend
    from kvcanary_cupy.backends.cuda.abi import SESSION_STAGE
    from kvcanary_cupy.constants import VIOLATION_FIELDS

    s = np.frombuffer(args[0], SESSION_STAGE)[0]
    (stamp,) = np.frombuffer(args[1], np.int64)
    kinds, ring, vcap, wcap = (int(s[k]) for k in ("num_kinds", "ring_capacity", "verify_capacity", "write_req_capacity"))
    layout = StageLayout(kinds, ring, int(s["attribution_capacity"]))
    i64 = lambda name, n: host_view(int(s[name]), np.int64, n)  # noqa: E731
    i32 = lambda name: host_view(int(s[name]), np.int32, 1)  # noqa: E731
    write_index = host_view(int(s["write_index"]), np.int32, int(s["num_rings"]))
    log = LogViews(ring=i64("ring", ring * VIOLATION_FIELDS).reshape(ring, VIOLATION_FIELDS), write_index=write_index,
                   **{k: i64(k, kinds) for k in ("violation_counters", "slot_run_counters", "kernel_run_counters",
                                                  "out_of_range_counters")})
    numpy_backend.session_stage(StageArgs(
        log=log, verify_slot_indices=i64("slots", vcap), verify_expected_tokens=i64("expected_tokens", vcap),
        verify_expected_positions=i64("expected_positions", vcap), verify_prev_slot_indices=i64("prev_slots", vcap),
        verify_num_valid=i32("verify_num_valid"), enable=i32("enable"), plan_out_of_range_count=i64("plan_out_of_range", 1),
        verify_offsets=i64("verify_offsets", wcap + 1), write_num_valid_reqs=i32("write_num_valid_reqs"),
        marks=i64("marks", int(s["num_slots"])), staging=i64("staging", layout.size), layout=layout), int(stamp))


@contextlib.contextmanager
def fake_device(record_bytes: bool = True, overlap: bool = False):
    """A :class:`FakeDevice` installed for the duration of the block."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        dev = FakeDevice(record_bytes, overlap)
        dev.install(mp)
        yield dev
