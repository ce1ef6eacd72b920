"""Building the model and its inputs, identical on every rank for a seed, and one forward + backward of it
with the seeded upstream gradient (on the ranks under CP, on rank 0 without it and for the reference)."""

from __future__ import annotations

from typing import Any

from cpdoctor.errors import BadInput, first_line
from cpdoctor.examinations.measurement import torch_dtype
from cpdoctor.examinations.model.grads import ParamLayout, flat_grads, param_layout
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.model.spec import ModelSpec, is_sliced, sliced_config, text_mask_param


def build_model(spec: ModelSpec, req: ModelRequest, device: Any, dtype: Any, stats: Any = None) -> Any:
    """The model in `dtype` on `device`, cut to req.blocks blocks a stack: weights seeded with req.seed (tiny) or
    loaded (checkpoint), rounded through fp32 so every rank and the reference round them the same way. A cut
    checkpoint is built with its parameters on the meta device and reads only its own tensors, one at a time
    (`stats`, a cpdoctor.model_zoo.slicing.ReadStats, counts them)."""
    import torch

    weights = spec.weights
    sliced = is_sliced(spec, req.blocks)  # first: its survey builds the model once, drawing from the global RNG
    torch.manual_seed(req.seed)  # (a class that makes a parameter with torch.randn draws even with empty parameters)
    if weights is not None and sliced and weights.use_safetensors:
        from cpdoctor.model_zoo import slicing

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
            raise BadInput(f"cannot load {weights.source}: {first_line(exc, with_type=False)}") from exc
    else:
        from cpdoctor.model_zoo.catalog import build_model as catalog_build

        model = catalog_build(spec.cls, sliced_config(spec, req.blocks) if sliced else spec.config, device="cpu")
    model = model.to(dtype=torch.float32)
    return model.to(dtype=dtype).to(device).eval()


def make_inputs(spec: ModelSpec, req: ModelRequest, config: Any) -> dict[str, Any]:
    """The full forward kwargs on CPU in fp32 rounded to the probe dtype (floating tensors), the text padding
    mask applied, identical on every rank."""
    import torch

    from cpdoctor.model_zoo.inputs import build_inputs

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
    """The output examined: the one tensor most classes return, or every output flattened into one (LTX-2's and
    MiniMax-H3's video and audio, each gathered by the plan), so that the upstream gradient reaches all of them."""
    import torch

    from cpdoctor.model_zoo.catalog import model_outputs

    outs = model_outputs(result)
    return outs[0] if len(outs) == 1 else torch.cat([o.reshape(o.shape[0], -1) for o in outs], dim=1)


def step(model: Any, kwargs: dict[str, Any], req: ModelRequest, device: Any, dtype: Any) -> tuple[Any, Any, ParamLayout]:
    """Forward and backward with the seeded upstream gradient: (output on CPU, flat fp32 parameter grads, the
    parameter layout); the model's own gradients are dropped."""
    out = _output(model(**cast_inputs(kwargs, dtype, device)))
    grad = upstream_grad(tuple(out.shape), req).to(device=device, dtype=out.dtype)
    out.backward(grad)
    layout = param_layout(model)
    return out.detach().cpu(), flat_grads(model), layout
