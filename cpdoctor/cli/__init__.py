"""The `cpdoctor` command line: parsing and rendering only; the work is in api.py and the probes.

Each command lives in cpdoctor/cli/<name>.py as one function; `register_commands` below lists them all, in the
order `--help` shows them. Shared options are typer `Annotated` aliases (options.py). Nothing here imports torch
or diffusers, so `cpdoctor --help` answers at once.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cpdoctor.cli import check, doctor, env, model, plan, run, step
from cpdoctor.cli.options import Command, Group, JsonPath, flag
from cpdoctor.errors import BadInput, CannotExamine

app = typer.Typer(
    name="cpdoctor",
    help=(
        "Finds and fixes silent context-parallel (ring / Ulysses) attention bugs in diffusers. "
        f"Without a command: the doctor (same as `cpdoctor doctor`): {doctor.RUNS}, one verdict table."
    ),
    no_args_is_help=False,  # `cpdoctor` alone is the doctor (cli/doctor.py)
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)


def _print_version(value: bool) -> None:
    if value:
        from cpdoctor.version import __version__

        print(f"cpdoctor {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, flag("--version", is_eager=True, callback=_print_version, help="Print cpdoctor's version and exit.")] = False,
    patch: Annotated[bool, flag("--patch", help="Without a command: also show every check with cpdoctor's fix applied.")] = False,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", help="Without a command: seconds no rank may move before it is reported as HANG (default 300)."),
    ] = None,
    json_path: JsonPath = None,
) -> None:
    """Without a command: the doctor (`cpdoctor doctor`, whose checks its `--help` lists from its plan); with one,
    refuse the doctor's options given before it (the app's `help` is what `cpdoctor --help` shows)."""
    if ctx.invoked_subcommand is None:
        doctor.doctor(patch=patch, timeout=timeout, json_path=json_path)
    elif patch or timeout is not None or json_path is not None:
        given = [name for name, value in (("--patch", patch), ("--timeout", timeout), ("--json", json_path)) if value not in (False, None)]
        raise BadInput(
            f"{', '.join(given)} before a command is an option of the doctor (`cpdoctor` alone); "
            f"give `{ctx.invoked_subcommand}` its options after its name (cpdoctor {ctx.invoked_subcommand} --help)"
        )


def register_commands(app: typer.Typer) -> None:
    """Every command, listed once."""
    app.command("check", cls=Command)(check.check)
    app.command("doctor", help=doctor.DOCTOR_HELP, cls=Command)(doctor.doctor_command)
    app.command("env", help=env.ENV_HELP, cls=Command)(env.env)
    app.command("model", help=model.MODEL_HELP, cls=Command)(model.model)
    app.command("plan", help=plan.PLAN_HELP, cls=Command)(plan.plan)
    app.command("run", help=run.RUN_HELP, cls=Command)(run.run)
    app.command("step", cls=Command)(step.step)


register_commands(app)


def main() -> None:
    """Console-script entry: BadInput -> one line and exit 2; CannotExamine -> one line and exit 3. Under
    torchrun every rank leaves together with the same code (api.end_command)."""
    from cpdoctor import api

    api.begin_command()
    code: int | str | None = 0
    try:
        app()
    except SystemExit as exc:  # not a probe: the command's own exit code
        code = exc.code
    except BadInput as exc:  # not a probe: bad input is one line and exit 2
        print(f"cpdoctor: error: {exc}", file=sys.stderr)
        code = 2
    except CannotExamine as exc:  # not a probe: what cannot run here is one line and exit 3
        print(f"cpdoctor: cannot examine: {exc}", file=sys.stderr)
        code = 3
    except KeyboardInterrupt:
        print("cpdoctor: interrupted", file=sys.stderr)
        code = 130
    api.end_command(code if isinstance(code, int) else (0 if code is None else 1))
