"""CPU-only checks of the CUDA side: every kernel variant compiles with NVRTC for the supported
architectures (no GPU needed), the header's constants equal the Python ones, the kernel sources
ship as package data, variant names change whenever any compiled byte does, and the parameter
records the launches fill mirror the kernels' signatures."""

import functools
import operator
import re

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.backends.cuda import abi, compile as cuda_compile

pytest.importorskip("cupy")

from kvcanary_cupy.devtools import abi_check  # noqa: E402
from kvcanary_cupy.devtools.abi_check import KERNEL_STRUCTS  # noqa: E402


@pytest.mark.parametrize("arch", cuda_compile.SUPPORTED_ARCHS)
@pytest.mark.parametrize("family", sorted(cuda_compile.FAMILIES))
def test_every_variant_compiles_and_fits_its_launch(family, arch):
    """Every instantiation compiles with the layout asserts of its structs (every field's width and
    the size equal to its NumPy mirror's; offsets: test_every_kernel_struct_matches_its_mirror),
    spills nothing, and its registers fit its block size."""
    report = abi_check.compile_check(arch, family, abi_check.family_struct_asserts(family))[family]
    assert report.cubin_bytes > 1000
    assert set(report.registers) == set(cuda_compile.FAMILIES[family].instantiations())
    block = {"plan_offsets": abi.PLAN_THREADS, "plan_fused": abi.PLAN_THREADS, "plan_small": abi.PLAN_THREADS,
             "plan_verify": abi.PLAN_THREADS, "canary_write": abi.WRITE_THREADS, "canary_verify": abi.VERIFY_THREADS}
    for name, regs in report.registers.items():
        kernel = name.split("<")[0].split("::")[1]
        threads = block.get(kernel, abi.THREADS)
        per_sm = 1
        if kernel == "plan_verify":  # the blocks per SM the host launches it with (configs.plan_verify_kernel)
            layout, *flags = (a.strip() for a in name.split("<")[1].rstrip(">").split(","))
            one_block = abi.plan_verify_one_block(int(layout), *(f == "true" for f in flags))
            per_sm = 1 if one_block else abi.PLAN_VERIFY_BLOCKS_PER_SM
        assert 0 < regs and regs * threads * per_sm <= 65536, (name, regs, threads, per_sm)
    assert set(report.spill_bytes) == set(report.registers)
    assert not any(report.spill_bytes.values()), report.spill_bytes


def test_every_kernel_struct_is_checked_field_by_field():
    """The registry covers every struct of canary_common.cuh and write.cu, and the generated asserts
    pin each field of each mirror (offset and width) plus the total size."""
    from kvcanary_cupy.backends.cuda import abi

    sources = cuda_compile._read("canary_common.cuh") + cuda_compile._read("write.cu")
    device_only = {"CanaryRecord", "ChainState", "TokenInputs", "StreamLayout"}  # built on the device, never passed
    c_structs = set(re.findall(r"^struct (\w+) \{", sources, re.M)) - device_only
    assert c_structs <= set(abi_check.KERNEL_STRUCTS), c_structs - set(abi_check.KERNEL_STRUCTS)
    text = abi_check.struct_asserts(abi.LAUNCH_LOG, "LaunchLog")
    assert "sizeof(kvcanary::LaunchLog) == 56" in text
    assert "sizeof(kvcanary::LaunchLog::capacity) == 4" in text
    assert text.count("static_assert") == 1 + len(abi.LAUNCH_LOG.names)


@pytest.mark.parametrize("struct", sorted(KERNEL_STRUCTS))
def test_every_kernel_struct_matches_its_mirror(struct):
    """Every member's offset in the compiled C struct equals its NumPy mirror's (read from PTX)."""
    dtype, family = abi_check.KERNEL_STRUCTS[struct]
    assert abi_check.struct_offsets_differ(dtype, struct, family) == []


@pytest.mark.parametrize("struct, first, second", [("LaunchLog", "slot_run_counters", "kernel_run_counters"),
                                                   ("CanaryBuffer", "fields", "vec"),
                                                   ("WriteInputs", "input_ids", "positions")])
