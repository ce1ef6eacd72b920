"""Every option the commands share, declared once as a typer `Annotated` alias (typer's own style:
docs_src/options/help/tutorial001_an_py310.py): a command names the alias and its default, so the flag, its
help text and its type cannot drift between `check`, `model`, `run`, `doctor`, `env`, `plan` and `step`.

Choices are the vocabulary's enums (cpdoctor/vocabulary.py; typer's docs: parameter-types/enum), so `--help` lists
them and typer refuses any other word before a command runs (exit 2, in typer's words). A flag's type column is
empty (`flag`, and `Command`/`Group` for typer's own `--help`): rich help would otherwise print `<bool>` after every
switch, which takes no value."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from cpdoctor.vocabulary import Device as DeviceName
from cpdoctor.vocabulary import ExaminedDType


class Command(typer.core.TyperCommand):
    """typer's command class (`app.command(cls=...)`, its documented hook) whose own `--help` takes no type column
    either: typer builds that flag itself, without a metavar, and rich help would print `<bool>` after it."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Group(typer.core.TyperGroup):
    """The same for the app itself (`typer.Typer(cls=...)`): `cpdoctor --help`."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


def flag(*names: str, **settings: Any) -> Any:
    """A typer.Option for a switch (`--patch`, `--causal/--no-causal`): no value, so no type in `--help`."""
    return typer.Option(*names, metavar="", **settings)


Ring = Annotated[Optional[int], typer.Option("--ring", help="Ring degree (default 2, or 1 when only --ulysses is given).")]
Ulysses = Annotated[Optional[int], typer.Option("--ulysses", help="Ulysses degree (default 1).")]
Backend = Annotated[str, typer.Option("--backend", help="diffusers attention backend, or auto (best CP-capable one that runs here).")]
Dtype = Annotated[ExaminedDType, typer.Option("--dtype", help="The dtype the examination computes in.")]
Batch = Annotated[int, typer.Option("--batch", help="Batch size.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random inputs (and of a tiny model's weights).")]
MaskPad = Annotated[int, typer.Option("--mask-pad", help="Mask out the last N keys (text tokens for a model) as padding.")]
Device = Annotated[DeviceName, typer.Option("--device", help="auto (a GPU per rank when there are enough, else the CPU), or forced.")]
Patch = Annotated[bool, flag("--patch", help="Examine, apply cpdoctor's fixed CP attention, examine again.")]
Emulate = Annotated[
    bool,
    flag(
        "--emulate",
        help="Run the CUDA backends' CP code (_native_flash, _native_cudnn, flash) on CPU through cpdoctor's kernel stand-ins.",
    ),
]
Checkpointing = Annotated[
    bool,
    flag(
        "--checkpointing",
        help="Run the CP forward and backward inside torch's non-reentrant activation checkpointing, as enable_gradient_checkpointing() does.",
    ),
]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="HANG when no rank has moved for this many seconds (a slow rank that keeps computing is not one); "
        "each launch's wall time is bounded at 10 × this (at least 600 s).",
    ),
]
LaunchTimeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="HANG when no rank has moved for this many seconds; each launch's wall time is bounded at 10 × this (at least 600 s).",
    ),
]
JsonPath = Annotated[
    Optional[str], typer.Option("--json", metavar="FILE", help="Write the JSON report to FILE ('-' for stdout, no table).")
]
JunitPath = Annotated[
    Optional[str],
    typer.Option("--junit", metavar="FILE", help="Write a JUnit XML report to FILE for CI (one testcase per examination; '-' for stdout)."),
]
MarkdownPath = Annotated[
    Optional[str],
    typer.Option(
        "--markdown",
        metavar="FILE",
        help="Write the table and verdict as Markdown to FILE, to paste into a pull request or issue ('-' for stdout).",
    ),
]
Height = Annotated[Optional[int], typer.Option("--height", help="Image height in pixels (default: the model family's).")]
Width = Annotated[Optional[int], typer.Option("--width", help="Image width in pixels (default as height).")]
TextLen = Annotated[Optional[int], typer.Option("--text-len", help="Text tokens the transformer receives.")]
Frames = Annotated[Optional[int], typer.Option("--frames", help="Video frames, video models only.")]

DEFAULT_TIMEOUT_S = 300.0
