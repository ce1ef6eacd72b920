"""What `cpdoctor plan` is asked: a model and the settings to split it at (validated into a `models.splits.plan.Setup`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from cpdoctor.model_zoo.splits.plan import Setup, setup


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """As given: None means the pipeline's default."""

    model: str
    height: int | None = None
    width: int | None = None
    text_len: int | None = None
    ring: int = 1
    ulysses: int = 1
    frames: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plan", **dataclasses.asdict(self)}

    def setup(self) -> Setup:
        """The validated settings (BadInput for unknown models and impossible settings)."""
        return setup(self.model, self.height, self.width, self.text_len, self.ring, self.ulysses, self.frames)
