"""`cpdoctor step train.py:fn --ring R` with a function that takes its degrees: the reference is the user's own
code without CP. cpdoctor runs `fn` twice: first as the same job without CP (dp processes; `cp`, `ring`,
`ulysses` are 1), where every watched block leaves its final gradients on disk, then across dp × cp ranks with
CP, where each CP group's first rank compares its final gradients with the ones of the run without CP that fed
the model the same inputs (baseline.RecordedRun). Loss scaling, clipping, accumulation, adapters, wrappers and
mixed precision are the same code in both runs: whatever is right in one process is right here, and nothing is
read or guessed.

The function receives by name what it declares among `job` (this `StepJob`), `watch_step`, `cp`, `ring`,
`ulysses` and `dp`; a function with a single other parameter gets `watch_step` (the one-run contract)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.runs.request import Role

__all__ = ["DEGREE_NAMES", "PASSED", "RecordingWatch", "Role", "StepJob", "call_arguments", "parameters_of", "takes_degrees"]

DEGREE_NAMES = ("job", "cp", "ring", "ulysses", "dp")
"""Parameters that tell cpdoctor the function builds its model and mesh from the degrees it is given."""
PASSED = (*DEGREE_NAMES, "watch_step")


def parameters_of(path: str, function: str) -> tuple[str, ...]:
    """The parameter names of `function` in `path`, read from its source (the parent never imports the script)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            a = node.args
            return tuple(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs))
    return ()


def takes_degrees(params: tuple[str, ...]) -> bool:
    return any(p in DEGREE_NAMES for p in params)


@dataclass(frozen=True)
class StepJob:
    """What `cpdoctor step` hands the user's function: the degrees of this run and the watcher to use."""

    ring: int
    ulysses: int
    dp: int
    watch_step: Any
    with_cp: bool

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    def __call__(self, model: Any, **options: Any) -> Any:
        """`job(model)` is `job.watch_step(model)`."""
        return self.watch_step(model, **options)


def call_arguments(params: tuple[str, ...], job: StepJob) -> tuple[tuple, dict]:
    """(args, kwargs) for the user's function: what it declares by name; a single undeclared parameter gets the
    watcher (the one-run contract, FUNCTION(watch_step))."""
    named = {"job": job, "watch_step": job.watch_step, "cp": job.cp, "ring": job.ring, "ulysses": job.ulysses, "dp": job.dp}
    kwargs = {p: named[p] for p in params if p in named}
    if not kwargs and len(params) == 1:
        return (job.watch_step,), {}
    return (), kwargs


class RecordingWatch:
    """The watcher of the run without CP: records what the model was fed (every forward's inputs, whole, and the
    gradient that flowed into its output) and the gradients as the step's first clip found them (its final ones when
    it does not clip; FSDP2's gathered whole), written for the run with CP to read, which takes its own the same way
    and judges its inputs against these. It examines nothing and never raises out of the block for its own sake."""

    def __init__(self, model: Any, directory: str, **_: Any) -> None:
        from cpdoctor.examinations.step.watcher.record import unwrap

        self.module = unwrap(model)
        self.directory = directory
        self.report = None

    def __enter__(self) -> RecordingWatch:
        from cpdoctor.examinations.step.watcher.observe import OBSERVING, Capture, Recorder
        from cpdoctor.examinations.step.watcher.record import Hooks

        recorder = Recorder(self.module, Capture.EVERY_CLIP)
        self.adopt(recorder, Hooks(self.module, keep_full=True, snapshot_weights=dict, recorder=recorder))
        self._hooks.install()
        OBSERVING.enter(recorder)
        return self

    def adopt(self, recorder: Any, hooks: Any) -> RecordingWatch:
        """Enter on a step already recorded by `recorder` and `hooks` (`cpdoctor step -- cmd`, at the first optimizer
        step, before the weights move); `__exit__` saves it as any watch."""
        from cpdoctor.examinations.step.judgment.reference import canonical
        from cpdoctor.examinations.step.watcher.record import weights_digest
        from cpdoctor.examinations.step.watcher.watch import WATCHED
        from cpdoctor.launch import watcher_comm

        self.seq = WATCHED.next()
        self.weights = weights_digest(self.module, canonical, watcher_comm.full_tensor)
        self._recorder, self._hooks = recorder, hooks
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        from cpdoctor.examinations.step.judgment.baseline import SavedInputs, save_step
        from cpdoctor.examinations.step.watcher.observe import OBSERVING
        from cpdoctor.examinations.step.watcher.record import compute_dtype
        from cpdoctor.launch import watcher_comm

        try:
            self._hooks.remove()
        finally:
            OBSERVING.leave(self._recorder)
        if exc is not None:
            return False
        grads = self._recorder.as_compared()  # a trainable parameter without a gradient reads as zeros
        rank = watcher_comm.world()[0]
        dtype = compute_dtype(self.module, [c.out_dtype for c in self._hooks.calls])
        prints = [(p.name, p.digest) for p in self._hooks.prints]
        inputs = SavedInputs(self._hooks.inputs(), self._hooks.out_grads())
        save_step(self.directory, rank, self.seq, grads.by_name(), prints, dtype, self.weights, inputs)
        return False
