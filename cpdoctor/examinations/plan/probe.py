"""Static divisibility planner: will this model's context-parallel split work at this resolution and prompt length?

diffusers splits every tensor named in a model's `_cp_plan` with `tensor.chunk(world, dim)` after asserting
`size % world == 0` (world = ring x ulysses), and Ulysses scatters attention heads over the Ulysses group. This
probe measures, without weights and without compute, the real length of every split input and gathered output:
it builds the model on the meta device from its config, hooks the modules named in `_cp_plan` exactly where
diffusers hooks them, and runs the model's own forward on meta tensors (shapes only). Attention head counts
are read from the attention calls of that same forward. So the lengths come from diffusers' code; the only
thing cpdoctor supplies is how a pipeline shapes the inputs (`cpdoctor.models.catalog` builders).

For every problem it then measures the ways out: the nearest resolutions, frame counts and text lengths that
divide (by re-running the forward at those settings, on a one-block copy of the model when that copy is shown
to give the same lengths), the CP degrees that divide (from the measured lengths and heads), and the
"anything" modes when this diffusers' ContextParallelConfig has them (constructed to see which degrees they
accept; their backward called to see that they are inference only).

It never prints: `plan_model()` returns a PlanResult.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.models.catalog import (
    InputBuilder,
    ModelEntry,
    build_inputs,
    build_model,
    builder_for,
    full_config,
    list_models,
    resolve_model,
)

__all__ = [
    "HeadsCheck",
    "ModelEntry",
    "PlanResult",
    "Problem",
    "Remedy",
    "TensorRow",
    "list_models",
    "plan_model",
    "resolve_model",
]

# How far the remedy search looks (in steps of the pipeline's resolution / frame multiple) and how many extra
# forwards it may spend. A one-block forward costs ~10-50 ms on meta, a full-depth one 0.3-3 s.
_MAX_STEPS = 8
_MAX_RESOLUTION_RUNS = 48
_MAX_TEXT_RUNS = 64
_RESOLUTION_OPTIONS = 3


# --------------------------------------------------------------------------------------------------------------
# result types
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorRow:
    """One tensor diffusers splits (or gathers) for CP, with its measured length."""

    name: str  # "hidden_states", "transformer_blocks.*:encoder_hidden_states_mask", "pos_embed:output[1]"
    module: str  # the `_cp_plan` key ("" is the model itself)
    kind: str  # "split" (an input, or an output with split_output=True) or "gather" (ContextParallelOutput)
    split_dim: int
    length: int
    per_rank: float  # length / world; an int when it divides
    divisible: bool
    calls: int  # how many module calls saw this length (wildcard entries hook every block)
    depends_on: list[str] | None = None  # of "resolution", "text", "frames"; None when not measured

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SkippedRow:
    """A `_cp_plan` entry diffusers would not split at these settings, and why."""

    name: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class HeadsCheck:
    """Ulysses scatters heads over its group: query (and key/value) heads must divide by the Ulysses degree."""

    heads: int
    kv_heads: int
    ulysses: int
    divisible: bool
    source: str  # "attention calls" (measured) or "config"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Remedy:
    kind: str  # "resolution", "text_padding", "frames", "degrees", "ulysses_anything", "ring_anything"
    text: str  # one line for humans
    measured: bool  # True when re-measured with diffusers' forward (or from measured lengths), not predicted
    values: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Problem:
    what: str
    tensors: list[str]
    remedies: list[Remedy]

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "tensors": list(self.tensors), "remedies": [r.to_dict() for r in self.remedies]}


@dataclasses.dataclass
class PlanResult:
    model: dict[str, Any]
    settings: dict[str, Any]
    tensors: list[TensorRow]
    skipped: list[SkippedRow]
    heads: list[HeadsCheck]
    problems: list[Problem]
    notes: list[str]
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        return "FAIL" if self.problems else "PASS"

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "model": dict(self.model),
            "settings": dict(self.settings),
            "tensors": [t.to_dict() for t in self.tensors],
            "skipped": [s.to_dict() for s in self.skipped],
            "heads": [h.to_dict() for h in self.heads],
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
            "seconds": round(self.seconds, 3),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------------------------------------------
# measuring one forward
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Key:
    module: str
    item: str  # parameter name, "output[i]" or "output"
    kind: str
    split_dim: int

    @property
    def name(self) -> str:
        return f"{self.module}:{self.item}" if self.module else self.item


@dataclasses.dataclass
class _Measurement:
    lengths: dict[_Key, dict[int, int]]  # key -> {length: calls}
    skipped: dict[str, str]  # name -> reason
    heads: set[tuple[int, int]]
    height: int
    width: int
    frames: int | None
    text_len: int

    def signature(self) -> dict[_Key, tuple[int, ...]]:
        return {k: tuple(sorted(v)) for k, v in self.lengths.items()}

    def all_divide(self, world: int, keys: set[_Key] | None = None) -> bool:
        return all(
            length % world == 0
            for k, seen in self.lengths.items()
            if keys is None or k in keys
            for length in seen
        )


def _find_modules(model: Any, module_id: str) -> list[Any]:
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


def _display_modules(plan: Mapping[str, Any]) -> dict[str, str]:
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


class _Recorder:
    """Forward (pre-)hooks at the places diffusers' ContextParallelSplitHook / GatherHook sit."""

    def __init__(self, model: Any, plan: Mapping[str, Any]):
        self.lengths: dict[_Key, dict[int, int]] = {}
        self.skipped: dict[str, str] = {}
        self.handles: list[Any] = []
        display = _display_modules(plan)
        for module_id, spec in plan.items():
            try:
                modules = _find_modules(model, module_id)
            except LookupError as exc:
                self.skipped[module_id or "<model>"] = f"module not found ({exc})"
                continue
            for mod in modules:
                self._attach(mod, display[module_id], spec)

    def _note(self, key: _Key, tensor: Any, spec: Any) -> None:
        import torch

        if not isinstance(tensor, torch.Tensor):
            return
        expected = getattr(spec, "expected_dims", None)
        if expected is not None and tensor.dim() != expected:
            self.skipped[key.name] = (
                f"has {tensor.dim()} dims, the plan expects {expected}: diffusers leaves it unsplit"
            )
            return
        dim = key.split_dim if key.split_dim >= 0 else tensor.dim() + key.split_dim
        length = int(tensor.shape[dim])
        seen = self.lengths.setdefault(key, {})
        seen[length] = seen.get(length, 0) + 1

    def _attach(self, mod: Any, module_id: str, spec: Any) -> None:
        if isinstance(spec, dict):
            by_name = {k: v for k, v in spec.items() if not (_is_input_spec(v) and v.split_output)}
            by_index = {k: v for k, v in spec.items() if _is_input_spec(v) and v.split_output}
            if by_name:
                sig = inspect.signature(type(mod).forward)
                varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)

                def pre_hook(module: Any, args: tuple, kwargs: dict, _by_name=by_name, _sig=sig, _varkw=varkw) -> None:
                    try:
                        bound = _sig.bind_partial(module, *args, **kwargs).arguments
                    except TypeError:
                        return
                    extra = bound.get(_varkw, {}) if _varkw else {}
                    for name, cpi in _by_name.items():
                        value = bound.get(name, extra.get(name))
                        if value is None:
                            self.skipped.setdefault(_Key(module_id, name, "split", 0).name, "not passed (None)")
                            continue
                        if isinstance(value, (list, tuple)):
                            for i, (v, c) in enumerate(zip(value, cpi)):
                                if not c.split_output:
                                    self._note(_Key(module_id, f"{name}[{i}]", "split", c.split_dim), v, c)
                        else:
                            self._note(_Key(module_id, name, "split", cpi.split_dim), value, cpi)

                self.handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True))
            if by_index:

                def out_hook(module: Any, args: tuple, output: Any, _by_index=by_index) -> None:
                    outs = list(output) if isinstance(output, (list, tuple)) else [output]
                    for index, cpi in _by_index.items():
                        if isinstance(index, int) and index < len(outs):
                            self._note(_Key(module_id, f"output[{index}]", "split", cpi.split_dim), outs[index], cpi)

                self.handles.append(mod.register_forward_hook(out_hook))
        else:
            specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]

            def gather_hook(module: Any, args: tuple, output: Any, _specs=specs) -> None:
                outs = list(output) if isinstance(output, (list, tuple)) else [output]
                for i, cpo in enumerate(_specs):
                    if cpo is None or i >= len(outs) or not _is_output_spec(cpo):
                        continue
                    item = "output" if len(_specs) == 1 else f"output[{i}]"
                    self._note(_Key(module_id, item, "gather", cpo.gather_dim), outs[i], cpo)

            self.handles.append(mod.register_forward_hook(gather_hook))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _attention_spy() -> Iterator[set[tuple[int, int]]]:
    """Records (query heads, key heads) of every scaled_dot_product_attention call (layout B, H, S, D)."""
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
                if q is not None and k is not None and q.dim() >= 3:
                    heads.add((int(q.shape[-3]), int(k.shape[-3])))
            return func(*args, **kwargs)

    with _Spy():
        yield heads


