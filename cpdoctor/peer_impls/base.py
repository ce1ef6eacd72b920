"""What a peer CP implementation declares to cpdoctor, and what one rank of it returns.

A peer is someone else's context-parallel attention (ring-flash-attn, yunchang, PyTorch's context_parallel).
Its adapter (one module each, beside this one) says: the package, the version CI pins and how to install it;
its variants (each with the token layout it shards the sequence by, the causal values it accepts and where
its own code refuses the others, and whether it returns the LSE); its block kernels; the dtypes those
kernels take; which CP degrees it has; and how one rank runs it forward and backward. Nothing here imports
torch (the parent answers "not installed" and "refused" without it) or any peer package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from cpdoctor import vocabulary
from cpdoctor.errors import BadInput, Unsupported, UnsupportedKind
from cpdoctor.peer_impls.layouts import Layout
from cpdoctor.peer_impls.source import SourceLine, package_root
from cpdoctor.vocabulary import DType, Impl

EXTRA = "cpdoctor[peers]"
"""The optional extra that installs every peer at the version CI tests (pyproject.toml)."""


def parse_impl(name: object) -> Impl:
    """The peer implementation named (an `Impl`, or its string from a suite or the API); BadInput for diffusers'
    own (kind "attention", not a peer) and for any other word."""
    for impl in Impl.peers():
        if impl == name:
            return impl
    raise BadInput(f"unknown --impl {name!r} (one of {', '.join(Impl.names())})")


@dataclass(frozen=True)
class VariantSpec:
    """One algorithm of a peer: its token layout, the causal values it accepts (`refuses` is where its own code
    says no to the others), whether it returns the LSE, and whether its inputs are packed varlen."""

    name: vocabulary.Variant
    layout: Layout
    causal: tuple[bool, ...] = (False, True)
    refuses: SourceLine | None = None
    exposes_lse: bool = True
    varlen: bool = False
    no_backward: SourceLine | None = None
    """Where the peer's code raises instead of running this variant's backward (None: it has one)."""
    note: str = ""
    source: str = ""
    """The file of the peer's package (relative to it) that holds this variant's forward and backward."""


@dataclass(frozen=True)
class KernelSpec:
    """A block kernel a peer calls per ring step, the dtypes it takes and the CPU stand-in that replaces it."""

    name: vocabulary.Kernel
    dtypes: tuple[DType, ...]
    standin: str
    refuses_dtype: str = ""
    no_backward: SourceLine | None = None
    """Where the peer's code raises instead of running this kernel's backward (None: it has one)."""
    package: str = ""
    """The package that holds the real kernel when it is not torch's own (flash-attn's `flash_attn`)."""


@dataclass(frozen=True)
class PeerSpec:
    """What an adapter declares."""

    impl: Impl
    distribution: str  # the pip name
    module: str  # the import name
    version: str  # the version CI tests (pinned in pyproject.toml's extra)
    variants: tuple[VariantSpec, ...]
    kernels: tuple[KernelSpec, ...]  # the first is the default
    has_ring: bool = True
    has_ulysses: bool = False
    bundled: bool = False  # ships with torch: always installed
    shards_itself: bool = False  # takes the full tensors and a mesh, and shards them itself (torch's context_parallel)

    @property
    def install(self) -> str:
        if self.bundled:
            return "pip install torch"
        return f"pip install --no-deps {self.distribution}=={self.version}  (or pip install '{EXTRA}')"

    def variant(self, name: object) -> VariantSpec:
        """The variant named (its `vocabulary.Variant`, or the string); BadInput when this peer has none such."""
        for v in self.variants:
            if v.name == name:
                return v
        raise BadInput(f"{self.impl.value} has no variant {name!r} (its variants: {', '.join(v.name for v in self.variants)})")

    def kernel(self, name: object) -> KernelSpec:
        """The block kernel named (its `vocabulary.Kernel`, or the string); BadInput when this peer has none such."""
        for k in self.kernels:
            if k.name == name:
                return k
        raise BadInput(f"{self.impl.value} has no kernel {name!r} (its kernels: {', '.join(k.name for k in self.kernels)})")


@dataclass(frozen=True)
class Shim:
    """Something cpdoctor put between the peer and this machine because gloo or the CPU differ from NCCL or
    CUDA where the peer relies on it (never a change to the peer's code): what, why, and how often it acted."""

    name: str
    what: str
    why: str
    acted: int = 0


@dataclass(frozen=True)
class RunShape:
    """What one rank runs: degrees, this rank, the attention shape."""

    ring: int
    ulysses: int
    rank: int
    causal: bool
    variant: vocabulary.Variant
    kernel: vocabulary.Kernel
    scale: float | None = None

    @property
    def world(self) -> int:
        return self.ring * self.ulysses


@dataclass
class PeerOutputs:
    """This rank's results in its own token order: out, dQ, dK, dV (B, S_local, H, D, or total_local, H, D for
    varlen), the LSE (B, H, S_local) or (H, total_local) where the peer returns it."""

    out: Any
    dq: Any
    dk: Any
    dv: Any
    lse: Any = None
    shims: list[Shim] = field(default_factory=list)

    def cpu(self) -> PeerOutputs:
        """The same results detached on the CPU (what a rank sends to rank 0)."""
        move = lambda x: None if x is None else x.detach().cpu()  # noqa: E731
        return PeerOutputs(move(self.out), move(self.dq), move(self.dk), move(self.dv), move(self.lse), list(self.shims))

    def tensor(self, name: str) -> Any:
        """out, lse, dq, dk or dv by the name the measured rows use."""
        return getattr(self, name)


def refused(message: str) -> Unsupported:
    """A request the peer's own code refuses (an assert, a shape it cannot split): its reason, typed."""
    return Unsupported(UnsupportedKind.REFUSED_BY_RELEASE, message)


class Adapter(ABC):
    """One peer implementation. The parent uses `spec`, `refusal` and `installed`; ranks use `run` and rank 0
    uses `single_process` (the same kernel without CP: the baseline the tolerance is built from)."""

    spec: PeerSpec

    def installed(self) -> bool:
        return self.spec.bundled or package_root(self.spec.module) is not None

    def refusal(
        self, variant: VariantSpec, kernel: KernelSpec, causal: bool, dtype: DType, ring: int, ulysses: int, seq: int, heads: int
    ) -> Unsupported | None:
        """The peer's own reason to refuse this request (None: it accepts it), typed like every other refusal. The
        shared checks; an adapter adds its own (degrees it cannot split) by overriding `degree_refusal`."""
        if causal not in variant.causal:
            where = variant.refuses.read() if variant.refuses is not None else None
            reason = where.text if where is not None else f"{variant.name} accepts causal={variant.causal[0]} only"
            at = f" ({where.location})" if where is not None and where.location else ""
            return refused(f"{self.spec.impl.value} {variant.name} refuses causal={causal}: {reason!r}{at}")
        if dtype not in kernel.dtypes:
            why = kernel.refuses_dtype or "dtypes " + ", ".join(kernel.dtypes)
            return Unsupported(UnsupportedKind.DOES_NOT_RUN, f"{self.spec.impl.value} with kernel {kernel.name} refuses {dtype}: {why}")
        if ulysses > 1 and not self.spec.has_ulysses:
            return refused(f"{self.spec.impl.value} has no Ulysses degree (ring attention only): use --ulysses 1")
        return self.degree_refusal(variant, causal, ring, ulysses, seq, heads)

    def degree_refusal(self, variant: VariantSpec, causal: bool, ring: int, ulysses: int, seq: int, heads: int) -> Unsupported | None:
        """The adapter's own refusal of these degrees and this length (None: it takes them)."""
        return None

    def layout(self, variant: VariantSpec, causal: bool, seq: int, world: int) -> Layout:
        """The token layout the peer shards by for this request (torch's depends on causal and the length)."""
        return variant.layout

    @abstractmethod
    def run(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, mesh: Any = None, extra: Any = None) -> PeerOutputs:
        """On every rank: the peer forward and backward on this rank's shards (already in its layout)."""

    @abstractmethod
    def single_process(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, extra: Any = None) -> PeerOutputs:
        """On rank 0: the same block kernel on the full sequence, without CP."""
