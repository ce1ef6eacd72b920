"""The `cpdoctor` command line: parsing and rendering only; the work is in api.py and the probes.

Each command lives in cpdoctor/cli/<name>.py and registers itself (`register(app)`). Nothing here imports torch or
diffusers, so `cpdoctor --help` answers at once.
"""

from __future__ import annotations

import sys

import typer

from cpdoctor.errors import BadInput, CannotExamine

app = typer.Typer(
    name="cpdoctor",
    help="Finds and fixes silent context-parallel (ring / Ulysses) attention bugs in diffusers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from cpdoctor import __version__

        print(f"cpdoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version, help="Print cpdoctor's version and exit."),
) -> None:
    """Finds and fixes silent context-parallel (ring / Ulysses) attention bugs in diffusers."""


def _register_commands() -> None:
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"cpdoctor.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_commands()


def main() -> None:
    """Console-script entry: BadInput -> one line and exit 2; CannotExamine -> one line and exit 3."""
    try:
        app()
    except BadInput as exc:
        print(f"cpdoctor: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except CannotExamine as exc:
        print(f"cpdoctor: cannot examine: {exc}", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        print("cpdoctor: interrupted", file=sys.stderr)
        sys.exit(130)
