"""The request of a peer examination: which implementation, which of its variants and block kernels, causal or
not, its CP degrees, dtype and shape. Validated in the parent with the implementation's own reasons (BadInput,
one line, exit 2) before anything launches; no torch, no peer import (a peer's refusals are read from its
installed source by the adapter)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import default_degrees, require_ints, validate_layout
from cpdoctor.peers import Adapter, Impl, adapter
from cpdoctor.peers.base import Kernel, Variant
from cpdoctor.peers.layouts import Layout

DEFAULT_SEQ = 240
"""Divides by 2·W for W = 1..6 and 8, so the zigzag, stripe and head-tail layouts work at every degree the
targets use without choosing a length (docs/FACTS.md measured the peers at S 240-256)."""


@dataclass(frozen=True)
class PeerRequest:
    """One CP parity examination of a peer implementation's attention, forward and backward."""

    label = "peer-request"

    impl: str = Impl.RING_FLASH_ATTN.value
    variant: str = ""  # "" = the implementation's first
    kernel: str = ""  # "" = the implementation's first
    causal: bool = False
    ring: int = 2
    ulysses: int = 1
    dtype: str = "bf16"
    batch: int = 1
    seq: int = DEFAULT_SEQ
    heads: int = 4
    head_dim: int = 32
    seed: int = 0
    device: str = "auto"
    emulate: bool = False
    """Run on CPU ranks through cpdoctor's kernel stand-ins even where a GPU is present (on a CPU it always does)."""

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    @property
    def implementation(self) -> Impl:
        return Impl.parse(self.impl)

    @property
    def adapter(self) -> Adapter:
        return adapter(self.implementation)

    @property
    def the_variant(self) -> Variant:
        return self.adapter.spec.variant(self.variant)

    @property
    def the_kernel(self) -> Kernel:
        return self.adapter.spec.kernel(self.kernel)

    @property
    def layout(self) -> Layout:
        return self.adapter.layout(self.the_variant, self.causal, self.seq, self.world_size)

    def validate(self) -> PeerRequest:
        require_ints(self, ("ring", "ulysses", "batch", "seq", "heads", "head_dim", "seed"))
        validate_layout(self.ring, self.ulysses, self.dtype, self.device)
        for name in ("batch", "seq", "heads", "head_dim"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("causal", "emulate"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{name} must be true or false, got {getattr(self, name)!r}")
        peer = self.adapter
        reason = peer.refusal(self.the_variant, self.the_kernel, self.causal, self.dtype, self.ring, self.ulysses, self.seq, self.heads)
        if reason:
            raise BadInput(reason)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerRequest:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"unknown {cls.label} keys: {', '.join(sorted(unknown))}")
        return cls(**data)


def build_request(**given: Any) -> PeerRequest:
    """A validated PeerRequest from keyword fields (None = default): the implementation's first variant and
    kernel, ring 2 (1 when only a Ulysses degree is given)."""
    data = default_degrees({k: v for k, v in given.items() if v is not None})
    impl = Impl.parse(str(data.get("impl", PeerRequest.impl)))
    spec = adapter(impl).spec
    data["impl"] = impl.value
    data.setdefault("variant", spec.variants[0].name)
    data.setdefault("kernel", spec.kernels[0].name)
    if not data["variant"]:
        data["variant"] = spec.variants[0].name
    if not data["kernel"]:
        data["kernel"] = spec.kernels[0].name
    return PeerRequest.from_dict(data).validate()
