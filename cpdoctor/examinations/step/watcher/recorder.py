"""One open watch's observations of its model (`Recorder`): the events the wrapped entry points tell it (observe.py,
gradient_calls.py), the model outputs its hooks registered (the loss graph's destinations), the gradients between
observed events (a probe of a few elements: whether the step's own code changed them, and by what) and the
gradients the comparison uses (before any clip; as an optimizer stepping inside backward found them)."""

from __future__ import annotations

import enum
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.compat import training
from cpdoctor.examinations.step.watcher.events import DDPReduce, EventLog, FSDPReduce, GradScale, InnerStep, Source, Unobserved
from cpdoctor.examinations.step.watcher.grads import Gradients, gather_grads, unclipped
from cpdoctor.examinations.step.watcher.loss_graph import SCALAR_OPS, read_root
from cpdoctor.launch import watcher_comm


class Capture(enum.Enum):
    """When a watch keeps the gradients as the first clip found them (the comparison is made before clipping)."""

    VALUE_CLIPS = "value_clips"  # one run: a norm clip is divided out by its recorded coefficient, a value clip cannot be
    EVERY_CLIP = "every_clip"  # two runs: both runs are compared as their clips found them


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
            self._probed = next((i for i, p in enumerate(params) if p.grad is not None and local_part(p.grad).numel()), None)
        if self._probed is None or params[self._probed].grad is None:
            return None
        with torch.no_grad():
            return local_part(params[self._probed].grad).reshape(-1)[:PROBE].double().clone()

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

    def optimizer_step(self, optimizer: Any, inside: bool) -> None:
        """An optimizer step begins: the gradients as it finds them, when it updates this model's parameters. Inside
        a backward (`inside`) it steps some parameters whose gradients are complete: those are kept."""
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]
        if not self.covers(params):
            return  # another model's optimizer
        if inside:
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


def local_part(t: Any) -> Any:
    """This rank's part of a tensor (a DTensor's local shard)."""
    local = getattr(t, "to_local", None)
    return local() if callable(local) else t


def listed(parameters: Any) -> list[Any]:
    """The parameters a clip (or a backward's inputs) were given, as a list (a generator is consumed once: the
    original gets the list)."""
    import torch

    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
