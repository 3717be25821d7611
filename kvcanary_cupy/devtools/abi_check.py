"""Checks of the kernels against their Python side, without a GPU (dev tooling, not imported at run time).

The ABI: every struct a kernel takes by value has a NumPy mirror in ``backends/cuda/abi.py``;
:func:`struct_asserts` pins its size and member widths as C++ ``static_assert`` lines and
:func:`struct_offsets_differ` reads its member offsets back from the PTX of a probe kernel.
The compile check: :func:`compile_check` compiles each kernel family with NVRTC as ``RawModule``
would and reports its cubin size, registers and spills.  ``tests/cuda/test_kernels_compile.py`` runs both.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from typing import NamedTuple

import numpy as np

from ..backends.cuda import compile as cuda_compile
from ..backends.cuda.abi import (CANARY_BUFFER, CANARY_TARGETS, LAUNCH_LOG, PLAN_INPUTS, PLAN_OUTPUTS, REAL_KV_SOURCES,
                                 SESSION_STAGE, WRITE_INPUTS)
from ..digest.cuda import DIGEST_POOL, DIGEST_REQUESTS, DIGEST_TABLE
from ..interop import import_cupy
from ..tables import TableKind

# Every struct a kernel takes by value: C name (namespace kvcanary) -> (its NumPy mirror, a family
# that compiles it).  Field names equal the C member names; tests/cuda/test_kernels_compile.py checks
# each with its family (struct_asserts for sizes and widths, struct_offsets_differ for offsets), so
# a field's offset or width drifting fails there.
KERNEL_STRUCTS = {
    "CanaryBuffer": (CANARY_BUFFER, "verify"),
    "RealKvSources": (REAL_KV_SOURCES, "verify"),
    "CanaryTargets": (CANARY_TARGETS, "verify"),
    "LaunchLog": (LAUNCH_LOG, "verify"),
    "WriteInputs": (WRITE_INPUTS, "write"),
    "PlanInputs": (PLAN_INPUTS, cuda_compile.plan_family(TableKind.REQ_TO_TOKEN)),
    "PlanOutputs": (PLAN_OUTPUTS, cuda_compile.plan_family(TableKind.REQ_TO_TOKEN)),
    "SessionStage": (SESSION_STAGE, "session"),
    "DigestTable": (DIGEST_TABLE, "digest"),
    "DigestPool": (DIGEST_POOL, "digest"),
    "DigestRequests": (DIGEST_REQUESTS, "digest"),
}


def struct_asserts(dtype: np.dtype, c_name: str) -> str:
    """C++ ``static_assert`` lines pinning the size of ``kvcanary::c_name`` and the width of each
    of its members to the NumPy structured ``dtype`` mirroring it (offsets: struct_offsets_differ)."""
    t = f"kvcanary::{c_name}"
    lines = [f'static_assert(sizeof({t}) == {dtype.itemsize}, "{c_name}: size differs from its NumPy mirror");']
    for field, (ftype, *_) in dtype.fields.items():
        lines.append(f'static_assert(sizeof({t}::{field}) == {ftype.itemsize}, "{c_name}.{field}: width differs from its NumPy mirror");')
    return "\n".join(lines) + "\n"


def family_struct_asserts(family: str) -> str:
    """The size and width asserts of every registered struct that ``family`` compiles."""
    return "".join(struct_asserts(dtype, name) for name, (dtype, fam) in KERNEL_STRUCTS.items() if fam == family)


def struct_offsets_differ(dtype: np.dtype, c_name: str, family: str, arch: str = "sm_90") -> list[str]:
    """The members of ``kvcanary::c_name`` whose offset differs from the NumPy mirror ``dtype``.

    NVRTC before 13.1 has no ``__builtin_offsetof`` (and the null-pointer ``offsetof`` is no
    constant expression), so the offsets are read back from the PTX of a probe kernel that stores
    each member's address in a null struct: the compiler folds every one to a constant.
    """
    t = f"kvcanary::{c_name}"
    stores = "".join(f"  out[{i}] = reinterpret_cast<unsigned long long>(&(reinterpret_cast<{t}*>(0)->{field}));\n"
                     for i, field in enumerate(dtype.names))
    probe = f'extern "C" __global__ void kvcanary_layout_probe(unsigned long long* out) {{\n{stores}}}\n'
    got = ptx_stored_constants(family, probe, "kvcanary_layout_probe", arch)
    return [f"{c_name}.{field}: offset differs from its NumPy mirror (C {got.get(i)}, NumPy {dtype.fields[field][1]})"
            for i, field in enumerate(dtype.names) if got.get(i) != dtype.fields[field][1]]


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

    return list(core.assemble_cupy_compiler_options(cuda_compile.NVRTC_OPTIONS)) + [
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
    prog = nvrtc.createProgram(cuda_compile.family_source(family) + extra_source, cuda_compile.FAMILIES[family].filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"kv-canary: {cuda_compile.FAMILIES[family].filename} failed to compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
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
    layout asserts of :func:`struct_asserts`).  Raises RuntimeError with the NVRTC log
    on a compile error.  Successful reports are cached on disk under a key covering every compiled
    byte (source, options, architecture, name expressions, NVRTC version), as CuPy caches cubins.
    """
    nvrtc = _nvrtc()
    cache_dir = _compile_cache_dir()
    sizes = {}
    for fam in [family] if family else cuda_compile.FAMILIES:
        options = _nvrtc_options(arch) + ["--ptxas-options=-v"]
        filename = cuda_compile.FAMILIES[fam].filename
        source = cuda_compile.family_source(fam) + extra_source
        exprs = cuda_compile.FAMILIES[fam].instantiations()
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
