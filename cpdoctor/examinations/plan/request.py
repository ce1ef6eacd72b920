"""What `cpdoctor plan` is asked: a model and the settings to split it at, validated into a `Setup`."""

from __future__ import annotations

import dataclasses
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.models.catalog import InputBuilder, ResolvedModel, builder_for, full_config, resolve_model


def check_int(name: str, value: Any, minimum: int) -> int:
    """`value` when it is an int (not a bool) of at least `minimum`, else BadInput naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise BadInput(f"{name} must be at least {minimum}, got {value}")
    return value


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


@dataclasses.dataclass(frozen=True)
class Setup:
    """A validated request: the model resolved, its input builder, and every setting filled in."""

    resolved: ResolvedModel
    builder: InputBuilder
    step: int  # the pipeline's resolution multiple
    height: int
    width: int
    text_len: int
    frames: int | None
    ring: int
    ulysses: int

    @property
    def world(self) -> int:
        return self.ring * self.ulysses


def setup(req: PlanRequest) -> Setup:
    """BadInput for unknown models and impossible settings, checked in the order a user fixes them."""
    ring = check_int("ring degree", req.ring, 1)
    ulysses = check_int("ulysses degree", req.ulysses, 1)
    resolved = resolve_model(req.model)
    if ring * ulysses < 2:
        raise BadInput("ring x ulysses must be at least 2 (ring=1, ulysses=1 is no context parallelism)")
    builder = builder_for(resolved.cls)
    step = builder.resolution_multiple(full_config(resolved.cls, resolved.config))
    height = check_int("height", builder.default_height if req.height is None else req.height, step)
    width = check_int("width", builder.default_width if req.width is None else req.width, step)
    text_len = check_int("text length", builder.default_text_len if req.text_len is None else req.text_len, 1)
    frames = req.frames
    if builder.is_video:
        frames = check_int("frames", builder.default_frames if frames is None else frames, 1)
    elif frames is not None:
        raise BadInput(f"{resolved.entry.short_name} is an image model; --frames applies to video models only")
    return Setup(resolved, builder, step, height, width, text_len, frames, ring, ulysses)
