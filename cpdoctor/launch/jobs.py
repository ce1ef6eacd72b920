"""The typed values that cross the process boundary: a Job of Cases and the RankProgram that runs them, each
rank's RankPayload (a `RankResult` or why there is none), and the CaseOutcome of every case (rank 0's
`CaseNumbers`, or the RankFailures that stopped it).

launch/ knows no examination: a Job carries its program (the examination entry, pickled by reference to its
class), so the worker runs whatever it is handed and never looks anything up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cpdoctor.launch.context import DistContext
    from cpdoctor.report.environment import Environment


@dataclass(frozen=True)
class Case:
    """One examination run on every rank: the examination's request (its own dataclass), patched or not;
    `label` names the case in fault injection and logs ("unpatched" / "patched")."""

    request: Any
    patched: bool = False

    @property
    def label(self) -> str:
        return "patched" if self.patched else "unpatched"


class RankResult:
    """Base of what one rank returns for one case: each examination's probe returns a dataclass of its own
    that derives from it (numbers, never opinions; plain tensors on the CPU, so it pickles)."""


class CaseNumbers:
    """Base of what rank 0 evaluates from every rank's RankResult for one case (judged later, in the parent).
    `environment` is what rank 0 saw (versions, device, process group, layout): the report's environment."""

    environment: Environment


class RankProgram(Protocol):
    """What a Job runs: `run_rank` on every rank, `evaluate` on rank 0 (an Examination is one)."""

    def run_rank(self, case: Case, ctx: DistContext) -> RankResult: ...

    def evaluate(self, case: Case, results: list[RankResult], ctx: DistContext) -> CaseNumbers: ...


WALL_BOUND_FACTOR = 10
WALL_BOUND_FLOOR_S = 600.0
"""A launch's total wall time is bounded by WALL_BOUND_FACTOR timeouts, and never below WALL_BOUND_FLOOR_S: the
timeout is how long no rank may move (progress.py); the wall bound only stops a job that keeps moving without
end (`--timeout 300`: 50 minutes), and a short timeout asked for a quick HANG must not cut a slow run short."""


def wall_bound_s(timeout_s: float) -> float:
    """The most one launch may take, all ranks moving or not."""
    return max(WALL_BOUND_FACTOR * timeout_s, WALL_BOUND_FLOOR_S)


@dataclass(frozen=True)
class Job:
    """What one launch runs: cases of one examination, in order, on one device kind. `timeout_s` is the
    longest no rank may move before the launch is a HANG; the launch's wall time is bounded by `wall_bound_s`."""

    program: RankProgram
    cases: tuple[Case, ...]
    device: str = "auto"
    timeout_s: float = 300.0
    fresh_interpreter: bool = False
    """The ranks must import diffusers themselves, after the job put something first on sys.path (the CUDA kernels'
    stand-ins): they are spawned, never forked from the warm server (warm.py)."""


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
    value: RankResult | None = None
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
    still_moving: bool = False  # a HANG at the wall bound of a rank that kept moving (not a stuck one)


@dataclass
class CaseOutcome:
    """A case's result: rank 0's evaluated numbers, or the failures that stopped it."""

    case: Case
    evaluated: CaseNumbers | None = None
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
    advice: list[str] = field(default_factory=list)
    """What the ranks advised while they ran (`progress.advise`), each line once, printed as it came."""