@contextlib.contextmanager
def _meta_safe() -> Iterator[None]:
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

    logger_level = None
    try:
        from diffusers.utils import logging as dlogging

        logger_level = dlogging.get_verbosity()
        dlogging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        dlogging = None
    torch.autocast = _Autocast
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.autocast = original
        if dlogging is not None and logger_level is not None:
            dlogging.set_verbosity(logger_level)


class _Measurer:
    """Runs the model's forward on meta tensors at given settings and returns the split lengths."""

    def __init__(self, cls: type, config: Mapping[str, Any], builder: InputBuilder):
        self.cls = cls
        self.config = dict(config)
        self.builder = builder
        self.model = build_model(cls, self.config, device="meta")
        self.full_config = dict(self.model.config)
        self.plan = cls._cp_plan
        self.runs = 0
        self.shallow = False

    def measure(self, height: int, width: int, text_len: int, frames: int | None, text_mask: bool = False) -> _Measurement:
        import torch

        inputs = build_inputs(
            self.cls, self.full_config, height, width, text_len, frames, device="meta", text_mask=text_mask
        )
        recorder = _Recorder(self.model, self.plan)
        self.runs += 1
        try:
            with torch.no_grad(), _attention_spy() as heads:
                self.model(**inputs.kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure means we cannot measure this model here
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CannotExamine(
                f"{self.cls.__name__}'s forward failed on the meta device at {inputs.height}x{inputs.width}"
                f"{'' if inputs.frames is None else f', {inputs.frames} frames'}, text {text_len}: "
                f"{type(exc).__name__}: {msg[:300]}"
            ) from exc
        finally:
            recorder.remove()
        return _Measurement(
            recorder.lengths, recorder.skipped, heads, inputs.height, inputs.width, inputs.frames, inputs.text_len
        )

    def make_shallow(self, reference: _Measurement, text_mask: bool) -> bool:
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


# --------------------------------------------------------------------------------------------------------------
# remedies
# --------------------------------------------------------------------------------------------------------------


def _per_rank(length: int, world: int) -> float:
    return length // world if length % world == 0 else round(length / world, 2)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degree_options(
    lengths: list[int], heads: list[int], ring: int, ulysses: int, limit: int = 4
) -> list[tuple[int, int]]:
    """(ring, ulysses) pairs, nearest world size first, for which every length and head count divides."""
    world = ring * ulysses
    top = max(8, 2 * world)
    options = []
    for w in range(2, top + 1):
        if any(length % w for length in lengths):
            continue
        for u in _divisors(w):
            r = w // u
            if any(h % u for h in heads):
                continue
            if (r, u) == (ring, ulysses):
                continue
            options.append((abs(w - world), w != world, abs(r - ring) + abs(u - ulysses), r, u))
    options.sort()
    return [(r, u) for *_, r, u in options[:limit]]


