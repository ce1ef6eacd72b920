"""Shared by the commands: where the report goes (rich table, JSON file or stdout) and the exit code."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import typer

from cpdoctor.errors import BadInput


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Piped into a log or CI, rich would wrap the tables at 80 columns; give them room instead.
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 130)


@contextlib.contextmanager
def waiting(message: str, quiet: bool) -> Iterator[None]:
    """A spinner on stderr while ranks run (nothing when JSON goes to stdout or stderr is not a terminal)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    with console(stderr=True).status(message):
        yield


def check_run_options(timeout: float | None, json_path: str | None) -> None:
    """Bad options caught before any rank starts: a timeout that is not a positive finite number, and a
    --json FILE that cannot be written (found after a long run, it would also hide the run's exit code)."""
    if timeout is not None:
        from cpdoctor.examinations.request import validate_timeout

        validate_timeout(timeout)
    from cpdoctor.launch import is_reporting_rank

    if json_path and json_path != "-" and is_reporting_rank():
        import os

        existed = os.path.exists(json_path)
        try:
            with open(json_path, "a"):
                pass
        except OSError as exc:
            raise BadInput(f"cannot write --json {json_path}: {exc.strerror}") from exc
        if not existed:
            os.remove(json_path)


def emit(report: Any, json_path: str | None, render: Any) -> None:
    """Render the table unless JSON goes to stdout; write JSON where asked; exit with the report's code.
    Under torchrun only rank 0 prints and writes; every rank exits with the same code."""
    from cpdoctor.launch import is_reporting_rank

    if not is_reporting_rank():
        raise typer.Exit(report.exit_code)
    if json_path != "-":
        render(report, console())
    if json_path:
        text = report.to_json()
        if json_path == "-":
            sys.stdout.write(text + "\n")
        else:
            try:
                with open(json_path, "w") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                raise BadInput(f"cannot write --json {json_path}: {exc.strerror}") from exc
    raise typer.Exit(report.exit_code)
