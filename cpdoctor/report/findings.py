"""What every examination returns and the user sees: Findings, a run's result, one Report.

Every examination (attention, model, env, plan, suites, the doctor) ends in the same `Report`, so the CLI, the
API and CI scripts read one shape. In process everything is typed: a finding's tensor rows are `JudgedRow`s,
what an examination adds is its own `evidence` dataclass, a crash's tracebacks are a `FailureEvidence`. The
JSON document (`Report.to_dict`, through `serialize.to_jsonable`) is a contract that scripts and CI jobs parse:
`verdict`, `exit_code`, `environment`, `request`, `findings` (each with `probe`, `verdict`, `diagnosis`,
`remedy`, `tensors` mapping a tensor name to `rel_err`, `max_abs`, `worst_rank`, `nonfinite`, ..., `details`,
`command`), `before` (the unpatched run) with --patch, and what an examination adds under its own keys, each a
typed section (report/sections.py): a suite's name, the ranks' `warnings` and `advice`, env's `backends` and
`peers`, a plan's keys (`tensors`, `problems`, ...), the doctor's summary, `--repro`'s `upstream_fix`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from cpdoctor.report.environment import Environment
from cpdoctor.report.numbers import JudgedRow
from cpdoctor.report.sections import DoctorSummary, Row, Section, UpstreamFixOutcome, Warnings
from cpdoctor.report.serialize import to_jsonable
from cpdoctor.report.verdict import ExitCode, Verdict, overall


@dataclass
class FailureEvidence:
    """What the ranks that failed left behind: tracebacks (CRASH) or log tails (HANG) per rank, the step each
    rank had reached, and the known crash signature recognised, if any."""

    tracebacks: dict[int, str] = field(default_factory=dict)
    logs: dict[int, str] = field(default_factory=dict)
    where: dict[int, str] = field(default_factory=dict)
    signature: str | None = None

    def to_jsonable(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("tracebacks", "logs", "where"):
            value = getattr(self, key)
            if value or key == "where":
                out[key] = {str(rank): text for rank, text in value.items()}
        if self.signature is not None:
            out["signature"] = self.signature
        return out


@dataclass(frozen=True)
class Finding:
    """One examined thing: its verdict, what the numbers say (diagnosis), what to do (remedy), the numbers.
    Frozen: built once with what it knows; whoever adds to it (where it ran, the command to look closer) makes a
    new one (`dataclasses.replace`), so no holder of a finding sees it change.

    `subject` names what was examined (JSON key "probe", kept for scripts written against earlier releases);
    `evidence` is the examination's own typed record (backend facts, a model's blocks and parameters, ...),
    written under `details` in JSON together with `emulated` and the failure evidence."""

    subject: str
    verdict: Verdict
    diagnosis: str
    remedy: str = ""
    tensors: dict[str, JudgedRow] = field(default_factory=dict)
    evidence: Any = None
    command: str | None = None
    """The exact cpdoctor command that examines this more closely."""
    emulated: str | None = None
    """What an emulated examination examined and what it did not (every report of one says it)."""
    failure: FailureEvidence | None = None
    environment: Environment | None = None
    """Where this finding's ranks ran (versions, device, process group, layout, backend, a peer's impl/variant/
    kernel/layout), as they reported it (what the parent knew when they reported none); a finding made without
    one gets its report's (`Report.of`). A suite's or the doctor's own environment is the machine's only, so
    there the finding's is the one that says how it ran. JSON `environment` of the finding."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "verdict", Verdict(self.verdict))  # a suite or the API may pass the word

    def ran_in(self, environment: Environment) -> Finding:
        """This finding, knowing where it ran: itself when it knows already, else a copy with `environment`."""
        return self if self.environment is not None else replace(self, environment=environment)

    @property
    def tracebacks(self) -> dict[int, str]:
        return self.failure.tracebacks if self.failure is not None else {}

    def details(self) -> dict[str, Any]:
        """The JSON `details` object: the evidence's fields, `emulated`, the failure evidence."""
        data = to_jsonable(self.evidence) if self.evidence is not None else {}
        if not isinstance(data, dict):
            data = {"evidence": data}
        if self.emulated:
            data["emulated"] = self.emulated
        if self.failure is not None:
            data.update(self.failure.to_jsonable())
        return data

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.subject,
            "verdict": self.verdict.value,
            "diagnosis": self.diagnosis,
            "remedy": self.remedy,
            "tensors": to_jsonable(self.tensors),
            "details": self.details(),
            "command": self.command,
            **({"environment": to_jsonable(self.environment)} if self.environment is not None else {}),
        }