def _cp_config_fields() -> set[str]:
    """The fields of this diffusers' ContextParallelConfig (ulysses_anything / ring_anything are recent)."""
    from cpdoctor.compat import diffusers as diffusers_compat

    try:
        return set(diffusers_compat.context_parallel_fields())
    except CannotExamine:
        return set()


def _cp_config_accepts(ring: int, ulysses: int, **flags: Any) -> str | None:
    """None when this diffusers' ContextParallelConfig accepts these degrees and flags, else its error."""
    from cpdoctor.compat import diffusers as diffusers_compat

    try:
        cp_cls, _ = diffusers_compat.parallel_config_classes()
        cp_cls(ring_degree=ring, ulysses_degree=ulysses, **flags)
    except Exception as exc:  # noqa: BLE001 - its __post_init__ raises ValueError with the reason
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def _anything_remedies(world: int, ring: int, ulysses: int, fields: set[str], heads_problem: bool) -> list[Remedy]:
    from cpdoctor.compat import diffusers as diffusers_compat

    out = []
    modes = [("ulysses_anything", 1, world)]
    if not heads_problem:
        modes.append(("ring_anything", world, 1))
    for field, r, u in modes:
        if field not in fields:
            continue
        error = _cp_config_accepts(ring, ulysses, **{field: True})
        use_r, use_u = (ring, ulysses) if error is None else (r, u)
        if error is not None and _cp_config_accepts(r, u, **{field: True}) is not None:
            continue
        backward = diffusers_compat.anything_backward_refused(field)
        scope = (
            "inference only: its backward raises NotImplementedError"
            if backward
            else "check that its backward works before training with it"
        )
        out.append(
            Remedy(
                kind=field,
                text=f"ContextParallelConfig(ring_degree={use_r}, ulysses_degree={use_u}, {field}=True) "
                f"splits uneven lengths; {scope}",
                measured=backward is not None,
                values={
                    "ring": use_r,
                    "ulysses": use_u,
                    "inference_only": bool(backward),
                    "refuses_requested_degrees": error,
                },
            )
        )
    return out


