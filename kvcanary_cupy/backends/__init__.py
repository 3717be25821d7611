"""Backends compute the canary on validated, normalised views.

The front door (:mod:`kvcanary_cupy.ops`) checks every argument, turns each array into a NumPy
or CuPy view of the caller's memory and hands one of the records of :mod:`kvcanary_cupy.args`
to the backend :func:`get_backend` picks by the arrays' device.  Both backends compute the same
bytes for the same record; only the order of ring rows written by GPU threads may differ.
"""

from __future__ import annotations

from typing import Any, Protocol

# The records used to live here; they stay importable from here for code written against that.
from ..args import (ATTRIBUTION, STAGE_HEADER, STAGE_HEADER_FIELDS, VERIFY_ENTRY_FIELDS, VERIFY_INPUT_FIELDS,  # noqa: F401
                    CanaryTarget, CopyArgs, LogViews, MoveArgs, PlanArgs, PlanOutputs, PlanVerifyArgs, ScatterArgs, SourceView,
                    StageArgs, StageLayout, TableView, VerifyArgs, WriteArgs)


class Backend(Protocol):
    """What a backend module provides (numpy_backend, the reference, and cuda.ops)."""

    def plan(self, a: PlanArgs) -> None: ...

    def write(self, a: WriteArgs) -> None: ...

    def verify(self, a: VerifyArgs) -> None: ...

    def plan_verify_stores_entries(self, bs: int) -> bool:
        """Whether plan_verify of ``bs`` requests writes its verify entries into the VerifyPlan."""

    def plan_verify(self, a: PlanVerifyArgs) -> None: ...

    def move(self, a: MoveArgs) -> None: ...

    def copy(self, a: CopyArgs) -> None: ...

    def scatter(self, a: ScatterArgs) -> None: ...

    def prepare_stage(self, a: StageArgs) -> Any:
        """A callable ``stage(stamp, stream=None, staging=None)`` that stages one step's record."""


_loaded: dict = {}  # name -> module: the bound launchers ask on every launch


def get_backend(name: str) -> Backend:
    backend = _loaded.get(name)
    if backend is not None:
        return backend
    if name == "numpy":
        from . import numpy_fast as backend  # the reference, numpy_backend, with its fast paths
    else:
        from .cuda import ops as backend
    _loaded[name] = backend
    return backend
