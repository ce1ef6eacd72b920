"""`cpdoctor step -- <command>` inside every process of the launched job: the first optimizer step, captured through
torch's public global hooks, then the job ends on every rank before the optimizer changes anything.

The startup module (launch/startup/sitecustomize.py) calls `arm(directory)` once torch is imported. Arming
registers three global hooks (torch.nn.modules.module.register_module_forward_pre_hook / register_module_forward_hook,
torch.optim.optimizer.register_optimizer_step_pre_hook) and nothing else; a process that never runs a module with
gradients pays for a counter and a clock read per module call (benchmarks/bench_arming.py).

- The model: every outermost module call (no module forward around it) made with gradients enabled, outside any
  backward (a checkpointed block recomputed there is not one), by a module with trainable parameters, starts a
  candidate: its model (record.unwrap: inside DDP, accelerate's or a trainer's wrapper) gets the watcher's
  `Recorder` (observe.py: backward roots, clips, scaler, reductions, as typed events) and `Hooks` (record.py:
  every forward's inputs whole, its output, the gradient into it), fed from the global forward hook (the one that
  receives keyword arguments). At the first optimizer step the model is the candidate whose parameters hold the
  optimizer's (the most of them); the others are dropped. A step the GradScaler skips drops its candidate: the
  next step is watched afresh, as preflight's armed watch does.
- The gradients are those the step's first clip found (Capture.EVERY_CLIP), else those the optimizer step finds,
  after the sync; FSDP2's DTensors gathered whole; names are the bare model's (reference.canonical).
- Run 1 (without CP) saves what `RecordingWatch` saves in the two-run examination; run 2 (with CP) closes a
  `StepWatch` whose baseline is run 1 on disk (`RecordedRun`): the same judge, the same report.
- Then every rank writes what it found (`Captured`, outcome/<who>.pkl) and leaves through launch/armed.py:
  agreed through the store, exit code 0, `os._exit` (the user's `try/except` cannot swallow it)."""

from __future__ import annotations

import enum
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.runs.request import Role
from cpdoctor.launch import armed, progress

ENTRY = "cpdoctor.examinations.step.runs.capture:arm"
"""What the startup module calls (arm.json names it: launch/ never imports an examination)."""
MAX_CANDIDATES = 4
"""Outermost modules with gradients watched at once before the first optimizer step (one model is the contract)."""


