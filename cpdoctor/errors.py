"""The ways an examination can refuse to start, shared by the CLI, the API and the probes.

Both carry a one-line message meant for the user verbatim; the CLI maps them to exit codes
(BadInput -> 2, CannotExamine -> 3) and never shows a traceback for them. `Unsupported` is the typed reason of an
UNSUPPORTED finding (something that cannot run here while the rest of a run goes on).
"""

from __future__ import annotations

import dataclasses
import enum


class BadInput(Exception):
    """The request or the install is wrong (degrees, shapes, names, files, a missing required package such as
    diffusers): exit code 2."""


class CannotExamine(Exception):
    """The request is fine but nothing of it can be examined here (e.g. --device cuda without a GPU, a model
    family without an input builder): exit code 3. A backend whose optional package is missing is not this:
    it is an UNSUPPORTED finding (also exit 3 when it is the only one)."""


class UnsupportedKind(enum.Enum):
    """Why an examination cannot run here; each kind has its own remedy (examinations/judging.py)."""

    MISSING_PACKAGE = "missing package"  # the backend's (or peer's) package is not installed
    NOT_REGISTERED = "not registered"  # this diffusers has no such backend
    NOT_CP_CAPABLE = "not CP-capable"  # not registered for context parallelism / ignores the parallel config
    DOES_NOT_RUN = "does not run here"  # no kernel for this device or dtype
    NO_BACKWARD = "no backward"  # runs forward only here, and every examination back-propagates
    NO_LSE = "no LSE"  # ring attention needs one to merge blocks
    REFUSED_BY_RELEASE = "refused by this release"  # the installed code refuses the layout with its own message
    NOT_EXAMINED = "not examined"  # an earlier case of the same launch stopped the job
    PLAN_DOES_NOT_FIT = "plan does not fit the model"  # a _cp_plan entry the model built from this config lacks


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """Why something cannot be examined here: a kind (which decides the remedy) and the message for the user."""

    kind: UnsupportedKind
    message: str


def first_line(exc: BaseException, *, with_type: bool = True, limit: int | None = None) -> str:
    """'TypeName: the first line of its message' (or only the line): how an exception is quoted in a finding or
    a one-line error, whatever the length of its message. `limit` cuts a long line with an ellipsis."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    line = f"{type(exc).__name__}: {text}".rstrip(": ") if with_type else (text or type(exc).__name__)
    return line if limit is None or len(line) <= limit else line[: limit - 1] + "…"
