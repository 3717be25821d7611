"""``kvcanary sim``: a fault-injection simulator of a paged-KV serving engine with the canary in
its loop.  :func:`run` returns a :class:`SimResult` whose ``to_json()`` is the report's schema."""

from .engine import EngineConfig
from .faults import FAULTS
from .runner import SimConfig, SimResult, run, simulate

__all__ = ["EngineConfig", "FAULTS", "SimConfig", "SimResult", "run", "simulate"]
