"""`cpdoctor check`: op-level CP parity of diffusers' attention, forward and backward, on every rank."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cpdoctor.cli.options import (
    DEFAULT_TIMEOUT_S,
    Backend,
    Batch,
    Device,
    Dtype,
    Emulate,
    JsonPath,
    JunitPath,
    MarkdownPath,
    MaskPad,
    Patch,
    Ring,
    Seed,
    Timeout,
    Ulysses,
)
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.errors import BadInput


def check(
    ring: Ring = None,
    ulysses: Ulysses = None,
    backend: Backend = "auto",
    dtype: Dtype = "fp32",
    batch: Batch = 2,
    seq: Annotated[
        Optional[int], typer.Option("--seq", help="Full sequence length (default 512, rounded up to divide ring × ulysses).")
    ] = None,
    heads: Annotated[int, typer.Option("--heads", help="Attention heads.")] = 8,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension.")] = 64,
    seed: Seed = 0,
    mask_pad: MaskPad = 0,
    device: Device = "auto",
    patch: Patch = False,
    emulate: Emulate = False,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
    repro_dir: Annotated[
        Optional[str],
        typer.Option(
            "--repro",
            help="For a FAIL, write DIR/repro.py (torch + diffusers only, run it with torchrun) and DIR/ISSUE.md (diffusers' bug-report shape).",
        ),
    ] = None,
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

    from cpdoctor.api import is_reporting_rank, write_repro

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