def _ordered_resolution_candidates(height: int, width: int, step: int) -> list[tuple[int, int]]:
    cands = []
    for dh in range(-_MAX_STEPS, _MAX_STEPS + 1):
        for dw in range(-_MAX_STEPS, _MAX_STEPS + 1):
            h, w = height + dh * step, width + dw * step
            if (dh, dw) == (0, 0) or h < step or w < step:
                continue
            cands.append((abs(dh) + abs(dw), max(abs(dh), abs(dw)), dh < 0 or dw < 0, h, w))
    cands.sort()
    return [(h, w) for *_, h, w in cands]


def _ordered_frame_candidates(frames: int, step: int, offset: int) -> list[int]:
    out = []
    for k in range(1, _MAX_STEPS + 1):
        for f in (frames + k * step, frames - k * step):
            if f >= offset and (f - offset) % step == 0:
                out.append(f)
    return out


def _fmt_lengths(m: _Measurement, keys: set[_Key], world: int) -> str:
    """"6972 -> 3486 per rank" when the tensors agree, else one "name length" per tensor."""
    by_length: dict[int, list[str]] = {}
    for k in sorted(keys, key=lambda k: k.name):
        for length in m.lengths.get(k, {}):
            by_length.setdefault(length, []).append(k.name)
    if len(by_length) == 1:
        length = next(iter(by_length))
        return f"{length} -> {_per_rank(length, world)} per rank"
    return ", ".join(
        f"{'/'.join(names)} {length} -> {_per_rank(length, world)}" for length, names in sorted(by_length.items())
    )


# --------------------------------------------------------------------------------------------------------------
# the planner
# --------------------------------------------------------------------------------------------------------------


def _plan_order(plan: Mapping[str, Any], key: _Key) -> tuple[int, int, int, str]:
    """Rows in the order of the class's `_cp_plan` (split inputs first, gathered outputs last)."""
    display = _display_modules(plan)
    modules = list(dict.fromkeys(display[m] for m in plan))
    m = modules.index(key.module) if key.module in modules else len(modules)
    spec = next((plan[i] for i in plan if display[i] == key.module), None)
    items = [str(k) for k in spec] if isinstance(spec, dict) else []
    item = key.item.split("[")[0] if not key.item.startswith("output[") else key.item[len("output[") : -1]
    i = items.index(item) if item in items else len(items)
    return (key.kind == "gather", m, i, key.name)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise BadInput(f"{name} must be at least {minimum}, got {value}")
    return value


