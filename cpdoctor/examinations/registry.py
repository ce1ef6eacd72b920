"""Every launched examination by kind. A new examination is one new package and one line here; entries are
imported when first asked for, so `cpdoctor --help` imports neither torch nor diffusers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cpdoctor.errors import BadInput

if TYPE_CHECKING:
    from cpdoctor.examinations.base import Examination

ENTRIES: dict[str, str] = {
    "attention": "cpdoctor.examinations.attention",
    "model": "cpdoctor.examinations.model",
    "fix_training": "cpdoctor.examinations.fix_training",
    "peer": "cpdoctor.examinations.peer",
    "step": "cpdoctor.examinations.step",
}
"""kind -> the package whose `EXAMINATION` is the entry."""


def get(kind: str) -> Examination:
    if kind not in ENTRIES:
        raise BadInput(f"unknown kind of examination {kind!r} (one of {', '.join(suite_kinds())})")
    return importlib.import_module(ENTRIES[kind]).EXAMINATION


def suite_kinds() -> tuple[str, ...]:
    """The kinds a suite or the API may name (internal probes excluded)."""
    return tuple(k for k in ENTRIES if get(k).in_suites)
