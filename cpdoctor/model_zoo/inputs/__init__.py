"""How a pipeline turns (height, width, frames, prompt) into its transformer's forward arguments: the VAE
compression, the latent packing, the text-embedding width. diffusers does not say this in the model class, so
the conventions are copied from the pipelines into one small input builder per family (`BUILDERS`), chosen by
the class's family (`FAMILIES`, inherited through the MRO). A builder reads the model's own config
(in_channels, joint_attention_dim, patch_size, ...) and forward signature and returns the keyword arguments of
`model.forward` for one `InputShape`, on any device: on "meta" they cost nothing, which is how `cpdoctor plan`
measures shapes, and on a real device they are random inputs with valid position ids.

torch and diffusers are imported inside functions only, so importing this module is free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from cpdoctor.compat.diffusers import cp_plan, forward_params
from cpdoctor.errors import CannotExamine
from cpdoctor.model_zoo.names import short_name_for


@dataclasses.dataclass(frozen=True)
class InputShape:
    """What every input builder is asked for: the resolution, text length and frames a pipeline would be run
    at, the batch, and where and how to make the tensors (on "meta" they cost nothing)."""

    height: int
    width: int
    text_len: int
    frames: int | None = None
    batch: int = 1
    device: Any = "meta"
    dtype: Any = None
    text_mask: bool | None = None
    generator: Any = None

    def fields(self) -> tuple[int, int, int, Any, int, Any, Any, Any]:
        """(height, width, text_len, frames, batch, device, dtype, generator), dtype defaulting to fp32."""
        import torch

        return self.height, self.width, self.text_len, self.frames, self.batch, self.device, self.dtype or torch.float32, self.generator


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """Keyword arguments for `model.forward` plus what the builder made of the request."""

    kwargs: dict[str, Any]
    height: int  # the resolution the inputs correspond to, after the pipeline's rounding
    width: int
    frames: int | None
    text_len: int
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class InputBuilder:
    """How one family's pipeline feeds its transformer.

    `resolution_multiple(config)` is the step the pipeline rounds height and width down to; `frames_step` and
    `frames_offset` describe valid frame counts (frames = step * k + offset) for video models.
    """

    name: str
    build: Callable[..., ModelInputs]
    resolution_multiple: Callable[[Mapping[str, Any]], int]
    default_height: int
    default_width: int
    default_text_len: int
    default_frames: int | None = None
    frames_step: int | None = None
    frames_offset: int = 1
    text_mask_param: str | None = None  # the forward argument that masks text padding, if any
    convention: str = ""  # one line for the docs / report

    @property
    def is_video(self) -> bool:
        return self.default_frames is not None


def _rand(shape: tuple[int, ...], device: Any, dtype: Any, generator: Any = None) -> Any:
    import torch

    return torch.randn(shape, device=device, dtype=dtype, generator=generator)


def _plan_input_dims(cls: type, name: str, default: int) -> int:
    """The expected_dims the class's own `_cp_plan` declares for input `name` (ids are 2-D in Flux, 3-D in Flux2)."""
    for spec in cp_plan(cls).values():
        if isinstance(spec, dict) and name in spec and getattr(spec[name], "expected_dims", None):
            return int(spec[name].expected_dims)
    return default


# -- packed-image MMDiTs (Flux, Flux2, Qwen-Image): latents are 2x2-packed tokens, 8x VAE ----------------------

_IMAGE_VAE_SCALE = 8  # the pipelines' fallback vae_scale_factor: 2 ** (len(block_out_channels) - 1)
_IMAGE_PACK = 2  # the pipelines pack 2x2 latent pixels into one token


def _packed_image_multiple(config: Mapping[str, Any]) -> int:
    return _IMAGE_VAE_SCALE * _IMAGE_PACK


def _build_packed_image(cls: type, config: Mapping[str, Any], shape: InputShape) -> ModelInputs:
    """Flux-style pipelines: tokens = (H // 16) * (W // 16), each with `in_channels` features; the text is
    `text_len` embeddings of width `joint_attention_dim`. Optional arguments are filled when the forward
    signature has them: pooled_projections, guidance, img_ids / txt_ids (rank from `_cp_plan`, one column per
    rope axis), img_shapes and encoder_hidden_states_mask (Qwen-Image)."""
    import torch

    height, width, text_len, frames, batch, device, dtype, generator = shape.fields()
    params = forward_params(cls)
    step = _packed_image_multiple(config)
    gh, gw = height // step, width // step
    n_img = gh * gw
    kw: dict[str, Any] = {
        "hidden_states": _rand((batch, n_img, int(config["in_channels"])), device, dtype, generator),
        "encoder_hidden_states": _rand((batch, text_len, int(config["joint_attention_dim"])), device, dtype, generator),
        "timestep": torch.full((batch,), 0.5, device=device, dtype=dtype),
        "return_dict": False,
    }
    if "pooled_projections" in params and config.get("pooled_projection_dim"):
        kw["pooled_projections"] = _rand((batch, int(config["pooled_projection_dim"])), device, dtype, generator)
    if "guidance" in params and config.get("guidance_embeds"):
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
        if _plan_input_dims(cls, "img_ids", 2) == 3:
            img_ids = img_ids.unsqueeze(0).expand(batch, -1, -1)
            txt_ids = txt_ids.unsqueeze(0).expand(batch, -1, -1)
        kw["img_ids"], kw["txt_ids"] = img_ids, txt_ids
    if "img_shapes" in params:
        kw["img_shapes"] = [[(1, gh, gw)]] * batch
    if "encoder_hidden_states_mask" in params and shape.text_mask:
        kw["encoder_hidden_states_mask"] = torch.ones((batch, text_len), device=device, dtype=torch.long)
    return ModelInputs(kw, gh * step, gw * step, None, text_len)


