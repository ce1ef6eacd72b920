"""The model examination's parent side, before any rank starts: fill the shapes left unset, check what can be
checked without weights (the model resolves, a text mask exists for --mask-pad, heads divide by Ulysses, every
split the model's `_cp_plan` makes divides: plan's measurement, `cpdoctor.model_zoo.splits`, which also moves the
family's small default shapes to the nearest that divide when the user gave none), choose how many blocks
fit in memory (the memory plan), and check that a sliced checkpoint has every tensor it needs. `prepare` returns
the request with all of it filled in, the memory plan included, and the time plan for a half dtype on the CPU
(`cpdoctor.model_zoo.throughput`: a 50-ms matmul probe, and a warning where that dtype is far slower than fp32)."""

from __future__ import annotations

import os
from typing import Any

from cpdoctor.compat import diffusers as compat
from cpdoctor.errors import BadInput
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.model.spec import ModelSpec, is_sliced, model_survey, request_spec, sliced_config, text_mask_param
from cpdoctor.model_zoo.memory import available_memory
from cpdoctor.model_zoo.splits.plan import plan_command, remedy_line
from cpdoctor.model_zoo.splits.result import RemedyKind
from cpdoctor.model_zoo.throughput import time_plan
from cpdoctor.vocabulary import Device

DEFAULT_TEXT_LEN = 8
RESOLUTION_STEPS = 8
"""Default height = width = 8 × the family's resolution step: 64 image tokens for the packed-image models
(128 px at 16 px per token), 2 × 64 video tokens for Wan at 5 frames; with 8 text tokens everything divides by
ring × ulysses up to 8."""


def prepare(req: ModelRequest) -> ModelRequest:
    """The request with every shape, the blocks that fit, the reference dtype and the memory plan filled in, and
    the tiny config derived for a name; BadInput for anything that cannot work, before any process starts. A plan
    that does not fit the model at those blocks is recorded (`misfit`), not raised: the examination refuses it as
    its own finding (ModelExamination.unsupported_here), and nothing after it is planned."""
    req = req.validate()
    spec = request_spec(req)
    if spec.weights is not None and spec.weights.revision:
        req = req.with_fields(revision=spec.weights.revision)  # the ranks load the commit the parent resolved
    req = req.with_fields(tiny=spec.tiny)
    shapes_given = any(getattr(req, k) is not None for k in ("height", "width", "text_len", "frames"))
    req, kwargs = fill_shapes(req, spec)
    survey = model_survey(spec)
    if req.blocks is not None and req.blocks > survey.depth:
        depths = ", ".join(f"{s.name} {s.depth}" for s in survey.stacks) or "no block stacks"
        raise BadInput(f"--blocks {req.blocks} is beyond the depth of {spec.short_name} ({depths}); give 1 to {survey.depth}")
    fitted = fit_divisibility(spec, req, survey, shapes_given)
    if fitted is not req:
        req, kwargs = fill_shapes(fitted, spec)
    req = req.with_fields(blocks=choose_blocks(spec, req, survey, kwargs))
    misfit = plan_misfit_at(spec, req.blocks)
    if misfit is not None:
        return req.with_fields(misfit=misfit)
    check_needed_files(spec, req)
    plan = memory_plan(spec, req, survey, kwargs)
    return req.with_fields(reference=plan.reference_dtype, memory=plan, timing=time_plan(plan))


def fill_shapes(req: ModelRequest, spec: ModelSpec) -> tuple[ModelRequest, dict[str, Any]]:
    """Height, width, text length and frames (the family's small defaults, rounded as its pipeline rounds
    them), checked against the model (a text mask for --mask-pad, heads for Ulysses); the request with them
    and the forward's arguments on the meta device."""
    from cpdoctor.model_zoo.inputs import build_inputs

    builder = spec.builder
    full = spec.full_config()
    step = builder.resolution_multiple(full)
    height = req.height or RESOLUTION_STEPS * step
    width = req.width or RESOLUTION_STEPS * step
    text_len = req.text_len or DEFAULT_TEXT_LEN
    frames = req.frames
    if builder.is_video:
        frames = frames or builder.small_frames
    elif frames is not None:
        raise BadInput(f"{spec.short_name} is an image model; --frames applies to video models only")
    if height < step or width < step:
        raise BadInput(f"--height and --width must be at least {step} for {spec.short_name} (its resolution step)")
    check_model_takes(req, spec, text_len, full.get("num_attention_heads"))
    inputs = build_inputs(spec.cls, full, height, width, text_len, frames, batch=req.batch, device="meta", text_mask=bool(req.mask_pad))
    return req.with_fields(height=inputs.height, width=inputs.width, text_len=text_len, frames=inputs.frames), inputs.kwargs


