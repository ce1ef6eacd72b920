"""`cpdoctor step path/to/train.py:function`: the user's own CP training step on every rank, examined against
one process (the command face of `cpdoctor.watch_step`)."""

from __future__ import annotations

from typing import Optional

import typer

from cpdoctor.cli.output import check_run_options, emit, json_option, junit_option, markdown_option, timeout_option, waiting


def step(
    target: str = typer.Argument(..., metavar="path/to/train.py:function", help="The script and its step function (see below)."),
    nproc: int = typer.Option(2, "--nproc", help="Ranks to start (ignored under torchrun, which decides)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    reference: str = typer.Option("fp64", "--reference", help="Precision of the one-process recomputation: fp64 or fp32."),
    timeout: float = timeout_option(),
    json_path: Optional[str] = json_option(),
    junit_path: Optional[str] = junit_option(),
    markdown_path: Optional[str] = markdown_option(),
) -> None:
    """Run FUNCTION(watch_step) from the script on every rank and examine the step it watches against one fp64 process.

    Examined: the inputs and RNG states of every CP peer, the gradient of the loss at the model's output, the gradient reduction (a constant factor: cp, 1/cp, dp), the gradients themselves (the attention), the first bad parameter.

    The contract: FUNCTION(watch_step) runs on every rank inside the job's process group (cpdoctor starts it, or joins torchrun's: do not initialise or destroy it). It builds its model (with enable_parallelism) and its data, and runs one training step inside `with watch_step(model):` (forward, loss, backward, gradient sync; optimizer.step() after the block).

    Exit 0 the step is right, 1 wrong / crash / hang, 2 bad input, 3 nothing examined (e.g. the step never called backward)."""
    from cpdoctor import api
    from cpdoctor.report import render

    check_run_options(timeout, json_path, junit_path, markdown_path)
    with waiting(f"running {target}", quiet="-" in (json_path, junit_path, markdown_path)):
        report = api.examine_step(target, nproc=nproc, device=device, reference=reference, timeout_s=timeout)
    emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="step")


def register(app: typer.Typer) -> None:
    app.command("step")(step)
