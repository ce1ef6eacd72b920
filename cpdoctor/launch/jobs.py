"""The typed values that cross the process boundary: a Job of Cases, each rank's RankPayload, and the
CaseOutcome of every case (its evaluated numbers, or the RankFailures that stopped it)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """One examination run on every rank: the examination's request (its own dataclass), patched or not.

    `options` carries what an examination adds to a case (the model's op-level cross-checks, the fix's dK/dV
    strategy); `label` names the case in fault injection and logs ("unpatched" / "patched")."""

    request: Any
    patched: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "patched" if self.patched else "unpatched"


@dataclass(frozen=True)
class Job:
    """What one launch runs: cases of one examination kind, in order, on one device kind."""

    kind: str
    cases: tuple[Case, ...]
    device: str = "auto"
    timeout_s: float = 300.0


class RankStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"  # the rank raised
    BAD_INPUT = "bad_input"  # the request is wrong (exit 2)
    CANNOT_EXAMINE = "cannot_examine"  # nothing of it can run here (exit 3)
    LOST = "lost"  # the rank never delivered its payload (it hung or died)


@dataclass
class RankPayload:
    """One rank's answer for one case: its numbers (`value`) or why it has none."""

    status: RankStatus
    value: Any = None
    message: str = ""
    traceback: str = ""
    warnings: list[str] = field(default_factory=list)  # raised inside the examination, kept off the terminal

    @property
    def ok(self) -> bool:
        return self.status is RankStatus.OK

    @property
    def timed_out(self) -> bool:
        """A collective that gave up waiting for a peer (gloo / NCCL wording): this rank was a victim."""
        text = self.message.lower()
        return self.status is RankStatus.ERROR and ("timed out" in text or "timeout" in text)


class FailureKind(enum.Enum):
    CRASH = "CRASH"  # raised or died
    HANG = "HANG"  # never got past where its peers were waiting for it


@dataclass
class RankFailure:
    """A rank that did not deliver: what it did (CRASH / HANG) and its traceback or log tail. `waiting` marks a
    rank that was itself fine but blocked in a collective with the failed one (it is named, not blamed)."""

    rank: int
    kind: FailureKind
    message: str
    traceback: str = ""
    waiting: bool = False
    where: str = ""  # the last step the rank recorded (launch/progress.py)


@dataclass
class CaseOutcome:
    """A case's result: rank 0's evaluated numbers, or the failures that stopped it."""

    case: Case
    evaluated: Any = None
    failures: list[RankFailure] = field(default_factory=list)
    refusal: RankPayload | None = None  # bad input / cannot examine: the request, not a rank, is at fault
    warnings: dict[str, int] = field(default_factory=dict)  # message -> how many times, over all ranks

    @property
    def completed(self) -> bool:
        return not self.failures and self.refusal is None


@dataclass
class LaunchResult:
    """Every case's outcome in order, or one bad-input / cannot-examine line that stops the whole job."""

    outcomes: list[CaseOutcome] = field(default_factory=list)
    bad_input: str | None = None
    cannot_examine: str | None = None
    wall_s: float = 0.0
    launches: int = 0
