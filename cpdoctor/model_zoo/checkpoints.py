"""Where a model's weights come from: a hub id found in the local Hugging Face cache, a pipeline directory, a
transformer directory, a sharded checkpoint with its index, a variant; safetensors only unless told otherwise.

`locate(MODEL, revision=, variant=, download=, allow_pickle=)` returns a `Checkpoint` (the directory and
subfolder `from_pretrained` gets, the variant, the class name and config, every weight file, and a one-line
description of the source), or None when MODEL is a name (a short name or a class name: the catalog's
business). Everything wrong with a checkpoint is a BadInput with one line naming the file or the place looked
in, found here before any process starts.

The Hugging Face cache is read through huggingface_hub only (`snapshot_download(..., local_files_only=True)`
resolves refs/ and snapshots/ under HF_HUB_CACHE or HF_HOME/hub; `scan_cache_dir` expands a short commit),
never by hand. The folder is then loaded as a folder: diffusers' `from_pretrained` on a hub id looks the
shards up on the Hub, which fails offline (docs/FACTS.md, "Real checkpoints"). Nothing is downloaded unless
`download=True`, and then only the transformer's config, index and the weight files it names.

torch and diffusers are imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from cpdoctor.errors import BadInput, first_line

SAFETENSORS_NAME = "diffusion_pytorch_model.safetensors"
SAFETENSORS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
PICKLE_NAME = "diffusion_pytorch_model.bin"
PICKLE_INDEX = "diffusion_pytorch_model.bin.index.json"
"""diffusers' weight file names (diffusers.utils.constants); a variant goes before the last suffix."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TRANSFORMER = "transformer"
"""The pipeline component examined: the subfolder a pipeline keeps its transformer in."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_HEX = re.compile(r"^[0-9a-f]{7,40}$")
_VARIANT = re.compile(r"^[A-Za-z0-9][\w-]*$")
_VARIANT_FILE = re.compile(r"^diffusion_pytorch_model(?:\.safetensors\.index\.([\w-]+)\.json|\.([\w-]+?)(?:-\d+-of-\d+)?\.safetensors)$")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A located transformer checkpoint: load it with
    `cls.from_pretrained(directory, subfolder=subfolder, variant=variant, use_safetensors=use_safetensors)`."""

    directory: str  # what from_pretrained gets: a snapshot, pipeline or transformer directory
    subfolder: str | None  # "transformer" for a pipeline, None when `directory` is the transformer itself
    variant: str | None
    class_name: str
    config: dict[str, Any]
    weight_files: tuple[str, ...]  # absolute paths, every shard of an index
    source: str  # one line: "hub cache org/name@0123456789ab" or the transformer directory
    use_safetensors: bool = True
    revision: str | None = None  # the commit of a hub snapshot

    @property
    def model_dir(self) -> str:
        """The directory holding config.json and the weights."""
        return os.path.join(self.directory, self.subfolder) if self.subfolder else self.directory

    @property
    def config_file(self) -> str:
        return os.path.join(self.model_dir, "config.json")


def add_variant(name: str, variant: str | None) -> str:
    """diffusers' convention: diffusion_pytorch_model.safetensors -> diffusion_pytorch_model.fp16.safetensors."""
    if not variant:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.{variant}.{suffix}"


def is_hub_id(name: str) -> bool:
    """`org/name` that is not an existing path."""
    return bool(_HUB_ID.match(name)) and not os.path.exists(name)


