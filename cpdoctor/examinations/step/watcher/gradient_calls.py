"""The calls that change a step's gradients after its backward, each family wrapped by its own class: the gradient
scaler (`ScalerCalls`), the clips (`ClipCalls`) and torch.distributed's reductions (`ReductionCalls`). Each wrapper
forwards the call unchanged and tells every open recorder what it did, through the `Watching` it is given
(observe.py's OBSERVING): the gradients compared before a call that changes them and settled after it, the
observation run in a function dynamo never traces and that never raises into the step."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, Protocol

from cpdoctor.compat import training
from cpdoctor.examinations.step.watcher.events import (
    ClipNorm,
    ClipValue,
    Collective,
    Op,
    ScalerScale,
    ScalerStep,
    ScalerUnscale,
    ScalerUpdate,
    Source,
)
from cpdoctor.examinations.step.watcher.recorder import Recorder, listed
from cpdoctor.launch import watcher_comm


class Watching(Protocol):
    """What a family of wrappers needs of the watcher (observe.Observing)."""

    recorders: list[Recorder]
    depth: int
    """How deep inside a backward this thread is."""

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Callable]) -> None: ...

    def each(self, what: str, act: Callable[[Recorder], None]) -> None: ...

    def disabled(self, fn: Callable, default: Any = None) -> Callable: ...

    def then(self, note: Callable, around: str = "") -> Callable[[Callable], Callable]: ...

    def gap(self, now: str, tensors: list[Any] | None = None) -> None: ...

    def settle(self, after: str, tensors: list[Any] | None = None) -> None: ...


class ScalerCalls:
    """`GradScaler.scale` / `unscale_` / `step` / `update`: the scale used, inf/NaN found, a skipped optimizer step."""

    def __init__(self, watching: Watching) -> None:
        self.w = watching

    def install(self) -> None:
        w = self.w
        for cls in training.scaler_classes():
            w.wrap(cls, "scale", w.then(self._note_scale))
            w.wrap(cls, "unscale_", w.then(self._note_unscale, around="GradScaler.unscale_"))
            w.wrap(cls, "step", w.then(self._note_step))
            w.wrap(cls, "update", w.then(self._note_update))

    def _note_scale(self, result: Any, scaler: Any, *_: Any) -> None:
        import torch

        if not self.w.recorders or not scaler.is_enabled():
            return
        tensors = [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]
        value = float(scaler.get_scale())

        def act(r: Recorder) -> None:
            for t in tensors:
                r.mark(t, Source.SCALER)
            r.log.add(ScalerScale(value))

        self.w.each("GradScaler.scale", act)

    def _note_unscale(self, _result: Any, scaler: Any, optimizer: Any, *_: Any) -> None:
        if self.w.recorders and scaler.is_enabled():
            event = ScalerUnscale(float(scaler.get_scale()), training.scaler_found_inf(scaler, optimizer))
            self.w.each("GradScaler.unscale_", lambda r: r.log.add(event))

    def _note_step(self, _result: Any, scaler: Any, optimizer: Any, *_: Any) -> None:
        if not self.w.recorders or not scaler.is_enabled():
            return
        skipped = bool(training.scaler_found_inf(scaler, optimizer))

        def act(r: Recorder) -> None:
            r.log.add(ScalerStep(skipped))
            if skipped and r.on_skip is not None:
                r.on_skip()

        self.w.each("GradScaler.step", act)

    def _note_update(self, _result: Any, scaler: Any, *_: Any) -> None:
        if self.w.recorders and scaler.is_enabled():
            event = ScalerUpdate(float(scaler.get_scale()))
            self.w.each("GradScaler.update", lambda r: r.log.add(event))


class ClipCalls:
    """The norm clip (the module global of torch.nn.utils.clip_grad that every clip_grad_norm_ scales through, and
    the public clip_grads_with_norm_), `clip_grad_value_`, FSDP1's `clip_grad_norm_`: the pre-clip norm and the
    coefficient each clipped parameter was multiplied by; with `Capture`, the gradients as the clip found them."""

    def __init__(self, watching: Watching) -> None:
        self.w = watching
        self.depth = 0
        """How deep inside a clip this thread is (FSDP1's clip calls torch's: one clip, observed once)."""
        self._entry: Callable[[list[Any], bool], None] = lambda params, by_value: None
        """The gradients as a clip found them, recorded (`install` makes it: `disabled` imports torch)."""

    def install(self) -> None:
        import torch

        w = self.w
        self._entry = w.disabled(self._note_clip_entry)
        clip_grad, scale_name, value_name = training.clip_functions()
        if scale_name is not None:
            scaled = getattr(clip_grad, scale_name)
            w.wrap(clip_grad, scale_name, self._clip_scale)
            if getattr(torch.nn.utils, "clip_grads_with_norm_", None) is scaled:
                w.wrap(torch.nn.utils, "clip_grads_with_norm_", self._clip_scale)
        if value_name is not None:
            for owner in {id(m): m for m in (clip_grad, torch.nn.utils) if callable(getattr(m, value_name, None))}.values():
                w.wrap(owner, value_name, self._clip_value)
        fsdp1 = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
        if fsdp1 is not None and hasattr(fsdp1, "FullyShardedDataParallel"):
            w.wrap(fsdp1.FullyShardedDataParallel, "clip_grad_norm_", self._fsdp1_clip)

    def _clipping(self, params: list[Any], by_value: bool, run: Callable[[], Any], note: Callable[[Any], None]) -> Any:
        """One clip as the watcher sees it: the outermost of nested clips (FSDP1's calls torch's) opens a gap in the
        step, the gradients are taken as the clip found them, `run` clips, `note(result)` records what it did, and
        the gap closes."""
        outermost = not self.depth
        if outermost:
            self.w.gap("the clip")
        self._entry(params, by_value)
        self.depth += 1
        try:
            result = run()
        finally:
            self.depth -= 1
        note(result)
        if outermost:
            self.w.settle("the clip")
        return result

    def _clip_scale(self, original: Callable) -> Callable:
        """torch's `_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None)`: every norm clip."""
        note = self.w.disabled(self._note_clip_norm)

        def clip(parameters: Any, max_norm: Any, total_norm: Any, *args: Any, **kwargs: Any) -> Any:
            params = listed(parameters)
            run = lambda: original(params, max_norm, total_norm, *args, **kwargs)  # noqa: E731
            return self._clipping(params, False, run, lambda _: note(params, max_norm, total_norm))

        return clip

    def _fsdp1_clip(self, original: Callable) -> Callable:
        note = self.w.disabled(self._note_clip_norm)

        def clip(module: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            params = list(module.parameters())
            run = lambda: original(module, max_norm, *args, **kwargs)  # noqa: E731
            return self._clipping(params, False, run, lambda total: note(params, max_norm, total))

        return clip

    def _clip_value(self, original: Callable) -> Callable:
        note = self.w.disabled(self._note_clip_value)

        def clip(parameters: Any, clip_value: Any, *args: Any, **kwargs: Any) -> Any:
            params = listed(parameters)
            run = lambda: original(params, clip_value, *args, **kwargs)  # noqa: E731
            return self._clipping(params, True, run, lambda _: note(params, clip_value))

        return clip

    def _note_clip_entry(self, params: list[Any], by_value: bool) -> None:
        if self.depth == 0:
            self.w.each("the gradients at the clip", lambda r: r.clip_entry(params, by_value))

    def _note_clip_norm(self, params: list[Any], max_norm: Any, total_norm: Any) -> None:
        if self.depth or not self.w.recorders:
            return
        total = float(watcher_comm.full_tensor(total_norm)) if hasattr(total_norm, "detach") else float(total_norm)
        coefficient = min(1.0, float(max_norm) / (total + 1e-6))

        def act(r: Recorder) -> None:
            if r.covers(params):
                r.log.add(ClipNorm(float(max_norm), total, coefficient, params=r.clipped(params, coefficient)))

        self.w.each("the clip", act)

    def _note_clip_value(self, params: list[Any], clip_value: Any) -> None:
        if self.w.recorders:
            event = ClipValue(float(clip_value))
            self.w.each("clip_grad_value_", lambda r: r.log.add(event) if r.covers(params) else None)


COLLECTIVES = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "reduce_scatter_tensor": "input",
    "reduce_scatter": "input_list",
    "reduce": "tensor",
}
"""torch.distributed's reductions, and the argument that holds what they reduce."""


