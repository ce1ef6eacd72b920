"""MiniMax-H3: one packed sequence [text | audio | video] that the caller lays out, with per-row modality tags,
timestep indices and a (t, h, w) rotary grid; the model splits it at its first block.

Read from diffusers' modular pipeline (0.42.1; the class is absent from 0.39.0):
`modular_pipelines/minimax_h3/before_denoise.py` `MiniMaxH3PrepareLayoutStep.__call__` (the frame count snapped up
to 17n + 5, `video_latent_num_frames` = 5n + 2 latent frames, latents H / 16 x W / 16, `audio_latent_num_frames` =
round(F / 24 x 40) latents) and `build_packed_sequence` (the t2va layout without keyframes: text rows, then the
audio latents channel-major over 2 channels, then the video rows; text rows on the time axis at their index, the
media clock continuing from there), `MiniMaxH3PrepareTimestepsStep.build_row_timesteps` (the distinct timesteps and
each row's index into them: text rows inherit the video's), and `denoise.py` `MiniMaxH3LoopDenoiser.__call__`, the
transformer call (`hidden_states=latents[None]`: the patchified video rows; `audio_hidden_states`; the layout
arguments by name). The constants below are `modular_pipeline.py`'s (`MINIMAX_H3_*` and the fallbacks of
`MiniMaxH3ModularPipeline`'s properties when no VAE is loaded). The pipeline's 5-15 s duration window is not kept:
the transformer takes any length, and a tiny examination needs a short one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cpdoctor.model_zoo.inputs.base import InputBuilder, InputShape, ModelInputs, rand

_VAE_SPATIAL = 16  # vae_spatial_compression_ratio
_FRAMES_PER_CHUNK = 17  # vae_frames_per_chunk: frames are 17n + 5
_LATENTS_PER_CHUNK = 5  # vae_latents_per_chunk
_FPS = 24
_AUDIO_LATENTS_PER_SECOND = 40
_AUDIO_CHANNELS = 2
_VIDEO_TAG, _TEXT_TAG, _AUDIO_TAG = 0, 1, 2
_ROPE_FRAME_RESCALE = 5.0 / 3.0
_ROPE_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_ROPE_SPATIAL_SCALE = 32
_TIMESTEPS = (0.6, 0.4)  # one video and one audio noise level: two distinct timesteps, as mid-schedule


def _patch(config: Mapping[str, Any]) -> tuple[int, int, int]:
    p = config.get("patch_size") or (1, 2, 2)
    return int(p[0]), int(p[1]), int(p[2])


def _minimax_multiple(config: Mapping[str, Any]) -> int:
    """`MiniMaxH3ModularPipeline.canvas_multiple`: the VAE's spatial ratio times the patch width."""
    return _VAE_SPATIAL * _patch(config)[2]


def aligned_frames(frames: int) -> int:
    """`align_num_frames`: the next 17n + 5 at or above `frames`."""
    frames = max(frames, _LATENTS_PER_CHUNK)
    return frames + (_LATENTS_PER_CHUNK - frames) % _FRAMES_PER_CHUNK


def _spatial_grid(dim: int, patch: int, sqrt_area: float) -> Any:
    """`_spatial_position_grid`: dim // patch coordinates over the unit interval, centred, times 32."""
    import torch

    ratio = dim / sqrt_area
    n = dim // patch
    return ((1.0 - ratio) / 2.0 + torch.arange(n, dtype=torch.float64) * (ratio / n)) * _ROPE_SPATIAL_SCALE


