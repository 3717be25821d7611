"""Every question the GPU side asks of the CUDA device and driver, and every kernel it loads: the
one seam a fake device replaces (``devtools/fake_cupy.py`` swaps :data:`cache` for its own and
answers :func:`load_module`, :func:`max_active_blocks_per_sm`, :func:`driver_launch` and
:func:`copy_from_host`).

The answers that never change for a device, and the loaded modules and kernels, are kept in
:data:`cache` (CuPy reads every attribute of a device to answer one), so that a fake device's
answers and kernels never mix with a real one's.
"""

from __future__ import annotations

import ctypes
import functools
import os

from ...interop import import_cupy

#: Every kept answer and loaded kernel, by key: ``("sm_count", device)``, ``("optin", device)``,
#: ``("overlap", device)``, ``("occupancy", kernel, block)``, ``("module", family)``,
#: ``(device, family, name)``.
cache: dict = {}


def current_id() -> int:
    """The id of CuPy's current device."""
    return import_cupy().cuda.Device().id


def sm_count(device_id: int) -> int:
    key = ("sm_count", device_id)
    found = cache.get(key)
    if found is None:
        found = cache[key] = import_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"]
    return found


def shared_mem_optin(device_id: int) -> int:
    """The most shared memory (bytes) one block of ``device_id`` may opt into."""
    key = ("optin", device_id)
    found = cache.get(key)
    if found is None:
        found = cache[key] = import_cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
    return found


def compute_capability(device_id: int) -> int:
    """E.g. 90 for sm_90."""
    return int(import_cupy().cuda.Device(device_id).compute_capability)


def driver_version() -> int:
    """The CUDA driver's version, e.g. 12030 for CUDA 12.3."""
    return import_cupy().cuda.runtime.driverGetVersion()


def max_active_blocks_per_sm(fn, block: int) -> int:
    """Blocks of ``block`` threads of the loaded kernel ``fn`` that one SM holds at once (CUDA's
    occupancy calculator over its registers and shared memory)."""
    return import_cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, block, 0)


def allow_all_shared_mem(fn, device_id: int) -> None:
    """Lets the loaded kernel ``fn`` take as much dynamic shared memory as a block of ``device_id`` may opt into."""
    driver = import_cupy().cuda.driver
    ptr = fn.kernel.ptr
    static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, ptr)
    driver.funcSetAttribute(ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem_optin(device_id) - static)


def copy_from_host(view, host) -> None:
    """Copy the NumPy array ``host`` into the device view ``view`` of the same shape and dtype (a
    synchronous copy: construction-time tables only, never on a step's path)."""
    view.set(host)


def load_module(code: str, options: tuple, name_expressions: list):
    """A CuPy RawModule of ``code`` (compiled by NVRTC on first use, or read from CuPy's disk cache)."""
    return import_cupy().RawModule(code=code, options=options, name_expressions=name_expressions)


@functools.lru_cache(maxsize=None)
def driver():
    """libcuda, or None where it cannot be loaded or has no ``cuLaunchKernelEx`` (before CUDA 12)."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if os.name == "nt" else "libcuda.so.1")
        launch = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def driver_launch():
    """``cuLaunchKernelEx(config, function, kernel_params, extra)``, or None (see :func:`driver`)."""
    lib = driver()
    return None if lib is None else lib.cuLaunchKernelEx
