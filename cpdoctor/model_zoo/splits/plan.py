"""A model's CP split plan at one setting, measured: every split input and gathered output with its length, the
heads against the Ulysses degree, and each problem with its measured ways out (`cpdoctor plan` reports it;
`cpdoctor model` refuses an indivisible layout with it before any rank starts).

`setup()` validates the settings against the model's pipeline conventions (BadInput, one line, in the order a
user fixes them); `measure_plan()` runs diffusers' own forward on the meta device (`measure.py`) and searches the
ways out (`remedies.py`); `plan_command()` is the `cpdoctor plan` line that shows a setting.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any

from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.model_zoo.catalog import ResolvedModel, full_config, resolve_model
from cpdoctor.model_zoo.inputs import InputBuilder, builder_for
from cpdoctor.model_zoo.splits.measure import Key, MeasuredSplits, Measurer, SplitKind, meta_safe, plan_order
from cpdoctor.model_zoo.splits.remedies import Found, Search, find_problems, per_rank
from cpdoctor.model_zoo.splits.result import HeadsCheck, Plan, RemedyKind, SkippedRow, SplitRow


def check_int(name: str, value: Any, minimum: int) -> int:
    """`value` when it is an int (not a bool) of at least `minimum`, else BadInput naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise BadInput(f"{name} must be at least {minimum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Setup:
    """A validated request: the model resolved, its input builder, and every setting filled in."""

    resolved: ResolvedModel
    builder: InputBuilder
    step: int  # the pipeline's resolution multiple
    height: int
    width: int
    text_len: int
    frames: int | None
    ring: int
    ulysses: int

    @property
    def world(self) -> int:
        return self.ring * self.ulysses


def setup(model: str, height: int | None, width: int | None, text_len: int | None, ring: int, ulysses: int, frames: int | None) -> Setup:
    """BadInput for unknown models and impossible settings, checked in the order a user fixes them."""
    ring = check_int("ring degree", ring, 1)
    ulysses = check_int("ulysses degree", ulysses, 1)
    resolved = resolve_model(model)
    if ring * ulysses < 2:
        raise BadInput("ring x ulysses must be at least 2 (ring=1, ulysses=1 is no context parallelism)")
    builder = builder_for(resolved.cls)
    step = builder.resolution_multiple(full_config(resolved.cls, resolved.config))
    height = check_int("height", builder.default_height if height is None else height, step)
    width = check_int("width", builder.default_width if width is None else width, step)
    text_len = check_int("text length", builder.default_text_len if text_len is None else text_len, 1)
    if builder.is_video:
        frames = check_int("frames", builder.default_frames if frames is None else frames, 1)
    elif frames is not None:
        raise BadInput(f"{resolved.entry.short_name} is an image model; --frames applies to video models only")
    return Setup(resolved, builder, step, height, width, text_len, frames, ring, ulysses)


def measure_plan(s: Setup) -> Plan:
    """Measure the plan at the settings of `s`, and the ways out of each problem."""
    with meta_safe():
        meas = Measurer(s.resolved.cls, s.resolved.config, s.builder)
        base = _measure_base(meas, s)
        heads = heads_checks(base, meas.full_config, s.ulysses)
        found = find_problems(Search(meas, s.builder, base, heads, s.ring, s.ulysses))
    return Plan(
        model=_model_info(s),
        settings=_settings(s, base, meas),
        tensors=tensor_rows(base, meas.plan, s.world, found.depends),
        skipped=skipped_rows(base),
        heads=heads,
        problems=found.problems,
        notes=_base_notes(s, base) + found.notes + _mask_note(s, base, found),
    )


def _measure_base(meas: Measurer, s: Setup) -> MeasuredSplits:
    """The forward at the requested settings, with the inputs the pipelines pass for one unpadded prompt
    (Qwen-Image drops an all-ones mask, so no text mask)."""
    base = meas.measure(s.height, s.width, s.text_len, s.frames, text_mask=False)
    if not base.lengths:
        raise CannotExamine(f"none of {s.resolved.cls.__name__}'s _cp_plan entries saw a tensor in its meta forward")
    return base


def heads_checks(base: MeasuredSplits, full_config: dict[str, Any], ulysses: int) -> list[HeadsCheck]:
    """Query/key heads per attention call (or, when no call was seen, every *num_attention_heads of the config)."""
    pairs, source = sorted(base.heads), "attention calls"
    if not pairs:
        heads = {int(v) for k, v in full_config.items() if k.endswith("num_attention_heads") and isinstance(v, int)}
        pairs, source = sorted((h, h) for h in heads), "config"
    return [HeadsCheck(q, kv, ulysses, q % ulysses == 0 and kv % ulysses == 0, source) for q, kv in pairs]


def tensor_rows(base: MeasuredSplits, plan: Any, world: int, depends: dict[Key, list[str]]) -> list[SplitRow]:
    """One row per measured (tensor, length), in the order of the class's `_cp_plan`."""
    rows = []
    for key in sorted(base.lengths, key=lambda k: plan_order(plan, k)):
        for length, calls in sorted(base.lengths[key].items()):
            rows.append(
                SplitRow(
                    name=key.name,
                    module=key.module,
                    kind=key.kind,
                    split_dim=key.split_dim,
                    length=length,
                    per_rank=per_rank(length, world),
                    divisible=length % world == 0,
                    calls=calls,
                    depends_on=depends.get(key),
                )
            )
    return rows


def skipped_rows(base: MeasuredSplits) -> list[SkippedRow]:
    measured = {k.name for k in base.lengths}
    return [SkippedRow(n, r) for n, r in sorted(base.skipped.items()) if n not in measured]


def _base_notes(s: Setup, base: MeasuredSplits) -> list[str]:
    notes = []
    if (base.height, base.width) != (s.height, s.width):
        notes.append(f"{s.height}x{s.width} is not a multiple of {s.step}: the pipeline uses {base.height}x{base.width}")
    if s.frames is not None and base.frames != s.frames:
        b = s.builder
        notes.append(f"{s.frames} frames is not {b.frames_step}k+{b.frames_offset}: the pipeline uses {base.frames}")
    return notes


def _mask_note(s: Setup, base: MeasuredSplits, found: Found) -> list[str]:
    """Under ring attention a split text mask must follow the KV chunks: point at `cpdoctor check`."""
    padded = any(r.kind is RemedyKind.TEXT_PADDING and r.values.get("mask") for p in found.problems for r in p.remedies)
    split = any(k.kind is SplitKind.SPLIT and "mask" in k.item for k in base.lengths)
    if s.ring > 1 and (padded or split):
        return [
            "a text mask is split: under ring attention each rank's mask must follow the KV chunks it meets "
            "(`cpdoctor check` measures whether this install does that)"
        ]
    return []


def _settings(s: Setup, base: MeasuredSplits, meas: Measurer) -> dict[str, Any]:
    return {
        "height": base.height,
        "width": base.width,
        "text_len": s.text_len,
        "frames": base.frames,
        "ring": s.ring,
        "ulysses": s.ulysses,
        "world_size": s.world,
        "requested": {"height": s.height, "width": s.width, "frames": s.frames},
        "config": s.resolved.source,
        "inputs": s.builder.convention,
        "forwards": meas.runs,
        "shallow_remedy_search": meas.shallow,
    }


def _model_info(s: Setup) -> dict[str, Any]:
    entry = s.resolved.entry
    return {
        "short_name": entry.short_name,
        "class_name": entry.class_name,
        "module": entry.module,
        "source": s.resolved.source,
        "builder": s.builder.name,
    }


SETTING_OPTIONS = (
    ("height", "--height"),
    ("width", "--width"),
    ("text_len", "--text-len"),
    ("frames", "--frames"),
    ("ring", "--ring"),
    ("ulysses", "--ulysses"),
)


def plan_command(model: str, settings: dict[str, Any], changes: dict[str, int] | None = None) -> str:
    """`cpdoctor plan MODEL --height H ...` at `settings` with `changes` applied."""
    values = {**settings, **(changes or {})}
    parts = ["cpdoctor", "plan", shlex.quote(model)]
    parts += [f"{opt} {values[key]}" for key, opt in SETTING_OPTIONS if values.get(key) is not None]
    return " ".join(parts)


def remedy_line(remedies: list[Any]) -> str:
    """'resolution: 1328x1344: 6972 -> 3486 per rank; degrees: ...', predicted ones marked."""
    return "; ".join(r.line() for r in remedies)
