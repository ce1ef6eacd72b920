"""`Attempt`: the one way a probe turns an exception into data.

A probe tries something the installed code may not do here (a backend's forward op, diffusers' requirement
check, a single-process baseline) and records what happened: the value, or the exception it raised, as a fact
of the report rather than a crash of cpdoctor. Written once, in the shape of pytest's `CallInfo.from_call`, so
that every such site catches the same thing (`Exception`, never `BaseException`: Ctrl-C and SystemExit go
through), quotes the error the same way (`errors.first_line`) and keeps the traceback text only where a
caller shows it. Code that turns an exception into another exception (BadInput, CannotExamine) or that guards
cleanup is not a probe and keeps its own `try`.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Generic, TypeVar

from cpdoctor.errors import first_line

T = TypeVar("T")
D = TypeVar("D")


@dataclasses.dataclass(frozen=True)
class Attempt(Generic[T]):
    """What one call did: its `value`, or the `error` it raised (then `value` is None), and that error's
    traceback text when `of(..., trace=True)` asked for it."""

    value: T | None = None
    error: Exception | None = None
    trace: str | None = None

    @classmethod
    def of(cls, fn: Callable[[], T], *, trace: bool = False, catching: tuple[type[Exception], ...] = (Exception,)) -> Attempt[T]:
        """Call `fn()` and keep whatever it returned or raised. `trace`: keep the traceback text too (a rank's
        failure shows it; a probe's one-line fact does not need it). `catching`: the exceptions that are facts here
        (a refusal the caller reports, such as BadInput); any other propagates as it would without the attempt."""
        try:
            return cls(fn())
        except catching as exc:  # noqa: BLE001 - the one place a probe's exception, whatever it is, becomes data
            return cls(None, exc, traceback.format_exc() if trace else None)

    @property
    def ok(self) -> bool:
        return self.error is None

    def why(self, *, with_type: bool = True, limit: int | None = None) -> str | None:
        """The error as a finding quotes it (`errors.first_line`), or None when the call returned."""
        return None if self.error is None else first_line(self.error, with_type=with_type, limit=limit)

    def or_else(self, default: D) -> T | D:
        """The value, or `default` when the call raised."""
        return default if self.error is not None else self.value  # type: ignore[return-value]
