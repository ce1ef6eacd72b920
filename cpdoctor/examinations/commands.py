"""The `cpdoctor check` command line a finding tells the user to run: the op-level examination's own (a FAIL
names its rerun with or without `--patch`), the model examination's op-level cross-check, the step's advice and
the doctor's rows. One builder, read by every kind that points at the op level, so no kind imports another's
judge for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpdoctor.examinations.request import LayoutRequest, default_seq
from cpdoctor.vocabulary import DType

if TYPE_CHECKING:
    from cpdoctor.examinations.attention.request import AttentionRequest


@dataclass(frozen=True)
class OpLayout:
    """The fields of an op-level check that another kind names (a model's or a step's layout): what
    `check_command` reads of an attention request, without building one (no validation, no defaults derived)."""

    ring: int
    ulysses: int
    dtype: DType = LayoutRequest.dtype
    backend: str = LayoutRequest.backend
    mask_pad: int = 0
    seq: int | None = None
    emulate: bool = False
    checkpointing: bool = False

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses


def check_command(req: OpLayout | AttentionRequest, patch: bool = False) -> str:
    """The exact `cpdoctor check` command that examines this layout: the options that differ from the request's
    defaults (`LayoutRequest`'s; the degrees' rule, `default_degrees`: `--ring` unless only `--ulysses` is given)."""
    parts = ["cpdoctor check"]
    if req.ring != 1 or req.ulysses == 1:
        parts.append(f"--ring {req.ring}")
    if req.ulysses != 1:
        parts.append(f"--ulysses {req.ulysses}")
    if req.dtype != LayoutRequest.dtype:
        parts.append(f"--dtype {req.dtype}")
    if req.backend != LayoutRequest.backend:
        parts.append(f"--backend {req.backend}")
    if req.seq not in (None, default_seq(req.world_size)):
        parts.append(f"--seq {req.seq}")
    if req.mask_pad:
        parts.append(f"--mask-pad {req.mask_pad}")
    if req.emulate:
        parts.append("--emulate")
    if req.checkpointing:
        parts.append("--checkpointing")
    if patch:
        parts.append("--patch")
    return " ".join(parts)
