"""A finding's verdict and a run's exit code, and how many findings make one run's verdict."""

from __future__ import annotations

import enum


class Verdict(str, enum.Enum):
    """One finding's verdict. A str subclass, so JSON and comparisons with plain strings keep working."""

    PASS = "PASS"
    FAIL = "FAIL"  # silent corruption: wrong numbers, no error
    CRASH = "CRASH"  # a rank raised or died
    HANG = "HANG"  # a rank did not finish within the timeout
    UNSUPPORTED = "UNSUPPORTED"  # cannot run here, with the reason
    WARN = "WARN"  # env: a hazard that does not corrupt by itself (RNG advance, unchecked dispatch)
    INFO = "INFO"  # env: a fact worth knowing

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def style(self) -> str:
        """The rich style a terminal shows this verdict in."""
        return {"PASS": "bold green", "WARN": "bold yellow", "UNSUPPORTED": "bold yellow", "INFO": "bold cyan"}.get(self.value, "bold red")


class ExitCode(enum.IntEnum):
    OK = 0  # nothing wrong
    FOUND = 1  # corruption, crash or hang found
    BAD_INPUT = 2
    CANNOT_EXAMINE = 3  # nothing could be examined here


SEVERITY = (Verdict.CRASH, Verdict.HANG, Verdict.FAIL)
"""Verdicts that make a run fail (exit 1), worst first."""


def overall(verdicts: object) -> tuple[Verdict, ExitCode]:
    """A run's verdict and exit code from its findings (or their verdicts): 1 on any corruption, crash or
    hang; 3 when nothing could be examined; WARN (env hazards) and INFO do not change the exit code."""
    seen = {Verdict(getattr(v, "verdict", v)) for v in verdicts}  # type: ignore[attr-defined]
    for v in SEVERITY:
        if v in seen:
            return v, ExitCode.FOUND
    if seen and seen <= {Verdict.UNSUPPORTED}:
        return Verdict.UNSUPPORTED, ExitCode.CANNOT_EXAMINE
    if Verdict.WARN in seen:
        return Verdict.WARN, ExitCode.OK
    return Verdict.PASS, ExitCode.OK
