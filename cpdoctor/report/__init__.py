"""What every examination returns and the user sees: a Verdict, Findings, one Report (rich table, JSON, exit code).

Every examination (attention, model, env, plan, suites, the front door) ends in the same `Report`, so the CLI,
the API and CI scripts read one shape. JSON keys are a contract (scripts and CI jobs parse them): `verdict`,
`exit_code`, `environment`, `request`, `findings` (each with `probe`, `verdict`, `diagnosis`, `remedy`,
`tensors` mapping a tensor name to `rel_err`, `max_abs`, `worst_rank`, `nonfinite`, ...), `before` (the
unpatched run) with --patch, and whatever an examination adds under its own keys (`extra`: env's `backends`,
plan's `tensors`/`problems`, a suite's name).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any


class Verdict(str, enum.Enum):
    """One finding's verdict. A str subclass, so JSON and comparisons with plain strings keep working."""

    PASS = "PASS"
    FAIL = "FAIL"  # silent corruption: wrong numbers, no error
    CRASH = "CRASH"  # a rank raised or died
    HANG = "HANG"  # a rank did not finish within the timeout
    UNSUPPORTED = "UNSUPPORTED"  # cannot run here, with the reason
    WARN = "WARN"  # env: a hazard that does not corrupt by itself (RNG advance, unchecked dispatch)
    INFO = "INFO"  # env: a fact worth knowing

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def style(self) -> str:
        return {"PASS": "bold green", "WARN": "bold yellow", "UNSUPPORTED": "bold yellow", "INFO": "bold cyan"}.get(self.value, "bold red")


class ExitCode(enum.IntEnum):
    OK = 0  # nothing wrong
    FOUND = 1  # corruption, crash or hang found
    BAD_INPUT = 2
    CANNOT_EXAMINE = 3  # nothing could be examined here


SEVERITY = (Verdict.CRASH, Verdict.HANG, Verdict.FAIL)
"""Verdicts that make a run fail (exit 1), worst first."""


@dataclass
class Finding:
    """One examined thing: its verdict, what the numbers say (diagnosis), what to do (remedy), the numbers."""

    probe: str
    verdict: Verdict
    diagnosis: str
    remedy: str = ""
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    command: str | None = None  # the exact cpdoctor command that examines this more closely

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["verdict"] = self.verdict.value
        return data


def overall(findings: list[Finding]) -> tuple[Verdict, ExitCode]:
    """A run's verdict and exit code: 1 on any corruption, crash or hang; 3 when nothing could be examined;
    WARN (env hazards) and INFO do not change the exit code."""
    verdicts = {f.verdict for f in findings}
    for v in SEVERITY:
        if v in verdicts:
            return v, ExitCode.FOUND
    if verdicts and verdicts <= {Verdict.UNSUPPORTED}:
        return Verdict.UNSUPPORTED, ExitCode.CANNOT_EXAMINE
    if Verdict.WARN in verdicts:
        return Verdict.WARN, ExitCode.OK
    return Verdict.PASS, ExitCode.OK


@dataclass
class RunResult:
    """The findings of one examination run (patched or not)."""

    verdict: Verdict
    findings: list[Finding]

    @classmethod
    def of(cls, findings: list[Finding]) -> RunResult:
        return cls(overall(findings)[0], findings)

    def to_dict(self) -> dict:
        return {"verdict": Verdict(self.verdict).value, "findings": [f.to_dict() for f in self.findings]}


@dataclass
class Report:
    verdict: Verdict
    exit_code: int
    environment: dict[str, Any]
    request: dict[str, Any]
    findings: list[Finding]
    before: RunResult | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, findings: list[Finding], environment: dict[str, Any], request: dict[str, Any], **kwargs: Any) -> Report:
        """The report of `findings`, its verdict and exit code derived from them."""
        verdict, code = overall(findings)
        return cls(verdict, int(code), environment, request, findings, **kwargs)

    def to_dict(self) -> dict:
        data = {
            "verdict": Verdict(self.verdict).value,
            "exit_code": int(self.exit_code),
            "environment": self.environment,
            "request": self.request,
            "findings": [f.to_dict() for f in self.findings],
            "wall_s": round(self.wall_s, 3),
        }
        if self.before is not None:
            data["before"] = self.before.to_dict()
        data.update(self.extra)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