class ReductionCalls:
    """`torch.distributed` reductions (`COLLECTIVES`): op and group, on the watched model's gradients or inside its
    backward (FSDP2's reduce-scatter)."""

    def __init__(self, watching: Watching) -> None:
        self.w = watching

    def install(self) -> None:
        import torch.distributed as dist

        if dist.is_available():
            for name, arg in COLLECTIVES.items():
                if callable(getattr(dist, name, None)):
                    self.w.wrap(dist, name, functools.partial(self._collective, name, arg))

    def _collective(self, name: str, arg: str, original: Callable) -> Callable:
        signature = inspect.signature(original)
        note = self.w.disabled(self._note_collective, ([], ""))

        def collective(*args: Any, **kwargs: Any) -> Any:
            tensors, label = note(name, arg, signature, args, kwargs)
            if tensors:
                self.w.gap(label, tensors)
            result = original(*args, **kwargs)
            if tensors:
                self.w.settle(label, tensors)
            return result

        return collective

    def _note_collective(self, name: str, arg: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[list[Any], str]:
        """Record the reduction in the recorders whose gradients it reduces; the gradients it reduces, when the
        watcher may compare them before and after it (not inside a backward, not asynchronous), and its name."""
        import torch

        if not self.w.recorders:
            return [], ""
        bound = signature.bind_partial(*args, **kwargs).arguments
        reduced = bound.get(arg)
        tensors = [reduced] if isinstance(reduced, torch.Tensor) else [t for t in (reduced or []) if isinstance(t, torch.Tensor)]
        op = _reduce_op(bound.get("op", signature.parameters["op"].default))
        group = bound.get("group")
        inside = self.w.depth > 0
        label = f"dist.{name} over ranks {', '.join(map(str, watcher_comm.group_ranks(group)))}" if group is not None else f"dist.{name}"

        def act(r: Recorder) -> None:
            param = next((i for i in (r.param_of(t) for t in tensors) if i is not None), None)
            if param is None and not inside:
                return  # the step's other collectives (metrics, the data): not a reduction of these gradients
            ranks = watcher_comm.group_ranks(group) if group is not None else tuple(range(watcher_comm.world()[1]))
            r.log.add(Collective(name, op, ranks, param is not None, param, inside))

        self.w.each(f"dist.{name}", act)
        return ([] if inside or bound.get("async_op") else tensors), label


def _reduce_op(op: Any) -> Op:
    import torch.distributed as dist

    red = dist.ReduceOp
    for member, word in ((red.SUM, Op.SUM), (red.AVG, Op.AVG)):
        if op == member:
            return word
    return Op.PREMUL_SUM if hasattr(red, "PREMUL_SUM") and op == red.PREMUL_SUM else Op.OTHER