def plan_model(
    model: str,
    height: int | None = None,
    width: int | None = None,
    text_len: int | None = None,
    ring: int = 1,
    ulysses: int = 1,
    frames: int | None = None,
) -> PlanResult:
    """Measure every CP split of `model` (short name, class name or checkpoint directory) at these settings.

    height / width / text_len / frames default to the family's pipeline defaults. Raises BadInput for unknown
    models and impossible settings, CannotExamine when the model's inputs cannot be built or its meta forward
    fails. Problems found are returned, not raised.
    """
    started = time.perf_counter()
    ring = _check_int("ring degree", ring, 1)
    ulysses = _check_int("ulysses degree", ulysses, 1)
    resolved = resolve_model(model)
    world = ring * ulysses
    if world < 2:
        raise BadInput("ring x ulysses must be at least 2 (ring=1, ulysses=1 is no context parallelism)")
    cls, entry = resolved.cls, resolved.entry
    builder = builder_for(cls)
    step = builder.resolution_multiple(full_config(cls, resolved.config))
    height = _check_int("height", builder.default_height if height is None else height, step)
    width = _check_int("width", builder.default_width if width is None else width, step)
    text_len = _check_int("text length", builder.default_text_len if text_len is None else text_len, 1)
    if builder.is_video:
        frames = _check_int("frames", builder.default_frames if frames is None else frames, 1)
    elif frames is not None:
        raise BadInput(f"{entry.short_name} is an image model; --frames applies to video models only")

    notes: list[str] = []
    with _meta_safe():
        meas = _Measurer(cls, resolved.config, builder)
        base_mask = False  # what the pipelines pass for one unpadded prompt (Qwen-Image drops an all-ones mask)
        base = meas.measure(height, width, text_len, frames, text_mask=base_mask)
        if (base.height, base.width) != (height, width):
            notes.append(
                f"{height}x{width} is not a multiple of {step}: the pipeline uses {base.height}x{base.width}"
            )
        if frames is not None and base.frames != frames:
            notes.append(f"{frames} frames is not {builder.frames_step}k+{builder.frames_offset}: the pipeline uses {base.frames}")
        if not base.lengths:
            raise CannotExamine(f"none of {cls.__name__}'s _cp_plan entries saw a tensor in its meta forward")

        heads_pairs = sorted(base.heads)
        heads_source = "attention calls"
        if not heads_pairs:
            cfg = meas.full_config
            heads_pairs = sorted(
                {(int(v), int(v)) for k, v in cfg.items() if k.endswith("num_attention_heads") and isinstance(v, int)}
            )
            heads_source = "config"
        heads = [HeadsCheck(q, kv, ulysses, q % ulysses == 0 and kv % ulysses == 0, heads_source) for q, kv in heads_pairs]

        failing = {k for k, seen in base.lengths.items() if any(length % world for length in seen)}
        heads_bad = [h for h in heads if not h.divisible]
        depends: dict[_Key, list[str]] = {}
        problems: list[Problem] = []
        if failing or heads_bad:
            problems = _remedies(meas, builder, base, failing, heads, heads_bad, ring, ulysses, text_len, depends, notes)

    rows = []
    for key in sorted(base.lengths, key=lambda k: _plan_order(meas.plan, k)):
        for length, calls in sorted(base.lengths[key].items()):
            rows.append(
                TensorRow(
                    name=key.name,
                    module=key.module,
                    kind=key.kind,
                    split_dim=key.split_dim,
                    length=length,
                    per_rank=_per_rank(length, world),
                    divisible=length % world == 0,
                    calls=calls,
                    depends_on=depends.get(key),
                )
            )
    measured_names = {k.name for k in base.lengths}
    skipped = [SkippedRow(n, r) for n, r in sorted(base.skipped.items()) if n not in measured_names]
    masked_padding = any(r.kind == "text_padding" and r.values.get("mask") for p in problems for r in p.remedies)
    if ring > 1 and (masked_padding or any(k.kind == "split" and "mask" in k.item for k in base.lengths)):
        notes.append(
            "a text mask is split: under ring attention each rank's mask must follow the KV chunks it meets "
            "(`cpdoctor check` measures whether this install does that)"
        )
    settings = {
        "height": base.height,
        "width": base.width,
        "text_len": text_len,
        "frames": base.frames,
        "ring": ring,
        "ulysses": ulysses,
        "world_size": world,
        "requested": {"height": height, "width": width, "frames": frames},
        "config": resolved.source,
        "inputs": builder.convention,
        "forwards": meas.runs,
        "shallow_remedy_search": meas.shallow,
    }
    model_info = {
        "short_name": entry.short_name,
        "class_name": entry.class_name,
        "module": entry.module,
        "source": resolved.source,
        "builder": builder.name,
    }
    return PlanResult(
        model=model_info,
        settings=settings,
        tensors=rows,
        skipped=skipped,
        heads=heads,
        problems=problems,
        notes=notes,
        seconds=time.perf_counter() - started,
    )


