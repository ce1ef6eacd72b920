"""`cpdoctor` alone (or `cpdoctor doctor`): the examinations that matter here, as one verdict table.

Parsing and rendering only; the plan and the run are in cpdoctor/doctor.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

from cpdoctor.cli.options import DEFAULT_TIMEOUT_S, JsonPath, JunitPath, LaunchTimeout, MarkdownPath, flag
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.doctor import plan, plan_in_words

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from cpdoctor.report import Environment, Finding, Report
    from cpdoctor.report.sections import DoctorSummary

RUNS = plan_in_words()
"""What the doctor runs, from its plan (cpdoctor/doctor.py), for `--help`."""

DOCTOR_HELP = (
    f"The front door (what `cpdoctor` alone runs): the environment, then {RUNS}, on the best backend here, as one "
    "verdict table, with the diagnosis, remedy and closer-look command of every check that did not pass. "
    "Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input, 3 cannot examine."
)


def render_doctor(report: Report, out: Console) -> None:
    """A few lines of environment, one row per check, then diagnosis, remedy and command of each that failed."""
    summary = report.doctor
    befores = report.before.findings if report.before is not None else None
    _header(report.environment, summary, out)
    out.print(_table(summary, report.findings, befores))
    _details(summary, report.findings, befores, out)
    _verdict(report, summary, befores, out)


def _header(env: Environment, summary: DoctorSummary, out: Console) -> None:
    from rich.markup import escape

    n = summary.accelerators
    out.print("[bold]cpdoctor[/] — the context-parallel examinations that matter on this machine")
    out.print(f"  torch {env.software.torch} · diffusers {env.software.diffusers} · python {env.software.python}")
    seen = f"accelerators visible: {n}" + ("" if n >= 2 else " (no ring over all accelerators)")
    if summary.torchrun_world:
        seen += f" · torchrun world {summary.torchrun_world}"
    device, group = (v if v is not None else "?" for v in (env.launch.device, env.launch.process_group))
    out.print(f"  device {escape(str(device))} · process group {group} · {seen}")
    if summary.backend == "auto":
        out.print("  CP backend here: [bold]auto[/] (asked for; no rank got far enough to say which backend it chose)")
    else:
        out.print(f"  CP backend here: [bold]{escape(summary.backend)}[/] (auto: the best CP-capable backend that runs here)")


def _table(summary: DoctorSummary, findings: Sequence[Finding], befores: Sequence[Finding] | None) -> Table:
    from rich.table import Table

    from cpdoctor.report import styled, worst_tensor

    table = Table(title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("check")
    table.add_column("covers", style="dim")
    if befores is not None:
        table.add_column("before the fix", justify="center")
        table.add_column("before: worst", justify="right")
    table.add_column("after the fix" if befores is not None else "verdict", justify="center")
    table.add_column("worst rel err", justify="right")
    for i, (row, finding) in enumerate(zip(summary.checks, findings, strict=True), 1):
        cells = [str(i), row.label, row.why]
        if befores is not None:
            cells += [styled(befores[i - 1].verdict), worst_tensor(befores[i - 1])]
        table.add_row(*cells, styled(finding.verdict), worst_tensor(finding))
    return table


def _details(summary: DoctorSummary, findings: Sequence[Finding], befores: Sequence[Finding] | None, out: Console) -> None:
    """Diagnosis, remedy, the result after the fix and the closer-look command of every check that did not pass."""
    from rich.markup import escape

    from cpdoctor.report import Verdict, styled

    for i, (row, finding) in enumerate(zip(summary.checks, findings, strict=True), 1):
        before = befores[i - 1] if befores is not None else None
        shown = before if before is not None and before.verdict != Verdict.PASS else finding
        if shown.verdict == Verdict.PASS and finding.verdict == Verdict.PASS:
            continue
        out.print(f"{i}. [bold]{row.label}[/] {styled(shown.verdict)} — {escape(shown.diagnosis)}")
        if shown.remedy:
            out.print(f"   [bold]remedy:[/] {escape(shown.remedy)}")
        if before is not None:
            after = f"{styled(finding.verdict)}" + ("" if finding.verdict == Verdict.PASS else f" — {escape(finding.diagnosis)}")
            out.print(f"   after cpdoctor's fix: {after}")
        out.print(f"   look closer: [bold]{escape(finding.command or '')}[/]")


def _verdict(report: Report, summary: DoctorSummary, befores: Sequence[Finding] | None, out: Console) -> None:
    from cpdoctor.report import Verdict, styled

    label = "after the fix: " if befores is not None else ""
    launches = summary.launches
    out.print(
        f"\n{label}verdict {styled(report.verdict)}  (exit {int(report.exit_code)}; {len(report.findings)} checks in "
        f"{launches} launch{'es' if launches != 1 else ''}, {report.wall_s:.1f} s in ranks)"
    )
    if befores is None and report.verdict != Verdict.PASS:
        world = summary.torchrun_world
        again = f"torchrun --nproc-per-node {world} -m cpdoctor --patch" if world else "cpdoctor --patch"
        out.print(
            f"[dim]`{again}` shows every check again with cpdoctor's fixed CP attention; `cpdoctor.patch()` applies it in your script.[/]"
        )


def doctor(
    patch: bool = False,
    timeout: Optional[float] = None,
    json_path: Optional[str] = None,
    junit_path: Optional[str] = None,
    markdown_path: Optional[str] = None,
) -> NoReturn:
    """Run the doctor and exit with its code (shared by `cpdoctor` alone and `cpdoctor doctor`)."""
    from cpdoctor.doctor import run_doctor

    timeout_s = DEFAULT_TIMEOUT_S if timeout is None else timeout
    check_run_options(timeout_s, json_path, junit_path, markdown_path)
    from cpdoctor.api import warm_ranks

    warm_ranks()  # the ranks of every launch fork from it: torch and diffusers imported once, while the doctor plans
    checks = " · ".join(c.label for c in plan(0))
    with waiting(f"examining {checks} and the installed peers", quiet="-" in (json_path, junit_path, markdown_path)):
        report = run_doctor(patch=patch, timeout_s=timeout_s)
    emit(report, json_path, render_doctor, junit_path=junit_path, markdown_path=markdown_path, command="doctor")


def doctor_command(
    patch: Annotated[bool, flag("--patch", help="Also run every check with cpdoctor's fixed CP attention, side by side.")] = False,
    timeout: LaunchTimeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
) -> NoReturn:
    doctor(patch=patch, timeout=timeout, json_path=json_path, junit_path=junit_path, markdown_path=markdown_path)
