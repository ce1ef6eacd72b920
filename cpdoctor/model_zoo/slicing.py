"""A model sliced to fit: its input embedders, the first N blocks of each block stack and its output layers,
with the checkpoint's real weights, read tensor by tensor from the safetensors files.

- `block_stacks(model)`: the `nn.ModuleList` attributes whose elements are the repeated blocks (the classes
  named by `_repeated_blocks` / `_no_split_modules` when the class has them, else a ModuleList of at least two
  modules of one class), in definition order.
- `stack_config_keys(cls, config)`: which config key sizes which stack (num_layers -> transformer_blocks,
  num_single_layers -> single_transformer_blocks), found by building the model on the meta device with every
  candidate key set to a distinct small depth and reading the stacks' lengths back: no name table.
- `sliced_config(config, keys, n)`: the config with each stack's key set to min(n, depth).
- `empty_parameters()`: parameters are created on the meta device, buffers and plain tensors for real (what
  accelerate's init_empty_weights(include_buffers=False) does), so rotary tables built in __init__ exist.
- `load_sliced(cls, config, files, ...)`: build the sliced model so, then read exactly its state-dict keys,
  one `safe_open(...).get_tensor(key)` each (the index says which shard holds which), and assign them.
  `ReadStats` counts what was read.

torch, diffusers and safetensors are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cpdoctor.errors import BadInput, first_line

DEPTH_KEY = re.compile(r"(layers|blocks|depth)$")
"""Config keys that may size a block stack (num_layers, num_single_layers, num_blocks, depth, ...)."""


@dataclasses.dataclass(frozen=True)
class Stack:
    name: str  # the attribute: transformer_blocks
    depth: int  # blocks in the full model
    key: str | None  # the config key that sizes it, None when none was found
    block_class: str
    block_params: int = 0  # parameters of one block

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _block_class_names(model: Any) -> set[str]:
    names: set[str] = set()
    for attr in ("_repeated_blocks", "_no_split_modules"):
        value = getattr(type(model), attr, None) or ()
        names.update(v for v in value if isinstance(v, str))
    return names


def block_stacks(model: Any) -> list[tuple[str, Any]]:
    """(attribute name, ModuleList) of every stack of repeated blocks, in the order the model defines them."""
    import torch

    named = _block_class_names(model)
    stacks = []
    for name, child in model.named_children():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        classes = {type(m).__name__ for m in child}
        if len(classes) != 1:
            continue
        (cls_name,) = classes
        if cls_name in named or (not named and len(child) >= 2):
            stacks.append((name, child))
    return stacks


def depth_candidates(config: Mapping[str, Any]) -> list[str]:
    return [k for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1 and DEPTH_KEY.search(k)]


def stack_config_keys(cls: type, config: Mapping[str, Any]) -> list[Stack]:
    """The model's stacks with the config key that sizes each (two meta builds, no weights)."""
    from cpdoctor.model_zoo.catalog import build_model, full_config

    full = full_config(cls, config)
    with empty_parameters():
        model = build_model(cls, full, device="cpu")
    found = [(name, len(ml), type(ml[0]).__name__, sum(p.numel() for p in ml[0].parameters())) for name, ml in block_stacks(model)]
    candidates = depth_candidates(full)
    probe_values = {k: i + 2 for i, k in enumerate(candidates)}
    keys: dict[str, str] = {}
    if candidates:
        with empty_parameters():
            probe = build_model(cls, {**full, **probe_values}, device="cpu")
        lengths = {name: len(getattr(probe, name)) for name, *_ in found}
        for k, v in probe_values.items():
            for name, length in lengths.items():
                if length == v and name not in keys:
                    keys[name] = k
    return [Stack(name, depth, keys.get(name), cls_name, per) for name, depth, cls_name, per in found]


@dataclasses.dataclass(frozen=True)
class Survey:
    """The stacks of a model and its parameter count outside them (embedders, output layers)."""

    stacks: tuple[Stack, ...]
    other_params: int

    @property
    def depth(self) -> int:
        return max_depth(self.stacks)

    def params(self, n: int) -> int:
        """Parameters of the model sliced to the first n blocks of each stack."""
        return self.other_params + sum(min(n, s.depth) * s.block_params for s in self.stacks)

    def blocks(self, n: int) -> int:
        return sum(min(n, s.depth) for s in self.stacks)


def survey(cls: type, config: Mapping[str, Any]) -> Survey:
    """Stacks (with their sizing keys) and the parameters outside them, from meta builds."""
    from cpdoctor.model_zoo.catalog import build_model, full_config

    stacks = stack_config_keys(cls, config)
    with empty_parameters():
        model = build_model(cls, full_config(cls, config), device="cpu")
    total = sum(p.numel() for p in model.parameters())
    in_stacks = sum(p.numel() for name, ml in block_stacks(model) for p in ml.parameters())
    return Survey(tuple(stacks), total - in_stacks)


