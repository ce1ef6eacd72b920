"""Requests: what to examine, as plain data. The CLI, the Python API and YAML suites all build these, so
they cannot drift apart. A request validates itself (BadInput with one line) before any process starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from cpdoctor.errors import BadInput

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class AttentionRequest:
    """One op-level CP parity examination of diffusers' dispatch_attention_fn."""

    ring: int = 2
    ulysses: int = 1
    backend: str = "auto"
    dtype: str = "fp32"
    batch: int = 2
    seq: int = 512
    heads: int = 8
    head_dim: int = 64
    seed: int = 0
    mask_pad: int = 0
    device: str = "auto"
    patch: bool = False

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    def validate(self) -> "AttentionRequest":
        for name in ("ring", "ulysses", "batch", "seq", "heads", "head_dim"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.world_size < 2:
            raise BadInput("context parallelism needs ring × ulysses ≥ 2 (got ring 1 × ulysses 1)")
        if self.dtype not in DTYPES:
            raise BadInput(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise BadInput(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.seq % self.world_size:
            lo = self.seq - self.seq % self.world_size
            raise BadInput(
                f"--seq {self.seq} does not divide by ring × ulysses = {self.world_size}: diffusers shards the sequence "
                f"evenly and asserts otherwise; use --seq {lo or self.world_size} or {lo + self.world_size}"
            )
        if self.heads % self.ulysses:
            raise BadInput(f"--heads {self.heads} does not divide by --ulysses {self.ulysses}: Ulysses splits the heads")
        if not 0 <= self.mask_pad < self.seq:
            raise BadInput(f"--mask-pad must be between 0 and seq-1 = {self.seq - 1}, got {self.mask_pad}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "AttentionRequest":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"unknown attention-request keys: {', '.join(sorted(unknown))}")
        return cls(**data)
