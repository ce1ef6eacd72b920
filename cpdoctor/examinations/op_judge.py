"""What the op-level judges (attention/judge.py for diffusers' CP attention, peer/judge.py for the peers') share:
the facts of a case that every op-level rule reads (`OpSignature`: where the error is, which gradients are wrong
for a reason of their own) and the judge itself (`OpJudge`: a diagnosis table and the crash signatures of the
code examined, both data). Each judge subclasses the signature with its own facts and passes its own tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from cpdoctor.examinations.judging import GRADS_FAR_WORSE, CrashSignature, Rule, diagnose, failure_findings
from cpdoctor.launch.jobs import RankFailure
from cpdoctor.report import Finding


@dataclass(frozen=True)
class OpSignature:
    """The facts of one measured op-level case that every judge's rules read."""

    ring: int
    ulysses: int
    bad: frozenset[str]  # tensors outside tolerance
    errors: dict[str, float]  # rel_err per tensor
    bad_ranks: tuple[int, ...]
    nonfinite: int

    @property
    def world(self) -> int:
        return self.ring * self.ulysses

    @property
    def where(self) -> str:
        if not self.bad_ranks or len(self.bad_ranks) == self.world:
            return f"on all {self.world} ranks"
        ranks = self.bad_ranks
        return f"only on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {self.world}"

    @property
    def grads_bad(self) -> list[str]:
        """Gradients wrong for a reason of their own (not just following a wrong forward)."""
        out = self.errors.get("out", 0.0)
        return [
            n for n in ("dq", "dk", "dv") if n in self.bad and ("out" not in self.bad or self.errors[n] > GRADS_FAR_WORSE * max(out, 1e-30))
        ]

    @property
    def fwd(self) -> str:
        """How a backward diagnosis opens when the forward was right."""
        return "forward exact, " if "out" not in self.bad else ""


S = TypeVar("S", bound=OpSignature)


@dataclass(frozen=True)
class OpJudge(Generic[S]):
    """An op-level judge: its diagnosis table (`rules`) and the crash signatures of the code it examines
    (`crashes`: diffusers' for diffusers' attention, the peers' own for a peer: another's would misname a crash)."""

    rules: tuple[Rule[S], ...]
    crashes: Sequence[CrashSignature]

    def diagnose(self, signature: S) -> tuple[str, str]:
        """(diagnosis, remedy) of the rules that apply to `signature`."""
        diagnosis, remedy, _ = diagnose(self.rules, signature)
        return diagnosis, remedy

    def failure_findings(self, subject: str, failures: list[RankFailure], timeout_s: float, raised_in: str = "") -> list[Finding]:
        """CRASH / HANG findings naming the first of this judge's crash signatures the tracebacks show."""
        return failure_findings(subject, failures, timeout_s, crashes=self.crashes, raised_in=raised_in)
