"""The step examination armed once, at the top of a training script (what `cpdoctor.preflight(..., model=model)`
uses): the watcher is entered now, records the model's next forward and backward, and is closed by the first
`optimizer.step()` of any optimizer (torch's global optimizer step pre-hook), which is where the user's
gradient sync has happened and the weights have not moved yet. `on_report` receives the Report on every rank
before that optimizer step runs, so it can stop the job before it learns from a wrong gradient.

A step the optimizer never takes (GradScaler found inf/NaN, the usual start of fp16 training, and skipped
`optimizer.step()`) is not examined: the watch is dropped at the skip and armed again for the next step, so the
examination is of the first step the optimizer takes.

An optimizer that steps inside backward (per parameter, from post-accumulate-grad hooks) does not close the watch at
its first step: the watch closes when that backward ends, every parameter's gradient taken before its own step, so
the examination stops a wrong job after the first update instead of before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpdoctor.examinations.step.watcher.observe import OBSERVING
from cpdoctor.examinations.step.watcher.watch import StepWatch
from cpdoctor.report import Report


class FirstStep:
    """An armed watch of the next training step the optimizer takes; `report` once its optimizer step has begun."""

    def __init__(
        self, model: Any, on_report: Callable[[Report], None] | None = None, reference: str = "fp64", loss_scale: float | None = None
    ) -> None:
        self.model, self.reference, self.loss_scale = model, reference, loss_scale
        self.on_report = on_report
        self.report: Report | None = None
        self.skipped = 0
        """Steps the optimizer skipped before the one examined (each re-armed the watch)."""
        self.watch = self._arm()
        self._listening = True
        self._deferred = False
        OBSERVING.listen_steps(self._close)  # after the watch's own look at the gradients at that step

    def _arm(self) -> StepWatch:
        watch = StepWatch(self.model, reference=self.reference, loss_scale=self.loss_scale)
        watch.on_skip = self._rearm
        return watch.__enter__()

    def _rearm(self) -> None:
        """The GradScaler skipped this optimizer step: drop what the watch saw and watch the next step."""
        self.watch.discard()
        self.skipped += 1
        self.watch = self._arm()

    def _close(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._listening:
            return
        if OBSERVING.depth:  # an optimizer step inside backward: the step ends with that backward
            if not self._deferred:
                self._deferred = True
                OBSERVING.after_backward(self._finish)
            return
        self._finish()

    def _finish(self) -> None:
        if not self._listening:
            return
        self.cancel()
        self.watch.__exit__(None, None, None)
        self.report = self.watch.report
        if self.on_report is not None and self.report is not None:
            self.on_report(self.report)

    def cancel(self) -> None:
        """Stop waiting for an optimizer step (the watcher's own hooks go at its exit)."""
        if self._listening:
            OBSERVING.stop_listening(self._close)
            self._listening = False


def watch_first_step(
    model: Any, on_report: Callable[[Report], None] | None = None, *, reference: str = "fp64", loss_scale: float | None = None
) -> FirstStep:
    """Arm the step examination on `model`'s next training step the optimizer takes, closed by its optimizer.step()."""
    return FirstStep(model, on_report, reference, loss_scale)
