"""`cpdoctor step path/to/train.py:function`: the user's own CP training step on every rank, examined against
one process (the command face of `cpdoctor.watch_step`)."""

from __future__ import annotations

from typing import Annotated, NoReturn, Optional

import typer

from cpdoctor.cli.options import DEFAULT_TIMEOUT_S, Device, JsonPath, JunitPath, MarkdownPath, Timeout
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import Reference


def step(
    target: Annotated[str, typer.Argument(metavar="path/to/train.py:function", help="The script and its step function (see below).")],
    nproc: Annotated[
        Optional[int], typer.Option("--nproc", help="Ranks to start (default: dp × ring × ulysses, or 2; torchrun decides under torchrun).")
    ] = None,
    ring: Annotated[
        Optional[int], typer.Option("--ring", help="Ring degree handed to a function that takes its degrees (default 2).")
    ] = None,
    ulysses: Annotated[Optional[int], typer.Option("--ulysses", help="Ulysses degree handed to it (default 1).")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", help="Data-parallel size handed to it (default 1).")] = None,
    device: Device = DeviceName.AUTO,
    reference: Annotated[Reference, typer.Option("--reference", help="Precision of the one-process recomputation.")] = Reference.FP64,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
) -> NoReturn:
    """Run FUNCTION from the script on every rank and examine the CP training step it watches against one process.

    A function that takes its degrees (parameters named cp, ring, ulysses, dp, job, watch_step) runs twice: as the same job without CP (dp processes, cp = 1), then with CP (dp × ring × ulysses ranks); the final gradients of every watched step are compared parameter by parameter. Its own loss scaling, clipping, accumulation, adapters and wrappers run in both, so nothing is guessed. A function with one other parameter gets watch_step and runs once, against the step recomputed in one fp64 process from what it recorded.

    Examined: the inputs and RNG states of every CP peer, the gradient of the loss at the model's output, the gradient reduction (a constant factor: cp, 1/cp, dp), the gradients themselves (the attention), the first bad parameter.

    The contract: FUNCTION runs on every rank inside the job's process group (cpdoctor starts it, or joins torchrun's: do not initialise or destroy it). It builds its model (enable_parallelism when cp > 1) and mesh from the degrees it is given, seeds weights and data the same way whatever the degrees, and runs its step inside `with watch_step(model):` (forward, loss, backward, gradient sync; optimizer.step() after the block).

    Exit 0 the step is right, 1 wrong / crash / hang, 2 bad input, 3 nothing examined (e.g. the step never called backward)."""
    from cpdoctor import api
    from cpdoctor.report import render

    check_run_options(timeout, json_path, junit_path, markdown_path)
    api.warm_ranks(models=True)
    with waiting(f"running {target}", quiet="-" in (json_path, junit_path, markdown_path)):
        report = api.examine_step(
            target, nproc=nproc, ring=ring, ulysses=ulysses, dp=dp, device=device, reference=reference, timeout_s=timeout
        )
    emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="step")