def hub_cache_dir() -> str:
    """The cache huggingface_hub reads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _check_options(revision: Any, variant: Any) -> None:
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise BadInput(f"--revision must be a branch, tag or commit, got {revision!r}")
    if variant is not None and (not isinstance(variant, str) or not _VARIANT.match(variant)):
        raise BadInput(f"--variant must be a file-name variant such as fp16 or bf16, got {variant!r}")


def locate(
    model: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    download: bool = False,
    allow_pickle: bool = False,
    partial: bool = False,
) -> Checkpoint | None:
    """The checkpoint MODEL names, or None when MODEL is a name for the catalog (no path, no `org/name`).
    `partial`: shards the index names may be missing (a sliced examination reads only some; the caller checks
    that the shards it needs exist)."""
    _check_options(revision, variant)
    name = (model or "").strip()
    path = os.path.expanduser(name)
    if os.path.exists(path):
        if revision is not None or download:
            raise BadInput(f"{name} is a local path; --revision and --download apply to a hub id (org/name)")
        directory, subfolder = _local_root(path)
        return _checkpoint(directory, subfolder, variant, allow_pickle, source=None, partial=partial)
    if is_hub_id(name):
        return locate_hub(name, revision=revision, variant=variant, download=download, allow_pickle=allow_pickle, partial=partial)
    if name.endswith((".json", ".safetensors")) or name.startswith((".", "~")) or os.sep in name:
        raise BadInput(f"no such file or directory: {name}")
    return None


# --------------------------------------------------------------------------------------------------------------
# local directories: pipeline, transformer, files
# --------------------------------------------------------------------------------------------------------------


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot read {what} {path}: {first_line(exc)}") from exc


def _local_root(path: str) -> tuple[str, str | None]:
    """(directory, subfolder) for a path: a file stands for its folder, a folder for itself."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        if not path.endswith((".json", ".safetensors", *PICKLE_SUFFIXES)):
            raise BadInput(f"{path} is not a checkpoint file (config.json, *.safetensors or an index); give its directory")
        path = os.path.dirname(path)
    return transformer_folder(path)


def _class_name(config_file: str) -> str | None:
    config = _read_json(config_file, "config")
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name else None


def transformer_folder(directory: str) -> tuple[str, str | None]:
    """(directory, "transformer") for a pipeline (model_index.json names a transformer, transformer/ holds it)
    or a folder with a transformer/ subfolder; (directory, None) for a transformer directory (config.json with a
    _class_name). BadInput otherwise."""
    index = os.path.join(directory, "model_index.json")
    nested = os.path.join(directory, TRANSFORMER, "config.json")
    if os.path.isfile(index):
        pipeline = _read_json(index, "pipeline index")
        entry = pipeline.get(TRANSFORMER) if isinstance(pipeline, dict) else None
        if not isinstance(entry, (list, tuple)) or not any(entry):
            raise BadInput(f"{directory} is a pipeline without a transformer (its model_index.json names none)")
        if not os.path.isfile(nested):
            raise BadInput(f"{directory} is a pipeline whose model_index.json names a transformer, but {nested} is missing")
        return directory, TRANSFORMER
    direct = os.path.join(directory, "config.json")
    if os.path.isfile(direct) and _class_name(direct):
        return directory, None
    if os.path.isfile(nested):
        return directory, TRANSFORMER
    raise BadInput(f"{directory} has no transformer: no config.json with a _class_name and no {TRANSFORMER}/ folder")


def _known_class(name: str, config_file: str) -> None:
    import diffusers

    try:
        known = isinstance(getattr(diffusers, name), type)
    except (AttributeError, ImportError, RuntimeError):
        known = False
    if not known:
        raise BadInput(f"{config_file} names {name}, which is not a class of diffusers {diffusers.__version__}")


def _checkpoint(
    directory: str,
    subfolder: str | None,
    variant: str | None,
    allow_pickle: bool,
    source: str | None,
    revision: str | None = None,
    partial: bool = False,
) -> Checkpoint:
    model_dir = os.path.join(directory, subfolder) if subfolder else directory
    config_file = os.path.join(model_dir, "config.json")
    config = _read_json(config_file, "config")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if not isinstance(name, str) or not name:
        raise BadInput(f"{config_file} has no _class_name; point at a diffusers transformer")
    _known_class(name, config_file)
    files, safe = weight_files(model_dir, variant, allow_pickle, partial=partial)
    return Checkpoint(
        directory=directory,
        subfolder=subfolder,
        variant=variant,
        class_name=name,
        config=dict(config),
        weight_files=tuple(files),
        source=source or model_dir,
        use_safetensors=safe,
        revision=revision,
    )


# --------------------------------------------------------------------------------------------------------------
# weight files
# --------------------------------------------------------------------------------------------------------------


