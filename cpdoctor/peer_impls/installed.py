"""Which peer CP implementations are installed here and what each offers (`cpdoctor env` lists them, the doctor
adds checks for them): pure functions of the installed metadata, no torch, no peer import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.compat.packages import NOT_INSTALLED, installed_version
from cpdoctor.peer_impls import Impl, adapter
from cpdoctor.report.serialize import to_jsonable


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

    def to_dict(self) -> dict[str, Any]:
        """The row of the report's `peers` (a `cpdoctor.report.sections.Row`): every field."""
        return to_jsonable(self)


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
