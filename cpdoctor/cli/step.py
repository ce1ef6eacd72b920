"""`cpdoctor step path/to/train.py:function` (the user's step function on every rank: the command face of
`cpdoctor.watch_step`) and `cpdoctor step -- COMMAND` (the user's own launch command, run twice)."""

from __future__ import annotations

import re
from typing import Annotated, Any, NoReturn, Optional

import typer

from cpdoctor.cli.options import DEFAULT_TIMEOUT_S, Device, JsonPath, JunitPath, MarkdownPath, Timeout
from cpdoctor.cli.output import check_run_options, emit, waiting
from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import Reference

FUNCTION_FORM = re.compile(r"^[^-].*:[A-Za-z_][A-Za-z0-9_]*$")
"""`path/to/train.py:function`: one argument, a colon, an identifier. Anything else is a command (after `--`)."""


# the options only `step` takes (the shared ones are cli/options.py's)
Target = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="path/to/train.py:function | -- COMMAND...",
        help="The script and its step function, or your launch command after -- (see below).",
    ),
]
Nproc = Annotated[
    Optional[int], typer.Option("--nproc", help="Ranks to start (default: dp × ring × ulysses, or 2; torchrun decides under torchrun).")
]
StepRing = Annotated[
    Optional[int],
    typer.Option("--ring", help="Ring degree handed to a function that takes its degrees, or to the command's {ring} (default 2)."),
]
StepUlysses = Annotated[Optional[int], typer.Option("--ulysses", help="Ulysses degree handed to it (default 1).")]
Dp = Annotated[Optional[int], typer.Option("--dp", help="Data-parallel size handed to it (default 1).")]
StepReference = Annotated[Reference, typer.Option("--reference", help="Precision of the one-process recomputation.")]
StepEmulate = Annotated[
    Optional[list[str]],
    typer.Option(
        "--emulate",
        help="With a command: fake an environment in its processes where CPU ranks differ from GPU ones (diffusers-cpu, torchtitan-cpu).",
    ),
]


def step(
    target: Target = None,
    nproc: Nproc = None,
    ring: StepRing = None,
    ulysses: StepUlysses = None,
    dp: Dp = None,
    device: Device = DeviceName.AUTO,
    reference: StepReference = Reference.FP64,
    emulate: StepEmulate = None,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    json_path: JsonPath = None,
    junit_path: JunitPath = None,
    markdown_path: MarkdownPath = None,
) -> NoReturn:
    """Examine your CP training step against the same step without CP: your own launch command run twice, or a step function.

    cpdoctor step [--ring R] [--ulysses U] [--dp D] -- COMMAND... runs your unmodified launch command twice: without CP ({cp} = {ring} = {ulysses} = 1, {world} = {nproc} = dp processes), then with CP ({ring} = R, {ulysses} = U, {cp} = R × U, {world} = {nproc} = dp × cp). Placeholders stand anywhere in an argument, e.g. `cpdoctor step --ring 2 -- torchrun --nproc-per-node {nproc} train.py --cp {cp}`. cpdoctor arms every Python process of it (a startup module on its PYTHONPATH), captures its first optimizer step (the model's inputs, the gradients before any clip, after the sync) and ends the job on every rank before the optimizer changes anything; run 2's gradients are compared with run 1's parameter by parameter, its inputs by layout. The command must train one model with one optimizer, seed its weights and data by the data-parallel rank, and set its CP degree from the placeholders. A command that is the same in both runs, or whose program is not found, is bad input.

    A function that takes its degrees (parameters named cp, ring, ulysses, dp, job, watch_step) runs twice: as the same job without CP (dp processes, cp = 1), then with CP (dp × ring × ulysses ranks); the final gradients of every watched step are compared parameter by parameter. Its own loss scaling, clipping, accumulation, adapters and wrappers run in both, so nothing is guessed. A function with one other parameter gets watch_step and runs once, against the step recomputed in one fp64 process from what it recorded.

    Examined: the inputs and RNG states of every CP peer, the gradient of the loss at the model's output, the gradient reduction (a constant factor: cp, 1/cp, dp), the gradients themselves (the attention), the first bad parameter.

    The function's contract: it runs on every rank inside the job's process group (cpdoctor starts it, or joins torchrun's: do not initialise or destroy it). It builds its model (enable_parallelism when cp > 1) and mesh from the degrees it is given, seeds weights and data the same way whatever the degrees, and runs its step inside `with watch_step(model):` (forward, loss, backward, gradient sync; optimizer.step() after the block).

    Exit 0 the step is right, 1 wrong / crash / hang, 2 bad input, 3 nothing examined (e.g. the step never called backward, the command never reached an optimizer step)."""
    from cpdoctor.report import render

    check_run_options(timeout, json_path, junit_path, markdown_path)
    words = list(target or [])
    quiet = "-" in (json_path, junit_path, markdown_path)
    degrees = {"ring": ring, "ulysses": ulysses, "dp": dp}
    if len(words) == 1 and FUNCTION_FORM.match(words[0]):
        report = _run_function(words[0], degrees, nproc, device, reference, emulate, timeout, quiet)
    else:
        report = _run_command(words, degrees, nproc, reference, emulate, timeout, quiet)
    emit(report, json_path, render, junit_path=junit_path, markdown_path=markdown_path, command="step")


def _run_function(
    target: str, degrees: dict[str, int | None], nproc: int | None, device: DeviceName, reference: Reference,
    emulate: list[str] | None, timeout: float, quiet: bool,
) -> Any:  # fmt: skip
    """`cpdoctor step path/to/train.py:function`: the step function on its ranks (once, or twice with its degrees)."""
    from cpdoctor import api
    from cpdoctor.errors import BadInput

    if emulate:
        raise BadInput("--emulate applies to a command (cpdoctor step -- COMMAND), not to a step function")
    api.warm_ranks(models=True)
    with waiting(f"running {target}", quiet=quiet):
        return api.examine_step(target, nproc=nproc, device=device, reference=reference, timeout_s=timeout, **degrees)


def _run_command(
    words: list[str], degrees: dict[str, int | None], nproc: int | None, reference: Reference, emulate: list[str] | None,
    timeout: float, quiet: bool,
) -> Any:  # fmt: skip
    """`cpdoctor step -- COMMAND`: the user's own launch command, run without CP and with it."""
    from cpdoctor import api
    from cpdoctor.errors import BadInput

    if nproc is not None:
        raise BadInput("--nproc is for a step function: your command starts its own processes (give it {nproc})")
    if reference is not Reference.FP64:
        raise BadInput("--reference is for a step function run once: a command is compared with its own run without CP")
    with waiting(f"running {' '.join(words)} twice", quiet=quiet):
        return api.examine_command(words, emulate=tuple(emulate or ()), timeout_s=timeout, **degrees)
