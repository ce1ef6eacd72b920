"""LTX-Video and LTX-2: packed video tokens of a 32x spatial / 8x temporal VAE, the latent grid passed beside
them, the text always with its attention mask; LTX-2 adds an audio stream and a second text stream.

Read from diffusers' pipelines: `pipelines/ltx/pipeline_ltx.py` `LTXPipeline.prepare_latents` (`_pack_latents`:
tokens ((F - 1) // 8 + 1) * (H // 32) * (W // 32)) and the transformer call in `__call__` (`num_frames`, `height`,
`width` of the latent grid, `rope_interpolation_scale`, `encoder_attention_mask` always passed);
`pipelines/ltx2/pipeline_ltx2.py` `LTX2Pipeline.prepare_latents`, `prepare_audio_latents` (`audio_num_frames =
round(F / frame_rate * sampling_rate / hop_length / audio_scale_factor)`) and its transformer call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpdoctor.compat.diffusers import forward_params
from cpdoctor.model_zoo.inputs.base import InputBuilder, InputShape, ModelInputs, rand

_LTX_VAE_SPATIAL = 32
_LTX_VAE_TEMPORAL = 8
_LTX_FRAME_RATE = 25


def _ltx_multiple(config: Mapping[str, Any]) -> int:
    scales = config.get("vae_scale_factors")
    spatial = int(scales[1]) if scales else _LTX_VAE_SPATIAL
    return spatial * int(config.get("patch_size") or 1)


def _ltx_latent_grid(config: Mapping[str, Any], height: int, width: int, frames: int) -> tuple[int, int, int, int, int]:
    scales = config.get("vae_scale_factors")
    temporal = int(scales[0]) if scales else _LTX_VAE_TEMPORAL
    spatial = int(scales[1]) if scales else _LTX_VAE_SPATIAL
    m = _ltx_multiple(config)
    lat_f = (frames - 1) // temporal + 1
    lat_h, lat_w = (height // m) * m // spatial, (width // m) * m // spatial
    return lat_f, lat_h, lat_w, spatial, temporal


def _build_ltx(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """LTX pipelines: tokens = ((F - 1) // 8 + 1) * (H // 32) * (W // 32) with `in_channels` features, the latent
    grid passed as num_frames / height / width; text `text_len` embeddings of width `caption_channels` with an
    attention mask (the pipeline always passes one)."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    lat_f, lat_h, lat_w, spatial, temporal = _ltx_latent_grid(config, height, width, frames)
    p, pt = int(config.get("patch_size") or 1), int(config.get("patch_size_t") or 1)
    n_tok = (lat_f // pt) * (lat_h // p) * (lat_w // p)
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, n_tok, int(config["in_channels"])), device, dtype, generator),
        "encoder_hidden_states": rand((batch, text_len, int(config["caption_channels"])), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_attention_mask": torch.ones((batch, text_len), device=device, dtype=torch.long),
        "num_frames": lat_f,
        "height": lat_h,
        "width": lat_w,
        "return_dict": False,
    }
    if "rope_interpolation_scale" in forward_params(cls):
        kw["rope_interpolation_scale"] = (temporal / _LTX_FRAME_RATE, spatial, spatial)
    snapped = (lat_f - 1) * temporal + 1
    return ModelInputs(kw, lat_h * spatial, lat_w * spatial, snapped, text_len)


_LTX2_FPS = 24.0


def _build_ltx2(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """LTX-2 pipelines: video tokens as LTX (VAE factors from the config); audio latents
    round(F / fps * sampling_rate / hop_length / audio_scale_factor) tokens of `audio_in_channels`; both text
    streams `text_len` embeddings of width `caption_channels` with a mask."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    lat_f, lat_h, lat_w, spatial, temporal = _ltx_latent_grid(config, height, width, frames)
    p, pt = int(config.get("patch_size") or 1), int(config.get("patch_size_t") or 1)
    n_tok = (lat_f // pt) * (lat_h // p) * (lat_w // p)
    audio_per_s = float(config["audio_sampling_rate"]) / float(config["audio_hop_length"]) / float(config["audio_scale_factor"])
    n_audio = round(frames / _LTX2_FPS * audio_per_s)
    caption = int(config["caption_channels"])
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, n_tok, int(config["in_channels"])), device, dtype, generator),
        "audio_hidden_states": rand((batch, n_audio, int(config["audio_in_channels"])), device, dtype, generator),
        "encoder_hidden_states": rand((batch, text_len, caption), device, dtype, generator),
        "audio_encoder_hidden_states": rand((batch, text_len, caption), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_attention_mask": torch.ones((batch, text_len), device=device, dtype=torch.long),
        "audio_encoder_attention_mask": torch.ones((batch, text_len), device=device, dtype=torch.long),
        "num_frames": lat_f,
        "height": lat_h,
        "width": lat_w,
        "fps": _LTX2_FPS,
        "audio_num_frames": n_audio,
        "return_dict": False,
    }
    snapped = (lat_f - 1) * temporal + 1
    return ModelInputs(kw, lat_h * spatial, lat_w * spatial, snapped, text_len)


LTX = InputBuilder(
    name="ltx",
    build=_build_ltx,
    resolution_multiple=_ltx_multiple,
    default_height=512,
    default_width=704,
    default_text_len=128,
    default_frames=161,
    frames_step=_LTX_VAE_TEMPORAL,
    text_mask_param="encoder_attention_mask",
    convention="tokens = ((F-1)/8+1)*(H/32)*(W/32); text = text_len x caption_channels, masked",
    pipeline="pipelines/ltx/pipeline_ltx.py: prepare_latents (_pack_latents) and the transformer call in __call__",
    small_frames=9,
)

LTX2 = InputBuilder(
    name="ltx2",
    build=_build_ltx2,
    resolution_multiple=_ltx_multiple,
    default_height=512,
    default_width=768,
    default_text_len=1024,
    default_frames=121,
    frames_step=_LTX_VAE_TEMPORAL,
    text_mask_param="encoder_attention_mask",
    convention="video as LTX; audio = F/fps*25 tokens; two text streams of text_len, masked",
    pipeline="pipelines/ltx2/pipeline_ltx2.py: prepare_latents, prepare_audio_latents and the transformer call in __call__",
    small_frames=9,
)