def _positions(text_len: int, audio_latents: int, lat_f: int, lat_h: int, lat_w: int, patch: tuple[int, int, int]) -> Any:
    """The (t, h, w) rotary coordinate of every row, as `build_packed_sequence` lays them out (float64, on CPU)."""
    import torch

    sqrt_area = math.sqrt(lat_h * lat_w)
    hg, wg = _spatial_grid(lat_h, patch[1], sqrt_area), _spatial_grid(lat_w, patch[2], sqrt_area)
    frame = torch.stack([g.reshape(-1) for g in torch.meshgrid(hg, wg, indexing="ij")], dim=-1)
    n_audio = audio_latents * _AUDIO_CHANNELS
    text = torch.zeros(text_len, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(text_len, dtype=torch.float64)
    audio = torch.zeros(n_audio, 3, dtype=torch.float64)
    audio[:, 0] = (text_len + torch.arange(audio_latents, dtype=torch.float64)).repeat(_AUDIO_CHANNELS)
    audio[:, 2] = torch.cat([torch.full((audio_latents,), float(wg[0])), torch.full((n_audio - audio_latents,), float(wg[-1]))])
    spans = torch.tensor([_ROPE_FRAME_RESCALE * _ROPE_FRAMES_PER_LATENT[i % 5] for i in range(lat_f)], dtype=torch.float64)
    times = text_len + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    video = torch.empty(lat_f, frame.shape[0], 3, dtype=torch.float64)
    video[:, :, 0] = times[:, None]
    video[:, :, 1:] = frame[None]
    return torch.cat([text, audio, video.reshape(-1, 3)])


def _build_minimax(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """The t2va layout at `shape`: video rows ((F - 5) // 17 * 5 + 2) x (H // 32) x (W // 32) of in_channels x
    prod(patch_size) features, 2 x round(F / 24 x 40) audio rows of audio_in_channels, text_len text rows of
    text_dim; one packed sequence of all of them (the split is on it, at the first block)."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    frames = aligned_frames(frames)
    patch = _patch(config)
    m = _minimax_multiple(config)
    lat_h, lat_w = (height // m) * m // _VAE_SPATIAL, (width // m) * m // _VAE_SPATIAL
    lat_f = (frames - _LATENTS_PER_CHUNK) // _FRAMES_PER_CHUNK * _LATENTS_PER_CHUNK + 2
    n_video = (lat_f // patch[0]) * (lat_h // patch[1]) * (lat_w // patch[2])
    audio_latents = int(round(frames / _FPS * _AUDIO_LATENTS_PER_SECOND))
    n_audio = audio_latents * _AUDIO_CHANNELS
    seq = text_len + n_audio + n_video
    tags = torch.full((seq,), _VIDEO_TAG, dtype=torch.long, device=device)
    tags[:text_len], tags[text_len : text_len + n_audio] = _TEXT_TAG, _AUDIO_TAG
    t_index = torch.zeros(seq, dtype=torch.long, device=device)
    t_index[text_len : text_len + n_audio] = 1  # text rows inherit the video's timestep
    kw: dict[str, Any] = {
        "hidden_states": rand((batch, n_video, int(config["in_channels"]) * math.prod(patch)), device, dtype, generator),
        "audio_hidden_states": rand((batch, n_audio, int(config["audio_in_channels"])), device, dtype, generator),
        "encoder_hidden_states": rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "timestep": torch.tensor(_TIMESTEPS, device=device, dtype=dtype),
        "timestep_indices": t_index,
        "token_tags": tags,
        "position_ids": _positions(text_len, audio_latents, lat_f, lat_h, lat_w, patch).to(device),
        "video_indices": torch.arange(text_len + n_audio, seq, device=device),
        "audio_indices": torch.arange(text_len, text_len + n_audio, device=device),
        "text_indices": torch.arange(text_len, device=device),
        "return_dict": False,
    }
    return ModelInputs(kw, lat_h * _VAE_SPATIAL, lat_w * _VAE_SPATIAL, frames, text_len)


MINIMAX = InputBuilder(
    name="minimax-h3",
    build=_build_minimax,
    resolution_multiple=_minimax_multiple,
    default_height=768,  # resolve_canvas_size(16, 9, 32, canvas_short_edge=768, canvas_max_pixels=768 * 1344)
    default_width=1344,
    default_text_len=256,  # the prompt's own tokens: the sequence carries no padding
    default_frames=124,  # MiniMaxH3PrepareLayoutStep's num_frames default (17 x 7 + 5)
    frames_step=_FRAMES_PER_CHUNK,
    frames_offset=_LATENTS_PER_CHUNK,
    convention="one sequence: text_len + 2*round(F/24*40) audio + ((F-5)/17*5+2)*(H/32)*(W/32) video rows",
    pipeline="modular_pipelines/minimax_h3/before_denoise.py: MiniMaxH3PrepareLayoutStep.build_packed_sequence; denoise.py: the transformer call",
    small_frames=5,
)
