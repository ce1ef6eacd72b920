"""The watcher's eyes on what a step does to its gradients: while at least one watch is open, the public entry points
a training step calls are wrapped, and each call becomes a typed event (events.py) in every open watch's
`Recorder`; the originals are back in place when the last watch closes, on every rank, whatever happened.

Wrapped (each call goes on unchanged; the watcher only reads):
- `torch.Tensor.backward`, `torch.autograd.backward`, `torch.autograd.grad` (when its inputs are the watched model's
  parameters): the root's autograd graph (loss_graph.py), before it is freed;
- `GradScaler.scale` / `unscale_` / `step` / `update`: the scale used, inf/NaN found, a skipped optimizer step;
- the norm clip (the module global of torch.nn.utils.clip_grad that every clip_grad_norm_ scales through, and the
  public clip_grads_with_norm_), `clip_grad_value_`, FSDP1's `clip_grad_norm_`: the pre-clip norm and the
  coefficient; with `Capture`, the gradients as the clip found them;
- `torch.distributed` reductions (all_reduce, all_reduce_coalesced, reduce_scatter_tensor, reduce_scatter, reduce):
  op and group, on the watched model's gradients or inside its backward (FSDP2's reduce-scatter);
- `DistributedDataParallel.forward`: the DDP module around the watched model, its group and comm hook;
- accelerate's `Accelerator.backward` (when accelerate is imported): its division by the accumulation steps;
- every optimizer step (torch's global pre-hook): outside a backward, the gradients as it finds them; inside one (an
  optimizer stepped per parameter from a post-accumulate-grad hook), each stepped parameter's gradient before its
  step, which neither ends the watched step nor narrows the comparison.

Every observation runs in a function dynamo never traces (`torch.compiler.disable`) and that never raises into the
step (a failure to read is an `Unobserved` event); the wrappers themselves only forward their arguments, so a
compiled model or step compiles as it would without the watcher."""

from __future__ import annotations

import enum
import functools
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.compat import training
from cpdoctor.examinations.step.watcher.events import (
    AccelerateBackward,
    ClipNorm,
    ClipValue,
    Collective,
    DDPReduce,
    EventLog,
    FSDPReduce,
    GradScale,
    InnerStep,
    Op,
    ScalerScale,
    ScalerStep,
    ScalerUnscale,
    ScalerUpdate,
    Source,
    Unobserved,
)
from cpdoctor.examinations.step.watcher.grads import Gradients, gather_grads, unclipped
from cpdoctor.examinations.step.watcher.loss_graph import SCALAR_OPS, read_root
from cpdoctor.launch import watcher_comm
from cpdoctor.patching import Patches


class Capture(enum.Enum):
    """When a watch keeps the gradients as the first clip found them (the comparison is made before clipping)."""

    VALUE_CLIPS = "value_clips"  # one run: a norm clip is divided out by its recorded coefficient, a value clip cannot be
    EVERY_CLIP = "every_clip"  # two runs: both runs are compared as their clips found them


