"""`cpdoctor env`: what is installed, which attention backends can do CP here, and what the installed diffusers
gets wrong, in one process and a few seconds. Rendering only: the examination is `cpdoctor.api.examine_environment`
and returns the `cpdoctor.report.Report` every examination returns (its backend rows under the `backends` key).
torch and diffusers are imported inside the command so that `cpdoctor --help` stays fast."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer

from cpdoctor.cli.options import Emulate, JsonPath
from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import ProbeDType

if TYPE_CHECKING:
    from cpdoctor.report import Environment

MARK = {True: "✓", False: "✗", None: "–"}
COLUMNS = ("backend", "installed", "CP", "runs here", "LSE", "backward", "saves LSE", "RNG", "ring", "Ulysses", "training", "note")

ENV_HELP = (
    "Report the environment (torch, diffusers, attention packages, CUDA/cuDNN/NCCL, devices, torchrun), one row "
    f"per diffusers attention backend ({' · '.join(COLUMNS[1:-1])}: whether ring, Ulysses and training can use it "
    "here, found by trying each on tiny tensors), and the defects of the installed diffusers, each with its remedy "
    "and the `cpdoctor check` command that settles it. One process, no ranks. Exit 0 nothing wrong (warnings "
    "included), 1 a FAIL finding, 2 bad input, 3 cannot examine."
)


def _cell_values(row: Any) -> list[tuple[Optional[bool], str]]:
    """(ok, text) per table column after the name, from a typed BackendRow; ok None renders dim."""
    op = row.op
    meta = bool(op is not None and op.on_meta)
    star = "*" if meta else ""
    na: tuple[Optional[bool], str] = (None, "–")
    installed = (row.installed, MARK[row.installed])
    cp = (row.cp_capable, MARK[row.cp_capable])
    runs = (row.runs_here, MARK[row.runs_here]) if row.installed else na
    lse = (row.returns_lse, MARK[row.returns_lse]) if row.runs_here and row.facts.routes_cp else na
    backward, saves, rng = na, na, na
    if op is not None and not op.error:
        ok = op.backward_ok
        backward = (ok, MARK[ok] + star)
        if meta:
            saves = (False, "✗*") if op.lse_not_requested else na
        elif op.saved_lse:
            saves = (True, "✓")
        else:
            saves = (None if ok else False, "recomputes" if ok else "✗")
        if op.rng_advanced or op.forced_dropout:
            rng = (False, "advances" + star)
        elif not meta:
            rng = (True, "steady")
    cells = [installed, cp, runs, lse, backward, saves, rng]
    cells += [(cell.ok, MARK[cell.ok]) for cell in (row.ring, row.ulysses, row.training)]
    return cells + [(None, _note(row))]


def _note(row: Any) -> str:
    """Every distinct reason the backend cannot do ring, Ulysses or training here, once each."""
    whys: list[str] = []
    for cell in (row.ulysses, row.ring, row.training):
        if cell.ok is False and cell.why and cell.why not in whys:
            whys.append(cell.why)
    return "; ".join(whys)


def _fmt_value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return "; ".join(map(str, value)) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) if value else "none set"
    return str(value)


def _env_lines(env: Environment) -> list[tuple[str, str]]:
    """(label, value) lines of the environment list, in report order."""
    lines = []
    for key, value in env.items():
        if key == "attention_packages" and isinstance(value, dict):
            lines += [(name, str(v)) for name, v in value.items()]
        elif key == "world" and isinstance(value, dict):
            lines.append(("world", value.get("summary", "")))
            if value.get("variables"):
                lines.append(("world variables", _fmt_value(value["variables"])))
        else:
            lines.append((key.replace("_", " "), _fmt_value(value)))
    return lines


def _render_environment(env: Environment, console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim", justify="right")
    grid.add_column()
    for label, value in _env_lines(env):
        style = "yellow" if value == "could not collect" else ("dim" if value in ("not installed", "not available") else "")
        grid.add_row(escape(label), f"[{style}]{escape(value)}[/]" if style else escape(value))
    console.print(grid)


def _render_backends(report: Any, console: Any) -> None:
    """The backend table, then one line per distinct reason a backend cannot do something here."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    env = report.environment
    table = Table(
        title=f"attention backends on {env.attention.probe_device} ({env.attention.probe_dtype})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in COLUMNS[:-1]:
        table.add_column(col, justify="left" if col == "backend" else "center", no_wrap=True)
    notes: dict[str, list[str]] = {}
    for row in report.backends or ():
        *values, (_, note) = _cell_values(row)
        cells = []
        for ok, text in values:
            style = "yellow" if text.startswith("advances") else "green" if ok is True else "red" if ok is False else "dim"
            cells.append(f"[{style}]{escape(text)}[/]")
        table.add_row(escape(row.name), *cells)
        if note:
            notes.setdefault(note, []).append(row.name)
    console.print(table)
    for note, names in notes.items():
        console.print(f"  [dim]✗ {escape(', '.join(names))}: {escape(note)}[/]")


def _peer_line(peer: Any, env: Environment) -> str:
    """One peer: installed version (and the version CI tests), what it offers, and how it runs on this device."""
    if not peer.installed:
        return f"{peer.impl}: not installed ({peer.install})"
    tested = (
        "" if peer.installed_version == peer.tested_version or peer.tested_version.startswith("(") else f", CI tests {peer.tested_version}"
    )
    where = "CPU ranks through cpdoctor's kernel stand-ins" if str(env.attention.probe_device or "cpu").startswith("cpu") else "this GPU"
    ulysses = " × Ulysses" if peer.ulysses else ""
    lse = f"; LSE from {', '.join(peer.lse)}" if peer.lse else ""
    return (
        f"{peer.impl} {peer.installed_version}{tested}: ring{ulysses}, variants {', '.join(peer.variants)}, "
        f"kernels {', '.join(peer.kernels)}{lse}; runs here on {where} (`cpdoctor check --impl {peer.impl}`)"
    )


def _render_peers(peers: list[Any], env: Environment, console: Any) -> None:
    from rich.markup import escape

    if peers:
        console.print("[bold]peers' CP attention[/]")
        for peer in peers:
            console.print(f"  {escape(_peer_line(peer, env))}")
        console.print()


def _render_findings(findings: list[Any], console: Any) -> None:
    from rich.markup import escape

    for f in findings:
        console.print(f"[{f.verdict.style}]{f.verdict}[/] [bold]{escape(f.subject)}[/] — {escape(f.diagnosis)}")
        if f.remedy:
            console.print(f"    [bold]remedy:[/] {escape(f.remedy)}")
        if f.command:
            console.print(f"    [bold]settle:[/] [cyan]{escape(f.command)}[/]")


def render(report: Any, console: Any) -> None:
    """The environment, the backend table, the findings and the verdict line of env's Report."""
    console.print("[bold]cpdoctor env[/]")
    _render_environment(report.environment, console)
    _render_backends(report, console)
    console.print(
        "[dim]ring / Ulysses / training: whether the backend can do that here (ring needs an LSE; training needs a "
        "backward that is right after a forward not asked for an LSE). Defects of diffusers' ring template apply to "
        "every backend: they are among the findings below. * measured on the meta device (no kernel here): shapes "
        "and kernel arguments only.[/]\n"
    )
    _render_peers(report.peers or (), report.environment, console)
    _render_findings(report.findings, console)
    console.print(f"\nverdict [{report.verdict.style}]{report.verdict}[/]  (exit {int(report.exit_code)}, {report.wall_s:.1f} s)")


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: Any) -> str:
    """The report as a Markdown block to paste into a bug report."""
    env = report.environment
    out = [f"### `cpdoctor env`: {report.verdict} (exit {int(report.exit_code)})", "", "| fact | value |", "|---|---|"]
    out += [f"| {_md(label)} | {_md(value)} |" for label, value in _env_lines(env)]
    out += ["", f"Attention backends on {env.attention.probe_device} ({env.attention.probe_dtype}):", ""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in report.backends or ():
        out.append("| " + " | ".join([f"`{row.name}`"] + [_md(text) for _, text in _cell_values(row)]) + " |")
    out += ["", "Peers' CP attention:", ""] + [f"- {_md(_peer_line(p, env))}" for p in report.peers or ()]
    out += ["", "Findings:", ""]
    for f in report.findings:
        line = f"- **{f.verdict}** {_md(f.subject)}: {_md(f.diagnosis).rstrip('.')}."
        if f.remedy:
            line += f" Remedy: {_md(f.remedy)}."
        if f.command:
            line += f" Settle: `{f.command}`."
        out.append(line)
    return "\n".join(out) + "\n"


def env(
    device: Annotated[DeviceName, typer.Option("--device", help="auto (this rank's CUDA device, else cpu), or forced.")] = DeviceName.AUTO,
    dtype: Annotated[
        ProbeDType, typer.Option("--dtype", help="Probe dtype: auto (bf16 on CUDA, fp32 on CPU) or forced.")
    ] = ProbeDType.AUTO,
    json_path: JsonPath = None,
    markdown_path: Annotated[
        Optional[str],
        typer.Option(
            "--markdown", metavar="FILE", help="Write a Markdown block for a bug report to FILE ('-' for stdout instead of the table)."
        ),
    ] = None,
    emulate: Emulate = False,
) -> NoReturn:
    from cpdoctor import api
    from cpdoctor.api import prints_here
    from cpdoctor.cli.output import check_run_options, emit, waiting
    from cpdoctor.errors import BadInput

    if markdown_path == "-" and json_path == "-":
        raise BadInput("--markdown - and --json - both write to stdout; give one of them a FILE")
    check_run_options(None, json_path, None, markdown_path)
    with waiting("examining the environment and the attention backends", quiet="-" in (json_path, markdown_path)):
        report = api.examine_environment(device=device, dtype=dtype, emulate=emulate)
    if not prints_here():  # under torchrun every rank examines its device; rank 0 reports
        raise typer.Exit(int(report.exit_code))
    if markdown_path and markdown_path != "-":
        try:
            with open(markdown_path, "w") as fh:
                fh.write(markdown(report))
        except OSError as exc:
            raise BadInput(f"cannot write --markdown {markdown_path}: {exc.strerror}") from exc

    def show(rep: Any, console: Any) -> None:
        if markdown_path == "-":
            sys.stdout.write(markdown(rep))
        else:
            render(rep, console)

    emit(report, json_path, show)
