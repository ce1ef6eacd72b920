"""`cpdoctor model MODEL`: CP parity of a real diffusers model class, output and parameter gradients."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import typer

from cpdoctor.cli.output import check_run_options, emit, emulate_option, json_option, junit_option, markdown_option, timeout_option, waiting

MODEL_HELP = (
    "Run a real diffusers model class through its own enable_parallelism (ring / Ulysses) on every rank, forward "
    "and backward, and compare the gathered output and every parameter gradient (summed over the CP group) with "
    "the same model in one process in fp64. MODEL: a short name (flux, qwen-image, wan: a tiny config of that "
    "architecture, random weights seeded alike on every rank), a class name, a hub id (org/name, found in the "
    "local Hugging Face cache; --download fetches it) or a pipeline / transformer directory (loaded from "
    "safetensors). Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input, 3 cannot examine."
)


def _display(finding: Any) -> Any:
    """A copy of the finding for the table only: readable row labels ("all grads", "worst param", whose name the
    diagnosis gives), '–' for the rank of summed gradients. The JSON keeps the keys out / grads / worst_param."""
    from cpdoctor.examinations.model.judge import MODEL_LABELS

    tensors = {}
    for key, row in finding.tensors.items():
        tensors[MODEL_LABELS.get(key, key)] = {**row, "worst_rank": "–" if row.get("worst_rank") is None else row["worst_rank"]}
    return dataclasses.replace(finding, tensors=tensors)


SPARK = "▁▂▃▄▅▆▇█"


def spark(err: Any) -> str:
    """One character for a relative error on a log scale: ▁ at 1e-8 or below, █ at 1 or above."""
    import math

    if err is None:
        return " "
    if not err < float("inf"):
        return "█"
    level = (math.log10(max(err, 1e-8)) + 8) / 8
    return SPARK[min(len(SPARK) - 1, max(0, int(level * len(SPARK))))]


def blocks_table(finding: Any) -> Any:
    """One row per examined block: output and input-gradient error against the reference, the no-CP error, a
    bar of each on a log scale, the verdict; the first bad block marked."""
    from rich.table import Table

    from cpdoctor.report import fmt, styled

    blocks = finding.details.get("blocks") or []
    if not blocks:
        return None
    first = finding.details.get("first_bad_block")
    table = Table(title="per block (output / input grad vs reference; bars: log10 err, ▁ 1e-8 … █ 1)", title_justify="left")
    for title, justify in (
        ("block", "left"),
        ("out err", "right"),
        ("no-CP", "right"),
        ("grad err", "right"),
        ("no-CP", "right"),
        ("out│grad", "center"),
        ("verdict", "center"),
    ):
        table.add_column(title, justify=justify)
    for b in blocks:
        name = f"[bold]{b['name']}[/] ← first bad" if b["name"] == first else b["name"]
        table.add_row(
            name,
            fmt(b["out_rel_err"]),
            fmt(b.get("baseline_out_rel_err")),
            fmt(b["grad_rel_err"]),
            fmt(b.get("baseline_grad_rel_err")),
            f"{spark(b['out_rel_err'])}│{spark(b['grad_rel_err'])}",
            styled(b["verdict"]),
        )
    return table


def render_model(report: Any, console: Any) -> None:
    """The environment line, each finding's table, its per-block table, then the verdict line."""
    from cpdoctor.report import environment_line, render_finding, styled

    befores = report.before.findings if report.before is not None else []
    console.print(f"[dim]{environment_line(report.environment)}[/]")
    for i, finding in enumerate(report.findings):
        before = befores[i] if i < len(befores) else None
        render_finding(_display(finding), None if before is None else _display(before), console)
        for f, label in ((before, "before the patch"), (finding, None)):
            table = None if f is None else blocks_table(f)
            if table is not None:
                if label:
                    table.title = f"{label}: {table.title}"
                console.print(table)
    label = "after the patch: " if report.before is not None else ""
    console.print(f"\n{label}verdict {styled(report.verdict)}  (exit {report.exit_code}, {report.wall_s:.1f} s)")