def _remedies(
    meas: _Measurer,
    builder: InputBuilder,
    base: _Measurement,
    failing: set[_Key],
    heads: list[HeadsCheck],
    heads_bad: list[HeadsCheck],
    ring: int,
    ulysses: int,
    text_len: int,
    depends: dict[_Key, list[str]],
    notes: list[str],
) -> list[Problem]:
    world = ring * ulysses
    H, W, T, F = base.height, base.width, base.text_len, base.frames
    step = builder.resolution_multiple(meas.full_config)
    mask_param = builder.text_mask_param if builder.text_mask_param in _forward_param_names(meas.cls) else None
    fields = _cp_config_fields()
    all_lengths = sorted({length for seen in base.lengths.values() for length in seen})
    all_heads = sorted({h.heads for h in heads} | {h.kv_heads for h in heads})
    problems: list[Problem] = []

    if failing:
        if not meas.make_shallow(base, text_mask=False):
            notes.append("the remedy search ran the full-depth model (a one-block copy measured differently)")

        # what each tensor's length depends on: perturb one knob at a time and see which lengths move
        probes = {"text": (H, W, T + 1, F)}
        probes["resolution"] = (H + step, W + step, T, F)
        if F is not None and builder.frames_step:
            probes["frames"] = (H, W, T, F + builder.frames_step)
        moved: dict[str, set[_Key]] = {}
        for knob, (h, w, t, f) in probes.items():
            m = _try_measure(meas, h, w, t, f)
            moved[knob] = set() if m is None else {k for k in base.lengths if m.signature().get(k) != base.signature()[k]}
        for key in base.lengths:
            depends[key] = [knob for knob in ("resolution", "frames", "text") if key in moved.get(knob, set())]

        groups: dict[tuple[str, ...], set[_Key]] = {}
        for key in failing:
            groups.setdefault(tuple(depends[key]), set()).add(key)
        label = {
            ("resolution",): "image tokens",
            ("resolution", "frames"): "video tokens",
            ("frames",): "frame tokens",
            ("text",): "text tokens",
        }
        for deps, keys in sorted(groups.items()):
            names = sorted({k.name for k in keys})
            what = (
                f"{label.get(deps, 'tokens that depend on ' + ' and '.join(deps) if deps else 'fixed-size tokens')}: "
                f"{', '.join(f'{k.name} {length}' for k in sorted(keys, key=lambda k: k.name) for length in sorted(base.lengths[k]))}"
                f" do not split over {world} ranks (ring {ring} x ulysses {ulysses})"
            )
            remedies: list[Remedy] = []
            if "resolution" in deps:
                remedies += _resolution_remedies(meas, base, keys, world, step)
            if "frames" in deps:
                remedies += _frame_remedies(meas, builder, base, keys, world)
            if "text" in deps:
                remedies += _text_remedies(meas, base, keys, world, mask_param, ring)
            group_lengths = sorted({length for k in keys for length in base.lengths[k]})
            degree_opts = _degree_options(group_lengths, all_heads, ring, ulysses)
            full_opts = set(_degree_options(all_lengths, all_heads, ring, ulysses, limit=64))
            if not degree_opts:
                remedies.append(
                    Remedy(
                        kind="degrees",
                        text=f"no ring x ulysses up to {max(8, 2 * world)} ranks divides "
                        + ", ".join(str(x) for x in group_lengths),
                        measured=True,
                        values={"options": []},
                    )
                )
            else:
                remedies.append(
                    Remedy(
                        kind="degrees",
                        text="degrees that divide these lengths and the heads: "
                        + ", ".join(
                            f"ring={r} x ulysses={u}" + (" (everything divides)" if (r, u) in full_opts else "")
                            for r, u in degree_opts
                        ),
                        measured=True,
                        values={"options": [{"ring": r, "ulysses": u, "all_divide": (r, u) in full_opts} for r, u in degree_opts]},
                    )
                )
            remedies += _anything_remedies(world, ring, ulysses, fields, heads_problem=bool(heads_bad))
            problems.append(Problem(what=what, tensors=names, remedies=remedies))

    for h in heads_bad:
        opts = [(r, u) for r, u in _degree_options(all_lengths, all_heads, ring, ulysses, limit=64) if r * u == world]
        opts = opts or _degree_options(all_lengths, all_heads, ring, ulysses)
        remedies = []
        if opts:
            remedies.append(
                Remedy(
                    kind="degrees",
                    text="degrees whose Ulysses group divides the heads (and every length): "
                    + ", ".join(f"ring={r} x ulysses={u}" for r, u in opts[:4]),
                    measured=True,
                    values={"options": [{"ring": r, "ulysses": u, "all_divide": True} for r, u in opts[:4]]},
                )
            )
        remedies += [r for r in _anything_remedies(world, ring, ulysses, fields, heads_problem=True)]
        kv = "" if h.kv_heads == h.heads else f" ({h.kv_heads} key/value heads)"
        problems.append(
            Problem(
                what=f"{h.heads} attention heads{kv} do not split over ulysses={ulysses} "
                f"(Ulysses scatters heads across its group; divisors of {h.heads}: "
                f"{', '.join(str(d) for d in _divisors(h.heads) if d > 1)})",
                tensors=["attention heads"],
                remedies=remedies,
            )
        )
    return problems


