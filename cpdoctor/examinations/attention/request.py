"""The request of an op-level CP examination (`cpdoctor check`): the shared layout plus the attention shape."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import LayoutRequest, default_degrees, require_ints, validate_timeout

__all__ = ["AttentionRequest", "DEFAULT_SEQ", "build_request", "default_seq", "validate_timeout"]

DEFAULT_SEQ = 512


def default_seq(world_size: int) -> int:
    """512 rounded up to a multiple of the CP world size, so `--ring 3` works without choosing a length."""
    return -(-DEFAULT_SEQ // world_size) * world_size


@dataclass(frozen=True)
class AttentionRequest(LayoutRequest):
    """One op-level CP parity examination of diffusers' dispatch_attention_fn."""

    label = "attention-request"

    batch: int = 2
    seq: int = 512
    heads: int = 8
    head_dim: int = 64
    emulate: bool = False
    """Run the CUDA backends' CP code on a CPU through cpdoctor's kernel stand-ins (cpdoctor/kernels/standins.py)."""

    def validate(self) -> AttentionRequest:
        self.validate_common()
        require_ints(self, ("batch", "seq", "heads", "head_dim"))
        for name in ("batch", "seq", "heads", "head_dim"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.seq % self.world_size:
            lo = self.seq - self.seq % self.world_size
            raise BadInput(
                f"--seq {self.seq} does not divide by ring × ulysses = {self.world_size}: diffusers shards the sequence "
                f"evenly and asserts otherwise; use --seq {lo or self.world_size} or {lo + self.world_size}"
            )
        if self.heads % self.ulysses:
            raise BadInput(f"--heads {self.heads} does not divide by --ulysses {self.ulysses}: Ulysses splits the heads")
        if not isinstance(self.emulate, bool):
            raise BadInput(f"emulate must be true or false, got {self.emulate!r}")
        if not 0 <= self.mask_pad < self.seq:
            raise BadInput(f"--mask-pad must be between 0 and seq-1 = {self.seq - 1}, got {self.mask_pad}")
        return self


def build_request(**fields: object) -> AttentionRequest:
    """An AttentionRequest from keyword fields (None = default); seq defaults to 512 rounded up to divide the
    world size, ring to 2 (1 when only a Ulysses degree is given)."""
    fields = default_degrees({k: v for k, v in fields.items() if v is not None})
    if fields.get("seq") is None:
        ring, ulysses = fields["ring"], fields["ulysses"]
        world = ring * ulysses if isinstance(ring, int) and isinstance(ulysses, int) else 1
        fields["seq"] = default_seq(max(1, world))
    return AttentionRequest.from_dict(fields).validate()