@dataclass(frozen=True)
class RunResult:
    """The findings of one examination run (patched or not), built once."""

    verdict: Verdict
    findings: tuple[Finding, ...]

    @classmethod
    def of(cls, findings: Iterable[Finding]) -> RunResult:
        findings = tuple(findings)
        return cls(overall(findings)[0], findings)

    def ran_in(self, environment: Environment) -> RunResult:
        """This run, each finding that does not know where it ran knowing it ran in `environment`."""
        return replace(self, findings=tuple(f.ran_in(environment) for f in self.findings))

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": Verdict(self.verdict).value, "findings": [f.to_dict() for f in self.findings]}


class Asked(Protocol):
    """What a report says was asked: the examination's request dataclass itself (`AttentionRequest`, ...: an
    `examinations.request.Request`), a suite's, the doctor's, env's, a plan's or a watched step's; JSON `request` is
    its `to_dict()`."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Report:
    """Everything one command found, with its verdict and exit code, built once (`Report.of`) and frozen: what a
    later step adds (`--repro`'s upstream fix) makes a new report. The sections an examination adds under
    their own top-level JSON keys (each None, or empty, and then absent from the JSON, where the examination adds
    none): `suite` (a suite's name), `warnings` and `advice` (what the ranks raised or advised), `backends` and
    `peers` (`cpdoctor env`'s rows), `plan` (`cpdoctor plan`'s measured split, its own keys), `doctor` (the
    doctor's summary), `upstream_fix` (what `--repro` made of the upstream fix)."""

    verdict: Verdict
    exit_code: ExitCode
    environment: Environment
    request: Asked
    findings: tuple[Finding, ...]
    before: RunResult | None = None
    wall_s: float = 0.0
    suite: str | None = None
    warnings: Warnings | None = None
    advice: tuple[str, ...] = ()
    plan: Section | None = None
    backends: tuple[Row, ...] | None = None
    peers: tuple[Row, ...] | None = None
    doctor: DoctorSummary | None = None
    upstream_fix: UpstreamFixOutcome | None = None
    runs: tuple[Row, ...] | None = None
    """`cpdoctor step -- cmd`'s two launches of the user's command (each its command line, processes, exit, wall)."""

    @classmethod
    def of(
        cls, findings: Iterable[Finding], environment: Environment, request: Asked, *, before: RunResult | None = None, **sections: Any
    ) -> Report:
        """The report of `findings`, its verdict and exit code derived from them; a finding (or a `before`
        finding) that does not know where it ran ran in `environment`. `sections`: the other fields, by name."""
        findings = tuple(f.ran_in(environment) for f in findings)
        verdict, code = overall(findings)
        return cls(verdict, code, environment, request, findings, None if before is None else before.ran_in(environment), **sections)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "verdict": Verdict(self.verdict).value,
            "exit_code": int(self.exit_code),
            "environment": to_jsonable(self.environment),
            "request": to_jsonable(self.request.to_dict()),
            "findings": [f.to_dict() for f in self.findings],
            "wall_s": round(self.wall_s, 3),
        }
        if self.before is not None:
            data["before"] = self.before.to_dict()
        data.update(self._sections())
        return data

    def _sections(self) -> dict[str, Any]:
        """The sections' top-level keys, in the order the examinations add them (a suite's name, then the ranks'
        warnings and advice; env's backends, then peers; `--repro`'s upstream fix last)."""
        data: dict[str, Any] = {}
        if self.suite is not None:
            data["suite"] = self.suite
        if self.warnings is not None:
            data["warnings"] = to_jsonable(self.warnings)
        if self.advice:
            data["advice"] = list(self.advice)
        if self.plan is not None:
            data.update(to_jsonable(self.plan.to_dict()))
        for key, rows in (("backends", self.backends), ("peers", self.peers), ("runs", self.runs)):
            if rows is not None:
                data[key] = [to_jsonable(r.to_dict()) for r in rows]
        if self.doctor is not None:
            data["doctor"] = to_jsonable(self.doctor)
        if self.upstream_fix is not None:
            data["upstream_fix"] = to_jsonable(self.upstream_fix)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)
