"""What `cpdoctor plan` measured, as plain data: the split tensors, the heads, the problems and their remedies.

`Plan.extra()` is what the `cpdoctor.report.Report` of a plan carries under its own keys (`model`, `settings`,
`tensors`, `skipped`, `heads`, `problems`, `notes`, `seconds`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TensorRow:
    """One tensor diffusers splits (or gathers) for CP, with its measured length."""

    name: str  # "hidden_states", "transformer_blocks.*:encoder_hidden_states_mask", "pos_embed:output[1]"
    module: str  # the `_cp_plan` key ("" is the model itself)
    kind: str  # "split" (an input, or an output with split_output=True) or "gather" (ContextParallelOutput)
    split_dim: int
    length: int
    per_rank: float  # length / world; an int when it divides
    divisible: bool
    calls: int  # how many module calls saw this length (wildcard entries hook every block)
    depends_on: list[str] | None = None  # of "resolution", "text", "frames"; None when not measured

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SkippedRow:
    """A `_cp_plan` entry diffusers would not split at these settings, and why."""

    name: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class HeadsCheck:
    """Ulysses scatters heads over its group: query (and key/value) heads must divide by the Ulysses degree."""

    heads: int
    kv_heads: int
    ulysses: int
    divisible: bool
    source: str  # "attention calls" (measured) or "config"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Remedy:
    kind: str  # "resolution", "text_padding", "frames", "degrees", "ulysses_anything", "ring_anything"
    text: str  # one line for humans
    measured: bool  # True when re-measured with diffusers' forward (or from measured lengths), not predicted
    values: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Problem:
    what: str
    tensors: list[str]
    remedies: list[Remedy]

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "tensors": list(self.tensors), "remedies": [r.to_dict() for r in self.remedies]}


@dataclasses.dataclass
class Plan:
    """Everything one plan measured, before it becomes findings."""

    model: dict[str, Any]
    settings: dict[str, Any]
    tensors: list[TensorRow]
    skipped: list[SkippedRow]
    heads: list[HeadsCheck]
    problems: list[Problem]
    notes: list[str]
    seconds: float = 0.0

    def extra(self) -> dict[str, Any]:
        """The report's plan-specific keys, JSON-ready."""
        return {
            "model": dict(self.model),
            "settings": dict(self.settings),
            "tensors": [t.to_dict() for t in self.tensors],
            "skipped": [s.to_dict() for s in self.skipped],
            "heads": [h.to_dict() for h in self.heads],
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
            "seconds": round(self.seconds, 3),
        }
