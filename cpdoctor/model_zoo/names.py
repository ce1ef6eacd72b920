"""A diffusers model class's short name (FluxTransformer2DModel -> flux): what `cpdoctor model NAME` takes, and
the key of its input family. Its own module because the catalogue and the input builders both need it (and the
catalogue needs the builders)."""

from __future__ import annotations

import re


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
