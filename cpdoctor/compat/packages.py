"""Installed packages' versions, read from their distribution metadata without importing them (so the parent
can say what is installed in milliseconds, and `cpdoctor --help` stays free of torch)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

NOT_INSTALLED = "not installed"

STANDIN_MARK = "+cpdoctor.standin"
"""The local version label of cpdoctor's own stand-in packages (cpu_kernels/flash_attn_standin, `2.6.3+cpdoctor.standin`):
an emulating process puts the stand-in first on sys.path, where importlib finds it as `flash_attn`. A version
that carries this mark is cpdoctor's CPU stand-in, never the installed package."""


def is_standin(version: str) -> bool:
    """Whether `version` (a distribution's, or a module's `__version__`) is one of cpdoctor's stand-ins."""
    return STANDIN_MARK in version


def installed_version(*distributions: str, module: str | None = None) -> str:
    """The version of the first of `distributions` that is installed; "installed (version unknown)" when only
    the importable `module` is found; "not installed" otherwise. cpdoctor's own stand-ins on sys.path are not
    installed packages: a real one behind them is reported, else "not installed (...)" naming the stand-in."""
    standin = None
    for dist in distributions:
        for found in importlib.metadata.distributions(name=dist):
            if not is_standin(found.version):
                return found.version
            standin = found.version
    if standin is not None:
        return f"{NOT_INSTALLED} (cpdoctor's CPU stand-in {standin} is on sys.path)"
    if module is not None and importlib.util.find_spec(module) is not None:
        return "installed (version unknown)"
    return NOT_INSTALLED
