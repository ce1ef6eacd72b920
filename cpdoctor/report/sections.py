"""What an examination adds to its report beside the findings, each under its own top-level JSON key (README):
the upstream fix `--repro` verified (`upstream_fix`), the doctor's summary (`doctor`), the ranks' warnings
(`warnings`), `cpdoctor env`'s backend and peer rows (`backends`, `peers`), a plan's measured split (`model`,
`settings`, `tensors`, ...). Typed here, in the bottom layer, so the CLI reads fields, not text keys; where the
rows are measured by a higher room (a backend row, a peer, a plan), the report holds them as a `Row` /
`Section`: whatever writes its own JSON with `to_dict()`, the room that measured it knowing its type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from cpdoctor.report.verdict import Verdict


class Row(Protocol):
    """One row of a section measured by a higher room (`cpdoctor env`'s backend row, an installed peer): its
    JSON object is `to_dict()`."""

    def to_dict(self) -> dict[str, Any]: ...


class Section(Protocol):
    """A section measured by a higher room that writes several top-level keys (a plan: `model`, `settings`,
    `tensors`, `skipped`, `heads`, `problems`, `notes`, `seconds`): `to_dict()` maps each key to its value."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class UpstreamFixOutcome:
    """What `--repro` made of the upstream fix (JSON `upstream_fix`): verified on a patched copy of diffusers or
    not, the line that says so, and the `fix.diff` written (None when not verified)."""

    verified: bool
    message: str
    diff: str | None


@dataclass(frozen=True)
class Warnings:
    """The warnings the examination raised on the ranks, kept off the terminal (JSON `warnings`: `count`, and
    `messages` mapping each message to how often it was raised)."""

    messages: dict[str, int]

    @classmethod
    def counted(cls, per_outcome: list[dict[str, int]]) -> Warnings | None:
        """The warnings of every case summed per message; None when there were none (no `warnings` key)."""
        counts: dict[str, int] = {}
        for seen in per_outcome:
            for message, n in seen.items():
                counts[message] = counts.get(message, 0) + n
        return cls(counts) if counts else None

    @property
    def count(self) -> int:
        return sum(self.messages.values())

    def to_jsonable(self) -> dict[str, Any]:
        return {"count": self.count, "messages": dict(self.messages)}


@dataclass(frozen=True)
class DoctorRow:
    """One check of the doctor's table: label, the fields the doctor gave its request (as the JSON row shows
    them), why it is there, its verdicts and the command that looks closer."""

    label: str
    fields: dict[str, Any]
    why: str
    verdict: Verdict
    command: str | None
    before: Verdict | None = None


@dataclass(frozen=True)
class DoctorSummary:
    """What the doctor adds to its report (JSON key `doctor`): the accelerators, torchrun's world, the backend
    the ranks chose, the number of launches, the rows, and what did not pass (before the fix, with --patch)."""

    accelerators: int
    torchrun_world: int | None
    backend: str
    """The backend the ranks chose ("auto", as asked for, when no rank got far enough to say)."""
    launches: int
    checks: tuple[DoctorRow, ...]
    not_passed: tuple[str, ...]
    not_passed_before: tuple[str, ...] | None = None
