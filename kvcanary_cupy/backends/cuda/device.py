"""Every query the GPU side makes of the CUDA device, in one place: the seam a fake device replaces.

The SM count and the opt-in shared memory are cached here (they never change for a device; CuPy
reads every attribute of the device to answer one); the launch policy caches occupancies per loaded
kernel, so a fake device's kernels never see a real one's answers.
"""

from __future__ import annotations

import functools

from ...interop import import_cupy


def current_id() -> int:
    """The id of CuPy's current device."""
    return import_cupy().cuda.Device().id


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    return import_cupy().cuda.Device(device_id).attributes["MultiProcessorCount"]


@functools.lru_cache(maxsize=None)
def shared_mem_optin(device_id: int) -> int:
    """The most shared memory (bytes) one block of ``device_id`` may opt into."""
    return import_cupy().cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]


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
