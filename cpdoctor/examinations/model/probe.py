"""Model-level CP parity: a real diffusers model class through its own `enable_parallelism`, output and every
parameter gradient, against the same model in one process.

Every rank builds the same model (a tiny config of the family seeded identically, or a local checkpoint
loaded with `from_pretrained(..., use_safetensors=True)`), sets the attention backend, enables context
parallelism with `ContextParallelConfig(ring_degree=, ulysses_degree=)` (the model's `_cp_plan` hooks split
the inputs and gather the output), feeds the same full inputs, back-propagates the same seeded upstream
gradient and sums the parameter gradients over the CP group (each rank back-propagates only its own tokens;
one collective for all of them). It then runs the op-level attention probe at the same ring × Ulysses layout
(the exact `cpdoctor check` the diagnosis suggests), so the verdict can say whether the attention op alone
reproduces what the model shows.

Rank 0 evaluates against the reference (the same weights and inputs in float64 on CPU, diffusers' default
attention backend) and measures the baseline (the same model in one process, probe dtype, same backend: the
error without CP, which sets the tolerance). Numbers only: verdict_model.py judges. Never prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from collections.abc import Iterator
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.measurement import Measurement, compare, rank_environment, torch_dtype
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.launch.jobs import Case

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ),
    "qwen-image": dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    ),
    "wan": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        rope_max_seq_len=32,
    ),
}
"""Family short name -> a config of the same architecture small enough that one fwd+bwd takes milliseconds on
a CPU. Weights are random, seeded identically on every rank."""

TINY_SOURCE = "tiny config"
REFERENCE_BACKEND = "native"
"""diffusers' default backend (torch SDPA), which runs in float64 on CPU."""
DEFAULT_TEXT_LEN = 8
RESOLUTION_STEPS = 8
"""Default height = width = 8 × the family's resolution step: 64 image tokens for the packed-image models
(128 px at 16 px per token), 2 × 64 video tokens for Wan at 5 frames; with 8 text tokens everything divides by
ring × ulysses up to 8."""


@dataclasses.dataclass
class ModelSpec:
    """What to build: the class, its config, and where the weights come from."""

    cls: type
    short_name: str
    class_name: str
    config: dict[str, Any]
    source: str  # TINY_SOURCE, the checkpoint directory or "hub cache org/name@commit"
    builder: Any
    weights: Any = None  # cpdoctor.models.checkpoints.Checkpoint, None for a tiny config

    @property
    def checkpoint(self) -> str | None:
        """The directory holding the transformer's config and weights, None for a tiny config."""
        return None if self.weights is None else self.weights.model_dir

    def full_config(self) -> dict[str, Any]:
        from cpdoctor.models.catalog import full_config

        return full_config(self.cls, self.config)


# --------------------------------------------------------------------------------------------------------------
# resolving the model and the request (also used by the parent, before any process starts)
# --------------------------------------------------------------------------------------------------------------


def resolve_spec(
    model: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    download: bool = False,
    allow_pickle: bool = False,
    partial: bool = False,
) -> ModelSpec:
    """The class and config for MODEL: a tiny config for a name, the checkpoint's own for a hub id (found in the
    local Hugging Face cache, fetched only with `download`), a pipeline or a transformer directory. BadInput
    for an unknown name, a family without a tiny config, checkpoint options given with a name, or a checkpoint
    that is missing, pickle-only, truncated or incomplete (cpdoctor.models.checkpoints)."""
    from cpdoctor.models import checkpoints
    from cpdoctor.models.catalog import builder_for, resolve_model

    weights = checkpoints.locate(model, revision=revision, variant=variant, download=download, allow_pickle=allow_pickle, partial=partial)
    resolved = resolve_model(model if weights is None else weights.config_file)
    cls, entry = resolved.cls, resolved.entry
    builder = builder_for(cls)
    if weights is None:
        given = [
            o
            for o, v in (("--revision", revision), ("--variant", variant), ("--download", download), ("--allow-pickle", allow_pickle))
            if v
        ]
        if given:
            raise BadInput(f"{' and '.join(given)} apply to a checkpoint (a hub id org/name or a directory), not to the name {model}")
        config = TINY_CONFIGS.get(entry.short_name)
        if config is None:
            raise BadInput(
                f"cpdoctor has no tiny config for {entry.short_name} ({entry.class_name}); pass a local checkpoint "
                f"directory instead (tiny configs: {', '.join(sorted(TINY_CONFIGS))})"
            )
        return ModelSpec(cls, entry.short_name, entry.class_name, dict(config), TINY_SOURCE, builder)
    return ModelSpec(cls, entry.short_name, entry.class_name, dict(weights.config), weights.source, builder, weights)