def test_swapped_mirror_fields_fail_to_compile(struct, first, second):
    """Two equal-width fields swapped in a NumPy mirror keep its size but fail the compile."""
    import numpy as np

    dtype, family = abi_check.KERNEL_STRUCTS[struct]
    names = [second if n == first else first if n == second else n for n in dtype.names]
    swapped = np.dtype({"names": names, "formats": [dtype.fields[n][0] for n in dtype.names],
                        "offsets": [dtype.fields[n][1] for n in dtype.names], "itemsize": dtype.itemsize})
    assert swapped.itemsize == dtype.itemsize
    abi_check.compile_check("sm_90", family, abi_check.struct_asserts(swapped, struct))  # sizes and widths still agree
    differ = abi_check.struct_offsets_differ(swapped, struct, family)
    assert [d.split(":")[0] for d in differ] == [f"{struct}.{n}" for n in names if n in (first, second)], differ


def test_compile_errors_name_the_family(monkeypatch):
    monkeypatch.setitem(cuda_compile.FAMILIES, "broken", cuda_compile.KernelFamily("plan.cu", (("no_such_kernel", ()),)))
    with pytest.raises(RuntimeError, match="plan.cu failed to compile for sm_90"):
        abi_check.compile_check("sm_90", "broken")


def test_instantiation_lists_cover_every_flag_combination():
    layouts = {"plan_req_to_token": 0, "plan_virtual_pages": 1, "plan_block": 2, "plan_paged_kv": 3, "plan_block_narrow": 6,
               "plan_paged_kv_narrow": 7}
    assert {cuda_compile.plan_family(layout): int(layout) for layout in abi.TableLayout} == layouts
    assert [cuda_compile.plan_family(kind) for kind in kc.tables.TableKind] == list(layouts)[:4]  # a kind names its general layout
    for family, layout in layouts.items():
        assert cuda_compile.FAMILIES[family].instantiations() == [
            f"kvcanary::{k}<{layout}, {a}, {b}{rows}>" for k in ("plan_small", "plan_fused", "plan_offsets", "plan_entries")
            for a in ("false", "true") for b in ("false", "true")
            for rows in ((", 1", f", {abi.SCAN_ROWS_PER_LANE}") if k == "plan_fused" else ("",))
        ]
        assert cuda_compile.FAMILIES[family.replace("plan_", "step_", 1)].instantiations() == [
            f"kvcanary::plan_verify<{layout}, {a}, {b}, {c}, {d}>" for a in ("false", "true") for b in ("false", "true")
            for c in ("false", "true") for d in ("false", "true")
        ]
    assert cuda_compile.step_family(abi.TableLayout.PAGED_KV_NARROW) == "step_paged_kv_narrow"
    assert cuda_compile.FAMILIES["write"].instantiations() == [
        f"kvcanary::canary_write<{n}, {a}, {b}>" for n in range(1, kc.MAX_CANARY_BUFFERS + 1)
        for a in ("false", "true") for b in ("false", "true")
    ]
    assert cuda_compile.kernel_name("canary_write", 2, True, False) == "kvcanary::canary_write<2, true, false>"
    assert cuda_compile.kernel_name("plan_fused", kc.tables.TableKind.BLOCK, True, False) == "kvcanary::plan_fused<2, true, false>"
    assert cuda_compile.FAMILIES["scatter"].instantiations() == ["kvcanary::scatter_req_token_ids"]


def test_sources_inline_their_headers():
    for family in cuda_compile.FAMILIES:
        src = cuda_compile.family_source(family)
        assert '#include "' not in src
        assert "struct LaunchLog" in src  # from canary_common.cuh


def test_variant_name_covers_included_headers(monkeypatch):
    before = cuda_compile.variant_name("verify")
    original = cuda_compile._read.__wrapped__

    def edited(filename):
        text = original(filename)
        return text + "\n// edited\n" if filename == "canary_common.cuh" else text

    monkeypatch.setattr(cuda_compile, "_read", edited)
    cuda_compile.family_source.cache_clear()
    try:
        assert cuda_compile.variant_name("verify") != before
    finally:
        monkeypatch.undo()
        cuda_compile.family_source.cache_clear()
    assert cuda_compile.variant_name("verify") == before


