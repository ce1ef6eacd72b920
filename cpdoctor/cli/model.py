"""`cpdoctor model MODEL`: CP parity of a real diffusers model class, output and parameter gradients."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import typer

from cpdoctor.cli.output import check_run_options, emit, waiting

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


def render_model(report: Any, console: Any) -> None:
    from cpdoctor.report import RunResult, render

    shown = dataclasses.replace(report, findings=[_display(f) for f in report.findings])
    if report.before is not None:
        shown.before = RunResult(report.before.verdict, [_display(f) for f in report.before.findings])
    render(shown, console)


def model(
    model_name: str = typer.Argument(..., metavar="MODEL", help="short name (flux, qwen-image, wan), class name, hub id (org/name, from the local Hugging Face cache), or a pipeline / transformer directory"),
    ring: Optional[int] = typer.Option(None, "--ring", help="Ring degree (default 2, or 1 when only --ulysses is given)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree (default 1)."),
    backend: str = typer.Option("auto", "--backend", help="diffusers attention backend, or auto (best CP-capable one that runs here)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    height: Optional[int] = typer.Option(None, "--height", help="Image height in pixels (default 8 x the family's step: 128 for Flux / Qwen-Image)."),
    width: Optional[int] = typer.Option(None, "--width", help="Image width in pixels (default as height)."),
    text_len: Optional[int] = typer.Option(None, "--text-len", help="Text tokens (default 8)."),
    frames: Optional[int] = typer.Option(None, "--frames", help="Video frames, video models only (default 5)."),
    batch: int = typer.Option(1, "--batch", help="Batch size."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights (tiny configs), inputs and upstream gradient."),
    mask_pad: int = typer.Option(0, "--mask-pad", help="Mask the last N text tokens as padding (models whose forward takes a text mask)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    patch: bool = typer.Option(False, "--patch", help="Examine, apply cpdoctor's fixed ring attention, examine again."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub id only: branch, tag or commit in the local Hugging Face cache (default main)."),
    variant: Optional[str] = typer.Option(None, "--variant", help="Weight file variant, e.g. fp16 or bf16 (diffusion_pytorch_model.fp16.safetensors)."),
    download: bool = typer.Option(False, "--download", help="Hub id only: fetch the transformer's files when the local cache lacks them (never otherwise)."),
    allow_pickle: bool = typer.Option(False, "--allow-pickle", help="Load pickle weights (.bin) when a checkpoint has no safetensors (unpickling runs code: trusted files only)."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds before a rank that has not finished is reported as HANG."),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write the JSON report to FILE ('-' for stdout, no table)."),
) -> None:
    from cpdoctor import api

    check_run_options(timeout, json_path)
    request = api.request_for(
        "model",
        model=model_name, ring=ring, ulysses=ulysses, backend=backend, dtype=dtype, height=height, width=width,
        text_len=text_len, frames=frames, batch=batch, seed=seed, mask_pad=mask_pad, device=device, patch=patch,
        revision=revision, variant=variant, download=download, allow_pickle=allow_pickle,
    )
    with waiting(f"examining {model_name} under CP on {request.world_size} ranks", quiet=json_path == "-"):
        report = api.check_model(request, timeout_s=timeout)
    emit(report, json_path, render_model)


def register(app: typer.Typer) -> None:
    app.command("model", help=MODEL_HELP)(model)
