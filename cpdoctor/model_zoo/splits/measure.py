"""Measuring one meta-device forward: the length of every tensor a model's `_cp_plan` splits or gathers
(shared by `cpdoctor plan`, which reports it, and `cpdoctor model`, which refuses an indivisible layout with it).

It builds the model on the meta device from its config, hooks the modules named in `_cp_plan` exactly where
diffusers' ContextParallelSplitHook / GatherHook sit, and runs the model's own forward on meta tensors (shapes
only). Attention head counts are read from the attention calls of that same forward. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.diffusers import cp_plan, quiet
from cpdoctor.errors import CannotExamine, first_line
from cpdoctor.model_zoo.catalog import build_model
from cpdoctor.model_zoo.inputs import InputBuilder, build_inputs


class SplitKind(str, enum.Enum):
    """What diffusers does with a tensor of the plan: splits it over the ranks, or gathers it back."""

    SPLIT = "split"  # an input (or an output with split_output=True): ContextParallelInput
    GATHER = "gather"  # ContextParallelOutput


@dataclasses.dataclass(frozen=True)
class Key:
    """One split or gathered tensor: the `_cp_plan` module it is hooked at, which input/output, how it is split."""

    module: str
    item: str  # parameter name, "output[i]" or "output"
    kind: SplitKind
    split_dim: int

    @property
    def name(self) -> str:
        return f"{self.module}:{self.item}" if self.module else self.item


@dataclasses.dataclass
class MeasuredSplits:
    """What one meta forward measured at its (pipeline-rounded) settings."""

    lengths: dict[Key, dict[int, int]]  # key -> {length: calls}
    skipped: dict[str, str]  # name -> reason
    heads: set[tuple[int, int]]
    height: int
    width: int
    frames: int | None
    text_len: int

    def signature(self) -> dict[Key, tuple[int, ...]]:
        return {k: tuple(sorted(v)) for k, v in self.lengths.items()}

    def all_divide(self, world: int, keys: set[Key] | None = None) -> bool:
        return all(length % world == 0 for k, seen in self.lengths.items() if keys is None or k in keys for length in seen)


def find_modules(model: Any, module_id: str) -> list[Any]:
    """The modules a `_cp_plan` key names: dotted attribute path, "*" expands a ModuleList (as diffusers does)."""
    import torch

    if module_id == "":
        return [model]
    current = [model]
    for atom in module_id.split("."):
        nxt = []
        for mod in current:
            if atom == "*":
                if not isinstance(mod, torch.nn.ModuleList):
                    raise LookupError(f"'*' in {module_id!r} is not a ModuleList")
                nxt.extend(mod)
            elif hasattr(mod, atom):
                nxt.append(getattr(mod, atom))
            else:
                raise LookupError(f"{module_id!r}: no submodule {atom!r}")
        current = nxt
    return current


def _is_input_spec(obj: Any) -> bool:
    return hasattr(obj, "split_dim")


def _is_output_spec(obj: Any) -> bool:
    return hasattr(obj, "gather_dim")


def display_modules(plan: Mapping[str, Any]) -> dict[str, str]:
    """Plan keys as rows name them. A plan that lists every block by number (Helios: blocks.0.attn1 ...
    blocks.39.attn1) gets one row for all of them, "blocks.{0..39}.attn1", so that a one-block copy of the
    model measures under the same names; a lone numbered key (Qwen-Image's transformer_blocks.0) stays."""
    import re

    number = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")
    groups: dict[str, list[str]] = {}
    for module_id in plan:
        groups.setdefault(number.sub("#", module_id, count=1), []).append(module_id)
    out = {}
    for pattern, ids in groups.items():
        if len(ids) == 1 or "#" not in pattern:
            out.update({i: i for i in ids})
            continue
        nums = [int(number.search(i).group()) for i in ids]
        merged = pattern.replace("#", f"{{{min(nums)}..{max(nums)}}}", 1)
        out.update({i: merged for i in ids})
    return out


class SplitRecorder:
    """Forward (pre-)hooks at the places diffusers' ContextParallelSplitHook / GatherHook sit."""

    def __init__(self, model: Any, plan: Mapping[str, Any]):
        self.lengths: dict[Key, dict[int, int]] = {}
        self.skipped: dict[str, str] = {}
        self.handles: list[Any] = []
        display = display_modules(plan)
        for module_id, spec in plan.items():
            found = Attempt.of(lambda m=module_id: find_modules(model, m), catching=(LookupError,))
            if found.value is None:
                self.skipped[module_id or "<model>"] = f"module not found ({found.error})"
                continue
            for mod in found.value:
                self._attach(mod, display[module_id], spec)

    def _note(self, key: Key, tensor: Any, spec: Any) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            return
        expected = getattr(spec, "expected_dims", None)
        if expected is not None and tensor.dim() != expected:
            self.skipped[key.name] = f"has {tensor.dim()} dims, the plan expects {expected}: diffusers leaves it unsplit"
            return
        dim = key.split_dim if key.split_dim >= 0 else tensor.dim() + key.split_dim
        length = int(tensor.shape[dim])
        seen = self.lengths.setdefault(key, {})
        seen[length] = seen.get(length, 0) + 1

    def _attach(self, mod: Any, module_id: str, spec: Any) -> None:
        if not isinstance(spec, dict):
            self._attach_gather(mod, module_id, list(spec) if isinstance(spec, (list, tuple)) else [spec])
            return
        by_name = {k: v for k, v in spec.items() if not (_is_input_spec(v) and v.split_output)}
        by_index = {k: v for k, v in spec.items() if _is_input_spec(v) and v.split_output}
        if by_name:
            self._attach_inputs(mod, module_id, by_name)
        if by_index:
            self._attach_split_outputs(mod, module_id, by_index)

    def _note_input(self, module_id: str, name: str, value: Any, cpi: Any) -> None:
        """One named input: None is 'not passed'; a list/tuple input has one spec per item."""
        if value is None:
            self.skipped.setdefault(Key(module_id, name, SplitKind.SPLIT, 0).name, "not passed (None)")
        elif isinstance(value, (list, tuple)):
            for i, (v, c) in enumerate(zip(value, cpi, strict=False)):
                if not c.split_output:
                    self._note(Key(module_id, f"{name}[{i}]", SplitKind.SPLIT, c.split_dim), v, c)
        else:
            self._note(Key(module_id, name, SplitKind.SPLIT, cpi.split_dim), value, cpi)

    def _attach_inputs(self, mod: Any, module_id: str, by_name: dict) -> None:
        """A pre-hook that reads the named inputs, positional or keyword (or in **kwargs), as diffusers does."""
        sig = inspect.signature(type(mod).forward)
        varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

        def pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
            try:
                bound = sig.bind_partial(module, *args, **kwargs).arguments
            except TypeError:
                return
            extra = bound.get(varkw, {}) if varkw else {}
            for name, cpi in by_name.items():
                self._note_input(module_id, name, bound.get(name, extra.get(name)), cpi)

        self.handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def _attach_split_outputs(self, mod: Any, module_id: str, by_index: dict) -> None:
        """A hook on the outputs the plan splits (split_output=True), by index."""

        def out_hook(module: Any, args: tuple, output: Any) -> None:
            outs = list(output) if isinstance(output, (list, tuple)) else [output]
            for index, cpi in by_index.items():
                if isinstance(index, int) and index < len(outs):
                    self._note(Key(module_id, f"output[{index}]", SplitKind.SPLIT, cpi.split_dim), outs[index], cpi)

        self.handles.append(mod.register_forward_hook(out_hook))

    def _attach_gather(self, mod: Any, module_id: str, specs: list) -> None:
        """A hook on the outputs the plan gathers (ContextParallelOutput)."""

        def gather_hook(module: Any, args: tuple, output: Any) -> None:
            outs = list(output) if isinstance(output, (list, tuple)) else [output]
            for i, cpo in enumerate(specs):
                if cpo is None or i >= len(outs) or not _is_output_spec(cpo):
                    continue
                item = "output" if len(specs) == 1 else f"output[{i}]"
                self._note(Key(module_id, item, SplitKind.GATHER, cpo.gather_dim), outs[i], cpo)

        self.handles.append(mod.register_forward_hook(gather_hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def attention_spy(dims: set[tuple[int, int]] | None = None) -> Iterator[set[tuple[int, int]]]:
    """Records (query heads, key heads) of every scaled_dot_product_attention call (layout B, H, S, D), and into
    `dims`, when given, (query/key head dim, value head dim): a rope table broadcast over a too small head dim
    widens the queries and keys but not the values (a tiny config's trial refuses that)."""
    import torch
    from torch.overrides import TorchFunctionMode

    heads: set[tuple[int, int]] = set()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    class _Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func is sdpa:
                q = args[0] if args else kwargs.get("query")
                k = args[1] if len(args) > 1 else kwargs.get("key")
                v = args[2] if len(args) > 2 else kwargs.get("value")
                if q is not None and k is not None and q.dim() >= 3:
                    heads.add((int(q.shape[-3]), int(k.shape[-3])))
                    if dims is not None and v is not None:
                        dims.add((int(max(q.shape[-1], k.shape[-1])), int(v.shape[-1])))
            return func(*args, **kwargs)

    with _Spy():
        yield heads


@contextlib.contextmanager
def meta_safe() -> Iterator[None]:
    """Make a meta-device forward run where diffusers asks for things meta cannot give, and keep it quiet:
    `torch.autocast(device_type="meta")` (Helios) becomes a disabled CPU autocast; diffusers' logger and
    Python warnings (deprecated id shapes, plan dims) are silenced for the duration."""
    import torch

    original = torch.autocast

    class _Autocast(original):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            if device_type == "meta":
                super().__init__("cpu", enabled=False)
            else:
                super().__init__(device_type, *args, **kwargs)

    torch.autocast = _Autocast
    try:
        with quiet():
            yield
    finally:
        torch.autocast = original


class Measurer:
    """Runs the model's forward on meta tensors at given settings and returns the split lengths."""

    def __init__(self, cls: type, config: Mapping[str, Any], builder: InputBuilder):
        self.cls = cls
        self.config = dict(config)
        self.builder = builder
        self.model = build_model(cls, self.config, device="meta")
        self.full_config = dict(self.model.config)
        self.plan = cp_plan(cls)
        self.runs = 0
        self.shallow = False

    def measure(self, height: int, width: int, text_len: int, frames: int | None, text_mask: bool = False) -> MeasuredSplits:
        import torch

        inputs = build_inputs(self.cls, self.full_config, height, width, text_len, frames, device="meta", text_mask=text_mask)
        recorder = SplitRecorder(self.model, self.plan)
        self.runs += 1
        try:
            with torch.no_grad(), attention_spy() as heads:
                self.model(**inputs.kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means we cannot measure this model here
            raise CannotExamine(
                f"{self.cls.__name__}'s forward failed on the meta device at {inputs.height}x{inputs.width}"
                f"{'' if inputs.frames is None else f', {inputs.frames} frames'}, text {text_len}: "
                f"{first_line(exc, limit=300)}"
            ) from exc
        finally:
            recorder.remove()
        return MeasuredSplits(recorder.lengths, recorder.skipped, heads, inputs.height, inputs.width, inputs.frames, inputs.text_len)

    def make_shallow(self, reference: MeasuredSplits, text_mask: bool) -> bool:
        """Keep one block of every top-level block stack; keep that only if it measures exactly like the full model."""
        import torch

        saved = {}
        for name, child in list(self.model.named_children()):
            if isinstance(child, torch.nn.ModuleList) and len(child) > 1:
                saved[name] = child
                setattr(self.model, name, torch.nn.ModuleList([child[0]]))
        if not saved:
            return False
        try:
            check = self.measure(reference.height, reference.width, reference.text_len, reference.frames, text_mask)
            ok = check.signature() == reference.signature() and check.heads == reference.heads
        except CannotExamine:
            ok = False
        if not ok:
            for name, child in saved.items():
                setattr(self.model, name, child)
        self.shallow = ok
        return ok


def try_measure(meas: Measurer, *args: Any, **kwargs: Any) -> MeasuredSplits | None:
    """meas.measure(...), or None when the forward fails at those settings."""
    try:
        return meas.measure(*args, **kwargs)
    except CannotExamine:
        return None


def plan_order(plan: Mapping[str, Any], key: Key) -> tuple[int, int, int, str]:
    """Rows in the order of the class's `_cp_plan` (split inputs first, gathered outputs last)."""
    display = display_modules(plan)
    modules = list(dict.fromkeys(display[m] for m in plan))
    m = modules.index(key.module) if key.module in modules else len(modules)
    spec = next((plan[i] for i in plan if display[i] == key.module), None)
    items = [str(k) for k in spec] if isinstance(spec, dict) else []
    item = key.item.split("[")[0] if not key.item.startswith("output[") else key.item[len("output[") : -1]
    i = items.index(item) if item in items else len(items)
    return (key.kind is SplitKind.GATHER, m, i, key.name)