def _disabled(fn: Callable, default: Any = None) -> Callable:
    """`fn` run eagerly even inside a compiled region (dynamo graph-breaks around it instead of tracing it), and
    never raising into the step: a failure is an `Unobserved` event in every open recorder, and `default` returns."""
    import torch

    @functools.wraps(fn)
    def safe(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - an observation that fails is said in the report, never raised into the step
            for recorder in list(OBSERVING.recorders):
                recorder.failed(getattr(fn, "__name__", "an entry point").lstrip("_").replace("_", " "))
            return default

    return torch.compiler.disable(safe)


@dataclass(eq=False)
class Recorder:
    """One open watch's observations of its model: the events, the model outputs its hooks registered (the loss
    graph's destinations), and the gradients at the first clip when `capture` asks for them."""

    module: Any
    capture: Capture = Capture.VALUE_CLIPS
    on_skip: Callable[[], None] | None = None
    """Called when GradScaler.step skips the optimizer step (the armed watch of preflight re-arms)."""
    log: EventLog = field(default_factory=EventLog)
    outputs: dict[int, int] = field(default_factory=dict)
    """id(grad_fn) of each recorded output -> which forward; `_nodes` keeps the nodes alive so ids stay unique."""
    marks: dict[int, Source] = field(default_factory=dict)
    on_inner_step: Callable[[list[Any]], None] | None = None
    """Called with the parameters an optimizer is about to step inside backward (the watch keeps their weights)."""
    coefficients: dict[int, float] = field(default_factory=dict)
    """Per trainable parameter (its index): the product of the norm clips' coefficients applied to it so far."""
    captured: tuple[Gradients, dict[int, float]] | None = None
    """The gradients as the first clip found them (when `capture` asks for it), and the coefficients applied then."""
    stepped: tuple[Gradients, dict[int, float]] | None = None
    """The gradients as the first optimizer step inside the watch found them (a step that zeroes them after)."""
    inner: dict[int, Any] = field(default_factory=dict)
    """Per parameter an optimizer stepped inside backward: its flat gradient before that step, unclipped."""
    _nodes: list = field(default_factory=list)
    _params: dict[int, int] = field(default_factory=dict)
    _grads: dict[int, int] = field(default_factory=dict)
    _ddp: set[tuple[int, bool]] = field(default_factory=set)
    _probe: Any = None
    """A few elements of one gradient as the last observed event left them (None: nothing to compare with)."""
    _probed: int | None = None
    _since: str = ""

    def __post_init__(self) -> None:
        self._params = {id(p): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad)}

    # -- what the model's hooks tell it --------------------------------------------------------------------------
    def output(self, tensor: Any, forward: int) -> None:
        node = getattr(tensor, "grad_fn", None)
        if node is not None:
            self._nodes.append(node)
            self.outputs[id(node)] = forward

    def mark(self, tensor: Any, source: Source) -> None:
        """The node that made `tensor` is a factor of `source` (GradScaler.scale's multiplication)."""
        node = getattr(tensor, "grad_fn", None)
        if node is not None:
            self._nodes.append(node)
            self.marks[id(node)] = source

    # -- what the wrappers tell it ------------------------------------------------------------------------------
    def backward(self, root: Any, gradient: Any, accelerate: int | None) -> None:
        marks = dict(self.marks)
        if accelerate is not None:  # Accelerator.backward divided the user's loss: those nodes are its own
            node = getattr(root, "grad_fn", None)
            while node is not None and id(node) != accelerate and type(node).__name__ in SCALAR_OPS:
                marks.setdefault(id(node), Source.ACCELERATE)
                node = next((fn for fn, _ in node.next_functions if fn is not None), None)
        self.log.add(read_root(root, self.outputs, frozenset(self._params), marks, gradient))

    def covers(self, params: list[Any]) -> bool:
        return any(id(p) in self._params for p in params)

    def param_of(self, tensor: Any) -> int | None:
        """The index of the trainable parameter whose gradient `tensor` is (None: not one of them)."""
        index = self._grads.get(id(tensor))
        if index is None and self._params:
            self._grads = {
                id(p.grad): i for i, p in enumerate(p for p in self.module.parameters() if p.requires_grad) if p.grad is not None
            }
            index = self._grads.get(id(tensor))
        return index

    # -- the gradients between observed events ---------------------------------------------------------------
    def _sample(self) -> Any:
        """Up to PROBE elements of one gradient (this rank's part of it), float64; None before any gradient."""
        import torch

        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._probed is None:
            self._probed = next((i for i, p in enumerate(params) if p.grad is not None and _local(p.grad).numel()), None)
        if self._probed is None or params[self._probed].grad is None:
            return None
        with torch.no_grad():
            return _local(params[self._probed].grad).reshape(-1)[:PROBE].double().clone()

    def gap(self, now: str) -> None:
        """Before an observed event touches the gradients (or at the block's exit): whether the step's own code
        changed them since the last one, and by what (a uniform factor: a GradScale event)."""
        before, self._probe = self._probe, None
        if before is None:
            return
        after = self._sample()
        if after is None or after.shape != before.shape:
            return
        b2 = float(before.dot(before))
        if b2 == 0 or float(after.dot(after)) == 0:  # nothing to compare, or zeroed (zero_grad): not a scaling
            return
        c = float(after.dot(before)) / b2
        left = float((after - c * before).norm()) / max(float(after.norm()), 1e-300)
        if left > PROBE_UNIFORM:
            self.log.add(
                Unobserved(
                    f"the gradients changed between {self._since} and {now}, not by a uniform factor: a reduction the watcher did not see"
                )
            )
        elif abs(c - 1.0) > 1e-6:
            self.log.add(GradScale(c, f"{self._since} and {now}"))

    def settle(self, after: str) -> None:
        """After an observed event changed the gradients: what they are now (the next `gap` compares with it)."""
        self._probe, self._since = self._sample(), after

    def optimizer_step(self, optimizer: Any, inside: bool | None = None) -> None:
        """An optimizer step begins: the gradients as it finds them, when it updates this model's parameters. Inside
        a backward (None: OBSERVING says) it steps some parameters whose gradients are complete: those are kept."""
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
        if not self.covers(params):
            return  # another model's optimizer
        if OBSERVING.depth > 0 if inside is None else inside:
            self._inner_step(params)
            return
        self.gap("the optimizer step")
        if self.stepped is None:
            self.stepped = (gather_grads(self.module), dict(self.coefficients))

    def _inner_step(self, params: list[Any]) -> None:
        import torch

        fresh = [(self._params[id(p)], p) for p in params if id(p) in self._params and p.grad is not None]
        fresh = [(i, p) for i, p in fresh if i not in self.inner]
        if not fresh:
            return
        if self.on_inner_step is not None:
            self.on_inner_step([p for _, p in fresh])
        with torch.no_grad():
            for i, p in fresh:
                grad = watcher_comm.full_tensor(p.grad.detach()).reshape(-1).to(torch.float32, copy=True)
                self.inner[i] = grad.div_(self.coefficients.get(i, 1.0))
        self.log.add(InnerStep(len(fresh)))

    def as_compared(self) -> Gradients:
        """The gradients the examination compares: before any clip. Captured at the first clip's entry where the
        watch asked for it (two runs; a clip by value); else as the first optimizer step inside the watch found
        them, or now; each parameter's norm clips divided out of it (torch multiplied it by exactly those), and a
        parameter an optimizer stepped inside backward as that step found it."""
        grads, clipped = self.captured or self.stepped or (gather_grads(self.module), self.coefficients)
        return unclipped(grads, clipped, self.inner)

    def clipped(self, params: list[Any], coefficient: float) -> int:
        """A norm clip multiplied these parameters' gradients by `coefficient`: how many of this model's it clipped."""
        mine = [self._params[id(p)] for p in params if id(p) in self._params]
        for i in mine:
            self.coefficients[i] = self.coefficients.get(i, 1.0) * coefficient
        return len(mine)

    def clip_entry(self, params: list[Any], by_value: bool) -> None:
        if self.captured is None and self.covers(params) and (by_value or self.capture is Capture.EVERY_CLIP):
            self.captured = (gather_grads(self.module), dict(self.coefficients))

    def ddp(self, ddp: Any) -> None:
        """DDP around the model, once per DDP module (under `no_sync` micro-batches, once it syncs)."""
        synced = training.ddp_syncs(ddp)
        if (id(ddp), True) in self._ddp or (id(ddp), synced) in self._ddp or not any(m is self.module for m in ddp.module.modules()):
            return
        self._ddp.add((id(ddp), synced))
        hook = training.ddp_comm_hook(ddp)
        ranks = watcher_comm.group_ranks(ddp.process_group)
        self.log.events = [e for e in self.log.events if not (isinstance(e, DDPReduce) and not e.synced and e.ranks == ranks)]
        self.log.add(DDPReduce(ranks, hook, synced))
        if hook is not None and synced:
            self.log.add(Unobserved(f"DDP's comm hook {hook} replaces its averaging over ranks {', '.join(map(str, ranks))}"))

    def fsdp(self) -> None:
        """FSDP2's reductions of the model's gradients, read from its state (once, at the watch's exit)."""
        found = training.fsdp_reductions(self.module)
        if found is None:
            self.log.add(Unobserved("FSDP2's reduction (its groups and divide factor are not readable here)"))
            return
        for reduction in found:
            ranks = tuple(sorted({r for pg in reduction.groups for r in watcher_comm.group_ranks(pg)}))
            self.log.add(FSDPReduce(ranks, reduction.divide_factor or float(len(ranks))))
            break  # one per model: every parameter group reduces over the same mesh

    def failed(self, what: str) -> None:
        self.log.add(Unobserved(f"the watcher could not read {what}: {traceback.format_exc(limit=1).strip().splitlines()[-1]}"))