@dataclass(frozen=True)
class ArmSpec:
    """What one run's processes are armed for (DIRECTORY/arm.json, written by the parent)."""

    role: Role
    saved: str
    """Run 1's saved steps: written by run 1, read by run 2."""
    ring: int
    ulysses: int
    dp: int
    timeout_s: float
    emulate: tuple[str, ...] = ()

    def write(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        data = {"entry": ENTRY, "role": self.role.value, "saved": self.saved, "ring": self.ring, "ulysses": self.ulysses,
                "dp": self.dp, "timeout_s": self.timeout_s, "emulate": list(self.emulate)}  # fmt: skip
        with open(os.path.join(directory, "arm.json"), "w") as fh:
            json.dump(data, fh)

    @classmethod
    def read(cls, directory: str) -> ArmSpec:
        with open(os.path.join(directory, "arm.json")) as fh:
            d = json.load(fh)
        return cls(Role(d["role"]), d["saved"], d["ring"], d["ulysses"], d["dp"], float(d["timeout_s"]), tuple(d["emulate"]))


class Ending(str, enum.Enum):
    """How a process's capture ended."""

    SAVED = "saved"  # run 1: the step saved for run 2
    REPORT = "report"  # run 2: the examination's report (the same on every rank)
    NO_MODEL = "no_model"  # the optimizer steps parameters of no module that ran with gradients
    REFUSED = "refused"  # the step cannot be examined as asked (bad input: e.g. no CP enabled in run 2)
    FAILED = "failed"  # cpdoctor's own error while capturing


@dataclass(frozen=True)
class Captured:
    """What one process found at its first optimizer step (pickled for the parent)."""

    who: str
    rank: int
    world: int
    ending: Ending
    message: str = ""
    traceback: str = ""
    report: Any = None
    model: str = ""
    forwards: int = 0


@dataclass
class Candidate:
    """An outermost module that ran with gradients, watched until the first optimizer step says whether it is the model."""

    outer: str
    module: Any
    recorder: Any
    hooks: Any
    rng_before: str
    started: float
    members: frozenset[int] = field(default_factory=frozenset)

    def covered(self, params: list[Any]) -> int:
        mine = {id(p) for p in self.module.parameters()}
        return sum(1 for p in params if id(p) in mine)

    def drop(self) -> None:
        from cpdoctor.examinations.step.watcher.observe import OBSERVING

        try:
            self.hooks.remove()
        finally:
            OBSERVING.leave(self.recorder)


class Capturing:
    """This process's capture. Lifetime: one instance, `CAPTURE`, created at this module's import, disarmed; armed
    once by `arm` (the startup module, when torch is imported in a process of `cpdoctor step -- cmd`): its global
    hooks stay for the process, which ends at its first optimizer step (`end`). `disarm` (a test) removes the
    hooks, drops the candidates and empties it."""

    def __init__(self) -> None:
        self.directory = ""
        self.spec: ArmSpec | None = None
        self.end: Callable[[float], Any] | None = None
        self.handles: list[Any] = []
        self.depth = 0
        self.candidates: list[Candidate] = []
        self.by_module: dict[int, Candidate] = {}
        self.finished = False
        self.outcome: Captured | None = None
        self.on_training: Callable[[], None] | None = None
        """Called at the first candidate (launch/armed.py: a process its launcher gave no RANK keeps its progress)."""

    def arm(self, directory: str, spec: ArmSpec, end: Callable[[float], Any], on_training: Callable[[], None] | None = None) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.directory, self.spec, self.end, self.on_training = directory, spec, end, on_training
        self.handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, with_kwargs=True, always_call=True),
            register_optimizer_step_pre_hook(self._on_step),
        ]

    def disarm(self) -> None:
        from torch.nn.modules import module as nn_module

        for handle in self.handles:
            handle.remove()
            # torch 2.13's handle of a global forward hook registered with_kwargs leaves its id in this table, which
            # keeps every later module call on the hooks' slow path (and torch.compile warning of global hooks)
            getattr(nn_module, "_global_forward_hooks_with_kwargs", {}).pop(handle.id, None)
        for candidate in self.candidates:
            candidate.drop()
        self.__init__()

    # -- the module calls ---------------------------------------------------------------------------------------
    def _pre(self, module: Any, args: tuple) -> None:
        self.depth += 1
        progress.tick()
        if self.depth == 1 and not self.finished and id(module) not in self.by_module:
            try:
                self._consider(module)
            # not a probe: a hook inside the user's forward, which must never raise into it
            except Exception:  # noqa: BLE001 - never raised into the user's forward; said when the step is judged
                progress.advise(f"cpdoctor could not watch {type(module).__name__}: {sys.exc_info()[1]}")

    def _post(self, module: Any, args: tuple, *rest: Any) -> None:
        self.depth = max(0, self.depth - 1)
        candidate = self.by_module.get(id(module))
        if candidate is None or self.finished or len(rest) != 2:  # (kwargs, output); an exception passes (output)
            return
        kwargs, result = rest
        try:
            candidate.hooks.seen(args, kwargs, result)
        except Exception:  # noqa: BLE001 - never raised into the user's forward: said in the report as unread
            candidate.recorder.failed(f"a forward of {type(module).__name__}")

    def _consider(self, module: Any) -> None:
        import torch

        if len(self.candidates) >= MAX_CANDIDATES or any(id(module) in c.members for c in self.candidates):
            return
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        observing = sys.modules.get("cpdoctor.examinations.step.watcher.observe")
        if observing is not None and observing.OBSERVING.depth:  # a forward recomputed inside a backward
            return
        if not any(p.requires_grad for p in module.parameters()):
            return
        self._watch(module)

    def _watch(self, outer: Any) -> None:
        from cpdoctor.examinations.step.watcher.observe import OBSERVING, Capture, Recorder
        from cpdoctor.examinations.step.watcher.record import Hooks, rng_digest, unwrap

        model = unwrap(outer)
        candidate = Candidate(type(outer).__name__, model, None, None, rng_digest(), time.perf_counter())
        candidate.recorder = Recorder(model, Capture.EVERY_CLIP, on_skip=lambda: self._skipped(candidate))
        candidate.hooks = Hooks(model, keep_full=True, snapshot_weights=dict, recorder=candidate.recorder)
        candidate.members = frozenset({id(outer), *(id(m) for m in outer.modules()), *(id(m) for m in model.modules())})
        OBSERVING.enter(candidate.recorder)
        self.candidates.append(candidate)
        self.by_module[id(model)] = candidate
        if self.on_training is not None:
            self.on_training()
        armed.mark("examining")

    def _skipped(self, candidate: Candidate) -> None:
        """The GradScaler skipped the optimizer step: what this candidate saw is not the step examined."""
        if candidate in self.candidates:
            self.candidates.remove(candidate)
            self.by_module.pop(id(candidate.module), None)
            candidate.drop()

    # -- the first optimizer step ------------------------------------------------------------------------------
    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.finished or self.spec is None:
            return
        self.finished = True
        armed.mark("reporting")
        spec = self.spec
        attempt = Attempt.of(lambda: self._capture(optimizer, spec), trace=True)
        outcome = attempt.value
        if outcome is None:
            ending = Ending.REFUSED if isinstance(attempt.error, BadInput) else Ending.FAILED
            message = str(attempt.error) if ending is Ending.REFUSED else attempt.why() or ""
            outcome = self._outcome(ending, message, traceback=attempt.trace or "")
        self.outcome = outcome
        armed.write_outcome(self.directory, outcome.who, outcome)
        assert self.end is not None
        self.end(spec.timeout_s)

    def _capture(self, optimizer: Any, spec: ArmSpec) -> Captured:
        observing = sys.modules.get("cpdoctor.examinations.step.watcher.observe")
        if observing is not None and observing.OBSERVING.depth:  # stepping from a post-accumulate-grad hook
            raise BadInput(
                "the first optimizer step runs inside the backward (an optimizer stepped from a post-accumulate-grad "
                "hook): its parameters change before the step's gradients are complete, so it cannot be captured; "
                "step the optimizer after the backward for the examination"
            )
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
        ranked = sorted(self.candidates, key=lambda c: c.covered(params), reverse=True)
        chosen = ranked[0] if ranked and ranked[0].covered(params) else None
        for candidate in ranked[1:] if chosen is not None else ranked:
            candidate.drop()
        self.candidates = [chosen] if chosen is not None else []
        if chosen is None:
            seen = ", ".join(c.outer for c in ranked) or "none"
            return self._outcome(
                Ending.NO_MODEL,
                f"its first optimizer step ({type(optimizer).__name__}, {len(params)} parameters) updates parameters of no "
                f"module that ran with gradients enabled (outermost modules that did: {seen})",
            )
        chosen.recorder.optimizer_step(optimizer, inside=False)  # the gradients as the optimizer step finds them (no clip before)
        forwards = chosen.hooks.forwards
        if spec.role is Role.WITHOUT_CP:
            from cpdoctor.examinations.step.runs.two_runs import RecordingWatch

            RecordingWatch(chosen.module, spec.saved).adopt(chosen.recorder, chosen.hooks).__exit__(None, None, None)
            return self._outcome(Ending.SAVED, model=type(chosen.module).__name__, forwards=forwards)
        return self._judged(chosen, spec, forwards)

    def _judged(self, chosen: Candidate, spec: ArmSpec, forwards: int) -> Captured:
        from cpdoctor.examinations.step.judgment.baseline import RecordedRun
        from cpdoctor.examinations.step.watcher.watch import StepWatch

        watch = StepWatch(chosen.module, baseline=RecordedRun(spec.saved), ring=spec.ring, ulysses=spec.ulysses, dp=spec.dp,
                          timeout_s=spec.timeout_s)  # fmt: skip
        watch.adopt(chosen.recorder, chosen.hooks, chosen.rng_before, chosen.started)
        watch.__exit__(None, None, None)
        return self._outcome(Ending.REPORT, report=watch.report, model=type(chosen.module).__name__, forwards=forwards)

    def _outcome(self, ending: Ending, message: str = "", **fields: Any) -> Captured:
        rank, world = _rank(), _world()
        return Captured(armed.who(rank), rank if rank is not None else 0, world, ending, message, **fields)


def _rank() -> int | None:
    """This process's rank: the process group's, else its launcher's RANK, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    text = os.environ.get(armed.RANK_VARIABLE, "")
    return int(text) if text.isdigit() else None


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


CAPTURE = Capturing()


def arm(directory: str) -> None:
    """The startup module's entry, once per process, right after torch is imported: arm the capture for the run
    described in DIRECTORY/arm.json; a process its launcher gave a RANK keeps its progress for the parent from now."""
    spec = ArmSpec.read(directory)
    armed.note_armed(directory)
    if armed.RANK_VARIABLE in os.environ:
        armed.keep_progress(directory, armed.who())
    if spec.emulate:
        from cpdoctor.examinations.step.runs.emulation import apply

        apply(spec.emulate)

    def on_training() -> None:  # a process its launcher gave no RANK: known from its first training forward
        if progress.ACTIVE.log is None:
            armed.keep_progress(directory, armed.who(_rank()))

    CAPTURE.arm(directory, spec, armed.leave_together, on_training)