# ----------------------------------------------------------------------------------------------------------
# Rendering (rich): one table a human reads at a glance
# ----------------------------------------------------------------------------------------------------------

TENSOR_LABELS = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV"}


def fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


def styled(verdict: Verdict | str) -> str:
    v = Verdict(verdict)
    return f"[{v.style}]{v.value}[/]"


def environment_line(env: dict[str, Any]) -> str:
    keys = ("torch", "diffusers", "device", "process_group", "world_size", "backend", "dtype", "emulated")
    names = {"world_size": "ranks", "process_group": "pg"}
    return " · ".join(f"{names.get(k, k)} {env[k]}" for k in keys if k in env)


def tensor_table(finding: Finding, before: Finding | None = None) -> Any:
    """One row per tensor; with `before`, the unpatched numbers side by side with the patched ones."""
    from rich.table import Table

    table = Table(title=finding.probe, title_justify="left", show_lines=False)
    table.add_column("tensor")
    if before is not None:
        table.add_column("before: rel err", justify="right")
        table.add_column("before", justify="center")
    for title in ("rel L2 err", "max abs err", "tolerance", "no-CP err", "worst rank", "NaN/Inf"):
        table.add_column(title, justify="right")
    table.add_column("verdict", justify="center")
    for name, t in finding.tensors.items():
        row = [TENSOR_LABELS.get(name, name)]
        if before is not None:
            b = before.tensors.get(name)
            row += [fmt(b["rel_err"]) if b else "–", styled(b["verdict"]) if b else styled(before.verdict)]
        row += [
            fmt(t["rel_err"]),
            fmt(t["max_abs"]),
            fmt(t.get("tolerance")),
            fmt(t.get("baseline_rel_err")),
            str(t["worst_rank"]),
            str(t["nonfinite"]),
            styled(t["verdict"]),
        ]
        table.add_row(*row)
    return table


def render_finding(finding: Finding, before: Finding | None, console: Any) -> None:
    """A finding's table (or its title), the before-the-patch line, the verdict with diagnosis and remedy, and
    the tracebacks of a CRASH."""
    if finding.tensors:
        console.print(tensor_table(finding, before if before is not None and before.tensors else None))
    else:
        console.print(f"[bold]{finding.probe}[/]")
    if before is not None:
        console.print(f"before the patch: {styled(before.verdict)} — {before.diagnosis}")
        if before.verdict in (Verdict.CRASH, Verdict.HANG) and before.remedy:
            console.print(f"[dim]before the patch, remedy: {before.remedy}[/]")
    console.print(f"{styled(finding.verdict)} — {finding.diagnosis}")
    if finding.remedy:
        console.print(f"[bold]remedy:[/] {finding.remedy}")
    if finding.details.get("emulated"):
        console.print(f"[dim]emulated: {finding.details['emulated']}[/]")
    for rank, tb in finding.details.get("tracebacks", {}).items():
        console.print(f"[dim]--- rank {rank} traceback ---[/]")
        console.print(tb.rstrip(), markup=False, highlight=False)


def render(report: Report, console: Any) -> None:
    """Print the report: environment line, a table per finding, then the verdict line."""
    console.print(f"[dim]{environment_line(report.environment)}[/]")
    befores = report.before.findings if report.before is not None else []
    for i, finding in enumerate(report.findings):
        render_finding(finding, befores[i] if i < len(befores) else None, console)
    label = "after the patch: " if report.before is not None else ""
    console.print(f"\n{label}verdict {styled(report.verdict)}  (exit {report.exit_code}, {report.wall_s:.1f} s)")
