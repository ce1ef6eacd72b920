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
import warnings
from typing import Any, Iterator

from cpdoctor.errors import BadInput
from cpdoctor.examinations.measurement import Measurement, compare, rank_environment, torch_dtype
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.launch.jobs import Case

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    ),
    "qwen-image": dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    ),
    "wan": dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=32,
        freq_dim=32, ffn_dim=64, num_layers=1, rope_max_seq_len=32,
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
) -> ModelSpec:
    """The class and config for MODEL: a tiny config for a name, the checkpoint's own for a hub id (found in the
    local Hugging Face cache, fetched only with `download`), a pipeline or a transformer directory. BadInput
    for an unknown name, a family without a tiny config, checkpoint options given with a name, or a checkpoint
    that is missing, pickle-only, truncated or incomplete (cpdoctor.models.checkpoints)."""
    from cpdoctor.models import checkpoints
    from cpdoctor.models.catalog import builder_for, resolve_model

    weights = checkpoints.locate(model, revision=revision, variant=variant, download=download, allow_pickle=allow_pickle)
    resolved = resolve_model(model if weights is None else weights.config_file)
    cls, entry = resolved.cls, resolved.entry
    builder = builder_for(cls)
    if weights is None:
        given = [o for o, v in (("--revision", revision), ("--variant", variant), ("--download", download), ("--allow-pickle", allow_pickle)) if v]
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
        req.model, revision=req.revision, variant=req.variant, download=req.download and not local_only,
        allow_pickle=req.allow_pickle,
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
        raise BadInput(f"{spec.short_name} has {heads} attention heads, which do not divide by --ulysses {req.ulysses}: Ulysses splits the heads")
    inputs = build_inputs(spec.cls, full, height, width, text_len, frames, batch=req.batch, device="meta", text_mask=bool(req.mask_pad))
    req = req.with_fields(height=inputs.height, width=inputs.width, text_len=text_len, frames=inputs.frames)
    _check_top_level_splits(spec, req, inputs.kwargs)
    return req, spec


def _check_top_level_splits(spec: ModelSpec, req: ModelRequest, kwargs: dict[str, Any]) -> None:
    """Every `_cp_plan` input that is a forward argument as given (same rank) must divide by the world size;
    inner splits (after patchify, per block) are left to the ranks, which report diffusers' assertion."""
    world = req.world_size
    for spec_map in (spec.cls._cp_plan or {}).values():
        if not isinstance(spec_map, dict):
            continue
        for name, inp in spec_map.items():
            t = kwargs.get(name) if isinstance(name, str) else None
            dim, dims = getattr(inp, "split_dim", None), getattr(inp, "expected_dims", None)
            if t is None or dim is None or not hasattr(t, "shape") or (dims is not None and t.ndim != dims):
                continue
            length = t.shape[dim]
            if length % world:
                raise BadInput(_indivisible(spec, req, f"{name} has {length} tokens"))


