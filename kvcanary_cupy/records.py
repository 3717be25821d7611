"""What every record of arrays shares: its ``arrays()`` by field name, and the refusal to allocate
one while a CUDA graph is being captured (a replay would write into memory returned to the pool)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from .interop import placement_of
from .runtime import refuse_during_capture


def refuse_allocation_during_capture(like, owner: str) -> None:
    if like is not None:
        refuse_during_capture(placement_of(like, "like"), f"{owner} allocates new arrays",
                              f"call {owner} before capturing and reuse what it returns")


class ArrayRecord:
    """A frozen dataclass of arrays (plans, the log): ``arrays()`` names them."""

    def arrays(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

