"""cpdoctor: finds and fixes silent context-parallel attention bugs in diffusers.

Public API (imported lazily, so `import cpdoctor` and `cpdoctor --help` stay free of torch/diffusers):
`check_attention`, `check_model`, `preflight`, `patch`, `unpatch`, `patched`.
"""

from __future__ import annotations

from typing import Any

from cpdoctor.version import __version__ as __version__

_LAZY = {
    "check_attention": ("cpdoctor.api", "check_attention"),
    "check_model": ("cpdoctor.api", "check_model"),
    "check_peer": ("cpdoctor.api", "check_peer"),
    "preflight": ("cpdoctor.api", "preflight"),
    "watch_step": ("cpdoctor.api", "watch_step"),
    "PreflightFailed": ("cpdoctor.api", "PreflightFailed"),
    "patch": ("cpdoctor.fix.patch", "apply"),
    "unpatch": ("cpdoctor.fix.patch", "revert"),
    "patched": ("cpdoctor.fix.patch", "patched"),
    "AttentionRequest": ("cpdoctor.examinations.attention.request", "AttentionRequest"),
    "run_suite": ("cpdoctor.api", "run_suite"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'cpdoctor' has no attribute {name!r}")
