"""Peer CP attention implementations examined like diffusers' own: one adapter module per implementation
(ring_flash_attn.py, yunchang.py, torch_cp.py), their token layouts (layouts.py), the shims where gloo or the
CPU differ from NCCL or CUDA (shims.py), and the peers' own source read as text (source.py).

Nothing here imports torch, diffusers or a peer package at import time; `adapter(impl)` imports the one
adapter module asked for (which itself imports torch and the peer only inside `run`).
"""

from __future__ import annotations

import importlib

from cpdoctor.peer_impls.base import Adapter, Impl

MODULES = {
    Impl.RING_FLASH_ATTN: "cpdoctor.peer_impls.ring_flash_attn",
    Impl.YUNCHANG: "cpdoctor.peer_impls.yunchang",
    Impl.TORCH: "cpdoctor.peer_impls.torch_cp",
}


def adapter(impl: Impl) -> Adapter:
    return importlib.import_module(MODULES[impl]).ADAPTER


__all__ = ["Adapter", "Impl", "MODULES", "adapter"]