def print_plan(request: Any) -> None:
    """The memory plan `prepare` made, on stderr, before any rank starts."""
    from cpdoctor.cli.output import console
    from cpdoctor.examinations.model import memory_plan
    from cpdoctor.launch import is_reporting_rank

    plan = memory_plan(request)
    if plan is None or not is_reporting_rank():
        return
    err = console(stderr=True)
    for line in plan.lines():
        err.print(line, markup=False, highlight=False)


def model(
    model_name: str = typer.Argument(
        ...,
        metavar="MODEL",
        help="short name (flux, qwen-image, wan), class name, hub id (org/name, from the local Hugging Face cache), or a pipeline / transformer directory",
    ),
    ring: Optional[int] = typer.Option(None, "--ring", help="Ring degree (default 2, or 1 when only --ulysses is given)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree (default 1)."),
    backend: str = typer.Option("auto", "--backend", help="diffusers attention backend, or auto (best CP-capable one that runs here)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    height: Optional[int] = typer.Option(
        None, "--height", help="Image height in pixels (default 8 x the family's step: 128 for Flux / Qwen-Image)."
    ),
    width: Optional[int] = typer.Option(None, "--width", help="Image width in pixels (default as height)."),
    text_len: Optional[int] = typer.Option(None, "--text-len", help="Text tokens (default 8)."),
    frames: Optional[int] = typer.Option(None, "--frames", help="Video frames, video models only (default 5)."),
    batch: int = typer.Option(1, "--batch", help="Batch size."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights (tiny configs), inputs and upstream gradient."),
    mask_pad: int = typer.Option(0, "--mask-pad", help="Mask the last N text tokens as padding (models whose forward takes a text mask)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    patch: bool = typer.Option(False, "--patch", help="Examine, apply cpdoctor's fixed CP attention, examine again."),
    revision: Optional[str] = typer.Option(
        None, "--revision", help="Hub id only: branch, tag or commit in the local Hugging Face cache (default main)."
    ),
    variant: Optional[str] = typer.Option(
        None, "--variant", help="Weight file variant, e.g. fp16 or bf16 (diffusion_pytorch_model.fp16.safetensors)."
    ),
    download: bool = typer.Option(
        False, "--download", help="Hub id only: fetch the transformer's files when the local cache lacks them (never otherwise)."
    ),
    allow_pickle: bool = typer.Option(
        False,
        "--allow-pickle",
        help="Load pickle weights (.bin) when a checkpoint has no safetensors (unpickling runs code: trusted files only).",
    ),
    blocks: Optional[int] = typer.Option(
        None,
        "--blocks",
        help="Examine the input embedders, the first N blocks of each block stack and the output layers, reading only their tensors (default: the most that fit in memory).",
    ),
    timeout: float = timeout_option(),
    json_path: Optional[str] = json_option(),
    junit_path: Optional[str] = junit_option(),
    markdown_path: Optional[str] = markdown_option(),
    emulate: bool = emulate_option(),
) -> None:
    from cpdoctor import api

    check_run_options(timeout, json_path, junit_path, markdown_path)
    request = api.request_for(
        "model",
        model=model_name,
        ring=ring,
        ulysses=ulysses,
        backend=backend,
        dtype=dtype,
        height=height,
        width=width,
        text_len=text_len,
        frames=frames,
        batch=batch,
        seed=seed,
        mask_pad=mask_pad,
        device=device,
        patch=patch,
        revision=revision,
        variant=variant,
        download=download,
        allow_pickle=allow_pickle,
        blocks=blocks,
        emulate=emulate,
    )
    print_plan(request)
    with waiting(f"examining {model_name} under CP on {request.world_size} ranks", quiet="-" in (json_path, junit_path, markdown_path)):
        report = api.check_model(request, timeout_s=timeout)
    emit(report, json_path, render_model, junit_path=junit_path, markdown_path=markdown_path, command="model")


def register(app: typer.Typer) -> None:
    app.command("model", help=MODEL_HELP)(model)