def request_spec(req: ModelRequest, *, local_only: bool = False) -> ModelSpec:
    """resolve_spec for a request. The ranks and rank 0's evaluation pass local_only: they never download, and
    `prepare` pinned a hub checkpoint's revision to the commit the parent resolved, so they load the same one."""
    return resolve_spec(
        req.model,
        revision=req.revision,
        variant=req.variant,
        download=req.download and not local_only,
        allow_pickle=req.allow_pickle,
        partial=req.blocks is not None,
    )


def _forward_params(cls: type) -> set[str]:
    return set(inspect.signature(cls.forward).parameters) - {"self"}


def text_mask_param(spec: ModelSpec) -> str | None:
    """The forward argument that masks text padding, when this model takes one."""
    name = getattr(spec.builder, "text_mask_param", None)
    return name if name and name in _forward_params(spec.cls) else None


def prepare(req: ModelRequest) -> tuple[ModelRequest, ModelSpec]:
    """Fill the shapes left unset and check, before any process starts, what can be checked without weights:
    the model resolves, a text mask exists when --mask-pad asks for one, heads divide by Ulysses, and every
    input the model's `_cp_plan` splits at its top level divides by ring × ulysses."""
    from cpdoctor.models.catalog import build_inputs

    req = req.validate()
    spec = request_spec(req)
    if spec.weights is not None and spec.weights.revision:
        req = req.with_fields(revision=spec.weights.revision)
    builder = spec.builder
    full = spec.full_config()
    step = builder.resolution_multiple(full)
    height = req.height or RESOLUTION_STEPS * step
    width = req.width or RESOLUTION_STEPS * step
    text_len = req.text_len or DEFAULT_TEXT_LEN
    frames = req.frames
    if builder.is_video:
        frames = frames or (builder.frames_step or 4) + builder.frames_offset
    elif frames is not None:
        raise BadInput(f"{spec.short_name} is an image model; --frames applies to video models only")
    if height < step or width < step:
        raise BadInput(f"--height and --width must be at least {step} for {spec.short_name} (its resolution step)")
    if req.mask_pad:
        if text_mask_param(spec) is None:
            raise BadInput(f"{spec.short_name} ({spec.class_name}) takes no text mask in its forward; --mask-pad does not apply")
        if req.mask_pad >= text_len:
            raise BadInput(f"--mask-pad must be between 0 and text-len - 1 = {text_len - 1}, got {req.mask_pad}")
    heads = full.get("num_attention_heads")
    if isinstance(heads, int) and heads % req.ulysses:
        raise BadInput(
            f"{spec.short_name} has {heads} attention heads, which do not divide by --ulysses {req.ulysses}: Ulysses splits the heads"
        )
    inputs = build_inputs(spec.cls, full, height, width, text_len, frames, batch=req.batch, device="meta", text_mask=bool(req.mask_pad))
    req = req.with_fields(height=inputs.height, width=inputs.width, text_len=text_len, frames=inputs.frames)
    survey = model_survey(spec)
    if req.blocks is not None and req.blocks > survey.depth:
        depths = ", ".join(f"{s.name} {s.depth}" for s in survey.stacks) or "no block stacks"
        raise BadInput(f"--blocks {req.blocks} is beyond the depth of {spec.short_name} ({depths}); give 1 to {survey.depth}")
    check_divisibility(spec, req, survey)
    blocks = choose_blocks(spec, req, survey, inputs.kwargs)
    req = req.with_fields(blocks=blocks)
    check_needed_files(spec, req)
    plan = memory_plan(spec, req, survey, inputs.kwargs)
    req = req.with_fields(reference=plan.reference_dtype)
    _PLANS[_plan_key(req)] = plan
    return req, spec


# --------------------------------------------------------------------------------------------------------------
# slicing to fit: the memory plan, and plan's divisibility check
# --------------------------------------------------------------------------------------------------------------

_PLANS: dict[tuple, Any] = {}
_SURVEYS: dict[tuple, Any] = {}