def _cuh_constant(name, filename="canary_common.cuh"):
    """The value of ``constexpr <type> name = <literal or 1 << n>;`` in a kernel source."""
    m = re.search(rf"constexpr \w+ {name} = ([^;]+);", cuda_compile._read(filename))
    assert m, name
    expr = m.group(1).replace("ULL", "")
    if re.fullmatch(r"k\w+( \| k\w+)+", expr):  # constants of the same file or'ed together
        return functools.reduce(operator.or_, (_cuh_constant(term, filename) for term in expr.split(" | ")))
    if "<<" in expr:
        base, shift = expr.split("<<")
        return int(base) << int(shift)
    return int(expr, 0)


def test_header_constants_match_python():
    assert _cuh_constant("kCanaryChainAnchor") == kc.CANARY_CHAIN_ANCHOR
    assert _cuh_constant("kSplitmix64Mul1") == kc.constants.SPLITMIX64_MUL1
    assert _cuh_constant("kSplitmix64Mul2") == kc.constants.SPLITMIX64_MUL2
    assert _cuh_constant("kCanaryFieldsPerSlot") == kc.CANARY_FIELDS_PER_SLOT
    assert _cuh_constant("kViolationFields") == kc.VIOLATION_FIELDS
    assert _cuh_constant("kMaxRealKvSources") == kc.MAX_REAL_KV_SOURCES
    assert _cuh_constant("kMaxCanaryBuffers") == kc.MAX_CANARY_BUFFERS
    assert _cuh_constant("kRealKvPartialBytes") == kc.constants.REAL_KV_PARTIAL_BYTES
    for member in kc.FailReason:
        camel = "k" + "".join(w.capitalize() for w in member.name.lower().split("_"))
        assert _cuh_constant(camel) == member.value, member


def test_kernel_sources_are_package_data():
    import importlib.resources

    names = {p.name for p in importlib.resources.files("kvcanary_cupy.kernels").iterdir()}
    assert {"canary_common.cuh", "plan.cu", "step.cu", "write.cu", "verify.cu", "scatter.cu", "session.cu", "move.cu"} <= names


def test_launch_constants_match_the_kernels():
    from kvcanary_cupy.backends.cuda import abi

    assert _cuh_constant("kPlanThreads", "plan.cu") == abi.PLAN_THREADS
    assert _cuh_constant("kPlanSmallRows", "plan.cu") == abi.PLAN_SMALL_MAX_ROWS
    assert _cuh_constant("kPlanVerifyBlocksPerSm", "step.cu") == abi.PLAN_VERIFY_BLOCKS_PER_SM
    assert _cuh_constant("kScanStateTiles", "plan.cu") == kc.plans.SCAN_STATE_TILES
    assert _cuh_constant("kScanRowsPerLane", "plan.cu") == abi.SCAN_ROWS_PER_LANE
    assert _cuh_constant("kScatterMaxGroupRows", "scatter.cu") == abi.SCATTER_MAX_GROUP_ROWS
    assert _cuh_constant("kVerifyThreads", "verify.cu") == abi.VERIFY_THREADS
    assert _cuh_constant("kWriteThreads", "write.cu") == abi.WRITE_THREADS


def test_session_record_layout_matches_python():
    from kvcanary_cupy.args import ATTRIBUTION, STAGE_HEADER, STAGE_HEADER_FIELDS

    assert _cuh_constant("kStageHeaderFields", "session.cu") == STAGE_HEADER_FIELDS >= len(STAGE_HEADER)
    assert _cuh_constant("kAttributionFields", "session.cu") == len(ATTRIBUTION)
    for index, name in enumerate(STAGE_HEADER):
        assert _cuh_constant("kStage" + "".join(w.capitalize() for w in name.split("_")), "session.cu") == index, name


def test_table_kinds_and_layouts_match_the_kernels():
    from kvcanary_cupy.tables import TableKind

    names = {"REQ_TO_TOKEN": "kTableReqToToken", "VIRTUAL_PAGES": "kTableVirtualPages", "BLOCK": "kTableBlock",
             "PAGED_KV": "kTablePagedKv", "BLOCK_NARROW": "kTableBlockNarrow", "PAGED_KV_NARROW": "kTablePagedKvNarrow"}
    assert set(names) == {k.name for k in abi.TableLayout} > {k.name for k in TableKind}
    for kind in TableKind:
        assert abi.TableLayout[kind.name] == kind.value
    assert _cuh_constant("kTableNarrow", "plan.cu") == abi.TABLE_NARROW
    for layout in abi.TableLayout:
        assert _cuh_constant(names[layout.name], "plan.cu") == layout.value, layout


