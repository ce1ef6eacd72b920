"""The report as Markdown, to paste into a pull request or an issue: the environment, one table per finding
(or one row per check for many), the verdict with its diagnosis and remedy."""

from __future__ import annotations

from typing import Any

from cpdoctor.report.findings import Finding, Report
from cpdoctor.report.render import TENSOR_LABELS, environment_line, fmt, row_numbers
from cpdoctor.report.verdict import Verdict


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _tensor_rows(finding: Finding, before: Finding | None) -> list[str]:
    head = (
        ["tensor"]
        + (["before: rel err"] if before is not None and before.tensors else [])
        + ["rel L2 err", "max abs err", "tolerance", "no-CP err", "worst rank", "NaN/Inf", "verdict"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in finding.tensors.items():
        row = [TENSOR_LABELS.get(name, name)]
        if before is not None and before.tensors:
            b = before.tensors.get(name)
            row.append(f"{fmt(b.rel_err)} {b.verdict.value}" if b else "–")
        row += [*row_numbers(t), f"**{t.verdict.value}**"]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines


def _finding_block(finding: Finding, before: Finding | None) -> list[str]:
    lines = [f"#### `{finding.subject}`", ""]
    if finding.tensors:
        lines += _tensor_rows(finding, before) + [""]
    if before is not None:
        lines.append(f"Before the patch: **{Verdict(before.verdict).value}** — {before.diagnosis}  ")
    lines.append(f"**{Verdict(finding.verdict).value}** — {finding.diagnosis}  ")
    if finding.remedy:
        lines.append(f"Remedy: {finding.remedy}  ")
    if finding.command:
        lines.append(f"Look closer: `{finding.command}`  ")
    for rank, tb in finding.tracebacks.items():
        lines += ["", f"<details><summary>rank {rank} traceback</summary>", "", "```", tb.rstrip(), "```", "</details>"]
    return lines + [""]


def _summary_table(report: Report) -> list[str]:
    befores = report.before.findings if report.before is not None else []
    head = ["#", "check"] + (["before"] if befores else []) + ["verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, f in enumerate(report.findings, 1):
        row = (
            [str(i), f"`{f.subject}`"]
            + ([Verdict(befores[i - 1].verdict).value if i - 1 < len(befores) else "–"] if befores else [])
            + [f"**{Verdict(f.verdict).value}**"]
        )
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return lines + [""]


def to_markdown(report: Report, command: str) -> str:
    """The Markdown document of `report`, produced by `cpdoctor <command>`."""
    label = "after the patch: " if report.before is not None else ""
    lines = [
        f"### cpdoctor {command}: {label}{Verdict(report.verdict).value} (exit {int(report.exit_code)})",
        "",
        f"_{environment_line(report.environment)}_",
        "",
    ]
    if len(report.findings) > 1:
        lines += _summary_table(report)
    befores = report.before.findings if report.before is not None else []
    for i, finding in enumerate(report.findings):
        if len(report.findings) > 1 and Verdict(finding.verdict) is Verdict.PASS and not finding.tensors:
            continue
        lines += _finding_block(finding, befores[i] if i < len(befores) else None)
    return "\n".join(lines).rstrip() + "\n"
