"""`Memo`: the one shape of a per-process cache in cpdoctor, so that every cache has an owner with a lifetime.

A module keeps what it computed once (a scan of diffusers' model classes, a model's meta-device survey, the
requirements read from diffusers' source, a peer's process groups) in a module-level `Memo` instead of a bare
dict or `functools.cache`: the memo says what it holds, can be emptied (`clear`), and a test can fill it, empty
it and fill it again. tests/unit/test_house_rules.py allows no other module-level mutable state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Memo(Generic[V]):
    """Values computed once per key and kept. Lifetime: created at its module's import (one per process);
    filled on first use of each key; emptied only by `clear()` (a test, or an owner whose world changed);
    everything it holds survives between uses until then."""

    def __init__(self, holds: str) -> None:
        self.holds = holds
        """What the values are, in words (shown by `repr`, read in a debugger or a failing test)."""
        self._values: dict[Hashable, V] = {}

    def get(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value for `key`, computed by `compute()` the first time (an exception is not kept: the next call
        computes again)."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]

    def clear(self) -> None:
        self._values.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Memo({self.holds!r}, {len(self)} kept)"
