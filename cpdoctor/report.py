"""What the user sees: one rich table a human reads at a glance, one JSON document a machine reads.

JSON keys are a contract (scripts and CI jobs parse them): `verdict`, `exit_code`, `environment`,
`request`, `findings` (each with `probe`, `verdict`, `diagnosis`, `remedy`, `tensors` mapping out/dq/dk/dv
to `rel_err`, `max_abs`, `worst_rank`, `nonfinite`, ...), and `before` (the unpatched run) with --patch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.examinations.attention.judge import TENSOR_LABELS, Finding

STYLE = {"PASS": "bold green", "FAIL": "bold red", "CRASH": "bold red", "HANG": "bold red", "UNSUPPORTED": "bold yellow"}


@dataclass
class RunResult:
    """The findings of one examination run (patched or not)."""

    verdict: str
    findings: list[Finding]

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "findings": [f.to_dict() for f in self.findings]}


@dataclass
class Report:
    verdict: str
    exit_code: int
    environment: dict[str, Any]
    request: dict[str, Any]
    findings: list[Finding]
    before: RunResult | None = None
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
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


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


def _styled(verdict: str) -> str:
    return f"[{STYLE.get(verdict, 'bold')}]{verdict}[/]"


def environment_line(env: dict[str, Any]) -> str:
    keys = ("torch", "diffusers", "device", "process_group", "world_size", "backend", "dtype")
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
    table.add_column("rel L2 err", justify="right")
    table.add_column("max abs err", justify="right")
    table.add_column("tolerance", justify="right")
    table.add_column("no-CP err", justify="right")
    table.add_column("worst rank", justify="right")
    table.add_column("NaN/Inf", justify="right")
    table.add_column("verdict", justify="center")
    for name, t in finding.tensors.items():
        row = [TENSOR_LABELS.get(name, name)]
        if before is not None:
            b = before.tensors.get(name)
            row += [_fmt(b["rel_err"]) if b else "–", _styled(b["verdict"]) if b else _styled(before.verdict)]
        row += [
            _fmt(t["rel_err"]),
            _fmt(t["max_abs"]),
            _fmt(t.get("tolerance")),
            _fmt(t.get("baseline_rel_err")),
            str(t["worst_rank"]),
            str(t["nonfinite"]),
            _styled(t["verdict"]),
        ]
        table.add_row(*row)
    return table


def render(report: Report, console: Any) -> None:
    """Print the report: environment line, a table per finding, then the verdict line with diagnosis and remedy."""
    console.print(f"[dim]{environment_line(report.environment)}[/]")
    befores = report.before.findings if report.before is not None else []
    for i, finding in enumerate(report.findings):
        before = befores[i] if i < len(befores) else None
        if finding.tensors:
            console.print(tensor_table(finding, before if before is not None and before.tensors else None))
        else:
            console.print(f"[bold]{finding.probe}[/]")
        if before is not None:
            console.print(f"before the patch: {_styled(before.verdict)} — {before.diagnosis}")
        console.print(f"{_styled(finding.verdict)} — {finding.diagnosis}")
        if finding.remedy:
            console.print(f"[bold]remedy:[/] {finding.remedy}")
        for rank, tb in finding.details.get("tracebacks", {}).items():
            console.print(f"[dim]--- rank {rank} traceback ---[/]")
            console.print(tb.rstrip(), markup=False, highlight=False)
    label = "after the patch: " if report.before is not None else ""
    console.print(f"\n{label}verdict {_styled(report.verdict)}  (exit {report.exit_code}, {report.wall_s:.1f} s)")