def _plan_key(req: ModelRequest) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in dataclasses.asdict(req).items()))


def model_survey(spec: ModelSpec) -> Any:
    """The model's block stacks (with the config keys that size them) and its parameters outside them."""
    from cpdoctor.models.slicing import survey

    key = (spec.cls.__name__, repr(sorted(spec.config.items())))
    if key not in _SURVEYS:
        _SURVEYS[key] = survey(spec.cls, spec.config)
    return _SURVEYS[key]


def sliced_config(spec: ModelSpec, blocks: int | None) -> dict[str, Any]:
    """The config with every stack cut to `blocks` (the full config for None)."""
    from cpdoctor.models.slicing import sliced_config as cut

    full = spec.full_config()
    if blocks is None:
        return full
    return cut(full, model_survey(spec).stacks, blocks)


def is_sliced(spec: ModelSpec, blocks: int | None) -> bool:
    return blocks is not None and any(s.depth > blocks for s in model_survey(spec).stacks)


def _plan_device(req: ModelRequest) -> str:
    if req.device == "cuda":
        return "cuda"
    if req.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cpu"


def _available(device: str) -> int | None:
    from cpdoctor.models.memory import available_host_memory

    if device == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:  # noqa: BLE001
            return None
    return available_host_memory()


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
    from cpdoctor.models import memory

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
    avail = _available(device) if available == "measure" else available
    return memory.plan(sizes, avail, {s.name: min(n, s.depth) for s in survey.stacks})


def choose_blocks(spec: ModelSpec, req: ModelRequest, survey: Any, kwargs: dict[str, Any]) -> int | None:
    """req.blocks when it fits; the most that fit when not given (None for a model without stacks). BadInput
    with the --blocks that would fit otherwise."""
    from cpdoctor.models import memory

    if not survey.stacks:
        return None
    avail = _available(_plan_device(req))

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
    from cpdoctor.models import checkpoints, slicing

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


def printed_plan(req: ModelRequest) -> Any:
    """The memory plan `prepare` made for this request (None when it made none)."""
    return _PLANS.get(_plan_key(req))


def check_divisibility(spec: ModelSpec, req: ModelRequest, survey: Any) -> None:
    """`cpdoctor plan`'s measurement at this layout (on the model cut to one block a stack: depth does not
    change a split): an indivisible split is BadInput with plan's remedy, before diffusers' hooks assert."""
    from cpdoctor.examinations.plan.judge import plan_command, remedy_line
    from cpdoctor.examinations.plan.probe import measure_plan
    from cpdoctor.examinations.plan.request import Setup
    from cpdoctor.models.catalog import ResolvedModel, resolve_model

    if req.world_size < 2:
        return
    entry = resolve_model(spec.class_name).entry
    config = sliced_config(spec, 1) if survey.stacks else spec.full_config()
    resolved = ResolvedModel(spec.cls, entry, config, spec.source)
    builder = spec.builder
    setup = Setup(
        resolved,
        builder,
        builder.resolution_multiple(resolved.full_config()),
        req.height,
        req.width,
        req.text_len,
        req.frames,
        req.ring,
        req.ulysses,
    )
    plan = measure_plan(setup)
    if not plan.problems:
        return
    problem = plan.problems[0]
    training = [r for r in problem.remedies if not r.kind.endswith("_anything")][:3]
    remedy = remedy_line(training) if training else "no measured way out at this layout"
    command = plan_command(spec.short_name if spec.weights is None else spec.weights.model_dir, plan.settings)
    raise BadInput(f"{_indivisible(spec, req, problem.what)}; plan's remedy: {remedy} (`{command}` lists every way out)")


def _indivisible(spec: ModelSpec, req: ModelRequest, what: str) -> str:
    frames = "" if req.frames is None else f", {req.frames} frames"
    return (
        f"{what} at {req.height}x{req.width}{frames}, text {req.text_len}: not divisible by ring × ulysses = "
        f"{req.world_size}, and diffusers asserts on uneven shards"
    )


