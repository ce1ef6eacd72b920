"""The user's whole CP training step, examined against one process (`cpdoctor.watch_step`, `cpdoctor step`)."""

from __future__ import annotations

from typing import Any


def watch_step(model: Any, *, step: int | None = None, reference: str = "fp64") -> Any:
    """See watch.py: `with watch_step(model) as step: <one training step>`; then `step.report`."""
    from cpdoctor.examinations.step.watch import watch_step as _watch

    return _watch(model, step=step, reference=reference)
