"""Rendering with rich: one table a human reads at a glance, for any finding with tensor rows."""

from __future__ import annotations

from typing import Any

from cpdoctor.report.environment import Environment
from cpdoctor.report.findings import Finding, Report
from cpdoctor.report.numbers import JudgedRow
from cpdoctor.report.verdict import Verdict

TENSOR_LABELS = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV", "lse": "LSE"}


def fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.2e}"
    return str(x)


def styled(verdict: Verdict | str) -> str:
    v = Verdict(verdict)
    return f"[{v.style}]{v.value}[/]"


def environment_line(env: Environment) -> str:
    keys = ("torch", "diffusers", "device", "process_group", "world_size", "backend", "dtype", "emulated")
    names = {"world_size": "ranks", "process_group": "pg"}
    return " · ".join(f"{names.get(k, k)} {_plain(v)}" for k in keys if (v := env.get(k)) is not None)


def _plain(value: Any) -> str:
    """A value as the JSON shows it (an enum by its value: `fp32`, not `DType.FP32`)."""
    return str(getattr(value, "value", value))


def row_numbers(t: JudgedRow) -> list[str]:
    """A judged row's numbers as every table shows them: rel L2 err, max abs err, tolerance, no-CP err, worst
    rank, NaN/Inf (the verdict is styled by each format)."""
    return [fmt(t.rel_err), fmt(t.max_abs), fmt(t.tolerance), fmt(t.baseline_rel_err), fmt(t.worst_rank), str(t.nonfinite)]


def tensor_table(finding: Finding, before: Finding | None = None, labels: dict[str, str] | None = None) -> Any:
    """One row per tensor; with `before`, the unpatched numbers side by side with the patched ones."""
    from rich.table import Table

    labels = {**TENSOR_LABELS, **(labels or {})}
    table = Table(title=finding.subject, title_justify="left", show_lines=False)
    table.add_column("tensor")
    if before is not None:
        table.add_column("before: rel err", justify="right")
        table.add_column("before", justify="center")
    for title in ("rel L2 err", "max abs err", "tolerance", "no-CP err", "worst rank", "NaN/Inf"):
        table.add_column(title, justify="right")
    table.add_column("verdict", justify="center")
    for name, t in finding.tensors.items():
        row = [labels.get(name, name)]
        if before is not None:
            b = before.tensors.get(name)
            row += [fmt(b.rel_err) if b else "–", styled(b.verdict) if b else styled(before.verdict)]
        row += [*row_numbers(t), styled(t.verdict)]
        table.add_row(*row)
    return table


def render_finding(finding: Finding, before: Finding | None, console: Any, labels: dict[str, str] | None = None) -> None:
    """A finding's table (or its title), the before-the-patch line, the verdict with diagnosis and remedy, and
    the tracebacks of a CRASH."""
    if finding.tensors:
        console.print(tensor_table(finding, before if before is not None and before.tensors else None, labels))
    else:
        console.print(f"[bold]{finding.subject}[/]")
    if before is not None:
        console.print(f"before the patch: {styled(before.verdict)} — {before.diagnosis}")
        if before.verdict in (Verdict.CRASH, Verdict.HANG) and before.remedy:
            console.print(f"[dim]before the patch, remedy: {before.remedy}[/]")
    console.print(f"{styled(finding.verdict)} — {finding.diagnosis}")
    if finding.remedy:
        console.print(f"[bold]remedy:[/] {finding.remedy}")
    if finding.emulated:
        console.print(f"[dim]emulated: {finding.emulated}[/]")
    for rank, tb in finding.tracebacks.items() if finding.verdict is Verdict.CRASH else ():
        console.print(f"[dim]--- rank {rank} traceback ---[/]")
        console.print(tb.rstrip(), markup=False, highlight=False)


def render(report: Report, console: Any) -> None:
    """Print the report: environment line, a table per finding, then the verdict line."""
    console.print(f"[dim]{environment_line(report.environment)}[/]")
    befores = report.before.findings if report.before is not None else []
    for i, finding in enumerate(report.findings):
        render_finding(finding, befores[i] if i < len(befores) else None, console)
    for line in report.advice:
        console.print(f"[yellow]warning:[/] {line}", highlight=False)
    label = "after the patch: " if report.before is not None else ""
    console.print(f"\n{label}verdict {styled(report.verdict)}  (exit {int(report.exit_code)}, {report.wall_s:.1f} s)")


def worst_tensor(finding: Finding | None, labels: bool = True) -> str:
    """The tensor furthest from the reference, as 'dK 1.16e+00' (– when nothing was measured); `labels` writes
    the tensor's display name (dK) instead of its key (dk)."""
    if finding is None or not finding.tensors:
        return "–"
    name, t = max(finding.tensors.items(), key=lambda kv: kv[1].rel_err or 0.0)
    return f"{TENSOR_LABELS.get(name, name) if labels else name} {t.rel_err:.2e}"
