"""Requests: what to examine, as plain data. The CLI, the Python API and YAML suites all build these, so
they cannot drift apart. A request validates itself (BadInput with one line) before any process starts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from cpdoctor.errors import BadInput

DTYPES = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


def validate_timeout(timeout_s: float) -> None:
    """A positive, finite number of seconds (nan would never expire, inf overflows the process group)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise BadInput(f"--timeout must be a positive, finite number of seconds, got {timeout_s!r}")


def require_ints(obj: object, names: tuple[str, ...]) -> None:
    """Integer fields must be integers (a suite or an API call can pass 2.5 or "2")."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise BadInput(f"--{name.replace('_', '-')} must be an integer, got {value!r}")


def validate_layout(ring: int, ulysses: int, dtype: str, device: str) -> None:
    """The checks every request shares: CP degrees, dtype and device names (BadInput, one line)."""
    for name, value in (("ring", ring), ("ulysses", ulysses)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadInput(f"--{name} must be an integer, got {value!r}")
        if value < 1:
            raise BadInput(f"--{name} must be at least 1, got {value}")
    if ring * ulysses < 2:
        raise BadInput("context parallelism needs ring × ulysses ≥ 2 (got ring 1 × ulysses 1)")
    if dtype not in DTYPES:
        raise BadInput(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device not in DEVICES:
        raise BadInput(f"unknown device {device!r}; choose {', '.join(DEVICES)}")


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
        validate_layout(self.ring, self.ulysses, self.dtype, self.device)
        require_ints(self, ("batch", "seq", "heads", "head_dim", "seed", "mask_pad"))
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
