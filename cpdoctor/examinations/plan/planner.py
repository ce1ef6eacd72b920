"""Static divisibility planner: will this model's context-parallel split work at this resolution and prompt length?

diffusers splits every tensor named in a model's `_cp_plan` with `tensor.chunk(world, dim)` after asserting
`size % world == 0` (world = ring x ulysses), and Ulysses scatters attention heads over the Ulysses group. This
examination measures, without weights and without compute, the real length of every split input and gathered
output (`measure`: the model's own forward on the meta device, hooked where diffusers hooks it), so the lengths
come from diffusers' code; the only thing cpdoctor supplies is how a pipeline shapes the inputs
(`cpdoctor.models.catalog` builders). For every problem it then measures the ways out (`remedies`), and `judge`
turns the problems into findings.

It never prints: `plan_model()` returns the `cpdoctor.report.Report` every examination returns, the measured
plan under its own keys (`model`, `settings`, `tensors`, `skipped`, `heads`, `problems`, `notes`, `seconds`).
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

from cpdoctor.errors import CannotExamine
from cpdoctor.examinations.plan.judge import plan_findings
from cpdoctor.examinations.plan.measure import Key, Measurement, Measurer, meta_safe, plan_order
from cpdoctor.examinations.plan.remedies import Found, Search, find_problems, per_rank
from cpdoctor.examinations.plan.request import PlanRequest, Setup, setup
from cpdoctor.examinations.plan.result import HeadsCheck, Plan, Problem, Remedy, SkippedRow, TensorRow
from cpdoctor.models.catalog import ModelEntry, list_models, resolve_model
from cpdoctor.report import Report

__all__ = [
    "HeadsCheck",
    "ModelEntry",
    "Plan",
    "PlanRequest",
    "Problem",
    "Remedy",
    "TensorRow",
    "list_models",
    "plan_model",
    "resolve_model",
]


def plan_model(
    model: str,
    height: int | None = None,
    width: int | None = None,
    text_len: int | None = None,
    ring: int = 1,
    ulysses: int = 1,
    frames: int | None = None,
) -> Report:
    """Measure every CP split of `model` (short name, class name or checkpoint directory) at these settings.

    height / width / text_len / frames default to the family's pipeline defaults. Raises BadInput for unknown
    models and impossible settings, CannotExamine when the model's inputs cannot be built or its meta forward
    fails. Problems found are FAIL findings of the report, not raised.
    """
    started = time.perf_counter()
    request = PlanRequest(model, height, width, text_len, ring, ulysses, frames)
    plan = measure_plan(setup(request))
    plan.seconds = time.perf_counter() - started
    findings = plan_findings(plan, request.model)
    return Report.of(findings, _environment(), request.to_dict(), wall_s=plan.seconds, extra=plan.extra())


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


def _measure_base(meas: Measurer, s: Setup) -> Measurement:
    """The forward at the requested settings, with the inputs the pipelines pass for one unpadded prompt
    (Qwen-Image drops an all-ones mask, so no text mask)."""
    base = meas.measure(s.height, s.width, s.text_len, s.frames, text_mask=False)
    if not base.lengths:
        raise CannotExamine(f"none of {s.resolved.cls.__name__}'s _cp_plan entries saw a tensor in its meta forward")
    return base


def heads_checks(base: Measurement, full_config: dict[str, Any], ulysses: int) -> list[HeadsCheck]:
    """Query/key heads per attention call (or, when no call was seen, every *num_attention_heads of the config)."""
    pairs, source = sorted(base.heads), "attention calls"
    if not pairs:
        heads = {int(v) for k, v in full_config.items() if k.endswith("num_attention_heads") and isinstance(v, int)}
        pairs, source = sorted((h, h) for h in heads), "config"
    return [HeadsCheck(q, kv, ulysses, q % ulysses == 0 and kv % ulysses == 0, source) for q, kv in pairs]


def tensor_rows(base: Measurement, plan: Any, world: int, depends: dict[Key, list[str]]) -> list[TensorRow]:
    """One row per measured (tensor, length), in the order of the class's `_cp_plan`."""
    rows = []
    for key in sorted(base.lengths, key=lambda k: plan_order(plan, k)):
        for length, calls in sorted(base.lengths[key].items()):
            rows.append(
                TensorRow(
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


def skipped_rows(base: Measurement) -> list[SkippedRow]:
    measured = {k.name for k in base.lengths}
    return [SkippedRow(n, r) for n, r in sorted(base.skipped.items()) if n not in measured]


def _base_notes(s: Setup, base: Measurement) -> list[str]:
    notes = []
    if (base.height, base.width) != (s.height, s.width):
        notes.append(f"{s.height}x{s.width} is not a multiple of {s.step}: the pipeline uses {base.height}x{base.width}")
    if s.frames is not None and base.frames != s.frames:
        b = s.builder
        notes.append(f"{s.frames} frames is not {b.frames_step}k+{b.frames_offset}: the pipeline uses {base.frames}")
    return notes


def _mask_note(s: Setup, base: Measurement, found: Found) -> list[str]:
    """Under ring attention a split text mask must follow the KV chunks: point at `cpdoctor check`."""
    padded = any(r.kind == "text_padding" and r.values.get("mask") for p in found.problems for r in p.remedies)
    split = any(k.kind == "split" and "mask" in k.item for k in base.lengths)
    if s.ring > 1 and (padded or split):
        return [
            "a text mask is split: under ring attention each rank's mask must follow the KV chunks it meets "
            "(`cpdoctor check` measures whether this install does that)"
        ]
    return []


def _settings(s: Setup, base: Measurement, meas: Measurer) -> dict[str, Any]:
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


def _environment() -> dict[str, Any]:
    """What the measurement ran on: no weights, no compute, the meta device."""
    import torch

    return {"torch": torch.__version__, "diffusers": importlib.metadata.version("diffusers"), "device": "meta"}
