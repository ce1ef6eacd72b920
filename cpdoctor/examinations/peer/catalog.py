"""The doctor's rows for the installed peers (a ring 2 and a ring 3 check per installed peer), without launching
anything; which peers are installed is `peer_impls/installed.py`'s. Pure functions of the installed metadata; no
torch, no peer import."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.examinations.peer.request import PeerRequest, build_request
from cpdoctor.peer_impls import Impl
from cpdoctor.peer_impls.installed import PeerInfo, installed_peers

__all__ = ["PeerRow", "PeerInfo", "doctor_checks", "installed_peers"]


@dataclass(frozen=True)
class PeerRow:
    """A row the doctor adds for an installed peer: its label, what it covers and the request to examine."""

    label: str
    covers: str
    request: PeerRequest


def doctor_checks(rings: tuple[tuple[int, str], ...], device: str = "auto") -> list[PeerRow]:
    """A row per ring degree the doctor checks (`rings`: (degree, what it covers), the doctor's) for each installed
    peer, with its first variant and kernel, causal where the peer's default layout needs it (torch's head-tail load
    balancing), in bf16 (flash-attn's dtypes)."""
    rows = []
    for info in installed_peers():
        if not info.installed:
            continue
        causal = info.impl == Impl.TORCH.value
        for ring, covers in rings:
            request = build_request(impl=info.impl, ring=ring, causal=causal, device=device)
            rows.append(PeerRow(f"{info.impl} ring {ring}", covers, request))
    return rows
