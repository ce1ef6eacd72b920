"""Packed-image MMDiTs (Flux, Flux2, Qwen-Image): the latents are 2x2-packed tokens of an 8x VAE, the text one
embedding per prompt token.

Read from diffusers' pipelines (the same in 0.39.0 and 0.42.1): `pipelines/flux/pipeline_flux.py`
`FluxPipeline.prepare_latents` (`_pack_latents`, `_prepare_latent_image_ids`) and the `self.transformer(...)` call
in `__call__`; `pipelines/flux2/pipeline_flux2.py` `Flux2Pipeline.prepare_latents` (`_prepare_latent_ids`,
`_prepare_text_ids`: 4-axis ids with a batch dim); `pipelines/qwenimage/pipeline_qwenimage.py`
`QwenImagePipeline.prepare_latents` (`_pack_latents`) and its transformer call (`img_shapes`, and
`encoder_hidden_states_mask`, which the pipeline drops when it is all ones; where the forward still takes
`txt_seq_lens`, as 0.36.0's does, the pipeline's `prompt_embeds_mask.sum(dim=1).tolist()`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpdoctor.compat.diffusers import forward_params
from cpdoctor.model_zoo.inputs.base import InputBuilder, InputShape, ModelInputs, plan_input_dims, rand

_IMAGE_VAE_SCALE = 8  # the pipelines' fallback vae_scale_factor: 2 ** (len(block_out_channels) - 1)
_IMAGE_PACK = 2  # the pipelines pack 2x2 latent pixels into one token


def _packed_image_multiple(config: Mapping[str, Any]) -> int:
    return _IMAGE_VAE_SCALE * _IMAGE_PACK


def _embeds_guidance(config: Mapping[str, Any]) -> bool:
    """The model embeds a guidance scale. `config` holds every `__init__` key of the class (`full_config` or
    `model.config`), so a class with the `guidance_embeds` switch says it there, and one without it always embeds
    the scale (Flux2 before the switch arrived, 0.36.0: its pipeline passes `guidance` on every call)."""
    return bool(config.get("guidance_embeds", True))


def _build_packed_image(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """Flux-style pipelines: tokens = (H // 16) * (W // 16), each with `in_channels` features; the text is
    `text_len` embeddings of width `joint_attention_dim` (the module docstring cites the calls). Optional arguments are filled when the forward
    signature has them: pooled_projections, guidance, img_ids / txt_ids (rank from `_cp_plan`, one column per
    rope axis), img_shapes and encoder_hidden_states_mask (Qwen-Image)."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    params = forward_params(cls)
    step = _packed_image_multiple(config)
    gh, gw = height // step, width // step
    n_img = gh * gw
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, n_img, int(config["in_channels"])), device, dtype, generator),
        "encoder_hidden_states": rand((batch, text_len, int(config["joint_attention_dim"])), device, dtype, generator),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
        "return_dict": False,
    }
    if "pooled_projections" in params and config.get("pooled_projection_dim"):
        kw["pooled_projections"] = rand((batch, int(config["pooled_projection_dim"])), device, dtype, generator)
    if "guidance" in params and _embeds_guidance(config):
        kw["guidance"] = torch.full((batch,), 3.5, device=device, dtype=dtype)
    if "img_ids" in params:
        axes = len(config.get("axes_dims_rope") or (0, 0, 0))
        h_idx = torch.arange(gh, device=device).repeat_interleave(gw)
        w_idx = torch.arange(gw, device=device).repeat(gh)
        # Flux: (0, h, w) per image token, zeros for text; Flux2: (t=0, h, w, l=0) and text (0, 0, 0, l)
        img_ids = torch.zeros((n_img, axes), device=device, dtype=dtype)
        txt_ids = torch.zeros((text_len, axes), device=device, dtype=dtype)
        img_ids[:, 1], img_ids[:, 2] = h_idx.to(dtype), w_idx.to(dtype)
        if axes >= 4:
            txt_ids[:, -1] = torch.arange(text_len, device=device).to(dtype)
        if plan_input_dims(cls, "img_ids", 2) == 3:
            img_ids = img_ids.unsqueeze(0).expand(batch, -1, -1)
            txt_ids = txt_ids.unsqueeze(0).expand(batch, -1, -1)
        kw["img_ids"], kw["txt_ids"] = img_ids, txt_ids
    if "img_shapes" in params:
        kw["img_shapes"] = [[(1, gh, gw)]] * batch
    # Qwen-Image's forward before `encoder_hidden_states_mask` alone sized its text rope (0.36.0) takes
    # `txt_seq_lens`, and that pipeline passes it and the mask on every call, ones where nothing is padded (its
    # plan names the mask, and that release's CP hook raises on a named input the call leaves out)
    sized_by_lens = "txt_seq_lens" in params
    if sized_by_lens:
        kw["txt_seq_lens"] = [text_len] * batch  # the pipeline's prompt_embeds_mask.sum(dim=1).tolist()
    if "encoder_hidden_states_mask" in params and (shape.text_mask or sized_by_lens):
        kw["encoder_hidden_states_mask"] = torch.ones((batch, text_len), device=device, dtype=torch.long)
    return ModelInputs(kw, gh * step, gw * step, None, text_len)


PACKED_IMAGE = InputBuilder(
    name="packed-image",
    build=_build_packed_image,
    resolution_multiple=_packed_image_multiple,
    default_height=1024,
    default_width=1024,
    default_text_len=512,
    text_mask_param="encoder_hidden_states_mask",
    convention="tokens = (H/16)*(W/16) (8x VAE, 2x2 packing); text = text_len x joint_attention_dim",
    pipeline="pipelines/flux/pipeline_flux.py, flux2/pipeline_flux2.py, qwenimage/pipeline_qwenimage.py: prepare_latents and the transformer call in __call__",
)
