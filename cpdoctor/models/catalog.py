"""Which diffusers models have a context-parallel plan, what cpdoctor calls them, and what they take as input.

Nothing here is a hand-kept list of models. `list_models()` scans `diffusers.models` for ModelMixin subclasses
whose class attribute `_cp_plan` is non-empty, and derives each short name from the class name
(FluxTransformer2DModel -> flux, QwenImageTransformer2DModel -> qwen-image, LTXVideoTransformer3DModel -> ltx).

What diffusers does not say is how a pipeline turns (height, width, frames, prompt) into the transformer's
forward arguments: the VAE compression, the latent packing, the text-embedding width. Those conventions are
copied from the pipelines into a small registry of input builders, one per family (`BUILDERS`). A builder
reads the model's own config (in_channels, joint_attention_dim, patch_size, ...) and forward signature and
returns the keyword arguments of `model.forward`, on any device: on "meta" they cost nothing, which is how
`cpdoctor plan` measures shapes, and on a real device they are random inputs with valid position ids.

torch and diffusers are imported inside functions only, so importing this module is free.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from cpdoctor.errors import BadInput, CannotExamine

# --------------------------------------------------------------------------------------------------------------
# discovery and names
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One diffusers class with a context-parallel plan."""

    short_name: str
    class_name: str
    module: str
    builder: str | None  # key into BUILDERS, None when cpdoctor cannot build its inputs
    cp_plan_entries: int  # number of module entries in `_cp_plan`

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _normalize(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _kebab(stem: str) -> str:
    # acronyms stay whole (LTX), digits stick to the word before them (Flux2 -> flux2, MiniMaxH3 -> mini-max-h3)
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z][a-z]*|[a-z]+|\d+", stem)
    out: list[str] = []
    for word in words:
        if word.isdigit() and out:
            out[-1] += word
        else:
            out.append(word.lower())
    return "-".join(out)


def _stem(class_name: str) -> str:
    return re.sub(r"(Transformer)?(\d+D)?(Model)?$", "", class_name) or class_name


def short_name_for(class_name: str, strip_video: bool = True) -> str:
    """FluxTransformer2DModel -> flux, QwenImageTransformer2DModel -> qwen-image, LTXVideoTransformer3DModel -> ltx."""
    stem = _stem(class_name)
    if strip_video and stem.endswith("Video") and len(stem) > len("Video"):
        stem = stem[: -len("Video")]
    return _kebab(stem)


def _import_models_package() -> Any:
    try:
        import diffusers.models as models
    except ImportError as exc:
        raise BadInput(f"diffusers is not installed or does not import ({exc}); pip install diffusers") from exc
    return models


@functools.cache
def _scan() -> tuple[tuple[type, ModelEntry], ...]:
    models = _import_models_package()
    from diffusers.models.modeling_utils import ModelMixin

    classes: dict[str, type] = {}
    for attr in sorted(dir(models)):
        if attr.startswith("_"):
            continue
        try:
            obj = getattr(models, attr)
        except Exception:  # noqa: BLE001 - a model whose optional dependency is missing: not ours to examine
            continue
        if inspect.isclass(obj) and issubclass(obj, ModelMixin) and getattr(obj, "_cp_plan", None):
            classes[obj.__name__] = obj

    names = {n: short_name_for(n) for n in classes}
    clashes = {s for s in names.values() if list(names.values()).count(s) > 1}
    for n in names:
        if names[n] in clashes:  # two classes would share a name once "Video" is dropped: keep it for both
            names[n] = short_name_for(n, strip_video=False)
    out = []
    for n, cls in sorted(classes.items(), key=lambda kv: names[kv[0]]):
        entry = ModelEntry(
            short_name=names[n],
            class_name=n,
            module=cls.__module__,
            builder=_builder_key_for(cls),
            cp_plan_entries=len(cls._cp_plan),
        )
        out.append((cls, entry))
    return tuple(out)


def list_models() -> list[ModelEntry]:
    """Every diffusers model class with a non-empty `_cp_plan`, sorted by short name."""
    return [entry for _, entry in _scan()]


def _class_for_entry(entry: ModelEntry) -> type:
    for cls, e in _scan():
        if e == entry:
            return cls
    raise KeyError(entry.class_name)


@dataclasses.dataclass
class ResolvedModel:
    """A model class plus the config to build it with ({} means the class's own defaults)."""

    cls: type
    entry: ModelEntry
    config: dict[str, Any]
    source: str  # "diffusers defaults" or the config.json path

    def full_config(self) -> dict[str, Any]:
        return full_config(self.cls, self.config)