# --------------------------------------------------------------------------------------------------------------
# building the model and its inputs (identical on every rank for a seed)
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers warns on every enable_parallelism / set_attention_backend ("experimental") and torch on the
    functional collectives diffusers calls; probes never print."""
    try:
        from diffusers.utils import logging as dlogging
    except ImportError:
        yield
        return
    level = dlogging.get_verbosity()
    dlogging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the funcol diffusers calls
            yield
    finally:
        dlogging.set_verbosity(level)


def build_model(spec: ModelSpec, req: ModelRequest, device: Any, dtype: Any, stats: Any = None) -> Any:
    """The model in `dtype` on `device`, cut to req.blocks blocks a stack: weights seeded with req.seed (tiny) or
    loaded (checkpoint), rounded through fp32 so every rank and the reference round them the same way. A cut
    checkpoint is built with its parameters on the meta device and reads only its own tensors, one at a time
    (`stats`, a cpdoctor.models.slicing.ReadStats, counts them)."""
    import torch

    torch.manual_seed(req.seed)
    weights = spec.weights
    sliced = is_sliced(spec, req.blocks)
    if weights is not None and sliced and weights.use_safetensors:
        from cpdoctor.models import slicing

        index = slicing.index_file_of(weights.weight_files, weights.model_dir, weights.variant)
        where = slicing.weight_map(weights.weight_files, index)

        model = slicing.load_sliced(spec.cls, sliced_config(spec, req.blocks), where, stats, dtype=dtype)
        return model.to(device).eval()
    if weights is not None:
        try:
            model = spec.cls.from_pretrained(
                weights.directory,
                subfolder=weights.subfolder,
                variant=weights.variant,
                use_safetensors=weights.use_safetensors,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise BadInput(f"cannot load {weights.source}: {str(exc).strip().splitlines()[0]}") from exc
    else:
        from cpdoctor.models.catalog import build_model as catalog_build

        model = catalog_build(spec.cls, sliced_config(spec, req.blocks) if sliced else spec.config, device="cpu")
    model = model.to(dtype=torch.float32)
    return model.to(dtype=dtype).to(device).eval()


def make_inputs(spec: ModelSpec, req: ModelRequest, config: Any) -> dict[str, Any]:
    """The full forward kwargs on CPU in fp32 rounded to the probe dtype (floating tensors), the text padding
    mask applied, identical on every rank."""
    import torch

    from cpdoctor.models.catalog import build_inputs

    gen = torch.Generator().manual_seed(req.seed + 1)
    inputs = build_inputs(
        spec.cls,
        dict(config),
        req.height,
        req.width,
        req.text_len,
        req.frames,
        batch=req.batch,
        device="cpu",
        dtype=torch.float32,
        text_mask=bool(req.mask_pad),
        generator=gen,
    )
    kwargs = cast_inputs(inputs.kwargs, torch_dtype(req.dtype), "cpu")
    if req.mask_pad:
        name = text_mask_param(spec)
        kwargs[name][:, req.text_len - req.mask_pad :] = 0
    return kwargs


def cast_inputs(kwargs: dict[str, Any], dtype: Any, device: Any) -> dict[str, Any]:
    import torch

    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device).clone()
        out[k] = v
    return out


def upstream_grad(shape: tuple[int, ...], req: ModelRequest) -> Any:
    import torch

    gen = torch.Generator().manual_seed(req.seed + 2)
    return torch.randn(shape, generator=gen).to(torch_dtype(req.dtype))


def _output(result: Any) -> Any:
    if isinstance(result, (tuple, list)):
        return result[0]
    return getattr(result, "sample", result)


def step(model: Any, kwargs: dict[str, Any], req: ModelRequest, device: Any, dtype: Any) -> tuple[Any, Any, list]:
    """Forward and backward with the seeded upstream gradient: (output on CPU, flat fp32 parameter grads, the
    parameter layout); the model's own gradients are dropped."""
    out = _output(model(**cast_inputs(kwargs, dtype, device)))
    grad = upstream_grad(tuple(out.shape), req).to(device=device, dtype=out.dtype)
    out.backward(grad)
    layout = param_layout(model)
    return out.detach().cpu(), flat_grads(model), layout


def flat_grads(model: Any) -> Any:
    """All parameter gradients in named_parameters order, flattened into one fp32 CPU vector (zeros where a
    parameter got none). Each parameter's gradient is dropped once copied, so a large model never holds its
    gradients twice."""
    import torch

    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)  # pages touched only as filled
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            flat[offset : offset + n].copy_(p.grad.detach().reshape(-1))
            p.grad = None
        else:
            flat[offset : offset + n].zero_()
        offset += n
    return flat


