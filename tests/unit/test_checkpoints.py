"""Where the weights come from (cpdoctor.model_zoo.checkpoints), without any process group: a tiny Flux saved by
diffusers (sharded, with its index), put into a Hugging Face cache laid out the way huggingface_hub lays it out,
found offline by hub id, revision, short commit, pipeline folder and variant; and every bad source refused with
one line that names the file or the place looked in."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hub_cache import add_to_cache, files_of, hub_env, save_pipeline, tiny_flux

from cpdoctor.errors import BadInput
from cpdoctor.model_zoo.checkpoints import locate

REPO = "org/tiny-flux"
MAIN = "a" * 40
OLD = "b1" * 20
SHARDS = 15  # 68 484 fp32 parameters at max_shard_size="20KB"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Two tiny Flux pipelines (seeds 3 and 4), sharded with an index, the first also with an fp16 variant
    file; and a plain transformer folder saved in one file."""
    import torch

    root = tmp_path_factory.mktemp("saved")
    model = tiny_flux(seed=3)
    pipe = save_pipeline(root / "pipe", model, max_shard_size="20KB")
    model.to(torch.float16).save_pretrained(str(pipe / "transformer"), variant="fp16")
    old = save_pipeline(root / "old", tiny_flux(seed=4), max_shard_size="20KB")
    single = root / "single"
    tiny_flux(seed=3).save_pretrained(str(single))
    return {"pipe": pipe, "old": old, "single": single}


@pytest.fixture
def cache(tmp_path, monkeypatch, saved) -> Path:
    """HF_HOME / HF_HUB_CACHE in tmp_path, offline; REPO cached at MAIN (main) and OLD (tag v1)."""
    from huggingface_hub import constants

    for key, value in hub_env(tmp_path / "hf").items():
        monkeypatch.setenv(key, value)
    hub = tmp_path / "hf" / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))  # read once at import: follow the env set here
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    add_to_cache(hub, REPO, files_of(saved["pipe"]), MAIN)
    add_to_cache(hub, REPO, files_of(saved["old"]), OLD, refs=("v1",))
    return hub


def snapshot(cache: Path, commit: str, repo: str = REPO) -> str:
    return str(cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit)


def test_layout_is_a_cache_huggingface_hub_reads(cache):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_type == "model"
    refs = {rev.commit_hash: set(rev.refs) for rev in repo.revisions}
    assert refs == {MAIN: {"main"}, OLD: {"v1"}}


def test_hub_id_resolves_to_the_snapshot(cache):
    ckpt = locate(REPO)
    assert ckpt.directory == snapshot(cache, MAIN)
    assert ckpt.subfolder == "transformer" and ckpt.variant is None
    assert ckpt.class_name == "FluxTransformer2DModel" and ckpt.config["num_attention_heads"] == 2
    assert ckpt.source == f"hub cache {REPO}@{MAIN[:12]}" and ckpt.revision == MAIN
    assert ckpt.use_safetensors
    assert len(ckpt.weight_files) == SHARDS
    assert ckpt.weight_files[0] == snapshot(cache, MAIN) + "/transformer/diffusion_pytorch_model-00001-of-00015.safetensors"


@pytest.mark.parametrize("revision", [OLD, OLD[:10], "v1"])
def test_revision_commit_short_commit_or_tag(cache, revision):
    ckpt = locate(REPO, revision=revision)
    assert ckpt.directory == snapshot(cache, OLD) and ckpt.revision == OLD
    assert ckpt.source == f"hub cache {REPO}@{OLD[:12]}"


def test_the_snapshot_loads_through_from_pretrained(cache, saved):
    """resolve_spec + build_model: from_pretrained(snapshot, subfolder="transformer", use_safetensors=True) gives
    exactly the saved weights; prepare pins the revision to the commit the ranks then load."""
    import torch

    from cpdoctor.examinations.model.build import build_model
    from cpdoctor.examinations.model.prepare import prepare
    from cpdoctor.examinations.model.request import ModelRequest
    from cpdoctor.examinations.model.spec import request_spec

    req = prepare(ModelRequest(model=REPO, ring=2))
    spec = request_spec(req)
    assert req.revision == MAIN and spec.source == f"hub cache {REPO}@{MAIN[:12]}"
    assert spec.checkpoint == snapshot(cache, MAIN) + "/transformer"
    rank_spec = request_spec(req, local_only=True)
    assert rank_spec.weights == spec.weights
    model = build_model(spec, req, "cpu", torch.float32)
    expected = tiny_flux(seed=3).state_dict()
    got = model.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