def _try_measure(meas: _Measurer, *args: Any, **kwargs: Any) -> _Measurement | None:
    try:
        return meas.measure(*args, **kwargs)
    except CannotExamine:
        return None


def _forward_param_names(cls: type) -> set[str]:
    return set(inspect.signature(cls.forward).parameters)


def _resolution_remedies(meas: _Measurer, base: _Measurement, keys: set[_Key], world: int, step: int) -> list[Remedy]:
    found: list[Remedy] = []
    runs = 0
    for h, w in _ordered_resolution_candidates(base.height, base.width, step):
        if len(found) >= _RESOLUTION_OPTIONS or runs >= _MAX_RESOLUTION_RUNS:
            break
        runs += 1
        m = _try_measure(meas, h, w, base.text_len, base.frames)
        if m is not None and m.all_divide(world, keys):
            found.append(
                Remedy(
                    kind="resolution",
                    text=f"{h}x{w}: {_fmt_lengths(m, keys, world)}",
                    measured=True,
                    values={"height": h, "width": w, "lengths": {k.name: sorted(m.lengths.get(k, {})) for k in keys}},
                )
            )
    if not found:
        found.append(
            Remedy(
                kind="resolution",
                text=f"no resolution within {_MAX_STEPS} steps of {step} px makes these divide",
                measured=True,
            )
        )
    return found


def _frame_remedies(
    meas: _Measurer, builder: InputBuilder, base: _Measurement, keys: set[_Key], world: int
) -> list[Remedy]:
    found: list[Remedy] = []
    for f in _ordered_frame_candidates(base.frames or 1, builder.frames_step or 1, builder.frames_offset):
        if len(found) >= 2:
            break
        m = _try_measure(meas, base.height, base.width, base.text_len, f)
        if m is not None and m.all_divide(world, keys):
            found.append(
                Remedy(
                    kind="frames",
                    text=f"{f} frames: {_fmt_lengths(m, keys, world)}",
                    measured=True,
                    values={"frames": f, "lengths": {k.name: sorted(m.lengths.get(k, {})) for k in keys}},
                )
            )
    return found


def _text_remedies(
    meas: _Measurer, base: _Measurement, keys: set[_Key], world: int, mask_param: str | None, ring: int
) -> list[Remedy]:
    for t in range(base.text_len + 1, base.text_len + _MAX_TEXT_RUNS + 1):
        m = _try_measure(meas, base.height, base.width, t, base.frames, text_mask=mask_param is not None)
        if m is None:
            continue
        new_keys = {k for k in m.lengths if k not in base.lengths}  # e.g. the mask, split once it is passed
        if not m.all_divide(world, keys | new_keys):
            continue
        if mask_param:
            how = f"pad the text to {t} tokens and mark the {t - base.text_len} padding token(s) in `{mask_param}`"
            if ring > 1:
                how += " (under ring attention the mask must follow the KV chunks: see the note)"
        else:
            how = (
                f"pad the text to {t} tokens; this model's forward takes no text mask, so the padding is attended "
                "to: pad as the pipeline does (its max_sequence_length padding), not with zeros"
            )
        return [
            Remedy(
                kind="text_padding",
                text=f"{how}: {_fmt_lengths(m, keys | new_keys, world)}",
                measured=True,
                values={"text_len": t, "pad": t - base.text_len, "mask": mask_param},
            )
        ]
    return [Remedy(kind="text_padding", text=f"no text length up to {base.text_len + _MAX_TEXT_RUNS} divides", measured=True)]