class _Errors:
    """Relative L2 error, max abs error and non-finite count of one vector against a reference, accumulated a
    chunk at a time in fp64 (`measurement.compare`, for vectors too long to copy into fp64 at once)."""

    def __init__(self) -> None:
        self.sq = self.ref_sq = self.max_abs = 0.0
        self.nonfinite = 0

    def add(self, x: Any, rd: Any, ref_sq: float) -> None:
        import torch

        finite = torch.isfinite(x)
        if bool(finite.all()):
            diff = x.double() - rd
        else:
            self.nonfinite += int((~finite).sum())
            diff = torch.where(finite, x.double() - rd, torch.zeros_like(rd))
        self.sq += float(torch.dot(diff, diff))
        self.ref_sq += ref_sq
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.abs().max()))

    def result(self) -> dict[str, float]:
        import math

        denom = math.sqrt(self.ref_sq) or 1.0
        return {
            "rel_err": math.sqrt(self.sq) / denom if not self.nonfinite else float("inf"),
            "max_abs": self.max_abs,
            "nonfinite": self.nonfinite,
        }


CHUNK = 1 << 22


def grad_errors(
    cp: Any, base: Any | None, ref: Any, layout: list[tuple[str, int, bool]], ref_layout: list
) -> tuple[dict, dict, dict | None]:
    """(per parameter, all of the CP grads, all of the no-CP grads) against the reference, in one pass over the
    flat vectors: each reference chunk is converted to fp64 once and serves both."""
    import math

    import torch

    params: dict[str, dict] = {}
    total_cp, total_base = _Errors(), None if base is None else _Errors()
    offset = 0
    for (name, numel, _), (_, _, ref_has_grad) in zip(layout, ref_layout):
        mine, theirs = _Errors(), None if base is None else _Errors()
        for i in range(offset, offset + numel, CHUNK):
            j = min(i + CHUNK, offset + numel)
            rd = ref[i:j].double()
            rsq = float(torch.dot(rd, rd))
            for acc, whole, vec in ((mine, total_cp, cp), (theirs, total_base, base)):
                if acc is None or whole is None:
                    continue
                before = (acc.sq, acc.nonfinite, acc.max_abs)
                acc.add(vec[i:j], rd, rsq)
                whole.sq += acc.sq - before[0]
                whole.nonfinite += acc.nonfinite - before[1]
                whole.ref_sq += rsq
                whole.max_abs = max(whole.max_abs, acc.max_abs)
        offset += numel
        if not ref_has_grad:
            continue
        c = mine.result()
        params[name] = {
            "rel_err": c["rel_err"],
            "max_abs": c["max_abs"],
            "nonfinite": c["nonfinite"],
            "numel": numel,
            "ref_norm": math.sqrt(mine.ref_sq),
            "baseline_rel_err": None if theirs is None else theirs.result()["rel_err"],
        }
    return params, total_cp.result(), None if total_base is None else total_base.result()


def param_layout(model: Any) -> list[tuple[str, int, bool]]:
    """(name, numel, got a gradient) per parameter, in the order of flat_grads (taken after the backward and
    before flat_grads drops the gradients)."""
    return [(n, p.numel(), p.grad is not None) for n, p in model.named_parameters()]


def select_backend(req: ModelRequest, spec: ModelSpec, device: Any) -> tuple[str, Any]:
    """The backend to examine with the model's own heads (per Ulysses rank) and head dim."""
    from cpdoctor.examinations.attention import probe as attention
    from cpdoctor.examinations.attention.request import AttentionRequest

    full = spec.full_config()
    heads = int(full.get("num_attention_heads") or 2)
    head_dim = int(full.get("attention_head_dim") or 64)
    probe_req = AttentionRequest(
        ring=req.ring, ulysses=req.ulysses, backend=req.backend, dtype=req.dtype, heads=heads, head_dim=head_dim, emulate=req.emulate
    )
    return attention.select_backend(probe_req, device)


def _is_split_assertion(exc: BaseException) -> bool:
    return isinstance(exc, AssertionError) and "divisible" in str(exc)


# --------------------------------------------------------------------------------------------------------------
# the probe
# --------------------------------------------------------------------------------------------------------------


