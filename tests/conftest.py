"""Array backends every test can run on.

The ``ab`` fixture runs a test once per array framework: NumPy, CPU torch tensors, CuPy and CUDA
torch tensors.  Tests build inputs with NumPy, move them with ``ab.asarray`` and read results
back with ``ab.to_numpy``, so the same body checks every backend against the same numbers.

GPU backends are skipped when no CUDA device is usable, unless ``KVCANARY_EXPECT_GPU=1`` is set
(as ``scripts/gpu_check.sh`` does on the GPU machine): then an unusable GPU fails the test.

The tests are grouped by area (``ops/``, ``bound/``, ``session/``, ``cuda/``, ``sim/``; package-wide
checks here), with shared helpers in ``_support/``.  Tests import helpers and each other's shared
cases by module name, so every area is on the import path, as this directory is.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

EXPECT_GPU = os.environ.get("KVCANARY_EXPECT_GPU") == "1"
AREAS = ("_support", "ops", "bound", "session", "cuda", "sim")
sys.path[1:1] = [str(pathlib.Path(__file__).resolve().parent / area) for area in AREAS]


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cupy_usable():
    try:
        import cupy
    except ImportError:
        return None
    return cupy if cupy.is_available() else None


@dataclass(frozen=True)
class ArrayBackend:
    name: str
    is_gpu: bool
    asarray: Callable  # NumPy array -> native array (a copy on the target device)
    to_numpy: Callable  # native array -> NumPy array (a host copy)

    @property
    def like(self):
        """A small native array: pass as ``like=`` to allocate in this framework."""
        return self.asarray(np.zeros(1, np.int32))

    def synchronize(self) -> None:
        if self.name == "cupy":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
        elif self.name == "torch_cuda":
            _torch().cuda.synchronize()


def _make(name: str):
    torch = _torch()
    if name == "numpy":
        return ArrayBackend("numpy", False, lambda a: np.array(a, copy=True), lambda x: np.asarray(x).copy())
    if name == "torch_cpu":
        if torch is None:
            return None
        return ArrayBackend("torch_cpu", False, lambda a: torch.from_numpy(np.array(a, copy=True)),
                            lambda x: x.detach().numpy().copy())
    if name == "cupy":
        cupy = _cupy_usable()
        if cupy is None:
            return None
        return ArrayBackend("cupy", True, lambda a: cupy.asarray(a), lambda x: cupy.asnumpy(x))
    if name == "torch_cuda":
        if torch is None or not torch.cuda.is_available() or _cupy_usable() is None:
            return None
        return ArrayBackend("torch_cuda", True, lambda a: torch.from_numpy(np.array(a, copy=True)).cuda(),
                            lambda x: x.detach().cpu().numpy())
    raise ValueError(name)


BACKEND_NAMES = ("numpy", "torch_cpu", "cupy", "torch_cuda")
GPU_BACKENDS = ("cupy", "torch_cuda")


def get_backend_or_skip(name: str) -> ArrayBackend:
    ab = _make(name)
    if ab is None:
        if name in GPU_BACKENDS and EXPECT_GPU:
            pytest.fail(f"KVCANARY_EXPECT_GPU=1 but the {name} backend is unusable (no CUDA device, CuPy or torch)")
        pytest.skip(f"{name} backend not available here")
    return ab


@pytest.fixture(params=BACKEND_NAMES)
def ab(request) -> ArrayBackend:
    """Every array backend; GPU ones skip cleanly without a GPU."""
    return get_backend_or_skip(request.param)


@pytest.fixture(params=GPU_BACKENDS)
def gpu_ab(request) -> ArrayBackend:
    """The GPU array backends only."""
    return get_backend_or_skip(request.param)


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec and any(isinstance(v, str) and v in GPU_BACKENDS for v in callspec.params.values()):
            item.add_marker(pytest.mark.gpu)


_CUPY_GUARDED = {"cuda": ("Stream", "Event", "Device", "get_current_stream"), "": ("empty", "full", "zeros", "asarray")}


def _cupy_attributes():
    try:
        import cupy
    except ImportError:
        return {}
    from kvcanary_cupy.backends.cuda import configs, device

    found = {(where, name): getattr(cupy.cuda if where else cupy, name) for where, names in _CUPY_GUARDED.items() for name in names}
    # what the fake device replaces in the library itself: its one seam, backends/cuda/device.py
    found.update({("kvcanary_cupy.backends.cuda.device", name): getattr(device, name)
                  for name in ("cache", "load_module", "max_active_blocks_per_sm", "driver_launch", "sm_count")})
    found[("kvcanary_cupy.backends.cuda.configs", "policy")] = configs.policy()
    return found


@pytest.fixture
def launch_policy():
    """``launch_policy(**changes)``: the GPU launch policy (backends/cuda/configs.py) with ``changes``
    for the rest of the test, e.g. ``launch_policy(plan_small_max_rows=-1)`` to force a plan path."""
    from kvcanary_cupy.backends.cuda import configs

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(configs.overridden(**changes))


@pytest.fixture(autouse=True)
def no_fake_cupy_leaks():
    """Tests that fake a CUDA device (kvcanary_cupy/devtools/fake_cupy.py) patch CuPy; a patch outliving its test
    would break every real-GPU test after it, so each test must leave CuPy as it found it."""
    before = _cupy_attributes()
    yield
    leaked = [f"{where if where.startswith('kvcanary') else 'cupy' + ('.' + where if where else '')}.{name}"
              for key, value in _cupy_attributes().items() if value is not before[key] for where, name in [key]]
    assert not leaked, f"this test left CuPy or the library patched: {leaked}"