PROBE = 64
"""Elements of one gradient compared between observed events (a uniform scale shows on any of them)."""
PROBE_UNIFORM = 1e-2
"""Relative residual under which a change of the probed elements is one factor (bf16 rounds a product by 2^-8)."""


def _local(t: Any) -> Any:
    """This rank's part of a tensor (a DTensor's local shard)."""
    local = getattr(t, "to_local", None)
    return local() if callable(local) else t


def _reduce_op(op: Any) -> Op:
    import torch.distributed as dist

    red = dist.ReduceOp
    for member, word in ((red.SUM, Op.SUM), (red.AVG, Op.AVG)):
        if op == member:
            return word
    return Op.PREMUL_SUM if hasattr(red, "PREMUL_SUM") and op == red.PREMUL_SUM else Op.OTHER


COLLECTIVES = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce_scatter_tensor": "input",
    "reduce_scatter": "input_list",
    "reduce": "tensor",
}
"""torch.distributed's reductions, and the argument that holds what they reduce."""


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
        self.clipping = 0
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
    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Callable]) -> None:
        self.patches.wrap(owner, name, make)

    def _restore(self) -> None:
        self.patches.restore()
        self.depth, self.accelerate, self.clipping, self.after = 0, [], 0, []

    def _install(self) -> None:
        import torch
        import torch.distributed as dist

        self._wrap(torch.Tensor, "backward", self._tensor_backward)
        self._wrap(torch.autograd, "backward", self._autograd_backward)
        self._wrap(torch.autograd, "grad", self._autograd_grad)
        for cls in training.scaler_classes():
            self._wrap(cls, "scale", self._then(self._note_scale))
            self._wrap(cls, "unscale_", self._then(self._note_unscale, around="GradScaler.unscale_"))
            self._wrap(cls, "step", self._then(self._note_step))
            self._wrap(cls, "update", self._then(self._note_update))
        clip_grad, scale_name, value_name = training.clip_functions()
        if scale_name is not None:
            scaled = getattr(clip_grad, scale_name)
            self._wrap(clip_grad, scale_name, self._clip_scale)
            if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is scaled:
                self._wrap(torch.nn.utils, "clip_grads_with_norm_", self._clip_scale)
        if value_name is not None:
            for owner in {id(m): m for m in (clip_grad, torch.nn.utils) if callable(getattr(m, value_name, None))}.values():
                self._wrap(owner, value_name, self._clip_value)
        fsdp1 = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
        if fsdp1 is not None and hasattr(fsdp1, "FullyShardedDataParallel"):
            self._wrap(fsdp1.FullyShardedDataParallel, "clip_grad_norm_", self._fsdp1_clip)
        if dist.is_available():
            for name, arg in COLLECTIVES.items():
                if callable(getattr(dist, name, None)):
                    self._wrap(dist, name, functools.partial(self._collective, name, arg))
        ddp = training.ddp_class()
        if ddp is not None:
            self._wrap(ddp, "forward", self._ddp_forward)
        self._hook_steps()
        accelerator = sys.modules.get("accelerate.accelerator")
        if accelerator is not None and hasattr(accelerator, "Accelerator"):
            self._wrap(accelerator.Accelerator, "backward", self._accelerate_backward)

    # -- each wrapper: forward the call unchanged, observe in a disabled function --------------------------------
    def _each(self, what: str, act: Callable[[Recorder], None]) -> None:
        for recorder in list(self.recorders):
            try:
                act(recorder)
            except Exception:  # noqa: BLE001 - an observation that fails is said in the report, never raised into the step
                recorder.failed(what)

    def _tensor_backward(self, original: Callable) -> Callable:
        note = _disabled(self._note_backward)

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            note((tensor,), args[0] if args else kwargs.get("gradient"))
            return self._inside(original, tensor, *args, **kwargs)

        return backward

    def _autograd_backward(self, original: Callable) -> Callable:
        note = _disabled(self._note_backward)

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            gradients = args[0] if args else kwargs.get("grad_tensors")
            note(tensors, gradients)
            return self._inside(original, tensors, *args, **kwargs)

        return backward

    def _autograd_grad(self, original: Callable) -> Callable:
        note = _disabled(self._note_backward)

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
        _disabled(self._probe)("gap", now, tensors)

    def settle(self, after: str, tensors: list[Any] | None = None) -> None:
        _disabled(self._probe)("settle", after, tensors)

    def _probe(self, how: str, what: str, tensors: list[Any] | None) -> None:
        def act(r: Recorder) -> None:
            if tensors is None or any(r.param_of(t) is not None for t in tensors):
                (r.gap if how == "gap" else r.settle)(what)

        self._each("the gradients between events", act)

    def _note_backward(self, tensors: Any, gradients: Any, inputs: Any = None) -> None:
        """A backward root (or `torch.autograd.grad`'s outputs: a root of the recorders whose parameters are among
        its `inputs`)."""
        import torch

        if self.depth or not self.recorders:  # a backward inside a backward (reentrant checkpointing) is not a root
            return
        wanted = None if inputs is None else _listed(inputs.values() if isinstance(inputs, dict) else inputs)
        self._probe("gap", "the next backward", None)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = gradients if isinstance(gradients, (list, tuple)) else [gradients] * len(roots)
        frame = self.accelerate[-1] if self.accelerate else None

        def act(r: Recorder, root: Any, g: Any) -> None:
            if wanted is None or r.covers(wanted):
                r.backward(root, g, frame)

        for root, gradient in zip(roots, grads):
            if isinstance(root, torch.Tensor):
                self._each("the loss's autograd graph", lambda r, root=root, g=gradient: act(r, root, g))

    def _then(self, note: Callable, around: str = "") -> Callable[[Callable], Callable]:
        """A wrapper maker: call the original, then `note(result, *args)` (run eagerly, never raising); with
        `around`, the gradients are compared before it and settled after it (it changes them)."""

        def make(original: Callable) -> Callable:
            observe = _disabled(note)

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

    def _note_scale(self, result: Any, scaler: Any, *_: Any) -> None:
        import torch

        if not self.recorders or not scaler.is_enabled():
            return
        tensors = [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]
        value = float(scaler.get_scale())

        def act(r: Recorder) -> None:
            for t in tensors:
                r.mark(t, Source.SCALER)
            r.log.add(ScalerScale(value))

        self._each("GradScaler.scale", act)

    def _note_unscale(self, _result: Any, scaler: Any, optimizer: Any, *_: Any) -> None:
        if self.recorders and scaler.is_enabled():
            event = ScalerUnscale(float(scaler.get_scale()), training.scaler_found_inf(scaler, optimizer))
            self._each("GradScaler.unscale_", lambda r: r.log.add(event))

    def _note_step(self, _result: Any, scaler: Any, optimizer: Any, *_: Any) -> None:
        if not self.recorders or not scaler.is_enabled():
            return
        skipped = bool(training.scaler_found_inf(scaler, optimizer))

        def act(r: Recorder) -> None:
            r.log.add(ScalerStep(skipped))
            if skipped and r.on_skip is not None:
                r.on_skip()

        self._each("GradScaler.step", act)

    def _note_update(self, _result: Any, scaler: Any, *_: Any) -> None:
        if self.recorders and scaler.is_enabled():
            event = ScalerUpdate(float(scaler.get_scale()))
            self._each("GradScaler.update", lambda r: r.log.add(event))

    def _clip_scale(self, original: Callable) -> Callable:
        """torch's `_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None)`: every norm clip."""
        entry, note = _disabled(self._note_clip_entry), _disabled(self._note_clip_norm)

        def clip(parameters: Any, max_norm: Any, total_norm: Any, *args: Any, **kwargs: Any) -> Any:
            params = _listed(parameters)
            outermost = not self.clipping
            if outermost:
                self.gap("the clip")
            entry(params, False)
            self.clipping += 1
            try:
                result = original(params, max_norm, total_norm, *args, **kwargs)
            finally:
                self.clipping -= 1
            note(params, max_norm, total_norm)
            if outermost:
                self.settle("the clip")
            return result

        return clip

    def _fsdp1_clip(self, original: Callable) -> Callable:
        entry, note = _disabled(self._note_clip_entry), _disabled(self._note_clip_norm)

        def clip(module: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            params = list(module.parameters())
            self.gap("the clip")
            entry(params, False)
            self.clipping += 1
            try:
                total = original(module, max_norm, *args, **kwargs)
            finally:
                self.clipping -= 1
            note(params, max_norm, total)
            self.settle("the clip")
            return total

        return clip

    def _clip_value(self, original: Callable) -> Callable:
        entry, note = _disabled(self._note_clip_entry), _disabled(self._note_clip_value)

        def clip(parameters: Any, clip_value: Any, *args: Any, **kwargs: Any) -> Any:
            params = _listed(parameters)
            self.gap("the clip")
            entry(params, True)
            result = original(params, clip_value, *args, **kwargs)
            note(params, clip_value)
            self.settle("the clip")
            return result

        return clip

    def _note_clip_entry(self, params: list[Any], by_value: bool) -> None:
        if self.clipping == 0:
            self._each("the gradients at the clip", lambda r: r.clip_entry(params, by_value))

    def _note_clip_norm(self, params: list[Any], max_norm: Any, total_norm: Any) -> None:
        if self.clipping or not self.recorders:
            return
        total = float(watcher_comm.full_tensor(total_norm)) if hasattr(total_norm, "detach") else float(total_norm)
        coefficient = min(1.0, float(max_norm) / (total + 1e-6))

        def act(r: Recorder) -> None:
            if r.covers(params):
                r.log.add(ClipNorm(float(max_norm), total, coefficient, params=r.clipped(params, coefficient)))

        self._each("the clip", act)

    def _note_clip_value(self, params: list[Any], clip_value: Any) -> None:
        if self.recorders:
            event = ClipValue(float(clip_value))
            self._each("clip_grad_value_", lambda r: r.log.add(event) if r.covers(params) else None)

    def _collective(self, name: str, arg: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        note = _disabled(self._note_collective, ([], ""))

        def collective(*args: Any, **kwargs: Any) -> Any:
            tensors, label = note(name, arg, signature, args, kwargs)
            if tensors:
                self.gap(label, tensors)
            result = original(*args, **kwargs)
            if tensors:
                self.settle(label, tensors)
            return result

        return collective

    def _note_collective(self, name: str, arg: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[list[Any], str]:
        """Record the reduction in the recorders whose gradients it reduces; the gradients it reduces, when the
        watcher may compare them before and after it (not inside a backward, not asynchronous), and its name."""
        import torch

        if not self.recorders:
            return [], ""
        bound = signature.bind_partial(*args, **kwargs).arguments
        reduced = bound.get(arg)
        tensors = [reduced] if isinstance(reduced, torch.Tensor) else [t for t in (reduced or []) if isinstance(t, torch.Tensor)]
        op = _reduce_op(bound.get("op", signature.parameters["op"].default))
        group = bound.get("group")
        inside = self.depth > 0
        label = f"dist.{name} over ranks {', '.join(map(str, watcher_comm.group_ranks(group)))}" if group is not None else f"dist.{name}"

        def act(r: Recorder) -> None:
            param = next((i for i in (r.param_of(t) for t in tensors) if i is not None), None)
            if param is None and not inside:
                return  # the step's other collectives (metrics, the data): not a reduction of these gradients
            ranks = watcher_comm.group_ranks(group) if group is not None else tuple(range(watcher_comm.world()[1]))
            r.log.add(Collective(name, op, ranks, param is not None, param, inside))

        self._each(f"dist.{name}", act)
        return ([] if inside or bound.get("async_op") else tensors), label

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
            _disabled(self._note_optimizer_step)(optimizer)
        for listener in list(self.step_listeners):
            listener(optimizer, args, kwargs)

    def _note_optimizer_step(self, optimizer: Any) -> None:
        inside = self.depth > 0
        self._each("the gradients at the optimizer step", lambda r: r.optimizer_step(optimizer, inside))

    def _ddp_forward(self, original: Callable) -> Callable:
        note = _disabled(self._note_ddp)

        def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            note(ddp)
            return original(ddp, *args, **kwargs)

        return forward

    def _note_ddp(self, ddp: Any) -> None:
        if self.recorders:
            self._each("the DDP module", lambda r: r.ddp(ddp))

    def _accelerate_backward(self, original: Callable) -> Callable:
        note = _disabled(self._note_accelerate)

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
            self._each("Accelerator.backward", lambda r: r.log.add(event))


def _listed(parameters: Any) -> list[Any]:
    """The parameters a clip (or a backward's inputs) were given, as a list (a generator is consumed once: the
    original gets the list)."""
    import torch

    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


OBSERVING = Observing()
