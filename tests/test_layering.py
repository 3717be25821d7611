"""The package's import graph has no circle: each module can be read knowing only the ones below it.

Every import counts, a function's lazy one too (a lazy import still makes the two modules depend on
each other; it only hides the circle from the interpreter).  ``from pkg import name`` counts as an
import of ``pkg.name`` when that is a module, else of ``pkg``; a package's ``__init__`` being run
first is not counted, so a package may dispatch to its own submodules.  Imports under
``if TYPE_CHECKING:`` are not counted: they never run, they only name types for annotations.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import numpy as np

PACKAGE = "kvcanary_cupy"
ROOT = pathlib.Path(__file__).resolve().parent.parent / PACKAGE


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_sources():
    graph = import_graph()
    # A hand-checked sample, so that an empty graph cannot pass the test below.
    assert f"{PACKAGE}.errors" in graph[f"{PACKAGE}.validation"]
    assert f"{PACKAGE}.backends.numpy_fast" in graph[f"{PACKAGE}.backends"]  # lazy, inside get_backend
    assert f"{PACKAGE}.backends.numpy_backend" in graph[f"{PACKAGE}.backends.numpy_fast"]
    assert f"{PACKAGE}.sim" in graph[f"{PACKAGE}.cli"]


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert circles(import_graph()) == []


def test_int32_bound_and_index_dtypes_have_one_home():
    """INT32_MAX and the I64 / I32 aliases live in validation.py; a module-level copy elsewhere could drift."""
    aliases = {"np.int64", "np.int32", "np.dtype(np.int64)", "np.dtype(np.int32)", "2 ** 31 - 1", "-2 ** 31"}
    copies = []
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                if any(ast.unparse(v) in aliases for v in values):
                    copies.append(name)
    assert set(copies) == {f"{PACKAGE}.validation"}
    from kvcanary_cupy import validation

    assert (validation.INT32_MIN, validation.INT32_MAX) == (-(2**31), 2**31 - 1)
    assert (validation.I64, validation.I32) == (np.dtype("int64"), np.dtype("int32"))


def test_importing_the_package_loads_no_devtools():
    """Dev tooling (ABI and compile checks, the fake device, the benchmark) stays off the run-time import path."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {PACKAGE}"], cwd=ROOT.parent,
                          capture_output=True, text=True, check=True)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert {f"{PACKAGE}.ops", f"{PACKAGE}.session"} <= loaded  # the report is read
    assert sorted(m for m in loaded if m.startswith(f"{PACKAGE}.devtools")) == []


def test_device_queries_go_through_one_module():
    """Every question the run-time asks of the CUDA device is asked in backends/cuda/device.py, so a
    fake device answers them all by replacing that one module's functions."""
    queries = (".attributes[", ").compute_capability", "driverGetVersion", "occupancyMaxActiveBlocksPerMultiprocessor",
               "funcGetAttribute", "funcSetAttribute", "Device().id")
    seam = f"{PACKAGE}.backends.cuda.device"
    askers = {name for name, path in _modules().items() if not name.startswith(f"{PACKAGE}.devtools")
              for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
              for query in queries if query in line}
    assert askers == {seam}


# The package's layers, lowest first (docs/architecture.md).  A module imports modules of its own
# layer or of lower ones only; the circle test above keeps each layer acyclic.
LAYERS = {
    "ground": ("errors", "constants", "runtime", "interop", "validation", "hashing"),
    "records": ("records", "violation", "containment", "reporting", "log", "sources", "plans", "args", "tables"),
    "gpu abi and device": ("backends.cuda", "backends.cuda.abi", "backends.cuda.device"),
    "gpu compile": ("backends.cuda.compile",),
    "gpu policy": ("backends.cuda.configs",),
    "gpu params": ("backends.cuda.params",),
    "gpu launch": ("backends.cuda.launch",),
    "backends": ("backends.cuda.ops", "backends.cuda.same_step", "backends.cuda.coverage", "backends.numpy_backend",
                 "backends.numpy_fast", "backends.numpy_kv", "backends.numpy_paged", "backends.numpy_coverage", "backends"),
    "front door": ("strict", "validation_cache", "last_call", "binding", "ops", "ops.canary", "ops.plan_cache", "ops.planning", "ops.pool", "digest", "same_step"),
    "bound": ("bound", "launchers", "plan_launcher", "planner", "coverage"),
    "engine": ("rank_exchange", "rank_worker", "rank_verdict", "distributed", "session", "session.loop", "session.staging", "session.sweep",
               "session.violations", "session.blocks", "metrics"),
    "tools": ("integrations", "hf", "sim", "cli", "__main__", "devtools", ""),  # "": the package's face, kvcanary_cupy/__init__.py
}
#: Layers named by a package hold all its modules.
_PACKAGES = ("sim", "devtools", "digest", "integrations", "hf")
#: Modules of at most this many lines, except the simulator and the NumPy reference.
MAX_MODULE_LINES = 430


def _layer_of(name: str) -> int:
    short = name.removeprefix(PACKAGE).removeprefix(".")
    for rank, modules in enumerate(LAYERS.values()):
        if short in modules or any(short.startswith(m + ".") for m in modules if m in _PACKAGES):
            return rank
    raise AssertionError(f"{name} is in no layer of LAYERS: add it where it belongs")


def test_every_module_has_a_layer_and_imports_nothing_above_it():
    graph = import_graph()
    upward = [(name, dep) for name, deps in graph.items() for dep in deps if _layer_of(dep) > _layer_of(name)]
    assert upward == []


def test_an_upward_import_is_found():
    assert _layer_of(f"{PACKAGE}.ops.planning") > _layer_of(f"{PACKAGE}.tables") > _layer_of(f"{PACKAGE}.errors")
    assert _layer_of(f"{PACKAGE}.sim.engine") == _layer_of(f"{PACKAGE}.cli")


def test_no_module_is_longer_than_the_limit():
    """A module over the limit does several jobs: split it (docs/architecture.md says where)."""
    exempt = (f"{PACKAGE}.sim", f"{PACKAGE}.backends.numpy_backend")
    long = {name: n for name, path in _modules().items() if not name.startswith(exempt)
            for n in [len(path.read_text().splitlines())] if n > MAX_MODULE_LINES}
    assert long == {}


def test_the_fake_device_replaces_only_the_device_seam():
    """devtools/fake_cupy.py patches CuPy and, of the library, only backends/cuda/device.py."""
    path = ROOT / "devtools" / "fake_cupy.py"
    targets = {ast.unparse(call.args[0]) for call in ast.walk(ast.parse(path.read_text()))
               if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("monkeypatch.setattr")}
    library = {t for t in targets if not t.startswith(("self.cupy", "cupyx"))}
    assert library == {"cuda_device"} and "from kvcanary_cupy.backends.cuda import abi, device as cuda_device" in path.read_text()