def test_pipeline_and_transformer_folders(saved):
    pipe = locate(str(saved["pipe"]))
    assert (pipe.directory, pipe.subfolder) == (str(saved["pipe"]), "transformer")
    assert pipe.source == str(saved["pipe"] / "transformer") and len(pipe.weight_files) == SHARDS
    inner = locate(str(saved["pipe"] / "transformer"))
    assert (inner.directory, inner.subfolder) == (str(saved["pipe"] / "transformer"), None)
    assert inner.weight_files == pipe.weight_files
    index = locate(str(saved["pipe"] / "transformer" / "diffusion_pytorch_model.safetensors.index.json"))
    assert index.model_dir == inner.model_dir
    single = locate(str(saved["single"]))
    assert single.weight_files == (str(saved["single"] / "diffusion_pytorch_model.safetensors"),)


def test_variant_files_are_found(cache, saved):
    ckpt = locate(str(saved["pipe"]), variant="fp16")
    assert ckpt.variant == "fp16"
    assert ckpt.weight_files == (str(saved["pipe"] / "transformer" / "diffusion_pytorch_model.fp16.safetensors"),)
    hub = locate(REPO, variant="fp16")
    assert hub.weight_files == (snapshot(cache, MAIN) + "/transformer/diffusion_pytorch_model.fp16.safetensors",)
    with pytest.raises(
        BadInput, match=r"has no bf16 variant \(diffusion_pytorch_model.bf16.safetensors or its index\); use --variant fp16 or no --variant"
    ):
        locate(str(saved["pipe"]), variant="bf16")


def test_variant_only_checkpoint_asks_for_the_variant(tmp_path, saved):
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(saved["pipe"] / "transformer" / "config.json", only)
    shutil.copy(saved["pipe"] / "transformer" / "diffusion_pytorch_model.fp16.safetensors", only)
    with pytest.raises(BadInput, match="has only variant weights; pass --variant fp16$"):
        locate(str(only))


def test_unknown_hub_id_names_the_cache(cache):
    with pytest.raises(BadInput) as err:
        locate("org/missing")
    msg = str(err.value)
    assert msg.startswith(f"org/missing@main is not in the Hugging Face cache at {cache} ")
    assert "--download" in msg and "\n" not in msg
    with pytest.raises(BadInput, match=f"^{REPO}@nope is not in the Hugging Face cache at {cache} "):
        locate(REPO, revision="nope")


def _transformer_copy(saved: dict[str, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved["pipe"] / "transformer", dst)
    for variant_file in dst.glob("*.fp16.*"):
        variant_file.unlink()
    return dst


def test_pickle_only_is_refused_unless_allowed(tmp_path, saved):
    import torch

    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    shutil.copy(saved["single"] / "config.json", ckpt)
    torch.save(tiny_flux(seed=3).state_dict(), ckpt / "diffusion_pytorch_model.bin")
    with pytest.raises(BadInput, match="only the pickle file diffusion_pytorch_model.bin; cpdoctor loads safetensors only"):
        locate(str(ckpt))
    allowed = locate(str(ckpt), allow_pickle=True)
    assert allowed.weight_files == (str(ckpt / "diffusion_pytorch_model.bin"),) and not allowed.use_safetensors
    odd = tmp_path / "odd"
    odd.mkdir()
    shutil.copy(saved["single"] / "config.json", odd)
    (odd / "model.ckpt").write_bytes(b"\x80\x04")
    with pytest.raises(BadInput, match="only the pickle file model.ckpt"):
        locate(str(odd))
    with pytest.raises(BadInput, match=r"model.ckpt is not a diffusers weights file"):
        locate(str(odd), allow_pickle=True)


def test_truncated_safetensors_is_refused(tmp_path, saved):
    ckpt = _transformer_copy(saved, tmp_path)
    shard = ckpt / "diffusion_pytorch_model-00003-of-00015.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(BadInput, match=r"00003-of-00015.safetensors is not a readable safetensors file \(truncated or corrupt\?\)"):
        locate(str(ckpt))


def test_index_naming_a_missing_shard_is_refused(tmp_path, saved, cache):
    ckpt = _transformer_copy(saved, tmp_path)
    (ckpt / "diffusion_pytorch_model-00007-of-00015.safetensors").unlink()
    with pytest.raises(BadInput, match=r"index.json names the shard diffusion_pytorch_model-00007-of-00015.safetensors, which is missing$"):
        locate(str(ckpt))
    # in the cache: a snapshot link whose blob is gone
    link = Path(snapshot(cache, MAIN)) / "transformer" / "diffusion_pytorch_model-00002-of-00015.safetensors"
    link.resolve().unlink()
    with pytest.raises(BadInput, match="names the shard diffusion_pytorch_model-00002-of-00015.safetensors, which is missing"):
        locate(REPO)


def test_directories_without_a_transformer(tmp_path, saved):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(BadInput, match=f"^{empty} has no transformer: no config.json with a _class_name and no transformer/ folder$"):
        locate(str(empty))
    unet = tmp_path / "unet-pipe"
    unet.mkdir()
    (unet / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}')
    with pytest.raises(BadInput, match="is a pipeline without a transformer"):
        locate(str(unet))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"_class_name": "NoSuchTransformer"}')
    with pytest.raises(BadInput, match="names NoSuchTransformer, which is not a class of diffusers"):
        locate(str(foreign))


