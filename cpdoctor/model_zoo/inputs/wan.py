"""Wan-style video DiTs (Wan, ChronoEdit, Helios): 5-D latents of an 8x spatial / 4x temporal VAE, patchified
inside the model; the text one embedding per prompt token.

Read from diffusers' pipelines: `pipelines/wan/pipeline_wan.py` `WanPipeline.prepare_latents` (latents
(B, C, (F - 1) // 4 + 1, H // 8, W // 8)) and the transformer call in `__call__` (`encoder_hidden_states_image` in
`pipeline_wan_i2v.py` when the config has `image_dim`); `pipelines/chronoedit/pipeline_chronoedit.py`
`ChronoEditPipeline.prepare_latents` (the same latent grid, condition frames concatenated on the channels, which
`in_channels` counts) and its transformer call; `pipelines/helios/pipeline_helios.py` `HeliosPipeline.__call__`
(one window of latents per forward, with the long / mid / short history latents and their frame indices).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpdoctor.compat.diffusers import forward_params
from cpdoctor.model_zoo.inputs.base import InputBuilder, InputShape, ModelInputs, rand

_WAN_VAE_SPATIAL = 8
_WAN_VAE_TEMPORAL = 4
_WAN_IMAGE_TOKENS = 257  # CLIP ViT-H/14 image embedding of the I2V pipelines (1 + 16 * 16 tokens)


def _wan_multiple(config: Mapping[str, Any]) -> int:
    patch = config.get("patch_size") or (1, 2, 2)
    return _WAN_VAE_SPATIAL * int(patch[-1])


def _build_wan(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """Wan pipelines: latents (B, in_channels, (F - 1) // 4 + 1, H // 8, W // 8), patchified inside the model;
    text `text_len` embeddings of width `text_dim`; an image embedding of 257 tokens when `image_dim` is set."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    lat_f = (frames - 1) // _WAN_VAE_TEMPORAL + 1
    m = _wan_multiple(config)
    lat_h, lat_w = (height // m) * m // _WAN_VAE_SPATIAL, (width // m) * m // _WAN_VAE_SPATIAL
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, int(config["in_channels"]), lat_f, lat_h, lat_w), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "return_dict": False,
    }
    if config.get("image_dim") and "encoder_hidden_states_image" in forward_params(cls):
        kw["encoder_hidden_states_image"] = rand((batch, _WAN_IMAGE_TOKENS, int(config["image_dim"])), device, dtype, generator)
    snapped = (lat_f - 1) * _WAN_VAE_TEMPORAL + 1
    return ModelInputs(kw, lat_h * _WAN_VAE_SPATIAL, lat_w * _WAN_VAE_SPATIAL, snapped, text_len)


# Helios generates a long video window by window; each forward sees one window of latents plus three
# compressed history latents (pipeline defaults: history_sizes=[16, 2, 1], keep_first_frame=True).
_HELIOS_HISTORY = (16, 2, 1)


def _build_helios(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """Helios pipeline, one window: `frames` is the window length in frames (default 33 = 9 latent frames);
    history latents long / mid / short of 16 / 2 / 1+1 latent frames with their frame indices."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    lat_f = (frames - 1) // _WAN_VAE_TEMPORAL + 1
    m = _wan_multiple(config)
    lat_h, lat_w = (height // m) * m // _WAN_VAE_SPATIAL, (width // m) * m // _WAN_VAE_SPATIAL
    c = int(config["in_channels"])
    long_n, mid_n, short_n = _HELIOS_HISTORY
    indices = torch.arange(0, 1 + long_n + mid_n + short_n + lat_f, device=device)
    prefix, idx_long, idx_mid, idx_1x, idx_hidden = indices.split([1, long_n, mid_n, short_n, lat_f])
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, c, lat_f, lat_h, lat_w), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "indices_hidden_states": idx_hidden.unsqueeze(0),
        "indices_latents_history_short": torch.cat([prefix, idx_1x]).unsqueeze(0),
        "indices_latents_history_mid": idx_mid.unsqueeze(0),
        "indices_latents_history_long": idx_long.unsqueeze(0),
        "latents_history_short": rand((batch, c, 1 + short_n, lat_h, lat_w), device, dtype, generator),
        "latents_history_mid": rand((batch, c, mid_n, lat_h, lat_w), device, dtype, generator),
        "latents_history_long": rand((batch, c, long_n, lat_h, lat_w), device, dtype, generator),
        "return_dict": False,
    }
    snapped = (lat_f - 1) * _WAN_VAE_TEMPORAL + 1
    return ModelInputs(kw, lat_h * _WAN_VAE_SPATIAL, lat_w * _WAN_VAE_SPATIAL, snapped, text_len)


WAN = InputBuilder(
    name="wan",
    build=_build_wan,
    resolution_multiple=_wan_multiple,
    default_height=480,
    default_width=832,
    default_text_len=512,
    default_frames=81,
    frames_step=_WAN_VAE_TEMPORAL,
    convention="latent (C, (F-1)/4+1, H/8, W/8), patchified in the model; text = text_len x text_dim",
    pipeline="pipelines/wan/pipeline_wan.py, chronoedit/pipeline_chronoedit.py: prepare_latents and the transformer call in __call__",
    small_frames=5,
)

HELIOS = InputBuilder(
    name="helios",
    build=_build_helios,
    resolution_multiple=_wan_multiple,
    default_height=384,
    default_width=640,
    default_text_len=512,
    default_frames=33,
    frames_step=_WAN_VAE_TEMPORAL,
    convention="one window: latent (C, (F-1)/4+1, H/8, W/8) + history latents of 16/2/2 frames; text = text_len x text_dim",
    pipeline="pipelines/helios/pipeline_helios.py: prepare_latents, the history latents and the transformer call in __call__",
    small_frames=5,
)
