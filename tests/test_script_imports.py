"""Every name the benchmarks, scripts and examples import from kvcanary_cupy exists.

Their GPU paths import inside functions that never run without a GPU, so a renamed or moved
helper would only fail on the H200 (bench_digest.py once imported ``copy_bandwidth`` from the
package after it moved to ``devtools.bench.timing``).  Resolved statically from the source, so it
also covers imports inside functions.
"""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for d in ("benchmarks", "scripts", "examples") for p in (ROOT / d).glob("*.py"))


def package_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvcanary_cupy":
            yield node.lineno, node.module, [alias.name for alias in node.names]


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_names_imported_from_the_package_exist(path):
    missing = []
    for lineno, module, names in package_imports(path):
        mod = importlib.import_module(module)
        for name in names:
            if not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                missing.append(f"line {lineno}: {module}.{name}")
    assert not missing, f"{path.name} imports names the package does not have: {missing}"


def test_the_check_sees_imports_inside_functions():
    found = {(m, name) for _, m, names in package_imports(ROOT / "benchmarks" / "bench_digest.py") for name in names}
    assert ("kvcanary_cupy.devtools.bench.timing", "copy_bandwidth") in found
