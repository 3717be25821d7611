"""One reduction of a :class:`~kvcanary_cupy.distributed.RankReducer` as data: what this rank put
in (:class:`_Contribution`) and what every rank found (:class:`Verdict`), which the session's
policy applies (``session._deliver``)."""

from __future__ import annotations

from dataclasses import dataclass

from .reporting import REPLICATED_KV_MISMATCH


@dataclass
class _Contribution:
    """What a rank put into one reduction: the findings it handled since the previous one."""

    new: dict
    problems: list
    undelivered: dict
    step: int  # 0-based step of the end_step that issued it
    offset: int  # first slot of its replicated window
    slots: int


@dataclass
class Verdict:
    """One reduction's result as every rank sees it (plus this rank's own findings in it)."""

    contribution: _Contribution
    rank: int
    new_by_rank: dict  # rank -> new violations it handled (nonzero only)
    problems_by_rank: dict  # rank -> health problems (nonzero only)
    mismatches: tuple = ()  # of ReplicaMismatch not reported before
    world_size: int = 1
    device: str = ""

    @property
    def ranks(self) -> list:
        """The ranks with new violations or replicated-KV mismatches."""
        found = set(self.new_by_rank)
        for m in self.mismatches:
            found.update((m.rank, m.other_rank))
        return sorted(found)

    @property
    def violations_anywhere(self) -> bool:
        return bool(self.new_by_rank or self.mismatches)

    def remote_problems(self) -> list:
        return [f"kv-canary: rank {r} handled {n} health problem(s) by step {self.contribution.step} "
                "(that rank's log has the message)" for r, n in sorted(self.problems_by_rank.items()) if r != self.rank]

    def where(self) -> str:
        """The headline's distributed part: this rank, and what every rank found."""
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(self.new_by_rank.items())) or "none"
        mismatches = f"; {len(self.mismatches)} {REPLICATED_KV_MISMATCH}(es)" if self.mismatches else ""
        return (f" on rank {self.rank} ({self.device}); over the {self.world_size} ranks by step "
                f"{self.contribution.step}: new violations on ranks {self.ranks} ({counts}){mismatches}")

    def joined(self, later: "Verdict") -> "Verdict":
        """This verdict and a later one, applied as one (``check()`` reads two at once)."""
        a, b = self.contribution, later.contribution
        both = _Contribution({**a.new, **b.new}, a.problems + b.problems, {**a.undelivered, **b.undelivered},
                             b.step, b.offset, b.slots)
        add = lambda x, y: {r: x.get(r, 0) + y.get(r, 0) for r in sorted(set(x) | set(y))}
        return Verdict(both, self.rank, add(self.new_by_rank, later.new_by_rank),
                       add(self.problems_by_rank, later.problems_by_rank), self.mismatches + later.mismatches,
                       self.world_size, self.device)