def run_rank(case: Case, ctx: Any) -> dict:
    """This rank's CP run of the model: its (gathered) output, the parameter gradients summed over the CP
    group (rank 0 keeps them), and the op-level payloads at the same layout."""
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.attention import probe as attention
    from cpdoctor.fix import patch as fix_patch
    from cpdoctor.kernels import cpu_backend

    req: ModelRequest = case.request.validate()
    attention.prepare_emulation(req)  # the kernel stand-ins, before diffusers is imported (with --emulate)
    fix_patch.set_patched(case.patched, dkv=case.options.get("dkv"))
    cpu_backend.register()
    with quiet_diffusers(), compat.preserved_active_backend():
        spec = request_spec(req, local_only=True)
        name, facts = select_backend(req, spec, ctx.device)
        reason = facts.unsupported_reason(req.ring)
        if not reason and not facts.cp_registered:
            reason = f"{name} is not registered as context-parallel capable, and enable_parallelism refuses it"
        if reason:
            return {"unsupported": reason, "backend": name, "facts": facts.to_dict()}
        from cpdoctor.examinations.model.blocks import BlockRecorder
        from cpdoctor.models.slicing import ReadStats

        dtype = torch_dtype(req.dtype)
        stats = ReadStats()
        model = build_model(spec, req, ctx.device, dtype, stats)
        recorder = BlockRecorder(model)
        kwargs = make_inputs(spec, req, model.config)
        model.set_attention_backend(name)
        mesh = ctx.cp_mesh(req.ring, req.ulysses)
        with compat.accelerator_count_at_least_one():
            model.enable_parallelism(config=compat.context_parallel_config(req.ring, req.ulysses, mesh=mesh))
        try:
            out, grads, layout = step(model, kwargs, req, ctx.device, dtype)
        except AssertionError as exc:
            if _is_split_assertion(exc):
                raise BadInput(
                    _indivisible(spec, req, "an input the model splits inside its forward")
                    + f" (`cpdoctor plan {spec.short_name} --ring {req.ring} --ulysses {req.ulysses}` names sizes that divide)"
                ) from exc
            raise
        summed = ctx.all_sum_cpu(grads)
        recorded = recorder.record()
        recorder.remove()
        del model
        op_payloads = []
        for op_request in case.options.get("op_requests", ()):
            try:
                op_payloads.append({"ok": attention.run_rank(Case(op_request, case.patched, case.options), ctx)})
            except Exception as exc:  # noqa: BLE001 - the op-level cross-check is evidence, not the examination
                op_payloads.append({"error": f"{type(exc).__name__}: {exc}"})
    return {
        "backend": name,
        "facts": facts.to_dict(),
        "out": out,
        "grads": _keep_on_rank0(case, summed) if ctx.rank == 0 else None,
        "layout": layout if ctx.rank == 0 else None,
        "op": op_payloads,
        "blocks": recorded,
        "read": stats.to_dict(),
    }


_RANK0: dict[int, Any] = {}


def _keep_on_rank0(case: Case, tensor: Any) -> Any:
    """Rank 0 keeps its summed gradients in this process (it evaluates here) instead of sending them through the
    payload gather, which pickles them and pads every rank's payload to the largest one: a full-width model's
    gradients would cross the gather, and sit in memory, several times over. The payload carries a ticket."""
    ticket = len(_RANK0) + 1
    _RANK0[ticket] = tensor
    return {"kept_on_rank0": ticket}


def _kept_on_rank0(value: Any) -> Any:
    if isinstance(value, dict) and "kept_on_rank0" in value:
        return _RANK0.pop(value["kept_on_rank0"])
    return value


def reference_dtype(req: ModelRequest) -> Any:
    """fp64 unless the memory plan `prepare` made chose fp32 (req.reference) for the reference."""
    import torch

    return torch.float32 if req.reference == "fp32" else torch.float64


def environment(ctx: Any, backend: str, req: ModelRequest) -> dict[str, Any]:
    env = rank_environment(ctx, backend, req)
    env["model"] = req.model
    return env


def _model_info(spec: ModelSpec, req: ModelRequest, kwargs: dict[str, Any], layout: list) -> dict[str, Any]:
    tokens = {}
    for k in ("hidden_states", "encoder_hidden_states"):
        t = kwargs.get(k)
        if t is not None and t.ndim == 3:
            tokens[k] = int(t.shape[1])
    return {
        "short_name": spec.short_name,
        "class_name": spec.class_name,
        "source": spec.source,
        "parameters": int(sum(n for _, n, _ in layout)),
        "parameter_tensors": len(layout),
        "height": req.height,
        "width": req.width,
        "frames": req.frames,
        "text_len": req.text_len,
        "tokens": tokens,
    }


