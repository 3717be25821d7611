"""A stand-in for GPU work: one thread spinning for a number of clock cycles.

For stream-ordering tests and for a benchmark's stand-in forward pass.
"""

from __future__ import annotations

import functools

import numpy as np

from ..interop import import_cupy

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel():
    cupy = import_cupy()
    return cupy.RawKernel(SPIN, "spin")


def spin(cycles: int, stream=None) -> None:
    """Keep ``stream`` (a CuPy stream; the current one when None) busy for ``cycles`` GPU clock
    cycles (about 2e6 per millisecond on an H200): for stream-ordering tests and stand-in work.
    Capture-safe once compiled (the kernel is kept)."""
    _spin_kernel()((1,), (1,), (np.int64(cycles),), stream=stream)


def cycles_per_second() -> float:
    """The current device's clock rate, in the cycles :func:`spin` counts (``clock64()`` runs at most
    this fast, so a spin of ``seconds * cycles_per_second()`` cycles lasts at least ``seconds``);
    2e9 when the device does not say."""
    cupy = import_cupy()
    try:
        return cupy.cuda.Device().attributes["ClockRate"] * 1e3  # kHz
    except (KeyError, cupy.cuda.runtime.CUDARuntimeError):
        return 2e9
