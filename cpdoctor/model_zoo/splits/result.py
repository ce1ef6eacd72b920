"""What `cpdoctor plan` measured, as plain data: the split tensors, the heads, the problems and their remedies.

`Plan.to_dict()` is what the `cpdoctor.report.Report` of a plan carries under its own keys (`model`, `settings`,
`tensors`, `skipped`, `heads`, `problems`, `notes`, `seconds`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from cpdoctor.model_zoo.splits.measure import SplitKind


@dataclasses.dataclass
class SplitRow:
    """One tensor diffusers splits (or gathers) for CP, with its measured length."""

    name: str  # "hidden_states", "transformer_blocks.*:encoder_hidden_states_mask", "pos_embed:output[1]"
    module: str  # the `_cp_plan` key ("" is the model itself)
    kind: SplitKind
    split_dim: int
    length: int
    per_rank: float  # length / world; an int when it divides
    divisible: bool
    calls: int  # how many module calls saw this length (wildcard entries hook every block)
    depends_on: list[str] | None = None  # of "resolution", "text", "frames"; None when not measured

    @property
    def gathered(self) -> bool:
        """diffusers gathers this tensor (a ContextParallelOutput) rather than splitting it."""
        return self.kind is SplitKind.GATHER


@dataclasses.dataclass
class SkippedRow:
    """A `_cp_plan` entry diffusers would not split at these settings, and why."""

    name: str
    reason: str


@dataclasses.dataclass
class HeadsCheck:
    """Ulysses scatters heads over its group: query (and key/value) heads must divide by the Ulysses degree."""

    heads: int
    kv_heads: int
    ulysses: int
    divisible: bool
    source: str  # "attention calls" (measured) or "config"


class RemedyKind(str, enum.Enum):
    """What a way out of a problem changes."""

    RESOLUTION = "resolution"
    TEXT_PADDING = "text_padding"
    FRAMES = "frames"
    DEGREES = "degrees"
    ULYSSES_ANYTHING = "ulysses_anything"
    RING_ANYTHING = "ring_anything"

    @property
    def uneven_mode(self) -> bool:
        """diffusers' "anything" modes: uneven lengths, inference only in the releases that have them."""
        return self in (RemedyKind.ULYSSES_ANYTHING, RemedyKind.RING_ANYTHING)


@dataclasses.dataclass
class Remedy:
    kind: RemedyKind
    text: str  # one line for humans
    measured: bool  # True when re-measured with diffusers' forward (or from measured lengths), not predicted
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What was measured for it (the setting it changes, the lengths it gives), as the JSON shows them."""

    def __post_init__(self) -> None:
        self.kind = RemedyKind(self.kind)

    def settings(self) -> dict[str, int] | None:
        """The `cpdoctor plan` settings this remedy changes, or None when it names none (nothing found, or an
        uneven-length mode, which is a config flag rather than a setting)."""
        v = self.values
        if self.kind is RemedyKind.RESOLUTION:
            return {"height": v["height"], "width": v["width"]} if "height" in v else None
        if self.kind is RemedyKind.TEXT_PADDING:
            return {"text_len": v["text_len"]} if "text_len" in v else None
        if self.kind is RemedyKind.FRAMES:
            return {"frames": v["frames"]} if "frames" in v else None
        if self.kind is RemedyKind.DEGREES:
            first = (v.get("options") or [None])[0]
            return None if first is None else {"ring": first["ring"], "ulysses": first["ulysses"]}
        return None

    def line(self) -> str:
        """'resolution: 1328x1344: 6972 -> 3486 per rank', a predicted one marked."""
        return f"{self.kind.value}: {self.text}" + ("" if self.measured else " (predicted)")


@dataclasses.dataclass
class Problem:
    what: str
    tensors: list[str]
    remedies: list[Remedy]


@dataclasses.dataclass
class Plan:
    """Everything one plan measured, before it becomes findings."""

    model: dict[str, Any]
    settings: dict[str, Any]
    tensors: list[SplitRow]
    skipped: list[SkippedRow]
    heads: list[HeadsCheck]
    problems: list[Problem]
    notes: list[str]
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The report's plan-specific keys (typed; the report's serialiser writes them): the report's `plan`
        section (`cpdoctor.report.sections.Section`)."""
        return {
            "model": self.model,
            "settings": self.settings,
            "tensors": self.tensors,
            "skipped": self.skipped,
            "heads": self.heads,
            "problems": self.problems,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
        }