def test_names_and_options(tmp_path, saved):
    from cpdoctor.examinations.model import spec as probe

    assert locate("flux") is None and locate("FluxTransformer2DModel") is None
    with pytest.raises(BadInput, match="no such file or directory: ./nowhere"):
        locate("./nowhere")
    with pytest.raises(BadInput, match="--revision and --download apply to a hub id"):
        locate(str(saved["single"]), revision="main")
    with pytest.raises(BadInput, match="--variant must be a file-name variant"):
        locate(REPO, variant="../fp16")
    with pytest.raises(BadInput, match="^--revision and --variant apply to a checkpoint"):
        probe.resolve_spec("flux", revision="main", variant="fp16")


def test_download_fetches_only_the_transformer(cache, monkeypatch, saved):
    """--download: the configs and indexes first, then exactly the shards the index names (no text encoder, no
    other variant). snapshot_download is replaced by a stand-in serving a 'remote' commit from disk with
    huggingface_hub's own pattern filter; local lookups stay real."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    real = huggingface_hub.snapshot_download
    remote = files_of(saved["pipe"])
    commit = "c" * 40
    asked: list[list[str]] = []

    def fake(repo_id, *, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None, **kw):
        if local_files_only:
            return real(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True, allow_patterns=allow_patterns, **kw)
        assert revision in (None, commit)
        asked.append(list(allow_patterns))
        chosen = {p: remote[p] for p in filter_repo_objects(list(remote), allow_patterns=allow_patterns)}
        return str(add_to_cache(Path(cache_dir), repo_id, chosen, commit))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(BadInput, match="org/new@main is not in the Hugging Face cache"):
        locate("org/new")
    ckpt = locate("org/new", download=True)
    assert ckpt.revision == commit and len(ckpt.weight_files) == SHARDS
    assert len(asked) == 2 and len(asked[1]) == SHARDS and all(p.startswith("transformer/diffusion_pytorch_model-") for p in asked[1])
    cached = set(files_of(Path(snapshot(cache, commit, "org/new"))))
    assert cached == {"model_index.json", "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json"} | {
        p for p in remote if p.startswith("transformer/diffusion_pytorch_model-")
    }
    assert locate("org/new").weight_files == ckpt.weight_files  # now offline too


def test_variant_and_pickle_load_through_from_pretrained(tmp_path, saved):
    """build_model passes variant= and use_safetensors=False (only with allow_pickle) to from_pretrained."""
    import torch

    from cpdoctor.examinations.model import build, spec
    from cpdoctor.examinations.model.request import ModelRequest

    expected = tiny_flux(seed=3).state_dict()
    req = ModelRequest(model=str(saved["pipe"]), variant="fp16")
    model = build.build_model(spec.request_spec(req), req, "cpu", torch.float32)
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k].half().float()) for k in expected)

    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    shutil.copy(saved["single"] / "config.json", ckpt)
    torch.save(expected, ckpt / "diffusion_pytorch_model.bin")
    req = ModelRequest(model=str(ckpt), allow_pickle=True)
    model = build.build_model(spec.request_spec(req), req, "cpu", torch.float32)
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
