"""The CP group a watched step is examined in, as one frozen object: built by the watcher at entry (and completed
at exit with every CP group of the job), handed to the reference and the judge, which never read the watcher."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class StepGroup:
    """Where this rank's watched step runs: its CP group, the job's layout, and which watched step it is."""

    rank: int
    world: int
    ranks: tuple[int, ...]
    """This rank's CP group (global ranks, group order: the first is its leader)."""
    ring: int
    ulysses: int
    seq: int
    """This process's count of watched steps (every rank counts alike): names the store keys of the step."""
    index: int
    """The step's number in the report (the user's `step=`, else `seq`)."""
    timeout_s: float
    cp_groups: tuple[tuple[int, ...], ...] = ()
    """Every CP group of the job (filled at the block's exit: they partition the world)."""
    process_group: Any = field(default=None, compare=False, repr=False)
    """The CP group's torch process group (the gathers to the leader run in it)."""

    @property
    def leader(self) -> bool:
        return self.rank == self.ranks[0]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(sorted(g[0] for g in self.cp_groups)) if self.cp_groups else (self.ranks[0],)

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def dp(self) -> int:
        """How many CP groups the world holds (the data-parallel degree)."""
        return max(1, self.world // len(self.ranks))

    @property
    def group_number(self) -> int:
        """This CP group's place among the job's groups (by leader)."""
        return list(self.leaders).index(self.ranks[0]) if self.ranks[0] in self.leaders else 0

    def replicas_in(self, ranks: tuple[int, ...]) -> int:
        """How many CP groups a set of ranks touches (the data-parallel replicas a reduction over them spans)."""
        members = set(ranks)
        return sum(1 for g in self.cp_groups if members & set(g)) or 1

    def with_groups(self, cp_groups: tuple[tuple[int, ...], ...]) -> StepGroup:
        """This group with every CP group of the job (each rank's, as gathered: duplicates are dropped)."""
        return replace(self, cp_groups=tuple(dict.fromkeys(tuple(g) for g in cp_groups)))

    def subject(self) -> str:
        return f"training step {self.index}, ring {self.ring} × Ulysses {self.ulysses}, {self.world} ranks"
