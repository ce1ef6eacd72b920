"""Which diffusers models have a context-parallel plan, what cpdoctor calls them, and what they take as input.

Nothing here is a hand-kept list of models. `list_models()` scans `diffusers.models` for ModelMixin subclasses
whose class attribute `_cp_plan` is non-empty, and derives each short name from the class name
(FluxTransformer2DModel -> flux, QwenImageTransformer2DModel -> qwen-image, LTXVideoTransformer3DModel -> ltx).

How a pipeline shapes each family's inputs is `cpdoctor.model_zoo.inputs` (one builder per family).

torch and diffusers are imported inside functions only, so importing this module is free.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.diffusers import cp_plan
from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.memo import Memo
from cpdoctor.model_zoo.inputs import family_builder_key
from cpdoctor.model_zoo.names import short_name_for

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


def _import_models_package() -> Any:
    try:
        import diffusers.models as models
    except ImportError as exc:
        raise BadInput(f"diffusers is not installed or does not import ({exc}); pip install diffusers") from exc
    return models


SCANNED: Memo[tuple[tuple[type, ModelEntry], ...]] = Memo("the diffusers model classes with a _cp_plan, and their entries")
"""`_scan`'s memo. Lifetime: the process's (the imported diffusers does not change under it); cleared by tests only."""


def _scan() -> tuple[tuple[type, ModelEntry], ...]:
    """Every diffusers model class with a `_cp_plan`, with its entry (scanned once per process)."""
    return SCANNED.get((), _scan_models)


def _scan_models() -> tuple[tuple[type, ModelEntry], ...]:
    models = _import_models_package()
    from diffusers.models.modeling_utils import ModelMixin

    classes: dict[str, type] = {}
    for attr in sorted(dir(models)):
        if attr.startswith("_"):
            continue
        found = Attempt.of(lambda: getattr(models, attr))  # noqa: B023 - called at once, in this iteration
        if not found.ok:  # a model whose optional dependency is missing: not ours to examine
            continue
        obj = found.value
        if inspect.isclass(obj) and issubclass(obj, ModelMixin) and cp_plan(obj):
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
            builder=family_builder_key(cls),
            cp_plan_entries=len(cp_plan(cls)),
        )
        out.append((cls, entry))
    return tuple(out)


def list_models() -> list[ModelEntry]:
    """Every diffusers model class with a non-empty `_cp_plan`, sorted by short name."""
    return [entry for _, entry in _scan()]


FAMILY_KINDS = ("video", "image", "all")
"""What a suite's `each:` names: the classes whose input family is video, image, or every class with a plan."""


def models_of(family: str) -> list[tuple[type, ModelEntry]]:
    """The classes with a `_cp_plan` in the installed diffusers (detected, never listed) of `family`
    (`FAMILY_KINDS`), with their entries, sorted by short name; classes without an input builder are left out."""
    from cpdoctor.model_zoo.inputs import BUILDERS

    if family not in FAMILY_KINDS:
        raise BadInput(f"each: must be one of {', '.join(FAMILY_KINDS)}, got {family!r}")
    chosen = []
    for cls, entry in _scan():
        builder = BUILDERS.get(entry.builder or "")
        if builder is not None and (family == "all" or builder.is_video == (family == "video")):
            chosen.append((cls, entry))
    return chosen


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
    except Exception as exc:  # noqa: BLE001 - the model's own constructor may raise anything; each is one CANNOT EXAMINE
        raise CannotExamine(f"cannot build {cls.__name__} from its config: {type(exc).__name__}: {exc}") from exc
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def model_outputs(result: Any) -> list[Any]:
    """The tensors a model's forward returned, in order: one for most classes (`(sample,)` with return_dict=False),
    the video and the audio for LTX-2 and MiniMax-H3 (each is gathered by the CP plan and each is examined)."""
    import torch

    items = list(result) if isinstance(result, (tuple, list)) else [getattr(result, "sample", result)]
    return [t for t in items if isinstance(t, torch.Tensor)]