def test_compile_reports_are_cached_by_every_compiled_byte(tmp_path, monkeypatch):
    """A second check of the same source reads the cached report; a changed byte compiles again."""
    from cupy_backends.cuda.libs import nvrtc

    monkeypatch.setenv("KVCANARY_COMPILE_CACHE", str(tmp_path))
    first = abi_check.compile_check("sm_90", "session")["session"]
    assert len(list(tmp_path.iterdir())) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again although the source did not change")

    with monkeypatch.context() as m:
        m.setattr(nvrtc, "compileProgram", no_compile)
        assert abi_check.compile_check("sm_90", "session")["session"] == first
        with pytest.raises(AssertionError, match="compiled again"):
            abi_check.compile_check("sm_90", "session", "\n// one more byte\n")
    monkeypatch.setenv("KVCANARY_COMPILE_CACHE", "off")
    # another byte, since some NVRTC versions skip ptxas (and its register report) for a source
    # compiled before in the same process
    assert abi_check.compile_check("sm_90", "session", "\n// off\n")["session"].registers == first.registers
    assert len(list(tmp_path.iterdir())) == 1


def _kernel_parameter_bytes(kernel, filename):
    """The by-value size of each parameter of ``kernel`` in ``filename`` (pointers: 8 bytes; the
    structs: their NumPy mirrors, whose layouts the struct asserts pin)."""
    sizes_of = {name: dtype for name, (dtype, _) in abi_check.KERNEL_STRUCTS.items()} | {"i64": np.int64, "int": np.int32}
    m = re.search(rf"__global__ void (?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?{kernel}\(([^)]*)\)", cuda_compile._read(filename))
    assert m, kernel
    sizes = []
    for param in m.group(1).split(","):
        words = param.replace("__restrict__", "").split()
        sizes.append(8 if "*" in param else np.dtype(sizes_of[words[-2]]).itemsize)
    return sizes


@pytest.mark.parametrize("kernel, filename, record", [
    ("canary_write", "write.cu", "WRITE_PARAMS"), ("canary_verify", "verify.cu", "VERIFY_PARAMS"),
    ("plan_fused", "plan.cu", "PLAN_PARAMS"), ("plan_offsets", "plan.cu", "PLAN_PARAMS"),
    ("plan_entries", "plan.cu", "PLAN_PARAMS"), ("plan_verify", "step.cu", "PLAN_VERIFY_PARAMS"),
    ("deep_write", "coverage.cu", "DEEP_WRITE_PARAMS"), ("deep_check", "coverage.cu", "DEEP_CHECK_PARAMS"),
    ("lost_snapshot", "coverage.cu", "LOST_SNAPSHOT_PARAMS"), ("lost_check", "coverage.cu", "LOST_CHECK_PARAMS"),
])
def test_parameter_records_mirror_the_kernel_signatures(kernel, filename, record):
    """Field i of a kernel's parameter record has the size of the kernel's parameter i."""
    params = getattr(abi, record)
    assert [params.fields[name][0].itemsize for name in params.names] == _kernel_parameter_bytes(kernel, filename)


def test_kernel_arguments_are_the_addresses_of_the_parameter_fields():
    from kvcanary_cupy.backends.cuda import params

    record = np.zeros(1, abi.PLAN_PARAMS)
    args = params.kernel_arguments(record)
    want = [record.ctypes.data + record.dtype.fields[name][1] for name in record.dtype.names]
    got = [a.ptr if params._CPointer is not None else a.ctypes.data for a in args]
    assert got == want
    view, index = params.ParamSlots(record)("inputs.bs")
    assert index * view.itemsize == abi.PLAN_PARAMS.fields["inputs"][1] + abi.PLAN_INPUTS.fields["bs"][1]
    view[index] = 7
    assert record["inputs"]["bs"][0] == 7
