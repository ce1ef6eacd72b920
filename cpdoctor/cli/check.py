"""`cpdoctor check`: op-level CP parity of diffusers' attention, forward and backward, on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer

from cpdoctor.cli.options import (
    DEFAULT_TIMEOUT_S,
    Checkpointing,
    Device,
    Emulate,
    JsonPath,
    JunitPath,
    MarkdownPath,
    Patch,
    Ring,
    Timeout,
    Ulysses,
    flag,
)
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.errors import BadInput
from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import ExaminedDType, Impl, Kernel, Variant

if TYPE_CHECKING:
    from cpdoctor.report import Report


CheckBackend = Annotated[
    Optional[str], typer.Option("--backend", help="diffusers attention backend, or auto (best CP-capable one that runs here; the default).")
]
CheckDtype = Annotated[Optional[ExaminedDType], typer.Option("--dtype", help="The dtype it computes in (default fp32; a peer's: bf16).")]
CheckBatch = Annotated[Optional[int], typer.Option("--batch", help="Batch size (default 2; a peer's: 1).")]
CheckSeq = Annotated[
    Optional[int], typer.Option("--seq", help="Full sequence length (default 512, a peer's 240, rounded up to divide the layout).")
]
CheckHeads = Annotated[Optional[int], typer.Option("--heads", help="Attention heads (default 8; a peer's: 4).")]
CheckHeadDim = Annotated[Optional[int], typer.Option("--head-dim", help="Head dimension (default 64; a peer's: 32).")]
CheckSeed = Annotated[Optional[int], typer.Option("--seed", help="Seed of the random inputs (default 0).")]
CheckMaskPad = Annotated[Optional[int], typer.Option("--mask-pad", help="Mask out the last N keys of the sequence as padding.")]
ImplOption = Annotated[Impl, typer.Option("--impl", help="Whose CP attention: diffusers', or a peer's (torch: its context_parallel).")]
VariantOption = Annotated[
    Optional[Variant],
    typer.Option(
        "--variant",
        help="A peer's variant: ring-flash-attn basic|zigzag|stripe|llama3, yunchang basic|basic_pytorch|zigzag|strip, torch allgather|alltoall.",
    ),
]
KernelOption = Annotated[
    Optional[Kernel],
    typer.Option(
        "--kernel",
        help="A peer's attention kernel: ring-flash-attn fa (flash-attn); yunchang fa|torch_flash|torch_efficient; torch flash|cudnn|efficient.",
    ),
]
CausalOption = Annotated[Optional[bool], flag("--causal/--no-causal", help="A peer's causal attention (default: not causal).")]
ReproDir = Annotated[
    Optional[str],
    typer.Option(
        "--repro",
        help="For a FAIL (or the ring backward's CRASH under --checkpointing), write DIR/repro.py (torch + diffusers only, run it with torchrun), DIR/ISSUE.md (diffusers' bug-report shape) and, for a defect of diffusers' code cpdoctor knows, DIR/fix.diff once verified on a patched copy.",
    ),
]


def check(
    ring: Ring = None,
    ulysses: Ulysses = None,
    backend: CheckBackend = None,
    dtype: CheckDtype = None,
    batch: CheckBatch = None,
    seq: CheckSeq = None,
    heads: CheckHeads = None,
    head_dim: CheckHeadDim = None,
    seed: CheckSeed = None,
    mask_pad: CheckMaskPad = None,
    device: Device = DeviceName.AUTO,
    patch: Patch = False,
    emulate: Emulate = False,
    checkpointing: Checkpointing = False,
    impl: ImplOption = Impl.DIFFUSERS,
    variant: VariantOption = None,
    kernel: KernelOption = None,
    causal: CausalOption = None,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
    repro_dir: ReproDir = None,
) -> NoReturn:
    """Run diffusers' real CP attention (forward and backward) on sequence shards and compare every rank with
    a full-sequence reference (with --patch, then again with cpdoctor's fixed CP attention); with --impl, a peer's
    CP attention the same way. Exit 0 nothing wrong, 1 corruption/crash/hang, 2 bad input, 3 cannot examine."""
    from cpdoctor import api
    from cpdoctor.report import render

    check_run_options(timeout, json_path, junit_path, markdown_path)
    quiet = "-" in (json_path, junit_path, markdown_path)
    if not emulate:  # emulating ranks import diffusers themselves, after the stand-ins
        api.warm_ranks()
    shape = dict(ring=ring, ulysses=ulysses, dtype=dtype, batch=batch, seq=seq, heads=heads, head_dim=head_dim, seed=seed, device=device)
    if impl.is_peer:  # the request is built once, here, and validated by its type (None: the type's default)
        _refuse_diffusers_options(impl, backend=backend, patch=patch, mask_pad=mask_pad, repro=repro_dir, checkpointing=checkpointing)
        peer = api.PeerRequest.of(impl=impl, variant=variant, kernel=kernel, causal=causal, emulate=emulate, **shape)
        with waiting(f"examining {impl}'s CP attention on {peer.world_size} ranks", quiet=quiet):
            report = api.examine(peer, timeout_s=timeout)
        emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="check")
    given = [name for name, value in (("--variant", variant), ("--kernel", kernel), ("--causal", causal)) if value is not None]
    if given:
        raise BadInput(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to a peer (--impl ring-flash-attn|yunchang|torch)")
    request = api.AttentionRequest.of(
        backend=backend, mask_pad=mask_pad, patch=patch, emulate=emulate, checkpointing=checkpointing, **shape
    )
    with waiting(f"examining CP attention on {request.world_size} ranks", quiet=quiet):
        report = api.examine(request, timeout_s=timeout)
    if repro_dir:
        with waiting("writing the repro; a known defect of diffusers' code: verifying its fix on a patched copy", quiet=quiet):
            report = write_repro_files(report, repro_dir, timeout)
    emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="check")


def _refuse_diffusers_options(impl: Impl, **given: object) -> None:
    """--backend, --patch, --mask-pad, --checkpointing and --repro examine diffusers' code: with a peer they are bad input."""
    named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value not in (None, False)]
    if named:
        raise BadInput(f"{', '.join(named)} appl{'ies' if len(named) == 1 else 'y'} to --impl diffusers only, not to {impl}")


def write_repro_files(report: Report, directory: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Report:
    """Write the upstream repro, issue text and (verified) fix for a FAIL (rank 0 only), say where and whether the
    fix was verified (on stderr), and return the check's report with the fix's outcome (`upstream_fix`)."""
    import dataclasses
    import sys

    from cpdoctor.api import prints_here, write_repro

    if not prints_here():
        return report
    try:
        written = write_repro(report, directory, "cpdoctor check", fix_timeout_s=timeout_s)
    except OSError as exc:
        raise BadInput(f"cannot write --repro {directory}: {exc.strerror}") from exc
    if written.paths:
        print(f"cpdoctor: wrote {', '.join(written.paths)}", file=sys.stderr)
        if written.upstream_fix is not None:
            print(f"cpdoctor: --repro: {written.upstream_fix.message}", file=sys.stderr)
        return dataclasses.replace(report, upstream_fix=written.upstream_fix)
    print(
        "cpdoctor: --repro: nothing to reproduce (no FAIL with measured tensors, no CRASH of the ring under --checkpointing)",
        file=sys.stderr,
    )
    return report
