"""What the rest of cpdoctor asks about peers without launching anything: which are installed and what they
offer (for `cpdoctor env`), and the doctor's rows for them (a ring 2 and a ring 3 check per installed peer).
Pure functions of the installed metadata; no torch, no peer import."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.compat.packages import NOT_INSTALLED, installed_version
from cpdoctor.examinations.peer.request import PeerRequest, build_request
from cpdoctor.peer_impls import Impl, adapter


@dataclass(frozen=True)
class PeerInfo:
    """One peer implementation as `cpdoctor env` lists it."""

    impl: str
    distribution: str
    tested_version: str  # the version CI tests (the `peers` extra pins it)
    installed_version: str | None  # None: not installed
    install: str
    variants: tuple[str, ...]
    kernels: tuple[str, ...]
    ulysses: bool
    lse: tuple[str, ...]  # the variants that return an LSE

    @property
    def installed(self) -> bool:
        return self.installed_version is not None


def _version(distribution: str) -> str | None:
    found = installed_version(distribution)
    return None if found == NOT_INSTALLED else found


def installed_peers() -> list[PeerInfo]:
    """Every peer cpdoctor examines, installed or not, with the version found here."""
    rows = []
    for impl in Impl.peers():
        peer = adapter(impl)
        spec = peer.spec
        found = _version(spec.distribution) if peer.installed() else None
        rows.append(
            PeerInfo(
                impl=impl.value,
                distribution=spec.distribution,
                tested_version=spec.version,
                installed_version=found,
                install=spec.install,
                variants=tuple(v.name for v in spec.variants),
                kernels=tuple(k.name for k in spec.kernels),
                ulysses=spec.has_ulysses,
                lse=tuple(v.name for v in spec.variants if v.exposes_lse),
            )
        )
    return rows


@dataclass(frozen=True)
class DoctorRow:
    """A row the doctor adds for an installed peer: its label, what it covers and the request to examine."""

    label: str
    covers: str
    request: PeerRequest


def doctor_checks(device: str = "auto") -> list[DoctorRow]:
    """Ring 2 and ring 3 for each installed peer, with its first variant and kernel, causal where the peer's
    default layout needs it (torch's head-tail load balancing), in bf16 (flash-attn's dtypes)."""
    rows = []
    for info in installed_peers():
        if not info.installed:
            continue
        causal = info.impl == Impl.TORCH.value
        for ring, covers in ((2, "where most jobs start"), (3, "ring ≥ 3: the dK/dV direction")):
            request = build_request(impl=info.impl, ring=ring, causal=causal, device=device)
            rows.append(DoctorRow(f"{info.impl} ring {ring}", covers, request))
    return rows
