"""The wheel ships every subpackage: pyproject's explicit package list names each one on disk.

The list is explicit because ``kvcanary_cupy.kernels`` is mapped onto the top-level ``kernels/``
folder; a subpackage left out of it imports from a checkout and fails from the wheel.
"""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_subpackage_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvcanary_cupy").rglob("__init__.py")}
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"
    assert listed - on_disk == {"kvcanary_cupy.kernels"}, sorted(listed - on_disk)
