"""`cpdoctor model` on real checkpoint sources, through the real CLI: a tiny Flux pipeline saved sharded into a
Hugging Face cache (laid out as huggingface_hub lays it out) and found by hub id with HF_HUB_OFFLINE=1 gives the
verdict the tiny config gives (docs/FACTS.md: ring 2 exact on 0.42.1, stale K/V backward on 0.39.0); bad sources are
exit 2 with one line on stderr, before any rank starts."""

from __future__ import annotations

import shutil

import pytest
from conftest import run_cli, run_cli_many
from hub_cache import add_to_cache, files_of, hub_env, save_pipeline, tiny_flux

REPO = "org/tiny-flux"
COMMIT = "0123456789abcdef" * 2 + "01234567"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sources")
    pipe = save_pipeline(root / "pipe", tiny_flux(seed=3), max_shard_size="20KB")
    hub = root / "hf" / "hub"
    add_to_cache(hub, REPO, files_of(pipe), COMMIT)

    bad = {}
    bad["pickle"] = root / "pickle"
    bad["pickle"].mkdir()
    shutil.copy(pipe / "transformer" / "config.json", bad["pickle"])
    (bad["pickle"] / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04N.")
    bad["truncated"] = root / "truncated"
    shutil.copytree(pipe / "transformer", bad["truncated"])
    shard = bad["truncated"] / "diffusion_pytorch_model-00001-of-00015.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    bad["missing"] = root / "missing"
    shutil.copytree(pipe / "transformer", bad["missing"])
    (bad["missing"] / "diffusion_pytorch_model-00015-of-00015.safetensors").unlink()
    bad["empty"] = root / "empty"
    bad["empty"].mkdir()
    return {"root": root, "hub": hub, "env": hub_env(root / "hf"), "bad": bad}


def test_hub_id_from_the_offline_cache(sources, has_stale_kv_backward):
    run = run_cli("model", REPO, "--ring", "2", "--json", "-", env=sources["env"])
    data = run.json
    finding = data["findings"][0]
    model = finding["details"]["model"]
    assert model["source"] == f"hub cache {REPO}@{COMMIT[:12]}"
    assert model["class_name"] == "FluxTransformer2DModel" and model["parameters"] == 68484
    assert data["request"]["model"] == REPO and data["request"]["revision"] == COMMIT
    expected = "FAIL" if has_stale_kv_backward else "PASS"  # what `cpdoctor model flux --ring 2` says (test_model)
    assert data["verdict"] == expected and run.code == data["exit_code"] == (1 if has_stale_kv_backward else 0), finding["diagnosis"]
    if has_stale_kv_backward:
        assert "stale iteration-0" in finding["diagnosis"]
    else:
        assert finding["tensors"]["grads"]["rel_err"] < 1e-6


BAD_SOURCES = {
    "org/missing": "org/missing@main is not in the Hugging Face cache at {hub} ",
    "pickle": "only the pickle file diffusion_pytorch_model.bin; cpdoctor loads safetensors only (--allow-pickle",
    "truncated": "diffusion_pytorch_model-00001-of-00015.safetensors is not a readable safetensors file",
    "missing": "names the shard diffusion_pytorch_model-00015-of-00015.safetensors, which is missing",
    "empty": "has no transformer: no config.json with a _class_name and no transformer/ folder",
}


@pytest.fixture(scope="module")
def bad_runs(sources) -> dict:
    """Every bad source through the CLI's own entry, in one interpreter (tests/cli_many.py): they end in the parent."""
    calls = [["model", str(sources["bad"].get(source, source)), "--ring", "2"] for source in BAD_SOURCES]
    return dict(zip(BAD_SOURCES, run_cli_many(calls, env=sources["env"]), strict=True))


@pytest.mark.parametrize("source", list(BAD_SOURCES))
def test_bad_sources_are_one_line(sources, bad_runs, source):
    run = bad_runs[source]
    assert run.code == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and BAD_SOURCES[source].format(hub=sources["hub"]) in lines[0], run.stderr
    assert "Traceback" not in run.stderr
