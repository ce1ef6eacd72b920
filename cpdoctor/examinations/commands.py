"""The `cpdoctor check` command line a finding tells the user to run: the op-level examination's own (a FAIL
names its rerun with or without `--patch`), the model examination's op-level cross-check, the step's advice and
the doctor's rows. One builder, read by every kind that points at the op level, so no kind imports another's
judge for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.request import default_seq
from cpdoctor.vocabulary import DType


@dataclass(frozen=True)
class OpLayout:
    """The fields of an op-level check that another kind names (a model's or a step's layout): what
    `check_command` reads of an attention request, without building one (no validation, no defaults derived)."""

    ring: int
    ulysses: int
    dtype: DType = DType.FP32
    backend: str = "auto"
    mask_pad: int = 0
    seq: int | None = None
    emulate: bool = False
    checkpointing: bool = False

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses


def check_command(req: Any, patch: bool = False) -> str:
    """The exact `cpdoctor check` command that examines this layout."""
    parts = ["cpdoctor check"]
    if req.ring != 1 or req.ulysses == 1:
        parts.append(f"--ring {req.ring}")
    if req.ulysses != 1:
        parts.append(f"--ulysses {req.ulysses}")
    for name, default in (("dtype", "fp32"), ("backend", "auto")):
        if getattr(req, name) != default:
            parts.append(f"--{name} {getattr(req, name)}")
    if getattr(req, "seq", None) not in (None, default_seq(req.world_size)):
        parts.append(f"--seq {req.seq}")
    if req.mask_pad:
        parts.append(f"--mask-pad {req.mask_pad}")
    if getattr(req, "emulate", False):
        parts.append("--emulate")
    if getattr(req, "checkpointing", False):
        parts.append("--checkpointing")
    if patch:
        parts.append("--patch")
    return " ".join(parts)