# -- Wan-style video DiTs (Wan, ChronoEdit): 5-D latents, 8x spatial / 4x temporal VAE ---------------------

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
        "hidden_states": _rand((batch, int(config["in_channels"]), lat_f, lat_h, lat_w), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": _rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "return_dict": False,
    }
    if config.get("image_dim") and "encoder_hidden_states_image" in forward_params(cls):
        kw["encoder_hidden_states_image"] = _rand((batch, _WAN_IMAGE_TOKENS, int(config["image_dim"])), device, dtype, generator)
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
        "hidden_states": _rand((batch, c, lat_f, lat_h, lat_w), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": _rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "indices_hidden_states": idx_hidden.unsqueeze(0),
        "indices_latents_history_short": torch.cat([prefix, idx_1x]).unsqueeze(0),
        "indices_latents_history_mid": idx_mid.unsqueeze(0),
        "indices_latents_history_long": idx_long.unsqueeze(0),
        "latents_history_short": _rand((batch, c, 1 + short_n, lat_h, lat_w), device, dtype, generator),
        "latents_history_mid": _rand((batch, c, mid_n, lat_h, lat_w), device, dtype, generator),
        "latents_history_long": _rand((batch, c, long_n, lat_h, lat_w), device, dtype, generator),
        "return_dict": False,
    }
    snapped = (lat_f - 1) * _WAN_VAE_TEMPORAL + 1
    return ModelInputs(kw, lat_h * _WAN_VAE_SPATIAL, lat_w * _WAN_VAE_SPATIAL, snapped, text_len)


# -- LTX-Video: packed video tokens, 32x spatial / 8x temporal VAE --------------------------------------------------

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
        "hidden_states": _rand((batch, n_tok, int(config["in_channels"])), device, dtype, generator),
        "encoder_hidden_states": _rand((batch, text_len, int(config["caption_channels"])), device, dtype, generator),
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
        "hidden_states": _rand((batch, n_tok, int(config["in_channels"])), device, dtype, generator),
        "audio_hidden_states": _rand((batch, n_audio, int(config["audio_in_channels"])), device, dtype, generator),
        "encoder_hidden_states": _rand((batch, text_len, caption), device, dtype, generator),
        "audio_encoder_hidden_states": _rand((batch, text_len, caption), device, dtype, generator),
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


BUILDERS: dict[str, InputBuilder] = {
    "packed-image": InputBuilder(
        name="packed-image",
        build=_build_packed_image,
        resolution_multiple=_packed_image_multiple,
        default_height=1024,
        default_width=1024,
        default_text_len=512,
        text_mask_param="encoder_hidden_states_mask",
        convention="tokens = (H/16)*(W/16) (8x VAE, 2x2 packing); text = text_len x joint_attention_dim",
    ),
    "wan": InputBuilder(
        name="wan",
        build=_build_wan,
        resolution_multiple=_wan_multiple,
        default_height=480,
        default_width=832,
        default_text_len=512,
        default_frames=81,
        frames_step=_WAN_VAE_TEMPORAL,
        convention="latent (C, (F-1)/4+1, H/8, W/8), patchified in the model; text = text_len x text_dim",
    ),
    "helios": InputBuilder(
        name="helios",
        build=_build_helios,
        resolution_multiple=_wan_multiple,
        default_height=384,
        default_width=640,
        default_text_len=512,
        default_frames=33,
        frames_step=_WAN_VAE_TEMPORAL,
        convention="one window: latent (C, (F-1)/4+1, H/8, W/8) + history latents of 16/2/2 frames; text = text_len x text_dim",
    ),
    "ltx": InputBuilder(
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
    ),
    "ltx2": InputBuilder(
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
    ),
}

# family short name -> builder key. A class inherits its nearest ancestor's family (a subclass of
# FluxTransformer2DModel is built like Flux); classes with no entry have no input builder (exit 3).
FAMILIES: dict[str, str] = {
    "flux": "packed-image",
    "flux2": "packed-image",
    "qwen-image": "packed-image",
    "wan": "wan",
    "chrono-edit": "wan",
    "helios": "helios",
    "ltx": "ltx",
    "ltx2": "ltx2",
}


def family_builder_key(cls: type) -> str | None:
    """The key of the input builder of `cls`'s family (its nearest ancestor's), None when there is none."""
    for klass in cls.__mro__:
        key = FAMILIES.get(short_name_for(klass.__name__))
        if key:
            return key
    return None


def builder_for(cls: type) -> InputBuilder:
    key = family_builder_key(cls)
    if key is None:
        raise CannotExamine(
            f"cpdoctor has no input builder for {cls.__name__} (it does not know how the pipeline shapes its "
            "inputs); add one to cpdoctor/model_zoo/catalog.py FAMILIES"
        )
    return BUILDERS[key]


def build_inputs(
    cls: type,
    config: Mapping[str, Any],
    height: int,
    width: int,
    text_len: int,
    frames: int | None = None,
    *,
    batch: int = 1,
    device: Any = "meta",
    dtype: Any = None,
    text_mask: bool | None = None,
    generator: Any = None,
) -> ModelInputs:
    """Forward kwargs for `cls` with `config` (pass `full_config(...)` or `model.config`) at this resolution.

    `text_mask=True` adds the text padding mask when the model takes one (the Qwen-Image pipeline drops an
    all-ones mask, LTX always passes one). Video builders default `frames` to their pipeline's default.
    """
    builder = builder_for(cls)
    if frames is None:
        frames = builder.default_frames
    shape = InputShape(height, width, text_len, frames, batch, device, dtype, text_mask, generator)
    return builder.build(cls, config, shape)