def _config_file(path: str) -> str:
    """The transformer config.json for a checkpoint directory, a pipeline directory or a config file."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise BadInput(f"no such file or directory: {path}")
    direct = os.path.join(path, "config.json")
    if os.path.isfile(direct):
        return direct
    index = os.path.join(path, "model_index.json")
    if os.path.isfile(index):
        nested = os.path.join(path, "transformer", "config.json")
        if os.path.isfile(nested):
            return nested
        raise BadInput(f"{path} is a pipeline directory without transformer/config.json")
    raise BadInput(f"{path} has no config.json (nor model_index.json with a transformer/ folder)")


def _looks_like_path(name: str) -> bool:
    return os.path.exists(name) or name.endswith(".json") or name.startswith((".", "~")) or os.sep in name


def resolve_model(name_or_path: str) -> ResolvedModel:
    """A short name (flux), a class name (FluxTransformer2DModel) or a local checkpoint / pipeline directory.

    Raises BadInput with the closest names on an unknown name, or when a checkpoint's class has no CP plan.
    """
    name_or_path = (name_or_path or "").strip()
    if not name_or_path:
        raise BadInput("give a model: a short name (see `cpdoctor plan --list`), a class name or a checkpoint directory")
    scanned = _scan()
    if _looks_like_path(name_or_path):
        cfg_path = _config_file(os.path.expanduser(name_or_path))
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, ValueError) as exc:
            raise BadInput(f"cannot read {cfg_path}: {exc}") from exc
        class_name = config.get("_class_name") if isinstance(config, dict) else None
        if not class_name:
            raise BadInput(f"{cfg_path} has no _class_name; point at a diffusers transformer config")
        for cls, entry in scanned:
            if entry.class_name == class_name:
                return ResolvedModel(cls, entry, dict(config), cfg_path)
        raise BadInput(
            f"{class_name} (from {cfg_path}) has no _cp_plan in this diffusers; "
            f"models with one: {', '.join(e.short_name for _, e in scanned)}"
        )

    wanted = _normalize(name_or_path)
    for cls, entry in scanned:
        keys = {
            _normalize(entry.short_name),
            _normalize(entry.class_name),
            _normalize(short_name_for(entry.class_name, strip_video=False)),
        }
        if wanted in keys:
            return ResolvedModel(cls, entry, {}, "diffusers defaults")
    candidates = {e.short_name: e.short_name for _, e in scanned}
    candidates.update({e.class_name: e.short_name for _, e in scanned})
    close = difflib.get_close_matches(name_or_path, list(candidates), n=3, cutoff=0.5)
    close = list(dict.fromkeys(candidates[c] if c in candidates else c for c in close))
    hint = f"; closest: {', '.join(close)}" if close else f"; known: {', '.join(e.short_name for _, e in scanned)}"
    raise BadInput(f"unknown model '{name_or_path}'{hint} (see `cpdoctor plan --list`)")


def full_config(cls: type, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The class's `__init__` defaults overlaid with `config` (private keys such as _class_name dropped)."""
    out: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name != "self" and param.default is not inspect.Parameter.empty:
            out[name] = param.default
    out.update({k: v for k, v in (config or {}).items() if not k.startswith("_")})
    return out


def build_model(cls: type, config: Mapping[str, Any] | None = None, device: Any = "meta", dtype: Any = None) -> Any:
    """`cls.from_config(config)` built directly on `device` (on "meta" it allocates nothing)."""
    import torch

    cfg = {k: v for k, v in (config or {}).items()}
    try:
        with torch.device(device):
            model = cls.from_config(cfg)
    except Exception as exc:  # noqa: BLE001
        raise CannotExamine(f"cannot build {cls.__name__} from its config: {type(exc).__name__}: {exc}") from exc
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


# --------------------------------------------------------------------------------------------------------------
# input builders: the pipelines' conventions, one small function per family
# --------------------------------------------------------------------------------------------------------------


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


def _forward_params(cls: type) -> set[str]:
    return set(inspect.signature(cls.forward).parameters) - {"self"}


def _rand(shape: tuple[int, ...], device: Any, dtype: Any, generator: Any = None) -> Any:
    import torch

    return torch.randn(shape, device=device, dtype=dtype, generator=generator)


