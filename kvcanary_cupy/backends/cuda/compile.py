"""What to compile and how it is loaded: the CUDA sources in ``kernels/`` (package data), through CuPy.

One :class:`KernelFamily` per ``.cu`` file lists every template instantiation it compiles.  The
source handed to NVRTC has its local ``#include "..."`` files inlined, so CuPy's disk-cache key
(which hashes the source string, not included headers) covers every header; the SHA-256 of that
text names the variant in :func:`variant_name`.  Each instantiation is a module of its own, compiled
once per device on first use (a call waits for its own kernel only) or ahead of time with
:func:`warmup`, which compiles them on threads (do that before capturing a CUDA graph).

The loaded kernels are memoized per device here rather than with ``cupy.memoize(for_each_device=True)``:
that keys on CuPy's own current device, past :mod:`.device`, the one seam a fake device replaces,
and each kernel that takes large shared memory is opted in once as it loads.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.resources
import itertools
import os
import re
import threading
from typing import NamedTuple

from ...constants import MAX_CANARY_BUFFERS
from ...interop import cuda_unavailable_reason, import_cupy
from . import device as cuda_device
from .abi import SCAN_ROWS_PER_LANE, TableLayout

NVRTC_OPTIONS = ("--std=c++17",)
SUPPORTED_ARCHS = ("sm_80", "sm_90")
WARMUP_THREADS = 16  # at most this many NVRTC compiles at once in warmup()

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


BOOL = (False, True)


class KernelFamily(NamedTuple):
    """A ``.cu`` file and the kernels it instantiates: ``kernel<arg, ...>`` for every combination
    of its template parameters' values (bools, or ints such as the table kind)."""

    filename: str
    kernels: tuple  # of (kernel name, tuple of (template parameter name, its values))

    def instantiations(self) -> list[str]:
        return [kernel_name(kernel, *args) for kernel, params in self.kernels
                for args in itertools.product(*(values for _, values in params))]


def plan_family(layout: int) -> str:
    """The plan kernels of one table layout (a TableKind is its general layout) are a family of
    their own: compiled on first use of it."""
    return f"plan_{TableLayout(layout).name.lower()}"


def step_family(layout: int) -> str:
    """The fused plan + verify kernels of one table layout (step.cu): compiled on first use of them."""
    return f"step_{TableLayout(layout).name.lower()}"


BUFFERS = ("kBuffers", tuple(range(1, MAX_CANARY_BUFFERS + 1)))  # canary buffers of one write/verify launch

# plan_fused's kScanRows: the strided scan passes alone (1), or those and the blocked ones
PLAN_FUSED_SCAN_ROWS = ("kScanRows", (1, SCAN_ROWS_PER_LANE))

FAMILIES = {
    **{plan_family(layout): KernelFamily("plan.cu", tuple(
        (k, (("kTable", (int(layout),)), ("kHasLut", BOOL), ("kHasPool", BOOL)) + ((PLAN_FUSED_SCAN_ROWS,) if k == "plan_fused" else ()))
        for k in ("plan_small", "plan_fused", "plan_offsets", "plan_entries")))
       for layout in TableLayout},
    **{step_family(layout): KernelFamily("step.cu", (
        ("plan_verify", (("kTable", (int(layout),)), ("kHasLut", BOOL), ("kHasPool", BOOL), ("kCheckToken", BOOL),
                         ("kHasRealKv", BOOL))),))
       for layout in TableLayout},
    "write": KernelFamily("write.cu", (("canary_write", (BUFFERS, ("kInputAssert", BOOL), ("kHasRealKv", BOOL))),)),
    "verify": KernelFamily("verify.cu", (("canary_verify", (BUFFERS, ("kCheckToken", BOOL), ("kHasRealKv", BOOL))),)),
    "scatter": KernelFamily("scatter.cu", (("scatter_req_token_ids", ()),)),
    "session": KernelFamily("session.cu", (("session_stage", ()), ("session_attribute", ()))),
    "move": KernelFamily("move.cu", tuple((k, ()) for k in ("move_gather", "move_clear", "move_scatter",
                                                                  "copy_gather", "copy_scatter"))),
    "same_step": KernelFamily("same_step.cu", tuple(
        (k, ()) for k in ("same_step_begin", "same_step_mark", "same_step_entries", "same_step_seeds"))),
    "coverage": KernelFamily("coverage.cu", tuple((k, ()) for k in ("deep_write", "deep_check", "lost_snapshot", "lost_check"))),
    "digest": KernelFamily("digest.cu", tuple((k, ()) for k in ("digest_init", "digest_accumulate", "digest_verify")) + (
        ("digest_units", (("kWords", (0, 4)),)),)),
}


# The kernels launched with the plan's scan arrays as dynamic shared memory
# (configs.plan_scan_config): past 48 KiB (about 3,000 rows a block) a launch needs its
# kernel opted in first.  Each is opted in, to all a block of the device may take, when it is
# loaded (kc.warmup() loads every kernel): no launch, captured or not, ever makes that driver call.
# (Raising the limit per launch size would also leave it at the last size set, too low for a
# larger launch.)
LARGE_SHARED_MEM_KERNELS = frozenset({"plan_fused", "plan_offsets", "plan_verify"})


