"""Test helpers: a tiny Flux saved the way diffusers saves it, and a Hugging Face cache laid out the way
huggingface_hub lays it out (file_download.py): `models--ORG--NAME/blobs/<sha256>`, `snapshots/<commit>/<path>`
as relative symlinks into blobs/, `refs/<branch or tag>` holding the commit without a newline. Nothing is
downloaded; `huggingface_hub.scan_cache_dir` reads the result as a valid cache (test_checkpoints checks it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

TINY_FLUX = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 4, 8),
)
TINY_QWEN_IMAGE = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=16,
    axes_dims_rope=(8, 4, 4),
)
"""docs/FACTS.md "Tiny models": small checkpoints to save and load (the tests' fixtures; `cpdoctor model flux`
derives its own tiny config from the class, cpdoctor/model_zoo/tiny.py)."""

FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
"""docs/FACTS.md, "Real checkpoints": FLUX.1-dev's transformer config."""


def tiny_flux(seed: int = 3):
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**TINY_FLUX)


def save_pipeline(directory: Path, model, **save_kwargs) -> Path:
    """A pipeline folder: model_index.json naming the transformer, transformer/ saved by save_pretrained, and a
    text encoder folder that is not the transformer's business."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model_index.json").write_text(
        '{"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1", '
        '"transformer": ["diffusers", "FluxTransformer2DModel"], "text_encoder": ["transformers", "CLIPTextModel"]}'
    )
    model.save_pretrained(str(directory / "transformer"), **save_kwargs)
    (directory / "text_encoder").mkdir(exist_ok=True)
    (directory / "text_encoder" / "config.json").write_text('{"architectures": ["CLIPTextModel"]}')
    return directory


def files_of(directory: Path) -> dict[str, Path]:
    """Repo path -> file, for everything under `directory`."""
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}


def add_to_cache(cache: Path, repo_id: str, files: dict[str, Path], commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `files` into the cache as commit `commit` of model repo `repo_id`; point each ref at it. Returns the
    snapshot folder."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for path, src in files.items():
        data = src.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def hub_env(root: Path) -> dict[str, str]:
    """The environment that points huggingface_hub at `root` and keeps it offline."""
    return {"HF_HOME": str(root), "HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}
