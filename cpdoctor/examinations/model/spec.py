"""What model an examination builds: the class, its config and where its weights come from (a tiny config derived
from the class, a config file with random weights, a hub id found in the local Hugging Face cache, a pipeline or
transformer folder), and the model's block stacks (to cut it to the blocks that fit). Used by the parent
(prepare.py) and by every rank (which receive the tiny config the parent derived inside the request)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from cpdoctor.compat.diffusers import forward_params
from cpdoctor.errors import BadInput
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.memo import Memo

TINY_SOURCE = "tiny config"
RANDOM_WEIGHTS = "random weights"
REFERENCE_BACKEND = "native"
"""diffusers' default backend (torch SDPA), which runs in float64 on CPU."""


@dataclasses.dataclass
class ModelSpec:
    """What to build: the class, its config, and where the weights come from."""

    cls: type
    short_name: str
    class_name: str
    config: dict[str, Any]
    source: str  # TINY_SOURCE, the checkpoint directory or "hub cache org/name@commit"
    builder: Any
    weights: Any = None  # cpdoctor.model_zoo.checkpoints.Checkpoint, None for a tiny config or a config file
    tiny: Any = None  # cpdoctor.model_zoo.tiny.TinyConfig for a tiny config

    @property
    def checkpoint(self) -> str | None:
        """The directory holding the transformer's config and weights, None for a tiny config."""
        return None if self.weights is None else self.weights.model_dir

    def full_config(self) -> dict[str, Any]:
        from cpdoctor.model_zoo.catalog import full_config

        return full_config(self.cls, self.config)


# the checkpoint options of `cpdoctor model` (--revision, --variant, --download, --allow-pickle, --partial)
def resolve_spec(
    model: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    download: bool = False,
    allow_pickle: bool = False,
    partial: bool = False,
    config: str | None = None,
    tiny: Any = None,
) -> ModelSpec:
    """The class and config for MODEL: a tiny config derived from the class for a name (`tiny`, when the parent
    derived it already), the `config` file's with random weights, the checkpoint's own for a hub id (found in the
    local Hugging Face cache, fetched only with `download`), a pipeline or a transformer directory. BadInput for an
    unknown name, checkpoint options given with a name, or a checkpoint that is missing, pickle-only, truncated or
    incomplete (cpdoctor.model_zoo.checkpoints); CannotShrink (exit 3) for a class cpdoctor cannot shrink."""
    from cpdoctor.model_zoo import checkpoints
    from cpdoctor.model_zoo.catalog import resolve_model
    from cpdoctor.model_zoo.inputs import builder_for

    weights = (
        None
        if config is not None
        else checkpoints.locate(model, revision=revision, variant=variant, download=download, allow_pickle=allow_pickle, partial=partial)
    )
    resolved = resolve_model(model if weights is None else weights.config_file)
    cls, entry = resolved.cls, resolved.entry
    builder = builder_for(cls)
    if weights is not None:
        return ModelSpec(cls, entry.short_name, entry.class_name, dict(weights.config), weights.source, builder, weights)
    given = [
        o for o, v in (("--revision", revision), ("--variant", variant), ("--download", download), ("--allow-pickle", allow_pickle)) if v
    ]
    if given:
        what = "a config file's random weights" if config is not None else f"the name {model}"
        raise BadInput(f"{' and '.join(given)} apply to a checkpoint (a hub id org/name or a directory), not to {what}")
    if config is not None:
        return ModelSpec(cls, entry.short_name, entry.class_name, config_file(config, cls), f"{config} ({RANDOM_WEIGHTS})", builder)
    from cpdoctor.model_zoo.tiny import derive

    tiny = tiny if tiny is not None else derive(cls)
    return ModelSpec(cls, entry.short_name, entry.class_name, dict(tiny.config), TINY_SOURCE, builder, tiny=tiny)


def config_file(path: str, cls: type) -> dict[str, Any]:
    """The keys of a config.json given with --config (private keys such as _class_name checked and dropped): the
    class's defaults fill the rest. BadInput for a file that does not read or names another class."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot read --config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise BadInput(f"--config {path} is not a JSON object of config keys")
    named = data.get("_class_name")
    if named and named != cls.__name__:
        raise BadInput(f"--config {path} is a {named} config, not {cls.__name__}'s")
    return {k: v for k, v in data.items() if not k.startswith("_")}


def request_spec(req: ModelRequest, *, local_only: bool = False) -> ModelSpec:
    """resolve_spec for a request. The ranks and rank 0's evaluation pass local_only: they never download, and
    `prepare` pinned a hub checkpoint's revision to the commit the parent resolved, so they load the same one;
    they build the tiny config the parent derived (`req.tiny`), never deriving it again."""
    return resolve_spec(
        req.model,
        revision=req.revision,
        variant=req.variant,
        download=req.download and not local_only,
        allow_pickle=req.allow_pickle,
        partial=req.blocks is not None,
        config=req.config,
        tiny=req.tiny,
    )


def text_mask_param(spec: ModelSpec) -> str | None:
    """The forward argument that masks text padding, when this model takes one."""
    name = getattr(spec.builder, "text_mask_param", None)
    return name if name and name in forward_params(spec.cls) else None


SURVEYS: Memo[Any] = Memo("(model class, config) -> its survey (one meta-device build per class and config per process)")
"""`model_survey`'s memo. Lifetime: the process's (a class and config survey alike every time); cleared by tests only."""


def model_survey(spec: ModelSpec) -> Any:
    """The model's block stacks (with the config keys that size them) and its parameters outside them."""
    from cpdoctor.model_zoo.slicing import survey

    key = (spec.cls.__name__, repr(sorted(spec.config.items())))
    return SURVEYS.get(key, lambda: survey(spec.cls, spec.config))


def sliced_config(spec: ModelSpec, blocks: int | None) -> dict[str, Any]:
    """The config with every stack cut to `blocks` (the full config for None)."""
    from cpdoctor.model_zoo.slicing import sliced_config as cut

    full = spec.full_config()
    if blocks is None:
        return full
    return cut(full, model_survey(spec).stacks, blocks)


def is_sliced(spec: ModelSpec, blocks: int | None) -> bool:
    return blocks is not None and any(s.depth > blocks for s in model_survey(spec).stacks)
