"""`cpdoctor model MODEL`: CP parity of a real diffusers model class, output and parameter gradients."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn, Optional

import typer

from cpdoctor.cli.options import (
    DEFAULT_TIMEOUT_S,
    Backend,
    Batch,
    Checkpointing,
    Device,
    Dtype,
    Emulate,
    Frames,
    Height,
    JsonPath,
    JunitPath,
    MarkdownPath,
    MaskPad,
    Patch,
    Ring,
    Seed,
    TextLen,
    Timeout,
    Ulysses,
    Width,
    flag,
)
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import ExaminedDType, Kind

MODEL_HELP = (
    "Run a real diffusers model class through its own enable_parallelism (ring / Ulysses) on every rank, forward "
    "and backward, and compare the gathered output and every parameter gradient (summed over the CP group) with "
    "the same model in one process in fp64. MODEL: a short name (flux, ltx, helios, ... every class with a _cp_plan: "
    "a tiny config derived from the class, random weights seeded alike on every rank; --config FILE for a config "
    "of your own, full width with random weights), a class name, a hub id (org/name, found in the "
    "local Hugging Face cache; --download fetches it) or a pipeline / transformer directory (loaded from "
    "safetensors). Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input, 3 cannot examine."
)


MODEL_LABELS = {"out": "out", "grads": "all grads", "worst_param": "worst param"}
"""Row labels of a model finding's table (the JSON keeps the keys out / grads / worst_param)."""

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

    evidence = finding.evidence
    blocks = getattr(evidence, "blocks", None) or []
    if not blocks:
        return None
    first = evidence.first_bad_block
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
        name = f"[bold]{b.name}[/] ← first bad" if b.name == first else b.name
        table.add_row(
            name,
            fmt(b.out_rel_err),
            fmt(b.baseline_out_rel_err),
            fmt(b.grad_rel_err),
            fmt(b.baseline_grad_rel_err),
            f"{spark(b.out_rel_err)}│{spark(b.grad_rel_err)}",
            styled(b.verdict),
        )
    return table


def render_model(report: Any, console: Any) -> None:
    """The environment line, each finding's table, its per-block table, then the verdict line."""
    from cpdoctor.report import environment_line, render_finding, styled

    befores = report.before.findings if report.before is not None else []
    console.print(f"[dim]{environment_line(report.environment)}[/]")
    for i, finding in enumerate(report.findings):
        before = befores[i] if i < len(befores) else None
        render_finding(finding, before, console, labels=MODEL_LABELS)
        for f, label in ((before, "before the patch"), (finding, None)):
            table = None if f is None else blocks_table(f)
            if table is not None:
                if label:
                    table.title = f"{label}: {table.title}"
                console.print(table)
    label = "after the patch: " if report.before is not None else ""
    console.print(f"\n{label}verdict {styled(report.verdict)}  (exit {int(report.exit_code)}, {report.wall_s:.1f} s)")


def print_plan(request: Any) -> None:
    """The memory plan `prepare` made, and its time plan when there is one (a half dtype on the CPU, with the
    warning where that dtype is far slower than fp32 here), on stderr, before any rank starts."""
    from cpdoctor.api import prints_here
    from cpdoctor.cli.output import console

    plan = request.memory
    if plan is None or not prints_here():
        return
    err = console(stderr=True)
    timing = request.timing.lines() if request.timing is not None else []
    tiny = request.tiny.lines() if request.tiny is not None else []
    for line in tiny + plan.lines() + timing:
        err.print(line, markup=False, highlight=False, style="yellow" if "warning:" in line else None)


# the options only `model` takes (the shared ones are cli/options.py's)
ModelName = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="short name (flux, ltx, wan, helios, ... see `cpdoctor plan --list`), class name, hub id (org/name, from the local Hugging Face cache), or a pipeline / transformer directory",
    ),
]
Revision = Annotated[
    Optional[str], typer.Option("--revision", help="Hub id only: branch, tag or commit in the local Hugging Face cache (default main).")
]
Variant = Annotated[
    Optional[str], typer.Option("--variant", help="Weight file variant, e.g. fp16 or bf16 (diffusion_pytorch_model.fp16.safetensors).")
]
Download = Annotated[
    bool,
    flag("--download", help="Hub id only: fetch the transformer's files when the local cache lacks them (never otherwise)."),
]
AllowPickle = Annotated[
    bool,
    flag(
        "--allow-pickle",
        help="Load pickle weights (.bin) when a checkpoint has no safetensors (unpickling runs code: trusted files only).",
    ),
]
ConfigFile = Annotated[
    Optional[str],
    typer.Option(
        "--config",
        help="A config.json for MODEL's class (e.g. a checkpoint's, full width): that model with seeded random weights instead of the tiny config; --blocks cuts it.",
    ),
]
Blocks = Annotated[
    Optional[int],
    typer.Option(
        "--blocks",
        help="Examine the input embedders, the first N blocks of each block stack and the output layers, reading only their tensors (default: the most that fit in memory).",
    ),
]


def model(
    model_name: ModelName,
    ring: Ring = None,
    ulysses: Ulysses = None,
    backend: Backend = "auto",
    dtype: Dtype = ExaminedDType.FP32,
    height: Height = None,
    width: Width = None,
    text_len: TextLen = None,
    frames: Frames = None,
    batch: Batch = 1,
    seed: Seed = 0,
    mask_pad: MaskPad = 0,
    device: Device = DeviceName.AUTO,
    patch: Patch = False,
    revision: Revision = None,
    variant: Variant = None,
    download: Download = False,
    allow_pickle: AllowPickle = False,
    config: ConfigFile = None,
    blocks: Blocks = None,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
    emulate: Emulate = False,
    checkpointing: Checkpointing = False,
) -> NoReturn:
    from cpdoctor import api

    check_run_options(timeout, json_path, junit_path, markdown_path)
    if not emulate:  # emulating ranks import diffusers themselves, after the stand-ins
        api.warm_ranks(models=True)
    request = api.request_for(
        Kind.MODEL,
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
        config=config,
        blocks=blocks,
        emulate=emulate,
        checkpointing=checkpointing,
    )
    print_plan(request)
    with waiting(f"examining {model_name} under CP on {request.world_size} ranks", quiet="-" in (json_path, junit_path, markdown_path)):
        report = api.check_model(request, timeout_s=timeout)
    emit(report, json_path, render_model, junit_path=junit_path, markdown_path=markdown_path, command="model")
