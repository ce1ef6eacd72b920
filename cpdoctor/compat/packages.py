"""Installed packages' versions, read from their distribution metadata without importing them (so the parent
can say what is installed in milliseconds, and `cpdoctor --help` stays free of torch)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

NOT_INSTALLED = "not installed"


def installed_version(*distributions: str, module: str | None = None) -> str:
    """The version of the first of `distributions` that is installed; "installed (version unknown)" when only
    the importable `module` is found; "not installed" otherwise."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if module is not None and importlib.util.find_spec(module) is not None:
        return "installed (version unknown)"
    return NOT_INSTALLED
