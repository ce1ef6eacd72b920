"""The request of a peer examination: which implementation, which of its variants and block kernels, causal or
not, its CP degrees, dtype and shape. Validated in the parent with the implementation's own reasons (BadInput,
one line, exit 2) before anything launches; no torch, no peer import (a peer's refusals are read from its
installed source by the adapter)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import Unpatched, default_degrees, layout_asked, require_ints, typed_words, validate_layout
from cpdoctor.peer_impls import Adapter, adapter
from cpdoctor.peer_impls.base import KernelSpec, VariantSpec, parse_impl
from cpdoctor.peer_impls.layouts import Layout
from cpdoctor.report.environment import Environment
from cpdoctor.vocabulary import Device, DType, Impl, Kind
from cpdoctor.vocabulary import Kernel as KernelName
from cpdoctor.vocabulary import Variant as VariantName

DEFAULT_SEQ = 240
"""Divides by 2·W for W = 1..6 and 8, so the zigzag, stripe and head-tail layouts work at every degree the
targets use without choosing a length (docs/FACTS.md measured the peers at S 240-256)."""


@dataclass(frozen=True)
class PeerRequest(Unpatched):
    """One CP parity examination of a peer implementation's attention, forward and backward."""

    kind = Kind.PEER  # the examination this request is for (registry.of)

    label = "peer-request"

    impl: Impl = Impl.RING_FLASH_ATTN
    variant: VariantName | None = None  # None = the implementation's first
    kernel: KernelName | None = None  # None = the implementation's first
    causal: bool = False
    ring: int = None  # type: ignore[assignment]  # None: 2, or 1 when only ulysses is given (default_degrees)
    ulysses: int = None  # type: ignore[assignment]  # None: 1
    dtype: DType = DType.BF16
    batch: int = 1
    seq: int = DEFAULT_SEQ
    heads: int = 4
    head_dim: int = 32
    seed: int = 0
    device: Device = Device.AUTO
    emulate: bool = False
    """Run on CPU ranks through cpdoctor's kernel stand-ins even where a GPU is present (on a CPU it always does)."""

    def __post_init__(self) -> None:
        """The words become the vocabulary's members once, here: the implementation (a peer's), its variant and
        kernel (the peer's first when not given; BadInput naming the peer's own when it has none such)."""
        typed_words(self, dtype=(DType, "dtype"), device=(Device, "device"))
        default_degrees(self)
        spec = adapter(parse_impl(self.impl)).spec
        object.__setattr__(self, "impl", spec.impl)
        object.__setattr__(self, "variant", spec.variant(self.variant).name if self.variant else spec.variants[0].name)
        object.__setattr__(self, "kernel", spec.kernel(self.kernel).name if self.kernel else spec.kernels[0].name)

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    def asked(self) -> Environment:
        return layout_asked(self.ring, self.ulysses, self.dtype)

    @property
    def adapter(self) -> Adapter:
        return adapter(self.impl)

    @property
    def the_variant(self) -> VariantSpec:
        return self.adapter.spec.variant(self.variant)

    @property
    def the_kernel(self) -> KernelSpec:
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
        if reason is not None:
            raise BadInput(reason.message)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, **given: Any) -> PeerRequest:
        """The validated request from keyword fields, None meaning the default (validated here, once)."""
        return cls.from_dict({k: v for k, v in given.items() if v is not None}).validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerRequest:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise BadInput(f"unknown {cls.label} keys: {', '.join(sorted(unknown))}")
        return cls(**data)


def build_request(**given: Any) -> PeerRequest:
    """A validated PeerRequest from keyword fields (None = default): `PeerRequest.of`."""
    return PeerRequest.of(**given)