def plan_misfit_at(spec: ModelSpec, blocks: int | None) -> Any:
    """The first entry of the class's `_cp_plan` that the model cut to `blocks` blocks a stack does not have
    (cpdoctor.model_zoo.plan_fit.PlanMisfit), None when the plan fits; measured on the meta device."""
    from cpdoctor.model_zoo.catalog import build_model
    from cpdoctor.model_zoo.plan_fit import plan_misfit

    with compat.quiet():
        return plan_misfit(build_model(spec.cls, sliced_config(spec, blocks), device="meta"))


def check_model_takes(req: ModelRequest, spec: ModelSpec, text_len: int, heads: Any) -> None:
    """A text mask when --mask-pad asks for one (shorter than the text), gradient checkpointing when
    --checkpointing asks for it, heads that divide by --ulysses."""
    if req.mask_pad:
        if text_mask_param(spec) is None:
            raise BadInput(f"{spec.short_name} ({spec.class_name}) takes no text mask in its forward; --mask-pad does not apply")
        if req.mask_pad >= text_len:
            raise BadInput(f"--mask-pad must be between 0 and text-len - 1 = {text_len - 1}, got {req.mask_pad}")
    if req.checkpointing and not compat.supports_gradient_checkpointing(spec.cls):
        raise BadInput(
            f"{spec.short_name} ({spec.class_name}) does not support gradient checkpointing (enable_gradient_checkpointing() "
            "refuses it): --checkpointing does not apply"
        )
    if isinstance(heads, int) and heads % req.ulysses:
        raise BadInput(
            f"{spec.short_name} has {heads} attention heads, which do not divide by --ulysses {req.ulysses}: Ulysses splits the heads"
        )


def _plan_device(req: ModelRequest) -> str:
    if req.device is Device.CUDA:
        return "cuda"
    if req.device is Device.AUTO:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _tokens(kwargs: dict[str, Any]) -> int:
    total = 0
    for k in ("hidden_states", "encoder_hidden_states"):
        t = kwargs.get(k)
        if t is not None and getattr(t, "ndim", 0) == 3:
            total += int(t.shape[1])
    return total


def memory_plan(
    spec: ModelSpec, req: ModelRequest, survey: Any, kwargs: dict[str, Any], blocks: int | None = None, available: Any = "measure"
) -> Any:
    """The memory plan of this examination with `blocks` (default req.blocks) blocks per stack."""
    from cpdoctor.model_zoo import memory

    n = blocks if blocks is not None else (req.blocks or survey.depth)
    full = spec.full_config()
    hidden = int(full.get("num_attention_heads") or 0) * int(full.get("attention_head_dim") or 0)
    device = _plan_device(req)
    sizes = memory.Sizes(
        params=survey.params(n),
        blocks=survey.blocks(n),
        tokens=_tokens(kwargs),
        hidden=hidden,
        batch=req.batch,
        dtype=req.dtype,
        world=req.world_size,
        device=device,
    )
    avail = available_memory(device) if available == "measure" else available
    return memory.plan(sizes, avail, {s.name: min(n, s.depth) for s in survey.stacks})


def choose_blocks(spec: ModelSpec, req: ModelRequest, survey: Any, kwargs: dict[str, Any]) -> int | None:
    """req.blocks when it fits; the most that fit when not given (None for a model without stacks). BadInput
    with the --blocks that would fit otherwise."""
    from cpdoctor.model_zoo import memory

    if not survey.stacks:
        return None
    avail = available_memory(_plan_device(req))

    def plan_for(n: int) -> Any:
        return memory_plan(spec, req, survey, kwargs, blocks=n, available=avail)

    if req.blocks is not None:
        wanted = plan_for(req.blocks)
        if wanted.fits:
            return req.blocks
        best = memory.most_blocks(plan_for, survey.depth)
        hint = f"--blocks {best} fits" if best else "not even --blocks 1 fits; lower --height/--width/--text-len or use bf16"
        raise BadInput(
            f"--blocks {req.blocks} needs {memory.gib(wanted.device_peak)} on {wanted.sizes.device} "
            f"(reference {wanted.reference_dtype}), {memory.gib(avail or 0)} available: {hint}"
        )
    best = memory.most_blocks(plan_for, survey.depth)
    if best == 0:
        one = plan_for(1)
        raise BadInput(
            f"{spec.short_name} does not fit even with --blocks 1: it needs {memory.gib(one.device_peak)} on "
            f"{one.sizes.device}, {memory.gib(avail or 0)} available; lower --height/--width/--text-len or use --dtype bf16"
        )
    return best