def evaluate(case: Case, payloads: list[dict], ctx: Any) -> Measurement:
    """On rank 0: the CP output and summed gradients against the fp64 single-process reference, the no-CP
    error in the probe dtype (the baseline), per parameter too, and the op-level cross-check."""
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.attention import probe as attention

    req: ModelRequest = case.request
    attention.prepare_emulation(req)
    first = payloads[0]
    backend = first["backend"]
    result = Measurement(backend, first["facts"], environment(ctx, backend, req))
    unsupported = [p["unsupported"] for p in payloads if "unsupported" in p]
    with quiet_diffusers(), compat.preserved_active_backend():
        spec = request_spec(req, local_only=True)
        if unsupported:
            result.unsupported = unsupported[0]
            result.details["model"] = {"short_name": spec.short_name, "class_name": spec.class_name, "source": spec.source}
            return result
        from cpdoctor.examinations.model.blocks import BlockRecorder, block_errors

        dtype = torch_dtype(req.dtype)
        base_model = build_model(spec, req, ctx.device, dtype)
        base_rec = BlockRecorder(base_model)
        kwargs = make_inputs(spec, req, base_model.config)
        base_out = base_grads = base_blocks = None
        try:
            base_model.set_attention_backend(backend)
            base_out, base_grads, _ = step(base_model, kwargs, req, ctx.device, dtype)
            base_blocks = base_rec.record()
        except Exception as exc:  # noqa: BLE001 - a backend without a local path still gets a dtype-only tolerance
            result.baseline_error = f"{type(exc).__name__}: {exc}"
        base_rec.remove()
        del base_model, base_rec
        ref_dtype = reference_dtype(req)
        ref_device = ctx.device  # the accelerator when there is one
        ref_model = build_model(spec, req, ref_device, dtype).to(ref_dtype)
        ref_rec = BlockRecorder(ref_model)
        ref_model.set_attention_backend(REFERENCE_BACKEND)  # set_attention_backend also sets the global active one
        ref_out, ref_grads, ref_layout = step(ref_model, kwargs, req, ref_device, ref_dtype)
        ref_blocks = ref_rec.record()
        ref_rec.remove()
        result.details["model"] = _model_info(spec, req, kwargs, ref_layout)
        result.details["model"]["reference_dtype"] = str(ref_dtype).replace("torch.float", "fp")
        result.details["model"]["read"] = first.get("read")
        result.details["model"]["stacks"] = {
            s.name: {"examined": min(req.blocks or s.depth, s.depth), "depth": s.depth} for s in model_survey(spec).stacks
        }
        del ref_model, ref_rec
        result.details["blocks"] = block_errors([p["blocks"] for p in payloads], base_blocks, ref_blocks)

    per_rank = [compare(p["out"], ref_out) for p in payloads]
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["rel_err"])
    out_row = {
        **per_rank[worst],
        "worst_rank": worst,
        "per_rank_rel_err": [p["rel_err"] for p in per_rank],
        "baseline_rel_err": None if base_out is None else compare(base_out, ref_out)["rel_err"],
    }
    grads = _kept_on_rank0(first["grads"])
    params, all_cp, all_base = grad_errors(grads, base_grads, ref_grads, first["layout"], ref_layout)
    grads_row = {
        **all_cp,
        "worst_rank": None,
        "per_rank_rel_err": [],
        "baseline_rel_err": None if all_base is None else all_base["rel_err"],
    }
    result.tensors = {"out": out_row, "grads": grads_row}
    result.details["params"] = params

    op_results = []
    for i, op_request in enumerate(case.options.get("op_requests", ())):
        ops = [p["op"][i] if i < len(p["op"]) else {"error": "not run"} for p in payloads]
        errors = [o["error"] for o in ops if "error" in o]
        if errors:
            op_results.append({"request": op_request, "error": errors[0]})
            continue
        try:
            evaluated = attention.evaluate(Case(op_request, case.patched), [o["ok"] for o in ops], ctx)
        except Exception as exc:  # noqa: BLE001
            op_results.append({"request": op_request, "error": f"{type(exc).__name__}: {exc}"})
            continue
        op_results.append({"request": op_request, "evaluated": evaluated})
    result.details["op_level"] = op_results
    return result
