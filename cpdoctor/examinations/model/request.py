"""The request of a model-level CP examination (`cpdoctor model`), as plain data.

Like `AttentionRequest` it validates itself (BadInput, one line) before any process starts. What depends on
the model (a tiny config to build, safetensors to load, a text mask to pad, default shapes, divisibility) is
checked by `cpdoctor.examinations.model.probe.prepare`, which needs diffusers; `validate()` here needs nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from cpdoctor.errors import BadInput
from cpdoctor.examinations.attention.request import require_ints, validate_layout


@dataclass(frozen=True)
class ModelRequest:
    """One model-level CP parity examination: a real diffusers model class through `enable_parallelism`.

    `model` is a short name (flux, qwen-image, wan), a class name or a local checkpoint directory. Shapes left
    None are filled by `prepare` from the model family (small, and divisible by ring x ulysses up to 8)."""

    model: str = "flux"
    ring: int = 2
    ulysses: int = 1
    backend: str = "auto"
    dtype: str = "fp32"
    height: int | None = None
    width: int | None = None
    text_len: int | None = None
    frames: int | None = None
    batch: int = 1
    seed: int = 0
    mask_pad: int = 0
    device: str = "auto"
    patch: bool = False

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    def validate(self) -> "ModelRequest":
        if not isinstance(self.model, str) or not self.model.strip():
            raise BadInput("give a MODEL: a short name (see `cpdoctor plan --list`), a class name or a checkpoint directory")
        validate_layout(self.ring, self.ulysses, self.dtype, self.device)
        require_ints(self, ("batch", "height", "width", "text_len", "frames", "seed", "mask_pad"))
        if self.batch < 1:
            raise BadInput(f"--batch must be at least 1, got {self.batch}")
        for name in ("height", "width", "text_len", "frames"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.mask_pad < 0:
            raise BadInput(f"--mask-pad must be at least 0, got {self.mask_pad}")
        if self.text_len is not None and self.mask_pad >= self.text_len:
            raise BadInput(f"--mask-pad must be between 0 and text-len - 1 = {self.text_len - 1}, got {self.mask_pad}")
        return self

    def with_fields(self, **changes: object) -> "ModelRequest":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelRequest":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"unknown model-request keys: {', '.join(sorted(unknown))}")
        return cls(**data)