def check_needed_files(spec: ModelSpec, req: ModelRequest) -> None:
    """A sliced safetensors checkpoint: every tensor the sliced model needs is in the index (or the file), and
    the shard holding it exists and reads (BadInput naming the first that does not)."""
    from cpdoctor.model_zoo import checkpoints, slicing

    weights = spec.weights
    if weights is None or not weights.use_safetensors or not is_sliced(spec, req.blocks):
        return
    index = slicing.index_file_of(weights.weight_files, weights.model_dir, weights.variant)
    if index is None:
        return
    where = slicing.weight_map(weights.weight_files, index)
    needed = slicing.selected_keys(spec.cls, sliced_config(spec, req.blocks))
    missing = [k for k in needed if k not in where]
    if missing:
        raise BadInput(
            f"{index} names no shard for {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; is it a {spec.class_name}?"
        )
    for path in sorted({where[k] for k in needed}):
        if not os.path.isfile(path):
            raise BadInput(f"{index} names the shard {os.path.basename(path)}, which is missing (--blocks {req.blocks} needs it)")
        checkpoints.check_safetensors(path)


SHAPE_REMEDIES = (RemedyKind.RESOLUTION, RemedyKind.FRAMES, RemedyKind.TEXT_PADDING)
"""The ways out `prepare` may take by itself where the user gave no shape (never the degrees: those were asked)."""


def fit_divisibility(spec: ModelSpec, req: ModelRequest, survey: Any, shapes_given: bool) -> ModelRequest:
    """`cpdoctor plan`'s measurement at this layout (on the model cut to one block a stack: depth does not change a
    split). Where a split does not divide: with no shape given, the family's small defaults move to the nearest
    that divide (each problem's first measured resolution, frames or text length, applied together and measured
    again); otherwise, or when that fails, BadInput with plan's remedy, before diffusers' hooks assert."""
    if req.world_size < 2:
        return req
    plan = _measure(spec, req, survey)
    if not plan.problems:
        return req
    if not shapes_given:
        changes: dict[str, int] = {}
        for problem in plan.problems:
            chosen = next((r.settings() for r in problem.remedies if r.kind in SHAPE_REMEDIES and r.settings()), None)
            changes.update(chosen or {})
        moved = req.with_fields(**changes)
        if changes and not _measure(spec, moved, survey).problems:
            return moved
    problem = plan.problems[0]
    training = [r for r in problem.remedies if not r.kind.uneven_mode][:3]
    remedy = remedy_line(training) if training else "no measured way out at this layout"
    command = plan_command(spec.short_name if spec.weights is None else spec.weights.model_dir, plan.settings)
    raise BadInput(f"{indivisible(req, problem.what)}; plan's remedy: {remedy} (`{command}` lists every way out)")


def _measure(spec: ModelSpec, req: ModelRequest, survey: Any) -> Any:
    from cpdoctor.model_zoo.catalog import ResolvedModel, resolve_model
    from cpdoctor.model_zoo.splits.plan import Setup, measure_plan

    entry = resolve_model(spec.class_name).entry
    config = sliced_config(spec, 1) if survey.stacks else spec.full_config()
    resolved = ResolvedModel(spec.cls, entry, config, spec.source)
    builder = spec.builder
    step = builder.resolution_multiple(resolved.full_config())
    setup = Setup(resolved, builder, step, req.height, req.width, req.text_len, req.frames, req.ring, req.ulysses)
    return measure_plan(setup)


def indivisible(req: ModelRequest, what: str) -> str:
    frames = "" if req.frames is None else f", {req.frames} frames"
    return (
        f"{what} at {req.height}x{req.width}{frames}, text {req.text_len}: not divisible by ring × ulysses = "
        f"{req.world_size}, and diffusers asserts on uneven shards"
    )
