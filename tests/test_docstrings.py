"""Every public function and class has a docstring that explains its arguments (issue #29)."""

import dataclasses
import enum
import inspect
import re
import warnings

import pytest

import kvcanary_cupy as kc

MIN_CHARS = 120  # a sentence or two at least

PUBLIC = [name for name in kc.__all__ if inspect.isclass(getattr(kc, name)) or inspect.isroutine(getattr(kc, name))]


def _unwrapped(fn):
    return inspect.unwrap(fn)


def _parameters(fn) -> list:
    """The parameter names a caller passes (not self/cls, not *args/**kwargs)."""
    try:
        sig = inspect.signature(_unwrapped(fn))
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _methods(cls):
    """The public methods and classmethods a class defines itself (not inherited from object/enum)."""
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(fn):
            yield name, fn


def _constructor_parameters(cls) -> list:
    if issubclass(cls, (enum.Enum, BaseException)):
        return []
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    if "__init__" in vars(cls):
        return _parameters(cls.__init__)
    return []


def _documented(doc: str) -> set:
    """The names a NumPy-style docstring documents: its Parameters/Attributes entries
    (``a, b : type`` lines) and every ``name`` quoted in double backquotes."""
    names = set(re.findall(r"``\*{0,2}([A-Za-z_]\w*)(?:=[^`]*)?``", doc))
    lines = doc.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.strip() in ("Parameters", "Attributes") and set(lines[i + 1].strip()) == {"-"}:
            indent = len(line) - len(line.lstrip())
            for entry in lines[i + 2:]:
                if entry.strip() in ("Returns", "Raises", "Examples", "Notes", "Yields", "See Also", "Warns"):
                    break
                if entry.strip() and len(entry) - len(entry.lstrip()) == indent:
                    head = entry.split(" : ")[0]
                    names.update(n.strip().lstrip("*") for n in head.split(","))
    return names


def _missing(doc: str, names) -> list:
    documented = _documented(doc)
    return [n for n in names if n not in documented]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_a_docstring_naming_its_parameters(name):
    obj = getattr(kc, name)
    doc = inspect.getdoc(obj) or ""
    assert len(doc) >= MIN_CHARS, f"{name}'s docstring is {len(doc)} characters"
    if inspect.isclass(obj):
        params = _constructor_parameters(obj)
        init_doc = inspect.getdoc(obj.__init__) if "__init__" in vars(obj) else ""
        assert not _missing(doc + (init_doc or ""), params), f"{name}'s docstring does not name {_missing(doc, params)}"
        for method, fn in _methods(obj):
            mdoc = inspect.getdoc(fn) or ""
            assert mdoc, f"{name}.{method} has no docstring"
            assert not _missing(mdoc, _parameters(fn)), f"{name}.{method}'s docstring does not name {_missing(mdoc, _parameters(fn))}"
    else:
        assert not _missing(doc, _parameters(obj)), f"{name}'s docstring does not name {_missing(doc, _parameters(obj))}"
        assert "Examples" in doc or ">>>" in doc, f"{name}'s docstring has no example"


def test_package_ships_py_typed():
    from importlib import resources

    assert resources.files("kvcanary_cupy").joinpath("py.typed").is_file()


@pytest.mark.parametrize("name", [n for n in PUBLIC if inspect.isfunction(getattr(kc, n))])
def test_public_function_is_type_hinted(name):
    sig = inspect.signature(_unwrapped(getattr(kc, name)))
    unhinted = [p.name for p in sig.parameters.values() if p.annotation is p.empty]
    assert not unhinted, f"{name} has parameters without type hints: {unhinted}"
    assert sig.return_annotation is not sig.empty, f"{name} has no return type hint"


DOCTEST_MODULES = ["constants", "hashing", "launchers", "ops", "planner", "plans", "reporting", "same_step", "session", "tables",
                   "digest.format", "digest.layout", "digest.pages", "digest.verdicts"]


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(module):
    """The examples are real: every one runs on NumPy and prints what it says (GPU ones are skipped)."""
    import doctest
    import importlib

    import numpy as np

    mod = importlib.import_module(f"kvcanary_cupy.{module}")
    with warnings.catch_warnings():  # verify_overflowed's example warns, as it says
        warnings.simplefilter("ignore", kc.CanaryCapacityWarning)
        result = doctest.testmod(mod, extraglobs={"np": np, "kc": kc}, optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of kvcanary_cupy.{module} failed (run doctest -v)"


def test_api_reference_lists_every_public_name():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = [name for name in kc.__all__ if f"`{name}" not in page]
    assert not missing, f"docs/api.md does not mention {missing}"
