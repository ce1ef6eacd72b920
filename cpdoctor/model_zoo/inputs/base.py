"""What every input builder shares: the shape it is asked for (`InputShape`), what it returns (`ModelInputs`), what
describes a family's pipeline convention (`InputBuilder`), and two helpers. The builders themselves live in one
module per family (image.py, wan.py, ltx.py, minimax.py); `cpdoctor.model_zoo.inputs` chooses among them.

torch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from cpdoctor.compat.diffusers import cp_plan


@dataclasses.dataclass(frozen=True)
class InputShape:
    """What every input builder is asked for: the resolution, text length and frames a pipeline would be run
    at, the batch, and where and how to make the tensors (on "meta" they cost nothing)."""

    height: int
    width: int
    text_len: int
    frames: int | None = None
    batch: int = 1
    device: Any = "meta"
    dtype: Any = None
    text_mask: bool | None = None
    generator: Any = None

    def fields(self) -> tuple[int, int, int, Any, int, Any, Any, Any]:
        """(height, width, text_len, frames, batch, device, dtype, generator), dtype defaulting to fp32."""
        import torch

        return self.height, self.width, self.text_len, self.frames, self.batch, self.device, self.dtype or torch.float32, self.generator


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """Keyword arguments for `model.forward` plus what the builder made of the request."""

    kwargs: dict[str, Any]
    height: int  # the resolution the inputs correspond to, after the pipeline's rounding
    width: int
    frames: int | None
    text_len: int
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class InputBuilder:
    """How one family's pipeline feeds its transformer.

    `resolution_multiple(config)` is the step the pipeline rounds height and width down to; `frames_step` and
    `frames_offset` describe valid frame counts (frames = step * k + offset) for video models.
    """

    name: str
    build: Callable[..., ModelInputs]
    resolution_multiple: Callable[[Mapping[str, Any]], int]
    default_height: int
    default_width: int
    default_text_len: int
    default_frames: int | None = None
    frames_step: int | None = None
    frames_offset: int = 1
    text_mask_param: str | None = None  # the forward argument that masks text padding, if any
    convention: str = ""  # one line for the docs / report
    pipeline: str = ""  # where the convention is read: the pipeline file and the calls that shape the inputs
    small_frames: int | None = None  # the frames `cpdoctor model` examines by default: the fewest giving 2 latent frames

    @property
    def is_video(self) -> bool:
        return self.default_frames is not None


def rand(shape: tuple[int, ...], device: Any, dtype: Any, generator: Any = None) -> Any:
    import torch

    return torch.randn(shape, device=device, dtype=dtype, generator=generator)


def plan_input_dims(cls: type, name: str, default: int) -> int:
    """The expected_dims the class's own `_cp_plan` declares for input `name` (ids are 2-D in Flux, 3-D in Flux2)."""
    for spec in cp_plan(cls).values():
        if isinstance(spec, dict) and name in spec and getattr(spec[name], "expected_dims", None):
            return int(spec[name].expected_dims)
    return default
