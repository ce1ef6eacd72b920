"""How a pipeline turns (height, width, frames, prompt) into its transformer's forward arguments: the VAE
compression, the latent packing, the text-embedding width. diffusers does not say this in the model class, so
the conventions are copied from the pipelines into one small input builder per family (`BUILDERS`; one module per
family, each citing the pipeline file and the calls it reads: image.py, wan.py, ltx.py, minimax.py), chosen by
the class's family (`FAMILIES`, inherited through the MRO). A builder reads the model's own config
(in_channels, joint_attention_dim, patch_size, ...) and forward signature and returns the keyword arguments of
`model.forward` for one `InputShape`, on any device: on "meta" they cost nothing, which is how `cpdoctor plan`
measures shapes, and on a real device they are random inputs with valid position ids.

torch and diffusers are imported inside functions only, so importing this module is free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cpdoctor.errors import CannotExamine
from cpdoctor.model_zoo.inputs.base import InputBuilder, InputShape, ModelInputs
from cpdoctor.model_zoo.inputs.image import PACKED_IMAGE
from cpdoctor.model_zoo.inputs.ltx import LTX, LTX2
from cpdoctor.model_zoo.inputs.minimax import MINIMAX
from cpdoctor.model_zoo.inputs.wan import HELIOS, WAN
from cpdoctor.model_zoo.names import short_name_for

__all__ = ["BUILDERS", "FAMILIES", "InputBuilder", "InputShape", "ModelInputs", "build_inputs", "builder_for", "family_builder_key"]

BUILDERS: dict[str, InputBuilder] = {b.name: b for b in (PACKED_IMAGE, WAN, HELIOS, LTX, LTX2, MINIMAX)}
"""Builder key -> how that family's pipeline feeds its transformer."""

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
    "mini-max-h3": "minimax-h3",
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
            "inputs); add one to cpdoctor/model_zoo/inputs/ (a module) and FAMILIES"
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
