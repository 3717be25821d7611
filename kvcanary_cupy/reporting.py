"""Decoding a violation log on the host: what went wrong, where, and how much was dropped."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import CanaryLaunchTag, FailReason
from .hashing import to_unsigned
from .interop import to_numpy

_WRITE_BITS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH


def _tag_name(kind: int) -> str:
    try:
        return CanaryLaunchTag(kind).name
    except ValueError:
        return f"KIND_{kind}"


@dataclass(frozen=True)
class Violation:
    """One decoded ring row (spec §2.6); hashes are unsigned."""

    kernel_kind: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int

    @classmethod
    def from_row(cls, row) -> "Violation":
        v = [int(x) for x in row]
        is_write = bool(v[7] & _WRITE_BITS)  # write rows carry a position in expected_aux
        return cls(v[0], v[1], v[2], v[3], v[4], to_unsigned(v[5]), v[6] if is_write else to_unsigned(v[6]), v[7])

    @property
    def is_write(self) -> bool:
        return bool(self.fail_reason_bits & _WRITE_BITS)

    @property
    def reasons(self) -> str:
        return FailReason.label(self.fail_reason_bits)

    def format(self) -> str:
        aux = f"expected_position={self.expected_aux}" if self.is_write else f"expected_chain_hash={self.expected_aux:#018x}"
        return (
            f"kv_canary violation: launch_tag={_tag_name(self.kernel_kind)} fail_reason={self.reasons} "
            f"slot_idx={self.slot_idx} position={self.position} stored_token={self.stored_token} "
            f"expected_token={self.expected_token} stored_chain_hash={self.stored_chain_hash:#018x} {aux}"
        )


@dataclass(frozen=True)
class ViolationReport:
    """A host snapshot of a :class:`~kvcanary_cupy.ViolationLog`."""

    violations: tuple  # of Violation, in ring order (ticket order)
    total_violations: int  # sum of violation_counters: every violation, the dropped ones included
    ring_capacity: int
    violation_counters: np.ndarray  # [num_kinds] int64, exact per launch kind
    slot_run_counters: np.ndarray
    kernel_run_counters: np.ndarray
    out_of_range_counters: np.ndarray

    @classmethod
    def from_log(cls, log) -> "ViolationReport":
        ring = to_numpy(log.ring)
        kept = min(max(int(to_numpy(log.write_index)[0]), 0), ring.shape[0])
        counters = to_numpy(log.violation_counters).copy()
        return cls(
            violations=tuple(Violation.from_row(r) for r in ring[:kept]),
            total_violations=int(counters.sum()),
            ring_capacity=ring.shape[0],
            violation_counters=counters,
            slot_run_counters=to_numpy(log.slot_run_counters).copy(),
            kernel_run_counters=to_numpy(log.kernel_run_counters).copy(),
            out_of_range_counters=to_numpy(log.out_of_range_counters).copy(),
        )

    @property
    def dropped(self) -> int:
        """Violations counted but not stored because the ring was full."""
        return max(self.total_violations - len(self.violations), 0)

    def format(self) -> str:
        lines = [v.format() for v in self.violations]
        lines.append(
            f"total_violations={self.total_violations} shown={len(self.violations)} dropped={self.dropped} "
            f"out_of_range_skipped={int(self.out_of_range_counters.sum())}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
