"""`cpdoctor plan MODEL`: will every context-parallel split of MODEL divide at this resolution and prompt length?

Parsing and rendering only; the measuring is `cpdoctor.api.plan_model`, which returns the
`cpdoctor.report.Report` every examination returns (the plan under its own keys). torch and diffusers are
imported inside the command so that `cpdoctor --help` stays fast.
"""

import json
import sys
from typing import Annotated, Any, NoReturn, Optional

import typer

from cpdoctor.cli.options import JsonPath, MarkdownPath, flag

PLAN_HELP = (
    "Measure every tensor diffusers splits for context parallelism (from the model's own _cp_plan and forward, "
    "run on the meta device: no weights, no compute) and say whether it divides over ring x ulysses ranks; "
    "for each problem, list the measured ways out. Exit 0 all divide, 1 a problem, 2 bad input, 3 cannot examine."
)


def _write_json(doc: Any, target: str) -> None:
    from cpdoctor.errors import BadInput

    text = json.dumps(doc, indent=2) + "\n"
    if target == "-":
        sys.stdout.write(text)
        return
    try:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise BadInput(f"cannot write --json {target}: {exc.strerror}") from exc


def _mark(ok: Optional[bool]) -> str:
    if ok is None:
        return "[dim]-[/dim]"
    return "[green]yes[/green]" if ok else "[bold red]NO[/bold red]"


def render_list(entries: list, console: Any) -> None:
    from rich.table import Table

    table = Table(title="diffusers models with a context-parallel plan (_cp_plan)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("class")
    table.add_column("inputs")
    table.add_column("plan entries", justify="right")
    for e in entries:
        table.add_row(
            e.short_name,
            e.class_name,
            e.builder or "[yellow]no input builder[/yellow]",
            str(e.cp_plan_entries),
        )
    console.print(table)
    console.print(
        "[dim]Found by scanning diffusers.models for classes with a non-empty _cp_plan; "
        "MODEL may also be the class name or a checkpoint directory.[/dim]"
    )


def _tensor_line(t: Any) -> list[str]:
    """One split tensor (a models.splits.result.SplitRow) as a table row."""
    from rich.markup import escape

    name = escape(t.name) + (" [dim](gathered)[/dim]" if t.gathered else "")
    if t.calls > 1:
        name += f" [dim]x{t.calls}[/dim]"
    return [name, str(t.split_dim), str(t.length), str(t.per_rank), _mark(t.divisible)]


def _heads_line(h: Any) -> list[str]:
    """The heads against the Ulysses degree (a HeadsCheck) as a table row."""
    kv = "" if h.kv_heads == h.heads else f"/{h.kv_heads}"
    per = h.heads // h.ulysses if h.divisible else round(h.heads / h.ulysses, 2)
    label = f"attention heads{' (q/kv)' if kv else ''} [dim]over ulysses[/dim]"
    return [label, "-", f"{h.heads}{kv}", str(per), _mark(h.divisible)]


def render_plan(report: Any, console: Any) -> None:
    """The plan of a `cpdoctor.report.Report` from `plan_model`: its title, one row per split tensor and the
    heads, what is not split, each problem with its measured ways out, the notes and the verdict line."""
    from rich.markup import escape
    from rich.table import Table

    data = report.plan  # the measured Plan (model_zoo/splits/result.py)
    s, m = data.settings, data.model
    frames = "" if s.get("frames") is None else f", {s['frames']} frames"
    title = (
        f"{m['short_name']} ({m['class_name']}) {s['height']}x{s['width']}{frames}, text {s['text_len']}, "
        f"ring {s['ring']} x ulysses {s['ulysses']} = {s['world_size']} ranks"
    )
    console.print(f"[bold]{escape(title)}[/bold]")
    table = Table()
    for column, justify in (("tensor", "left"), ("split dim", "right"), ("length", "right"), ("per rank", "right"), ("divides", "center")):
        table.add_column(column, justify=justify)
    for row in [_tensor_line(t) for t in data.tensors] + [_heads_line(h) for h in data.heads]:
        table.add_row(*row)
    console.print(table)
    for sk in data.skipped:
        console.print(f"[dim]not split: {escape(sk.name)}: {escape(sk.reason)}[/dim]")
    for i, p in enumerate(data.problems, 1):
        console.print(f"[bold red]problem {i}:[/bold red] {escape(p.what)}")
        for r in p.remedies:
            tag = "" if r.measured else " [dim](predicted)[/dim]"
            console.print(f"  [cyan]-> {r.kind.value}:[/cyan] {escape(r.text)}{tag}")
    for note in data.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")
    _verdict_line(data, console)


def _verdict_line(data: Any, console: Any) -> None:
    s, problems, seconds = data.settings, data.problems, data.seconds
    if problems:
        console.print(
            f"[bold red]FAIL[/bold red]: {len(problems)} problem(s) at {s['world_size']} ranks "
            f"[dim]({s['forwards']} meta forwards, {seconds:.1f} s)[/dim]"
        )
    else:
        console.print(
            f"[bold green]PASS[/bold green]: every split divides over {s['world_size']} ranks"
            f"{'' if s['ulysses'] == 1 else ' and the heads over ulysses ' + str(s['ulysses'])} "
            f"[dim]({s['forwards']} meta forward(s), {seconds:.1f} s)[/dim]"
        )


def plan(
    model: Annotated[
        Optional[str], typer.Argument(help="short name (flux, qwen-image, wan, ...), class name, or a local checkpoint directory")
    ] = None,
    height: Annotated[Optional[int], typer.Option("--height", help="image height in pixels (default: the pipeline's)")] = None,
    width: Annotated[Optional[int], typer.Option("--width", help="image width in pixels (default: the pipeline's)")] = None,
    text_len: Annotated[
        Optional[int], typer.Option("--text-len", help="text tokens the transformer receives (default: the pipeline's max_sequence_length)")
    ] = None,
    ring: Annotated[int, typer.Option("--ring", help="ring degree")] = 1,
    ulysses: Annotated[int, typer.Option("--ulysses", help="Ulysses degree")] = 1,
    frames: Annotated[Optional[int], typer.Option("--frames", help="video frames, video models only (default: the pipeline's)")] = None,
    list_models_: Annotated[bool, flag("--list", help="list the models cpdoctor can plan and exit")] = False,
    json_out: JsonPath = None,
    markdown_out: MarkdownPath = None,
) -> NoReturn:
    from cpdoctor.cli.output import check_run_options, console, emit
    from cpdoctor.errors import BadInput

    check_run_options(None, json_out, None, markdown_out)

    from cpdoctor import api
    from cpdoctor.report.serialize import to_jsonable

    try:
        if list_models_:
            entries = api.list_models()
            if json_out != "-":
                render_list(entries, console())
            if json_out:
                _write_json({"models": to_jsonable(entries)}, json_out)
            raise typer.Exit(0)
        if not model:
            raise BadInput("give a MODEL (see `cpdoctor plan --list`)")
        report = api.plan_model(model, height=height, width=width, text_len=text_len, ring=ring, ulysses=ulysses, frames=frames)
    except ImportError as exc:  # torch or diffusers missing
        raise BadInput(f"missing package: {exc}") from exc
    emit(report, json_out, render_plan, markdown_path=markdown_out, command="plan")
