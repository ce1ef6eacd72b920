"""Shared by the commands: where the report goes (rich table, JSON file or stdout) and the exit code."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

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


def _check_writable(option: str, path: str) -> None:
    import os

    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise BadInput(f"cannot write {option} {path}: {exc.strerror}") from exc
    if not existed:
        os.remove(path)


def check_run_options(
    timeout: float | None, json_path: str | None, junit_path: str | None = None, markdown_path: str | None = None
) -> None:
    """Bad options caught before any rank starts: a timeout that is not a positive finite number, and an output
    FILE that cannot be written (found after a long run, it would also hide the run's exit code)."""
    if timeout is not None:
        from cpdoctor.api import validate_timeout

        validate_timeout(timeout)
    from cpdoctor.api import prints_here

    if not prints_here():
        return
    for option, path in (("--json", json_path), ("--junit", junit_path), ("--markdown", markdown_path)):
        if path and path != "-":
            _check_writable(option, path)


def _write(option: str, path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        with open(path, "w") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise BadInput(f"cannot write {option} {path}: {exc.strerror}") from exc


def emit(
    report: Any,
    json_path: str | None,
    render: Any,
    *,
    junit_path: str | None = None,
    markdown_path: str | None = None,
    command: str = "check",
) -> NoReturn:
    """Render the table unless a document goes to stdout; write JSON / JUnit XML / Markdown where asked; exit
    with the report's code (it never returns: every command ends here). Under torchrun only rank 0 prints and writes; every rank exits with the same code."""
    from cpdoctor.api import prints_here

    if not prints_here():
        raise typer.Exit(report.exit_code)
    if "-" not in (json_path, junit_path, markdown_path):
        render(report, console())
    if json_path:
        _write("--json", json_path, report.to_json())
    if junit_path:
        from cpdoctor.report.junit import to_junit

        _write("--junit", junit_path, to_junit(report, command))
    if markdown_path:
        from cpdoctor.report.markdown import to_markdown

        _write("--markdown", markdown_path, to_markdown(report, command))
    raise typer.Exit(report.exit_code)
