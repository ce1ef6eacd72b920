"""The watcher's eyes on what a step does to its gradients: while at least one watch is open, the public entry points
a training step calls are wrapped, and each call becomes a typed event (events.py) in every open watch's
`Recorder`; the originals are back in place when the last watch closes, on every rank, whatever happened.

Wrapped (each call goes on unchanged; the watcher only reads):
- `torch.Tensor.backward`, `torch.autograd.backward`, `torch.autograd.grad` (when its inputs are the watched model's
  parameters): the root's autograd graph (loss_graph.py), before it is freed;
- the gradient scaler, the clips and torch.distributed's reductions: gradient_calls.py, one class a family;
- `DistributedDataParallel.forward`: the DDP module around the watched model, its group and comm hook;
- accelerate's `Accelerator.backward` (when accelerate is imported): its division by the accumulation steps;
- every optimizer step (torch's global pre-hook): outside a backward, the gradients as it finds them; inside one (an
  optimizer stepped per parameter from a post-accumulate-grad hook), each stepped parameter's gradient before its
  step, which neither ends the watched step nor narrows the comparison.

Every observation runs in a function dynamo never traces (`torch.compiler.disable`) and that never raises into the
step (a failure to read is an `Unobserved` event); the wrappers themselves only forward their arguments, so a
compiled model or step compiles as it would without the watcher."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from cpdoctor.compat import training
from cpdoctor.examinations.step.watcher.events import AccelerateBackward
from cpdoctor.examinations.step.watcher.gradient_calls import ClipCalls, ReductionCalls, ScalerCalls
from cpdoctor.examinations.step.watcher.recorder import Capture, Recorder, listed
from cpdoctor.patching import Patches

__all__ = ["OBSERVING", "Capture", "Observing", "Recorder"]


class Observing:
    """The entry points wrapped while watches are open. Lifetime: one instance, `OBSERVING`, created at this
    module's import, empty; the first `enter` wraps the entry points (saving each original), every event goes to
    the recorders entered, and the last `leave` puts every original back and empties it (StepWatch leaves in a
    `finally`, so an exception in the step or in cpdoctor never leaves torch wrapped). The one exception is
    torch's global optimizer step pre-hook: registered by the first watch (or listener) and kept for the process,
    doing nothing while no watch is open and no listener waits (see `step_hook`)."""

    def __init__(self) -> None:
        self.recorders: list[Recorder] = []
        self.patches = Patches()
        """The entry points wrapped while a watch is open (patching.py, the mechanism launch/flight.py shares)."""
        self.depth = 0
        """How deep inside a backward this thread is (a backward inside a backward is not a root)."""
        self.accelerate: list[int] = []
        """The user's loss nodes of the Accelerator.backward calls in progress."""
        self.clips = ClipCalls(self)
        self.families = (ScalerCalls(self), self.clips, ReductionCalls(self))
        """The calls that change the gradients after a backward, one wrapper class a family (gradient_calls.py)."""
        self.step_hook: Any = None
        """torch's global optimizer step pre-hook, registered by the first watch and kept for the process: torch
        iterates its hooks while it calls them, so one removed from inside another's call (a watch closed by an
        optimizer step) would break that step. With no watch open and no listener it does nothing."""
        self.step_listeners: list[Callable[[Any, Any, Any], None]] = []
        """Called at every optimizer step after the open watches took their gradients (preflight's armed watch)."""
        self.after: list[Callable[[], None]] = []
        """Called once when the outermost backward running now ends (a step whose optimizer stepped inside it ends there)."""

    def enter(self, recorder: Recorder) -> None:
        if not self.recorders:
            self._install()
        self.recorders.append(recorder)

    def leave(self, recorder: Recorder) -> None:
        if recorder in self.recorders:
            self.recorders.remove(recorder)
        if not self.recorders:
            self._restore()

    # -- the wrapped entry points ----------------------------------------------------------------------------
    def wrap(self, owner: Any, name: str, make: Callable[[Any], Callable]) -> None:
        self.patches.wrap(owner, name, make)

    def _restore(self) -> None:
        self.patches.restore()
        self.depth, self.accelerate, self.clips.depth, self.after = 0, [], 0, []

    def _install(self) -> None:
        import torch

        self.wrap(torch.Tensor, "backward", self._tensor_backward)
        self.wrap(torch.autograd, "backward", self._autograd_backward)
        self.wrap(torch.autograd, "grad", self._autograd_grad)
        for family in self.families:
            family.install()
        ddp = training.ddp_class()
        if ddp is not None:
            self.wrap(ddp, "forward", self._ddp_forward)
        self._hook_steps()
        accelerator = sys.modules.get("accelerate.accelerator")
        if accelerator is not None and hasattr(accelerator, "Accelerator"):
            self.wrap(accelerator.Accelerator, "backward", self._accelerate_backward)

    # -- each wrapper: forward the call unchanged, observe in a disabled function --------------------------------
    def disabled(self, fn: Callable, default: Any = None) -> Callable:
        """`fn` run eagerly even inside a compiled region (dynamo graph-breaks around it instead of tracing it), and
        never raising into the step: a failure is an `Unobserved` event in every open recorder, and `default` returns."""
        import torch

        @functools.wraps(fn)
        def safe(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - an observation that fails is said in the report, never raised into the step
                for recorder in list(self.recorders):
                    recorder.failed(getattr(fn, "__name__", "an entry point").lstrip("_").replace("_", " "))
                return default

        return torch.compiler.disable(safe)

    def each(self, what: str, act: Callable[[Recorder], None]) -> None:
        for recorder in list(self.recorders):
            try:
                act(recorder)
            except Exception:  # noqa: BLE001 - an observation that fails is said in the report, never raised into the step
                recorder.failed(what)

    def _tensor_backward(self, original: Callable) -> Callable:
        note = self.disabled(self._note_backward)

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            note((tensor,), args[0] if args else kwargs.get("gradient"))
            return self._inside(original, tensor, *args, **kwargs)

        return backward

    def _autograd_backward(self, original: Callable) -> Callable:
        note = self.disabled(self._note_backward)

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            gradients = args[0] if args else kwargs.get("grad_tensors")
            note(tensors, gradients)
            return self._inside(original, tensors, *args, **kwargs)

        return backward

    def _autograd_grad(self, original: Callable) -> Callable:
        note = self.disabled(self._note_backward)

        def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            gradients = args[0] if args else kwargs.get("grad_outputs")
            if not isinstance(inputs, (tuple, list, dict)) and not hasattr(inputs, "grad_fn"):
                inputs = tuple(inputs)  # a generator (model.parameters()) is read once: both get the tuple
            note(outputs, gradients, inputs)
            return self._inside(original, outputs, inputs, *args, **kwargs)

        return grad

    def _inside(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        outermost = self.depth == 0
        self.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            self.depth -= 1
            if outermost:
                self.settle("the backward")
                after, self.after = self.after, []
                for fn in after:
                    fn()

    def after_backward(self, fn: Callable[[], None]) -> None:
        """Call `fn` when the outermost backward running now ends (at once when none runs)."""
        if self.depth:
            self.after.append(fn)
        else:
            fn()

    def gap(self, now: str, tensors: list[Any] | None = None) -> None:
        """Before an observed event changes the gradients of the recorders it concerns (`tensors`: those whose
        gradients they are; None: all): what their step's own code did to them since the last event."""
        self.disabled(self._probe)("gap", now, tensors)

    def settle(self, after: str, tensors: list[Any] | None = None) -> None:
        self.disabled(self._probe)("settle", after, tensors)

    def _probe(self, how: str, what: str, tensors: list[Any] | None) -> None:
        def act(r: Recorder) -> None:
            if tensors is None or any(r.param_of(t) is not None for t in tensors):
                (r.gap if how == "gap" else r.settle)(what)

        self.each("the gradients between events", act)

    def _note_backward(self, tensors: Any, gradients: Any, inputs: Any = None) -> None:
        """A backward root (or `torch.autograd.grad`'s outputs: a root of the recorders whose parameters are among
        its `inputs`)."""
        import torch

        if self.depth or not self.recorders:  # a backward inside a backward (reentrant checkpointing) is not a root
            return
        wanted = None if inputs is None else listed(inputs.values() if isinstance(inputs, dict) else inputs)
        self._probe("gap", "the next backward", None)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = gradients if isinstance(gradients, (list, tuple)) else [gradients] * len(roots)
        frame = self.accelerate[-1] if self.accelerate else None

        def act(r: Recorder, root: Any, g: Any) -> None:
            if wanted is None or r.covers(wanted):
                r.backward(root, g, frame)

        for root, gradient in zip(roots, grads):
            if isinstance(root, torch.Tensor):
                self.each("the loss's autograd graph", lambda r, root=root, g=gradient: act(r, root, g))

    def then(self, note: Callable, around: str = "") -> Callable[[Callable], Callable]:
        """A wrapper maker: call the original, then `note(result, *args)` (run eagerly, never raising); with
        `around`, the gradients are compared before it and settled after it (it changes them)."""

        def make(original: Callable) -> Callable:
            observe = self.disabled(note)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if around:
                    self.gap(around)
                result = original(*args, **kwargs)
                observe(result, *args)
                if around:
                    self.settle(around)
                return result

            return wrapper

        return make

    def _hook_steps(self) -> None:
        if self.step_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.step_hook = register_optimizer_step_pre_hook(self._optimizer_step)

    def listen_steps(self, listener: Callable[[Any, Any, Any], None]) -> None:
        """Call `listener(optimizer, args, kwargs)` at every optimizer step until `stop_listening` (its exceptions go
        on into the step: preflight's PreflightFailed stops it on purpose)."""
        self._hook_steps()
        self.step_listeners.append(listener)

    def stop_listening(self, listener: Callable[[Any, Any, Any], None]) -> None:
        if listener in self.step_listeners:
            self.step_listeners.remove(listener)

    def _optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.recorders:
            self.disabled(self._note_optimizer_step)(optimizer)
        for listener in list(self.step_listeners):
            listener(optimizer, args, kwargs)

    def _note_optimizer_step(self, optimizer: Any) -> None:
        inside = self.depth > 0
        self.each("the gradients at the optimizer step", lambda r: r.optimizer_step(optimizer, inside))

    def _ddp_forward(self, original: Callable) -> Callable:
        note = self.disabled(self._note_ddp)

        def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            note(ddp)
            return original(ddp, *args, **kwargs)

        return forward

    def _note_ddp(self, ddp: Any) -> None:
        if self.recorders:
            self.each("the DDP module", lambda r: r.ddp(ddp))

    def _accelerate_backward(self, original: Callable) -> Callable:
        note = self.disabled(self._note_accelerate)

        def backward(accelerator: Any, loss: Any, **kwargs: Any) -> Any:
            note(accelerator)
            self.accelerate.append(id(getattr(loss, "grad_fn", None)))
            try:
                return original(accelerator, loss, **kwargs)
            finally:
                self.accelerate.pop()

        return backward

    def _note_accelerate(self, accelerator: Any) -> None:
        if self.recorders:
            event = AccelerateBackward(int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1))
            self.each("Accelerator.backward", lambda r: r.log.add(event))


OBSERVING = Observing()
