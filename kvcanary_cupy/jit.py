"""Run-time compilation of the CUDA sources in ``kernels/`` (package data) through CuPy.

One :class:`KernelFamily` per ``.cu`` file lists every template instantiation it compiles.  The
source handed to NVRTC has its local ``#include "..."`` files inlined, so CuPy's disk-cache key
(which hashes the source string, not included headers) covers every header; the SHA-256 of that
text names the variant in :func:`variant_name`.  Modules are compiled once per device, on first
use or ahead of time with :func:`warmup` (do that before capturing a CUDA graph).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.resources
import itertools
import json
import os
import re
import threading
from typing import NamedTuple

from .constants import MAX_CANARY_BUFFERS
from .interop import cuda_unavailable_reason, import_cupy
from .tables import TableKind

NVRTC_OPTIONS = ("--std=c++17",)
SUPPORTED_ARCHS = ("sm_80", "sm_90")

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


TABLE_NARROW = 4  # kTableNarrow in kernels/plan.cu


class TableLayout(enum.IntEnum):
    """The table layouts the plan kernels are instantiated for (kTable in kernels/plan.cu): each
    table kind's general layout, of its :class:`~kvcanary_cupy.tables.TableKind` value, and the
    narrow layout (TABLE_NARROW added) of a block or page table with int32 ids, a power-of-two
    page size and rows of at most 2**31 - 1 tokens, which ``cupy_backend.table_layout`` picks."""

    REQ_TO_TOKEN = TableKind.REQ_TO_TOKEN
    VIRTUAL_PAGES = TableKind.VIRTUAL_PAGES
    BLOCK = TableKind.BLOCK
    PAGED_KV = TableKind.PAGED_KV
    BLOCK_NARROW = TableKind.BLOCK | TABLE_NARROW
    PAGED_KV_NARROW = TableKind.PAGED_KV | TABLE_NARROW


def plan_family(layout: int) -> str:
    """The plan kernels of one table layout (a TableKind is its general layout) are a family of
    their own: compiled on first use of it."""
    return f"plan_{TableLayout(layout).name.lower()}"


def step_family(layout: int) -> str:
    """The fused plan + verify kernels of one table layout (step.cu): compiled on first use of them."""
    return f"step_{TableLayout(layout).name.lower()}"


BUFFERS = ("kBuffers", tuple(range(1, MAX_CANARY_BUFFERS + 1)))  # canary buffers of one write/verify launch

SCAN_ROWS_PER_LANE = 9  # kScanRowsPerLane in kernels/plan.cu: the most rows a lane sums in a pass of a long scan
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
    "move": KernelFamily("move.cu", tuple((k, ()) for k in ("move_gather", "move_clear", "move_scatter"))),
}


# The kernels launched with the plan's scan arrays as dynamic shared memory
# (cupy_backend.plan_scan_config): past 48 KiB (about 3,000 rows a block) a launch needs its
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
_functions: dict = {}


def get_function(family: str, name: str):
    """The compiled kernel ``name`` of ``family`` for the current CUDA device (compiled and
    loaded once; one of LARGE_SHARED_MEM_KERNELS is opted in as it is loaded)."""
    cupy = import_cupy()
    device = cupy.cuda.Device().id
    key = (device, family, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock:
            fn = _functions.get(key)
            if fn is None:
                fn = _compile(family).get_function(name)
                if kernel_of(name) in LARGE_SHARED_MEM_KERNELS:
                    _allow_all_shared_mem(fn, device)
                _functions[key] = fn
    return fn


def _allow_all_shared_mem(fn, device: int) -> None:
    """Lets ``fn`` take as much dynamic shared memory as a block of ``device`` may opt into."""
    cupy = import_cupy()
    driver = cupy.cuda.driver
    ptr = fn.kernel.ptr
    static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, ptr)
    optin = cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
    driver.funcSetAttribute(ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static)


@functools.lru_cache(maxsize=None)
def _compile(family: str):
    cupy = import_cupy()
    return cupy.RawModule(
        code=f"// {variant_name(family)}\n" + family_source(family),
        options=NVRTC_OPTIONS,
        name_expressions=FAMILIES[family].instantiations(),
    )


def warmup(device=None) -> None:
    """Compile and load every kernel variant on ``device`` (default: the current one).

    Call it before capturing a CUDA graph so no compilation (and no kernel's shared-memory
    opt-in) happens inside the capture.  Without a usable GPU it raises RuntimeError with one line
    saying what is missing.
    """
    cupy = import_cupy()
    reason = cuda_unavailable_reason()
    if reason:
        raise RuntimeError(f"kv-canary warmup: {reason}")
    with cupy.cuda.Device(device):
        for family, spec in FAMILIES.items():
            for name in spec.instantiations():
                get_function(family, name)


class CompileReport(NamedTuple):
    cubin_bytes: int
    registers: dict  # name expression -> registers per thread
    spill_bytes: dict  # name expression -> bytes of spill stores + loads


def _nvrtc():
    import_cupy()
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def _nvrtc_options(arch: str) -> list:
    """The options RawModule compiles with (CuPy's include paths and flags) for ``arch``."""
    from cupy._core import core  # private: the include paths CuPy adds for RawModule

    return list(core.assemble_cupy_compiler_options(NVRTC_OPTIONS)) + [
        "-ftz=true", f"-arch={arch}", "--device-as-default-execution-space"]


_PTX_MOV = re.compile(r"^\s*mov\.[bu]64\s+(%rd\d+),\s*(-?\d+);", re.M)
_PTX_STORE = re.compile(r"^\s*st\.global\.[bu]64\s+\[%rd\d+(?:\+(\d+))?\],\s*(%rd\d+|-?\d+);", re.M)


def ptx_stored_constants(family: str, extra_source: str, kernel: str, arch: str = "sm_90") -> dict:
    """``{i: value}`` for each ``out[i] = <constant>`` (64-bit) the ``extern "C"`` ``kernel`` of
    ``extra_source`` stores, read from the PTX of ``family``'s source plus ``extra_source``.

    A way to read compile-time layout facts (member offsets) from any NVRTC without a GPU.
    """
    nvrtc = _nvrtc()
    options = _nvrtc_options(arch.replace("sm_", "compute_"))
    prog = nvrtc.createProgram(family_source(family) + extra_source, FAMILIES[family].filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"kv-canary: {FAMILIES[family].filename} failed to compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    body = ptx[ptx.index(f".entry {kernel}("):]
    body = body[: body.index("\n}")]
    registers = dict(_PTX_MOV.findall(body))
    return {int(offset or 0) // 8: int(registers.get(value, value)) for offset, value in _PTX_STORE.findall(body)}


_CHECK_IDS = itertools.count()


def _compile_cache_dir() -> str | None:
    """Where :func:`compile_check` keeps its reports; ``KVCANARY_COMPILE_CACHE=off`` disables it."""
    where = os.environ.get("KVCANARY_COMPILE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "kvcanary-cupy", "compile-check"))
    return None if where.lower() in ("", "0", "off", "none") else where


def compile_check(arch: str = "sm_90", family: str | None = None, extra_source: str = "") -> dict:
    """Compile families with NVRTC for ``arch`` without a GPU; returns ``{family: CompileReport}``.

    Uses CuPy's own option assembly (its bundled headers and ``--std``), so it compiles what
    ``RawModule`` would; ``extra_source`` is appended to each family's source (e.g. the struct
    layout asserts of ``cupy_backend.struct_asserts``).  Raises RuntimeError with the NVRTC log
    on a compile error.  Successful reports are cached on disk under a key covering every compiled
    byte (source, options, architecture, name expressions, NVRTC version), as CuPy caches cubins.
    """
    nvrtc = _nvrtc()
    cache_dir = _compile_cache_dir()
    sizes = {}
    for fam in [family] if family else FAMILIES:
        options = _nvrtc_options(arch) + ["--ptxas-options=-v"]
        filename = FAMILIES[fam].filename
        source = family_source(fam) + extra_source
        exprs = FAMILIES[fam].instantiations()
        key = hashlib.sha256("\0".join([source, *options, *exprs, repr(nvrtc.getVersion())]).encode()).hexdigest()
        path = os.path.join(cache_dir, f"{fam}-{arch}-{key[:32]}.json") if cache_dir else None
        if path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                sizes[fam] = CompileReport(*json.load(f))
            continue
        # A source compiled before in this process (by CuPy, or an earlier check) may come back
        # from NVRTC without running ptxas, so without its register report: every check compiles
        # a source of its own (the trailing comment changes no byte of the cubin's code).
        prog = nvrtc.createProgram(f"{source}\n// compile_check {next(_CHECK_IDS)}\n", filename, [], [])
        try:
            for expr in exprs:
                nvrtc.addNameExpression(prog, expr)
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError as exc:
                raise RuntimeError(f"kv-canary: {filename} failed to compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
            lowered = {nvrtc.getLoweredName(prog, expr): expr for expr in exprs}
            usage = re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers",
                               nvrtc.getProgramLog(prog), re.S)
            sizes[fam] = CompileReport(len(nvrtc.getCUBIN(prog)),
                                       {lowered[name]: int(regs) for name, _, _, regs in usage},
                                       {lowered[name]: int(st) + int(ld) for name, st, ld, _ in usage})
        finally:
            nvrtc.destroyProgram(prog)
        if path:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(list(sizes[fam]), f)
            os.replace(tmp, path)  # atomic: concurrent test runs never read half a report
    return sizes
