"""`cpdoctor run SUITE`: every examination of a YAML suite (a shipped one, cpdoctor/suites/, or the user's)."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn, Optional

import typer

from cpdoctor import suite as suites
from cpdoctor.cli.options import DEFAULT_TIMEOUT_S, JsonPath, JunitPath, LaunchTimeout, MarkdownPath, flag
from cpdoctor.cli.output import check_run_options, console, emit, waiting
from cpdoctor.vocabulary import Kind

RUN_HELP = (
    f"Run a suite of examinations: a shipped one ({', '.join(suites.shipped())}; --list says what each holds) or a YAML "
    "file. Checks of the same world size and device share one launch, whatever their kind. "
    "Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input (a malformed suite too), 3 cannot examine."
)


def render_suite(report: Any, out: Any) -> None:
    """One row per check; then the diagnosis and remedy of every check that did not pass."""
    from rich.table import Table

    from cpdoctor.report import Verdict, environment_line, worst_tensor
    from cpdoctor.report import styled as _styled

    out.print(f"[dim]{environment_line(report.environment)}[/]")
    befores = report.before.findings if report.before is not None else None
    table = Table(title=f"suite {report.request.suite} ({report.request.source})", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("check")
    if befores is not None:
        table.add_column("before", justify="center")
        table.add_column("before: worst", justify="right")
    table.add_column("verdict", justify="center")
    table.add_column("worst rel err", justify="right")
    for i, finding in enumerate(report.findings, 1):
        row = [str(i), finding.subject]
        if befores is not None:
            b = befores[i - 1] if i - 1 < len(befores) else None
            row += [_styled(b.verdict) if b else "–", worst_tensor(b, labels=False) if b else "–"]
        row += [_styled(finding.verdict), worst_tensor(finding, labels=False)]
        table.add_row(*row)
    out.print(table)
    for i, finding in enumerate(report.findings, 1):
        if finding.verdict is not Verdict.PASS:
            out.print(f"{i}. {_styled(finding.verdict)} — {finding.diagnosis}")
            if finding.remedy:
                out.print(f"   [bold]remedy:[/] {finding.remedy}")
    label = "after the patch: " if befores is not None else ""
    out.print(f"\n{label}verdict {_styled(report.verdict)}  (exit {int(report.exit_code)}, {report.wall_s:.1f} s in ranks)")


def run(
    suite: Annotated[Optional[str], typer.Argument(help="A shipped suite name (see --list) or a YAML file.")] = None,
    patch: Annotated[bool, flag("--patch", help="Run every check before and after cpdoctor's fixed CP attention.")] = False,
    timeout: LaunchTimeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
    list_suites: Annotated[bool, flag("--list", help="List the shipped suites and exit.")] = False,
) -> NoReturn:
    from cpdoctor.errors import BadInput

    if list_suites:
        out = console()
        for name, path in suites.shipped().items():
            s = suites.load(path)
            out.print(f"[bold]{name}[/] ({len(s.checks)} checks): {s.description}")
        raise typer.Exit(0)
    if suite is None:
        raise BadInput("give a SUITE: a shipped name (cpdoctor run --list) or a YAML file")
    check_run_options(timeout, json_path, junit_path, markdown_path)
    from cpdoctor.api import run_suite

    loaded = suites.load(suite)
    if not all(fields.get("emulate") for _, fields in loaded.checks):  # emulating ranks import diffusers themselves
        from cpdoctor.api import warm_ranks

        warm_ranks(models=any(kind is Kind.MODEL for kind, _ in loaded.checks))
    with waiting(f"running suite {loaded.name} ({len(loaded.checks)} checks)", quiet="-" in (json_path, junit_path, markdown_path)):
        report = run_suite(loaded, patch=patch, timeout_s=timeout)
    emit(report, json_path, render_suite, junit_path=junit_path, markdown_path=markdown_path, command="run")