def _indivisible(spec: ModelSpec, req: ModelRequest, what: str) -> str:
    frames = "" if req.frames is None else f", {req.frames} frames"
    return (
        f"{what} at {req.height}x{req.width}{frames}, text {req.text_len}: not divisible by ring × ulysses = "
        f"{req.world_size}, and diffusers asserts on uneven shards (`cpdoctor plan {spec.short_name} --ring {req.ring} "
        f"--ulysses {req.ulysses} --height {req.height} --width {req.width} --text-len {req.text_len}` names sizes that divide)"
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


def build_model(spec: ModelSpec, req: ModelRequest, device: Any, dtype: Any) -> Any:
    """The model in `dtype` on `device`: weights seeded with req.seed (tiny) or loaded (checkpoint), made in
    fp32 on CPU first so every rank and the reference round them the same way."""
    import torch

    torch.manual_seed(req.seed)
    weights = spec.weights
    if weights is not None:
        try:
            model = spec.cls.from_pretrained(
                weights.directory, subfolder=weights.subfolder, variant=weights.variant,
                use_safetensors=weights.use_safetensors,
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise BadInput(f"cannot load {weights.source}: {str(exc).strip().splitlines()[0]}") from exc
    else:
        from cpdoctor.models.catalog import build_model as catalog_build

        model = catalog_build(spec.cls, spec.config, device="cpu")
    model = model.to(dtype=torch.float32)
    return model.to(dtype=dtype).to(device).eval()


def make_inputs(spec: ModelSpec, req: ModelRequest, config: Any) -> dict[str, Any]:
    """The full forward kwargs on CPU in fp32 rounded to the probe dtype (floating tensors), the text padding
    mask applied, identical on every rank."""
    import torch

    from cpdoctor.models.catalog import build_inputs

    gen = torch.Generator().manual_seed(req.seed + 1)
    inputs = build_inputs(
        spec.cls, dict(config), req.height, req.width, req.text_len, req.frames, batch=req.batch, device="cpu",
        dtype=torch.float32, text_mask=bool(req.mask_pad), generator=gen,
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


def step(model: Any, kwargs: dict[str, Any], req: ModelRequest, device: Any, dtype: Any) -> tuple[Any, Any]:
    """Forward and backward with the seeded upstream gradient: (output on CPU, flat fp32 parameter grads)."""
    out = _output(model(**cast_inputs(kwargs, dtype, device)))
    grad = upstream_grad(tuple(out.shape), req).to(device=device, dtype=out.dtype)
    out.backward(grad)
    return out.detach().cpu(), flat_grads(model)


def flat_grads(model: Any) -> Any:
    """All parameter gradients in named_parameters order, flattened into one fp32 CPU vector (zeros where a
    parameter got none)."""
    import torch

    parts = []
    for _, p in model.named_parameters():
        g = p.grad
        parts.append(torch.zeros(p.numel()) if g is None else g.detach().float().reshape(-1).cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def param_layout(model: Any) -> list[tuple[str, int, bool]]:
    """(name, numel, got a gradient) per parameter, in the order of flat_grads."""
    return [(n, p.numel(), p.grad is not None) for n, p in model.named_parameters()]


def select_backend(req: ModelRequest, spec: ModelSpec, device: Any) -> tuple[str, Any]:
    """The backend to examine with the model's own heads (per Ulysses rank) and head dim."""
    from cpdoctor.examinations.attention import probe as attention
    from cpdoctor.examinations.attention.request import AttentionRequest

    full = spec.full_config()
    heads = int(full.get("num_attention_heads") or 2)
    head_dim = int(full.get("attention_head_dim") or 64)
    probe_req = AttentionRequest(ring=req.ring, ulysses=req.ulysses, backend=req.backend, dtype=req.dtype, heads=heads, head_dim=head_dim)
    return attention.select_backend(probe_req, device)


def _is_split_assertion(exc: BaseException) -> bool:
    return isinstance(exc, AssertionError) and "divisible" in str(exc)


# --------------------------------------------------------------------------------------------------------------
# the probe
# --------------------------------------------------------------------------------------------------------------


def run_rank(case: Case, ctx: Any) -> dict:
    """This rank's CP run of the model: its (gathered) output, the parameter gradients summed over the CP
    group (rank 0 keeps them), and the op-level payloads at the same layout."""
    from cpdoctor.kernels import cpu_backend
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix import patch as fix_patch
    from cpdoctor.examinations.attention import probe as attention

    req: ModelRequest = case.request.validate()
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
        dtype = torch_dtype(req.dtype)
        model = build_model(spec, req, ctx.device, dtype)
        kwargs = make_inputs(spec, req, model.config)
        model.set_attention_backend(name)
        mesh = ctx.cp_mesh(req.ring, req.ulysses)
        with compat.accelerator_count_at_least_one():
            model.enable_parallelism(config=compat.context_parallel_config(req.ring, req.ulysses, mesh=mesh))
        try:
            out, grads = step(model, kwargs, req, ctx.device, dtype)
        except AssertionError as exc:
            if _is_split_assertion(exc):
                raise BadInput(_indivisible(spec, req, "an input the model splits inside its forward")) from exc
            raise
        layout = param_layout(model)
        summed = ctx.all_sum_cpu(grads)
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
        "grads": summed if ctx.rank == 0 else None,
        "layout": layout if ctx.rank == 0 else None,
        "op": op_payloads,
    }


def environment(ctx: Any, backend: str, req: ModelRequest) -> dict[str, Any]:
    env = rank_environment(ctx, backend, req)
    env["model"] = req.model
    return env


def _param_errors(cp: Any, base: Any | None, ref: Any, layout: list[tuple[str, int, bool]], ref_layout: list) -> dict[str, dict]:
    """Per parameter: rel err of the CP grad and of the no-CP grad against the fp64 reference."""
    params: dict[str, dict] = {}
    offset = 0
    for (name, numel, _), (_, _, ref_has_grad) in zip(layout, ref_layout):
        sl = slice(offset, offset + numel)
        offset += numel
        if not ref_has_grad:
            continue
        c = compare(cp[sl], ref[sl])
        params[name] = {
            "rel_err": c["rel_err"],
            "max_abs": c["max_abs"],
            "nonfinite": c["nonfinite"],
            "numel": numel,
            "ref_norm": ref[sl].norm().item(),
            "baseline_rel_err": None if base is None else compare(base[sl], ref[sl])["rel_err"],
        }
    return params


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
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.attention import probe as attention

    req: ModelRequest = case.request
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
        dtype = torch_dtype(req.dtype)
        base_model = build_model(spec, req, ctx.device, dtype)
        kwargs = make_inputs(spec, req, base_model.config)
        base_out = base_grads = None
        try:
            base_model.set_attention_backend(backend)
            base_out, base_grads = step(base_model, kwargs, req, ctx.device, dtype)
        except Exception as exc:  # noqa: BLE001 - a backend without a local path still gets a dtype-only tolerance
            result.baseline_error = f"{type(exc).__name__}: {exc}"
        del base_model
        ref_model = build_model(spec, req, "cpu", dtype).to(torch.float64)
        ref_model.set_attention_backend(REFERENCE_BACKEND)  # set_attention_backend also sets the global active one
        ref_out, ref_grads = step(ref_model, kwargs, req, "cpu", torch.float64)
        ref_layout = param_layout(ref_model)
        result.details["model"] = _model_info(spec, req, kwargs, ref_layout)
        del ref_model

    per_rank = [compare(p["out"], ref_out) for p in payloads]
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["rel_err"])
    out_row = {
        **per_rank[worst],
        "worst_rank": worst,
        "per_rank_rel_err": [p["rel_err"] for p in per_rank],
        "baseline_rel_err": None if base_out is None else compare(base_out, ref_out)["rel_err"],
    }
    grads = first["grads"]
    grads_row = {
        **compare(grads, ref_grads),
        "worst_rank": None,
        "per_rank_rel_err": [],
        "baseline_rel_err": None if base_grads is None else compare(base_grads, ref_grads)["rel_err"],
    }
    result.tensors = {"out": out_row, "grads": grads_row}
    result.details["params"] = _param_errors(grads, base_grads, ref_grads, first["layout"], ref_layout)

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
