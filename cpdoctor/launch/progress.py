"""Where each rank is: every rank records the step it has reached, so a hang is named by what the ranks did,
not by timing margins.

A spawned rank writes its latest step to `rank<R>.step` (atomically) as it joins the process group, prepares a
case, enters the examination's collectives, reports to rank 0 and evaluates. When the deadline passes, the
ranks that are furthest behind are the hung ones; the others were waiting for them in a collective. Ranks
that all stopped at the same step are a deadlock among themselves, and all of them are named.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

STEPS = ("joining", "preparing", "examining", "reporting", "evaluating", "done")
"""In order. `preparing` -> `examining` is where a rank enters the examination's first collective."""


@dataclass(frozen=True, order=True)
class Step:
    case: int
    index: int

    @property
    def name(self) -> str:
        return STEPS[self.index]

    def describe(self) -> str:
        if self.index == 0:
            return "joining the process group"
        return f"case {self.case + 1}: {self.name}"

    @classmethod
    def parse(cls, text: str) -> Step | None:
        try:
            case, name = text.split()
            return cls(int(case), STEPS.index(name))
        except ValueError:
            return None


class StepLog:
    """Records this rank's steps in `path` (no-op without one: under torchrun nobody supervises)."""

    def __init__(self, path: str | None, case_offset: int = 0):
        self.path = path
        self.case_offset = case_offset

    def mark(self, case: int, step: str) -> None:
        if self.path is None:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(f"{case + self.case_offset} {step}")
        os.replace(tmp, self.path)


def read_step(path: str) -> Step | None:
    try:
        with open(path) as fh:
            return Step.parse(fh.read())
    except OSError:
        return None


def blame(steps: dict[int, Step | None]) -> tuple[list[int], list[int]]:
    """(hung, waiting) among the ranks that did not finish, from the step each one reached (None: not even
    started). The ranks behind all others are hung; the rest were waiting for them. When all are at the same
    step, nobody is ahead to wait for anyone: all are named as hung."""
    if not steps:
        return [], []
    floor = Step(-1, -1)
    progress = {rank: step or floor for rank, step in steps.items()}
    lowest = min(progress.values())
    hung = sorted(r for r, s in progress.items() if s == lowest)
    waiting = sorted(r for r in progress if r not in hung)
    return hung, waiting
