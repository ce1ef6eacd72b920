"""The request of an op-level CP examination (`cpdoctor check`): the shared layout plus the attention shape."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import DEFAULT_SEQ, LayoutRequest, default_seq, require_ints, validate_timeout
from cpdoctor.vocabulary import Kind

__all__ = ["AttentionRequest", "DEFAULT_SEQ", "build_request", "default_seq", "validate_timeout"]


@dataclass(frozen=True)
class AttentionRequest(LayoutRequest):
    """One op-level CP parity examination of diffusers' dispatch_attention_fn."""

    kind = Kind.ATTENTION  # the examination this request is for (registry.of)

    label = "attention-request"

    batch: int = 2
    seq: int = None  # type: ignore[assignment]  # None: 512 rounded up to divide ring × ulysses (default_seq)
    heads: int = 8
    head_dim: int = 64
    emulate: bool = False
    """Run the CUDA backends' CP code on a CPU through cpdoctor's kernel stand-ins (cpdoctor/cpu_kernels/standins.py)."""
    checkpointing: bool = False
    """Run the CP forward+backward of diffusers' real dispatch_attention_fn inside torch's non-reentrant activation
    checkpointing (`torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`), as diffusers' own
    `enable_gradient_checkpointing()` does, because that is how every memory-bound trainer runs it and the ring
    backward's contract with it is per release; the full-sequence reference is unchanged."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seq is None:
            world = self.ring * self.ulysses if isinstance(self.ring, int) and isinstance(self.ulysses, int) else 1
            object.__setattr__(self, "seq", default_seq(max(1, world)))

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
        if not isinstance(self.checkpointing, bool):
            raise BadInput(f"checkpointing must be true or false, got {self.checkpointing!r}")
        if not 0 <= self.mask_pad < self.seq:
            raise BadInput(f"--mask-pad must be between 0 and seq-1 = {self.seq - 1}, got {self.mask_pad}")
        return self


def build_request(**fields: object) -> AttentionRequest:
    """A validated AttentionRequest from keyword fields (None = default): `AttentionRequest.of`."""
    return AttentionRequest.of(**fields)