def sliced_config(config: Mapping[str, Any], stacks: Iterable[Stack], n: int) -> dict[str, Any]:
    """The config with every stack's sizing key set to min(n, depth). BadInput when a stack has no key."""
    out = dict(config)
    for s in stacks:
        if s.depth <= n:
            continue
        if s.key is None:
            raise BadInput(f"cannot slice {s.name}: no config key sizes it (candidates: {', '.join(depth_candidates(config)) or 'none'})")
        out[s.key] = min(n, s.depth)
    return out


def max_depth(stacks: Iterable[Stack]) -> int:
    return max((s.depth for s in stacks), default=0)


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Parameters registered inside are created on the meta device; buffers and plain tensors are real."""
    import torch

    original = torch.nn.Module.register_parameter

    def register(module: Any, name: str, param: Any) -> None:
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------------------------
# which tensor lies in which file, and reading them one by one
# --------------------------------------------------------------------------------------------------------------


def weight_map(files: Iterable[str], index_file: str | None = None) -> dict[str, str]:
    """Tensor name -> the file holding it: from the index when there is one (reading no shard), else from each
    file's header."""
    files = list(files)
    if index_file and os.path.isfile(index_file):
        with open(index_file, encoding="utf-8") as fh:
            wm = json.load(fh).get("weight_map") or {}
        directory = os.path.dirname(index_file)
        return {k: os.path.join(directory, v) for k, v in wm.items()}
    from safetensors import safe_open

    out: dict[str, str] = {}
    for path in files:
        with safe_open(path, "pt") as fh:
            out.update({k: path for k in fh.keys()})
    return out


@dataclasses.dataclass
class ReadStats:
    tensors_read: int = 0
    bytes_read: int = 0
    files_opened: int = 0
    tensors_in_checkpoint: int = 0


def read_tensors(names: Iterable[str], where: Mapping[str, str], stats: ReadStats | None = None, dtype: Any = None) -> dict[str, Any]:
    """Exactly `names`, each with one get_tensor call on the file that holds it (cast to `dtype` one at a time)."""
    from safetensors import safe_open

    stats = stats if stats is not None else ReadStats()
    names = list(names)
    missing = [n for n in names if n not in where]
    if missing:
        raise BadInput(
            f"the checkpoint has no tensor {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; is it this model class's?"
        )
    by_file: dict[str, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    out: dict[str, Any] = {}
    for path, keys in by_file.items():
        if not os.path.isfile(path):
            raise BadInput(f"the shard {os.path.basename(path)} holding {keys[0]} is missing")
        try:
            with safe_open(path, "pt") as fh:
                stats.files_opened += 1
                for k in keys:
                    t = fh.get_tensor(k)
                    stats.tensors_read += 1
                    stats.bytes_read += t.numel() * t.element_size()
                    out[k] = t if dtype is None else t.to(dtype)
        except BadInput:
            raise
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError
            raise BadInput(f"cannot read {path}: {first_line(exc)}") from exc
    return out


def index_file_of(files: Iterable[str], model_dir: str, variant: str | None) -> str | None:
    from cpdoctor.model_zoo.checkpoints import SAFETENSORS_INDEX, add_variant

    path = os.path.join(model_dir, add_variant(SAFETENSORS_INDEX, variant))
    return path if os.path.isfile(path) else None


def load_sliced(cls: type, config: Mapping[str, Any], where: Mapping[str, str], stats: ReadStats | None = None, dtype: Any = None) -> Any:
    """The model of `config` (already sliced) with its state dict read lazily from the files of `where`."""
    from cpdoctor.model_zoo.catalog import build_model

    with empty_parameters():
        model = build_model(cls, dict(config), device="cpu")
    names = list(model.state_dict().keys())
    if stats is not None:
        stats.tensors_in_checkpoint = len(where)
    state = read_tensors(names, where, stats, dtype)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise BadInput(f"the checkpoint's tensors do not fit {cls.__name__}: {first_line(exc, with_type=False)}") from exc
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise BadInput(f"the checkpoint left {leftover[0]} unset")
    return model


def selected_keys(cls: type, config: Mapping[str, Any]) -> list[str]:
    """The state-dict keys of the model of `config` (no weights): what a sliced load reads."""
    from cpdoctor.model_zoo.catalog import build_model

    with empty_parameters():
        model = build_model(cls, dict(config), device="cpu")
    return list(model.state_dict().keys())