def _template_arg(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(int(value))


def kernel_name(kernel: str, *args) -> str:
    """The name expression of one instantiation, e.g. ``kvcanary::canary_write<2, true, false>``."""
    if not args:
        return f"kvcanary::{kernel}"
    return f"kvcanary::{kernel}<{', '.join(_template_arg(a) for a in args)}>"


def kernel_of(name: str) -> str:
    """The kernel of a name expression: ``plan_fused`` for ``kvcanary::plan_fused<1, true, false>``."""
    return name.partition("<")[0].removeprefix("kvcanary::")


@functools.lru_cache(maxsize=None)
def _read(filename: str) -> str:
    return importlib.resources.files("kvcanary_cupy.kernels").joinpath(filename).read_text(encoding="utf-8")


def _inline(filename: str, seen: set) -> str:
    if filename in seen:  # headers carry #pragma once; inline each at most once
        return ""
    seen.add(filename)
    out = []
    for lineno, line in enumerate(_read(filename).splitlines(), 1):
        m = _INCLUDE.match(line)
        if m:
            out.append(_inline(m.group(1), seen))
            out.append(f'#line {lineno + 1} "{filename}"')
        else:
            out.append(line)
    return f'#line 1 "{filename}"\n' + "\n".join(out) + "\n"


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> str:
    """The full source of a family, every local header inlined."""
    return _inline(FAMILIES[family].filename, set())


def variant_name(family: str) -> str:
    """Deterministic name of a family's compiled variant: it changes when any compiled byte does."""
    digest = hashlib.sha256((family_source(family) + "\0" + " ".join(NVRTC_OPTIONS)).encode()).hexdigest()
    return f"kvcanary_{family}_{digest[:16]}"


_lock = threading.Lock()


def get_function(family: str, name: str):
    """The compiled kernel ``name`` of ``family`` for the current CUDA device (compiled and
    loaded once, kept in device.cache; one of LARGE_SHARED_MEM_KERNELS is opted in as it is loaded)."""
    device = cuda_device.current_id()
    key = (device, family, name)
    loaded = cuda_device.cache
    fn = loaded.get(key)
    if fn is None:
        with _lock:
            fn = loaded.get(key)
            if fn is None:
                fn = _module(family, name).get_function(name)
                if kernel_of(name) in LARGE_SHARED_MEM_KERNELS:
                    cuda_device.allow_all_shared_mem(fn, device)
                loaded[key] = fn
    return fn


def _module(family: str, name: str):
    """The RawModule of one instantiation (one per process: CuPy loads it per device).  A first
    call waits for the kernels it launches only, not for their whole family (a family's 16-20
    instantiations take ~10x longer); the name on the first line gives each instantiation a
    source, and so a CuPy disk-cache key, of its own."""
    key = ("module", family, name)
    module = cuda_device.cache.get(key)
    if module is None:
        module = cuda_device.cache[key] = cuda_device.load_module(
            f"// {variant_name(family)} {name}\n" + family_source(family), NVRTC_OPTIONS, [name])
    return module


def _compile_in_parallel(device: int, variants: list) -> None:
    """Compile and load ``variants`` ((family, name) pairs) on threads: NVRTC releases the GIL."""
    cupy = import_cupy()

    def build(variant):
        with cupy.cuda.Device(device):
            _module(*variant).get_function(variant[1])

    workers = max(1, min(len(variants), os.cpu_count() or 1, WARMUP_THREADS))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvcanary-warmup") as pool:
        for future in [pool.submit(build, v) for v in variants]:
            future.result()  # the first compile error, as a serial warm-up would raise it


def warmup(device: int | None = None) -> None:
    """Compile and load every kernel variant on ``device`` (default: the current one).

    Call it before capturing a CUDA graph so no compilation (and no kernel's shared-memory
    opt-in) happens inside the capture.  CuPy caches the compiled kernels on disk, so a later
    process loads them instead of compiling.  Without a usable GPU it raises RuntimeError with one
    line saying what is missing.

    Parameters
    ----------
    device : int, optional
        The CUDA device ordinal; None takes CuPy's current device.

    Raises
    ------
    ImportError
        CuPy is not installed (the message names the extra to install).
    RuntimeError
        No usable CUDA device (one line saying what is missing).

    Examples
    --------
    >>> kc.warmup()  # once per process and device, before the first capture  # doctest: +SKIP
    """
    cupy = import_cupy()
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"kv-canary warmup: {reason}")
    with cupy.cuda.Device(device):
        variants = [(family, name) for family, spec in FAMILIES.items() for name in spec.instantiations()]
        current = cuda_device.current_id()
        _compile_in_parallel(current, [v for v in variants if (current, *v) not in cuda_device.cache])
        for family, name in variants:
            get_function(family, name)
