"""`cpdoctor check`: op-level CP parity of diffusers' attention, forward and backward, on every rank."""

from __future__ import annotations

from typing import Optional

import typer

from cpdoctor.cli.output import check_run_options, emit, emulate_option, json_option, junit_option, markdown_option, timeout_option, waiting
from cpdoctor.errors import BadInput


def check(
    ring: Optional[int] = typer.Option(None, "--ring", help="Ring degree (default 2, or 1 when only --ulysses is given)."),
    ulysses: Optional[int] = typer.Option(None, "--ulysses", help="Ulysses degree (default 1)."),
    backend: str = typer.Option("auto", "--backend", help="diffusers attention backend, or auto (best CP-capable one that runs here)."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16."),
    batch: int = typer.Option(2, "--batch", help="Batch size."),
    seq: Optional[int] = typer.Option(None, "--seq", help="Full sequence length (default 512, rounded up to divide ring × ulysses)."),
    heads: int = typer.Option(8, "--heads", help="Attention heads."),
    head_dim: int = typer.Option(64, "--head-dim", help="Head dimension."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    mask_pad: int = typer.Option(0, "--mask-pad", help="Mask out the last N keys of the sequence as padding."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    patch: bool = typer.Option(False, "--patch", help="Examine, apply cpdoctor's fixed CP attention, examine again."),
    emulate: bool = emulate_option(),
    timeout: float = timeout_option(),
    json_path: Optional[str] = json_option(),
    junit_path: Optional[str] = junit_option(),
    markdown_path: Optional[str] = markdown_option(),
    repro_dir: Optional[str] = typer.Option(
        None,
        "--repro",
        help="For a FAIL, write DIR/repro.py (torch + diffusers only, run it with torchrun) and DIR/ISSUE.md (diffusers' bug-report shape).",
    ),
) -> None:
    """Run diffusers' real CP attention (forward and backward) on sequence shards and compare every rank with
    a full-sequence reference. Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input, 3 cannot examine."""
    from cpdoctor import api
    from cpdoctor.report import render

    check_run_options(timeout, json_path, junit_path, markdown_path)
    request = api.request_for(
        "attention",
        ring=ring,
        ulysses=ulysses,
        backend=backend,
        dtype=dtype,
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        seed=seed,
        mask_pad=mask_pad,
        device=device,
        patch=patch,
        emulate=emulate,
    )
    with waiting(f"examining CP attention on {request.world_size} ranks", quiet="-" in (json_path, junit_path, markdown_path)):
        report = api.check_attention(request, timeout_s=timeout)
    if repro_dir:
        write_repro_files(report, repro_dir)
    emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="check")


def write_repro_files(report: object, directory: str) -> None:
    """Write the upstream repro and issue text for a FAIL (rank 0 only), and say where (on stderr)."""
    import sys

    from cpdoctor.launch import is_reporting_rank
    from cpdoctor.report.repro import write_repro

    if not is_reporting_rank():
        return
    try:
        paths = write_repro(report, directory, "cpdoctor check")  # type: ignore[arg-type]
    except OSError as exc:
        raise BadInput(f"cannot write --repro {directory}: {exc.strerror}") from exc
    if paths:
        print(f"cpdoctor: wrote {' and '.join(paths)}", file=sys.stderr)
    else:
        print("cpdoctor: --repro: nothing to reproduce (no FAIL with measured tensors)", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("check")(check)