def _listing(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def _variants_in(names: list[str]) -> list[str]:
    found = []
    for name in names:
        m = _VARIANT_FILE.match(name)
        if m and (m.group(1) or m.group(2)):
            found.append(m.group(1) or m.group(2))
    return sorted(set(found))


def _shard_names(index_file: str) -> list[str]:
    """The file names the index's weight_map names (plain names: the shards lie next to the index)."""
    index = _read_json(index_file, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInput(f"{index_file} has no weight_map")
    names = sorted({str(v) for v in weight_map.values()})
    for name in names:
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise BadInput(f"{index_file} names {name!r}, which is not a plain file name next to it")
    return names


def _shards(index_file: str, partial: bool = False) -> list[str]:
    """Every file the index names, each checked to exist (a dangling cache link is missing too); with `partial`
    only those present."""
    directory = os.path.dirname(index_file)
    shards = [os.path.join(directory, name) for name in _shard_names(index_file)]
    if partial:
        return [path for path in shards if os.path.isfile(path)]
    for path in shards:
        if not os.path.isfile(path):
            raise BadInput(f"{index_file} names the shard {os.path.basename(path)}, which is missing")
    return shards


def check_safetensors(path: str) -> None:
    """BadInput unless the file's header parses and covers the file (safetensors checks both without loading
    a tensor: a truncated download fails here)."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as fh:
            fh.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: all one thing to the user
        raise BadInput(f"{path} is not a readable safetensors file (truncated or corrupt?): {first_line(exc)}") from exc


def weight_files(model_dir: str, variant: str | None = None, allow_pickle: bool = False, partial: bool = False) -> tuple[list[str], bool]:
    """(files, use_safetensors): the index's shards or the single file of this variant, as from_pretrained
    reads them. Safetensors first; pickle files (.bin and friends) only with allow_pickle."""
    names = _listing(model_dir)
    index = os.path.join(model_dir, add_variant(SAFETENSORS_INDEX, variant))
    single = os.path.join(model_dir, add_variant(SAFETENSORS_NAME, variant))
    files = _shards(index, partial) if os.path.isfile(index) else [single] if os.path.isfile(single) else []
    if files:
        for path in files:
            check_safetensors(path)
        return files, True
    safetensors = [n for n in names if n.endswith(".safetensors")]
    variants = _variants_in(names)
    plain = len(safetensors) > sum(1 for n in safetensors if _VARIANT_FILE.match(n))
    if variant and (safetensors or variants):
        choices = [f"--variant {v}" for v in variants if v != variant] + (["no --variant"] if plain else [])
        hint = f"; use {' or '.join(choices)}" if choices else ""
        raise BadInput(f"{model_dir} has no {variant} variant ({os.path.basename(single)} or its index){hint}")
    if not variant and variants and not plain:
        raise BadInput(f"{model_dir} has only variant weights; pass {' or '.join(f'--variant {v}' for v in variants)}")
    if safetensors:
        raise BadInput(f"{model_dir} has no {os.path.basename(single)} (nor its index); its safetensors are named {safetensors[0]}")
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not pickles:
        raise BadInput(f"{model_dir} has no safetensors weights ({os.path.basename(single)} or its index)")
    if not allow_pickle:
        more = f" (and {len(pickles) - 1} more)" if len(pickles) > 1 else ""
        raise BadInput(
            f"{model_dir} has no safetensors weights, only the pickle file {pickles[0]}{more}; cpdoctor loads "
            "safetensors only (--allow-pickle to unpickle it)"
        )
    index = os.path.join(model_dir, add_variant(PICKLE_INDEX, variant))
    single = os.path.join(model_dir, add_variant(PICKLE_NAME, variant))
    if os.path.isfile(index):
        return _shards(index), False
    if os.path.isfile(single):
        return [single], False
    raise BadInput(
        f"{os.path.join(model_dir, pickles[0])} is not a diffusers weights file (from_pretrained reads {os.path.basename(single)})"
    )


# --------------------------------------------------------------------------------------------------------------
# the Hugging Face cache
# --------------------------------------------------------------------------------------------------------------


def _not_found(repo_id: str, revision: str | None, cache: str) -> BadInput:
    return BadInput(
        f"{repo_id}@{revision or 'main'} is not in the Hugging Face cache at {cache} (HF_HUB_CACHE / HF_HOME) "
        "nor a local directory; pass --download to fetch its transformer"
    )


def _full_commit(repo_id: str, revision: str, cache: str) -> str | None:
    """The one cached commit of repo_id that starts with `revision` (a short commit), via scan_cache_dir."""
    if not _HEX.match(revision) or len(revision) == 40:
        return None
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except Exception:  # noqa: BLE001 - no cache at all: not found
        return None
    commits = {
        rev.commit_hash
        for repo in info.repos
        if repo.repo_id == repo_id and repo.repo_type == "model"
        for rev in repo.revisions
        if rev.commit_hash.startswith(revision)
    }
    return commits.pop() if len(commits) == 1 else None


def _transformer_patterns(subfolder: str | None, names: list[str]) -> list[str]:
    return [f"{subfolder}/{n}" if subfolder else n for n in names]


_CONFIG_PATTERNS = [
    "model_index.json",
    "config.json",
    f"{TRANSFORMER}/config.json",
    "diffusion_pytorch_model*.index*.json",
    f"{TRANSFORMER}/diffusion_pytorch_model*.index*.json",
]
_OFFLINE_PATTERNS = ["model_index.json", "config.json", "diffusion_pytorch_model*", f"{TRANSFORMER}/*"]
"""What the transformer needs of a repo: checked for completeness offline, fetched (in two steps) online."""


def _snapshot(repo_id: str, revision: str | None, cache: str, *, local: bool, patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=local, allow_patterns=patterns)


def _download(repo_id: str, revision: str | None, cache: str, variant: str | None, allow_pickle: bool) -> str:
    """Fetch the configs and indexes, then exactly the weight files the transformer's index names (or its single
    file), of this variant; pickles only when allowed and no safetensors came."""
    folder = _snapshot(repo_id, revision, cache, local=False, patterns=_CONFIG_PATTERNS)
    commit = os.path.basename(os.path.normpath(folder))
    directory, subfolder = transformer_folder(folder)
    model_dir = os.path.join(directory, subfolder) if subfolder else directory
    formats = [(SAFETENSORS_INDEX, SAFETENSORS_NAME)] + ([(PICKLE_INDEX, PICKLE_NAME)] if allow_pickle else [])
    for index_name, single_name in formats:
        index = os.path.join(model_dir, add_variant(index_name, variant))
        names = _shard_names(index) if os.path.isfile(index) else [add_variant(single_name, variant)]
        folder = _snapshot(repo_id, commit, cache, local=False, patterns=_transformer_patterns(subfolder, names))
        if any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
            break
    return folder


# the checkpoint options of `cpdoctor model` (--revision, --variant, --download, --allow-pickle, --partial)
def locate_hub(
    repo_id: str,
    *,
    revision: str | None = None,
    variant: str | None = None,
    download: bool = False,
    allow_pickle: bool = False,
    partial: bool = False,
) -> Checkpoint:
    """The transformer of `repo_id` at `revision` (branch, tag, commit or a unique short commit) in the local
    Hugging Face cache, fetched first when `download`."""
    from huggingface_hub.utils import LocalEntryNotFoundError

    cache = hub_cache_dir()
    rev = revision
    where = f"{repo_id}@{revision or 'main'}"
    try:
        if download:
            folder = _download(repo_id, rev, cache, variant, allow_pickle)
        else:
            try:
                folder = _snapshot(repo_id, rev, cache, local=True, patterns=_OFFLINE_PATTERNS)
            except LocalEntryNotFoundError:
                rev = _full_commit(repo_id, revision, cache) if revision else None
                if rev is None:
                    raise
                folder = _snapshot(repo_id, rev, cache, local=True, patterns=_OFFLINE_PATTERNS)
    except BadInput:
        raise
    except LocalEntryNotFoundError as exc:
        if download:
            raise BadInput(f"cannot download {where} into {cache} (offline? HF_HUB_OFFLINE): {first_line(exc)}") from exc
        raise _not_found(repo_id, revision, cache) from exc
    except Exception as exc:  # noqa: BLE001 - invalid id, incomplete snapshot, network, auth: one line each
        verb = "download" if download else "find"
        raise BadInput(f"cannot {verb} {where} in the Hugging Face cache at {cache}: {first_line(exc)}") from exc
    commit = os.path.basename(os.path.normpath(folder))
    directory, subfolder = transformer_folder(folder)
    source = f"hub cache {repo_id}@{commit[:12]}"
    return _checkpoint(directory, subfolder, variant, allow_pickle, source=source, revision=commit, partial=partial)
