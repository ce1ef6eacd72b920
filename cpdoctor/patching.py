"""Functions replaced in the modules or classes that own them, and put back: the one mechanism by which cpdoctor
wraps torch's entry points in a running process (the flight record's collectives, launch/flight.py; the step
watcher's training entry points, examinations/step/watcher/observe.py).

Why one mechanism: both wrap some of the same functions (`torch.distributed.all_reduce` is a collective for the
flight record and a reduction for the step watcher), opened and closed at different moments. Put back in reverse
order, and only where our wrapper still sits: a function wrapped again over ours meanwhile keeps that outer
wrapper (whose inner call of ours then passes straight through), so neither owner ever removes the other's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Patches:
    """The functions one owner replaced, in the order it replaced them."""

    def __init__(self) -> None:
        self.installed: list[tuple[Any, str, Any, Any]] = []
        """(owner, name, original, wrapper) per replaced function."""

    def __bool__(self) -> bool:
        return bool(self.installed)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Callable]) -> bool:
        """Replace `owner.name` by `make(original)` (named as the original); nothing where the owner has no such
        function. A class is asked for its own attribute (its `__dict__`: an inherited one is left alone). True when
        replaced."""
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None:
            return False
        self.install(owner, name, original, functools.wraps(original)(make(original)))
        return True

    def install(self, owner: Any, name: str, original: Any, wrapper: Any) -> None:
        """Put `wrapper` where `original` was."""
        self.installed.append((owner, name, original, wrapper))
        setattr(owner, name, wrapper)

    def restore(self) -> None:
        """Every original back, the last replaced first, where our wrapper still sits."""
        while self.installed:
            owner, name, original, wrapper = self.installed.pop()
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if current is wrapper:
                setattr(owner, name, original)