def _snap(value: int, multiple: int) -> int:
    return (value // multiple) * multiple


def _plan_input_dims(cls: type, name: str, default: int) -> int:
    """The expected_dims the class's own `_cp_plan` declares for input `name` (ids are 2-D in Flux, 3-D in Flux2)."""
    for spec in (cls._cp_plan or {}).values():
        if isinstance(spec, dict) and name in spec and getattr(spec[name], "expected_dims", None):
            return int(spec[name].expected_dims)
    return default


# -- packed-image MMDiTs (Flux, Flux2, Qwen-Image): latents are 2x2-packed tokens, 8x VAE ----------------------

_IMAGE_VAE_SCALE = 8  # the pipelines' fallback vae_scale_factor: 2 ** (len(block_out_channels) - 1)
_IMAGE_PACK = 2  # the pipelines pack 2x2 latent pixels into one token


def _packed_image_multiple(config: Mapping[str, Any]) -> int:
    return _IMAGE_VAE_SCALE * _IMAGE_PACK


def _build_packed_image(
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
    """Flux-style pipelines: tokens = (H // 16) * (W // 16), each with `in_channels` features; the text is
    `text_len` embeddings of width `joint_attention_dim`. Optional arguments are filled when the forward
    signature has them: pooled_projections, guidance, img_ids / txt_ids (rank from `_cp_plan`, one column per
    rope axis), img_shapes and encoder_hidden_states_mask (Qwen-Image)."""
    import torch

    dtype = dtype or torch.float32
    params = _forward_params(cls)
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
    if "encoder_hidden_states_mask" in params and text_mask:
        kw["encoder_hidden_states_mask"] = torch.ones((batch, text_len), device=device, dtype=torch.long)
    return ModelInputs(kw, gh * step, gw * step, None, text_len)


# -- Wan-style video DiTs (Wan, ChronoEdit): 5-D latents, 8x spatial / 4x temporal VAE ---------------------

_WAN_VAE_SPATIAL = 8
_WAN_VAE_TEMPORAL = 4
_WAN_IMAGE_TOKENS = 257  # CLIP ViT-H/14 image embedding of the I2V pipelines (1 + 16 * 16 tokens)


def _wan_multiple(config: Mapping[str, Any]) -> int:
    patch = config.get("patch_size") or (1, 2, 2)
    return _WAN_VAE_SPATIAL * int(patch[-1])


def _build_wan(
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
    """Wan pipelines: latents (B, in_channels, (F - 1) // 4 + 1, H // 8, W // 8), patchified inside the model;
    text `text_len` embeddings of width `text_dim`; an image embedding of 257 tokens when `image_dim` is set."""
    import torch

    dtype = dtype or torch.float32
    frames = 81 if frames is None else frames
    lat_f = (frames - 1) // _WAN_VAE_TEMPORAL + 1
    m = _wan_multiple(config)
    lat_h, lat_w = (height // m) * m // _WAN_VAE_SPATIAL, (width // m) * m // _WAN_VAE_SPATIAL
    kw: dict[str, Any] = {
        "hidden_states": _rand((batch, int(config["in_channels"]), lat_f, lat_h, lat_w), device, dtype, generator),
        "timestep": torch.full((batch,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": _rand((batch, text_len, int(config["text_dim"])), device, dtype, generator),
        "return_dict": False,
    }
    if config.get("image_dim") and "encoder_hidden_states_image" in _forward_params(cls):
        kw["encoder_hidden_states_image"] = _rand((batch, _WAN_IMAGE_TOKENS, int(config["image_dim"])), device, dtype, generator)
    snapped = (lat_f - 1) * _WAN_VAE_TEMPORAL + 1
    return ModelInputs(kw, lat_h * _WAN_VAE_SPATIAL, lat_w * _WAN_VAE_SPATIAL, snapped, text_len)


# Helios generates a long video window by window; each forward sees one window of latents plus three
# compressed history latents (pipeline defaults: history_sizes=[16, 2, 1], keep_first_frame=True).
_HELIOS_HISTORY = (16, 2, 1)


def _build_helios(
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
    """Helios pipeline, one window: `frames` is the window length in frames (default 33 = 9 latent frames);
    history latents long / mid / short of 16 / 2 / 1+1 latent frames with their frame indices."""
    import torch

    dtype = dtype or torch.float32
    frames = 33 if frames is None else frames
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


def _build_ltx(
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
    """LTX pipelines: tokens = ((F - 1) // 8 + 1) * (H // 32) * (W // 32) with `in_channels` features, the latent
    grid passed as num_frames / height / width; text `text_len` embeddings of width `caption_channels` with an
    attention mask (the pipeline always passes one)."""
    import torch

    dtype = dtype or torch.float32
    frames = 161 if frames is None else frames
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
    if "rope_interpolation_scale" in _forward_params(cls):
        kw["rope_interpolation_scale"] = (temporal / _LTX_FRAME_RATE, spatial, spatial)
    snapped = (lat_f - 1) * temporal + 1
    return ModelInputs(kw, lat_h * spatial, lat_w * spatial, snapped, text_len)


_LTX2_FPS = 24.0


def _build_ltx2(
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
    """LTX-2 pipelines: video tokens as LTX (VAE factors from the config); audio latents
    round(F / fps * sampling_rate / hop_length / audio_scale_factor) tokens of `audio_in_channels`; both text
    streams `text_len` embeddings of width `caption_channels` with a mask."""
    import torch

    dtype = dtype or torch.float32
    frames = 121 if frames is None else frames
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


def _builder_key_for(cls: type) -> str | None:
    for klass in cls.__mro__:
        key = FAMILIES.get(short_name_for(klass.__name__))
        if key:
            return key
    return None


def builder_for(cls: type) -> InputBuilder:
    key = _builder_key_for(cls)
    if key is None:
        raise CannotExamine(
            f"cpdoctor has no input builder for {cls.__name__} (it does not know how the pipeline shapes its "
            "inputs); add one to cpdoctor/models/catalog.py FAMILIES"
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
    return builder.build(
        cls,
        config,
        height,
        width,
        text_len,
        frames,
        batch=batch,
        device=device,
        dtype=dtype,
        text_mask=text_mask,
        generator=generator,
    )
