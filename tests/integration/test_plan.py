"""`cpdoctor plan`: the static divisibility planner, called directly and through the CLI.

`plan_model` returns the `cpdoctor.report.Report` every examination returns; the measured plan is under its own
keys (`report.plan`, the measured Plan: tensors, heads, problems, notes, settings, model), read here as the JSON has them (`to_dict()`).

The lengths asserted here are the ones diffusers' own forward produces on the meta device; the arithmetic in
the comments only explains them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from cpdoctor.api import list_models, plan_model  # noqa: E402
from cpdoctor.errors import BadInput, CannotExamine  # noqa: E402
from cpdoctor.model_zoo import catalog as model_catalog  # noqa: E402
from cpdoctor.model_zoo.catalog import resolve_model  # noqa: E402
from cpdoctor.report import Verdict  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# A Flux transformer small enough to read (docs/FACTS.md), saved as a checkpoint config: 2 attention heads.
TINY_FLUX = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [4, 4, 8],
}


def _rows(report):
    """The measured tensors of a plan's Report (its `tensors` key), by name."""
    return {t["name"]: t for t in report.to_dict()["tensors"]}


def _cli(*args, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "cpdoctor", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


# ------------------------------------------------------------------------------------------------ catalogue


def test_short_names_are_derived_from_class_names():
    assert model_catalog.short_name_for("FluxTransformer2DModel") == "flux"
    assert model_catalog.short_name_for("Flux2Transformer2DModel") == "flux2"
    assert model_catalog.short_name_for("QwenImageTransformer2DModel") == "qwen-image"
    assert model_catalog.short_name_for("WanTransformer3DModel") == "wan"
    assert model_catalog.short_name_for("LTXVideoTransformer3DModel") == "ltx"
    assert model_catalog.short_name_for("LTX2VideoTransformer3DModel") == "ltx2"


def test_list_models_scans_diffusers_for_cp_plans():
    entries = list_models()
    names = {e.short_name for e in entries}
    assert {"flux", "flux2", "qwen-image", "wan", "ltx"} <= names
    import diffusers.models

    for e in entries:
        cls = getattr(diffusers.models, e.class_name)
        assert cls._cp_plan, e
        assert e.to_dict()["short_name"] == e.short_name


@pytest.mark.parametrize("name", ["flux", "FluxTransformer2DModel", "FLUX"])
def test_resolve_by_short_or_class_name(name):
    assert resolve_model(name).cls.__name__ == "FluxTransformer2DModel"
    assert resolve_model("qwenimage").entry.short_name == "qwen-image"


def test_unknown_model_names_the_closest():
    with pytest.raises(BadInput) as exc:
        resolve_model("fluxx")
    assert "flux" in str(exc.value) and "\n" not in str(exc.value)


def test_checkpoint_directory_and_pipeline_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(TINY_FLUX))
    resolved = resolve_model(str(tmp_path / "ckpt"))
    assert resolved.cls.__name__ == "FluxTransformer2DModel" and resolved.config["num_attention_heads"] == 2
    (tmp_path / "pipe" / "transformer").mkdir(parents=True)
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    (tmp_path / "pipe" / "transformer" / "config.json").write_text(json.dumps(TINY_FLUX))
    assert resolve_model(str(tmp_path / "pipe")).cls.__name__ == "FluxTransformer2DModel"
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(BadInput, match="no _cp_plan"):
        resolve_model(str(tmp_path / "unet"))
    with pytest.raises(BadInput, match="no such"):
        resolve_model(str(tmp_path / "missing") + os.sep)


# ------------------------------------------------------------------------------------------------ planner


def test_flux_1024_text512_ring2_ulysses2_everything_divides():
    r = plan_model("flux", height=1024, width=1024, text_len=512, ring=2, ulysses=2)
    assert r.verdict == "PASS" and r.exit_code == 0 and not r.to_dict()["problems"]
    assert r.verdict is Verdict.PASS
    assert [(f.verdict, f.diagnosis) for f in r.findings] == [
        (Verdict.PASS, "every split divides over 4 ranks and the heads over ulysses 2")
    ]
    rows = _rows(r)
    # 1024 / 8 (VAE) / 2 (2x2 packing) = 64 -> 64 * 64 = 4096 image tokens
    assert {n: (t["split_dim"], t["length"], t["per_rank"]) for n, t in rows.items()} == {
        "hidden_states": (1, 4096, 1024),
        "encoder_hidden_states": (1, 512, 128),
        "img_ids": (0, 4096, 1024),
        "txt_ids": (0, 512, 128),
        "proj_out:output": (1, 4096, 1024),
    }
    assert rows["proj_out:output"]["kind"] == "gather"
    assert [(h["heads"], h["divisible"], h["source"]) for h in r.to_dict()["heads"]] == [(24, True, "attention calls")]
    doc = r.to_dict()
    assert doc["verdict"] == "PASS" and doc["settings"]["world_size"] == 4
    assert set(doc["tensors"][0]) >= {"name", "split_dim", "length", "per_rank", "divisible"}


def test_qwen_image_1328_text77_ring2_text_does_not_divide():
    r = plan_model("qwen-image", height=1328, width=1328, text_len=77, ring=2, ulysses=1)
    assert r.verdict == "FAIL" and r.exit_code == 1
    rows = _rows(r)
    text = rows["transformer_blocks.0:encoder_hidden_states"]
    assert (text["length"], text["per_rank"], text["divisible"], text["depends_on"]) == (77, 38.5, False, ["text"])
    assert rows["pos_embed:output[1]"]["length"] == 77  # the text rotary embedding is split too
    # 1328 / 16 = 83 -> 83 * 83 = 6889 image tokens: odd, so the image does not divide by 2 either
    assert rows["transformer_blocks.0:hidden_states"]["length"] == 6889
    assert not rows["transformer_blocks.0:hidden_states"]["divisible"]

    problems = r.to_dict()["problems"]
    text_problem = next(p for p in problems if "transformer_blocks.0:encoder_hidden_states" in p["tensors"])
    kinds = {rem["kind"]: rem for rem in text_problem["remedies"]}
    pad = kinds["text_padding"]
    assert pad["measured"] and pad["values"] == {"text_len": 78, "pad": 1, "mask": "encoder_hidden_states_mask"}
    assert "mask" in pad["text"]
    assert any("mask" in n for n in r.to_dict()["notes"])  # ring attention and masks: pointed at `cpdoctor check`
    import dataclasses

    import diffusers

    has_field = "ring_anything" in {f.name for f in dataclasses.fields(diffusers.ContextParallelConfig)}
    assert ("ring_anything" in kinds) == has_field  # offered exactly when this diffusers' ContextParallelConfig has it
    if has_field:
        assert kinds["ring_anything"]["values"]["inference_only"] is True

    image_problem = next(p for p in problems if "transformer_blocks.0:hidden_states" in p["tensors"])
    resolutions = [rem["values"] for rem in image_problem["remedies"] if rem["kind"] == "resolution"]
    assert resolutions and all(v["height"] % 16 == 0 and v["width"] % 16 == 0 for v in resolutions)
    assert all(((v["height"] // 16) * (v["width"] // 16)) % 2 == 0 for v in resolutions)
    assert r.to_dict()["settings"]["shallow_remedy_search"] is True

    # every problem is a FAIL finding: its diagnosis the problem, its remedy the measured ways out, its command
    # the plan again with the first of them applied
    assert [(f.verdict, f.diagnosis) for f in r.findings] == [(Verdict.FAIL, p["what"]) for p in problems]
    text_finding = r.findings[problems.index(text_problem)]
    assert text_finding.remedy.startswith("text_padding: pad the text to 78 tokens")
    assert text_finding.command == "cpdoctor plan qwen-image --height 1328 --width 1328 --text-len 78 --ring 2 --ulysses 1"
    image_finding = r.findings[problems.index(image_problem)]
    v = resolutions[0]
    assert f"--height {v['height']} --width {v['width']} --text-len 77" in image_finding.command

    # the two measured remedies together make everything divide
    fixed = plan_model("qwen-image", resolutions[0]["height"], resolutions[0]["width"], 78, ring=2, ulysses=1)
    assert fixed.verdict == "PASS"


def test_width_that_makes_image_tokens_odd():
    r = plan_model("flux", height=1040, width=1040, text_len=512, ring=2, ulysses=1)
    rows = _rows(r)
    assert rows["hidden_states"]["length"] == 65 * 65 and not rows["hidden_states"]["divisible"]
    assert rows["encoder_hidden_states"]["divisible"]
    problems = r.to_dict()["problems"]
    assert len(problems) == 1 and problems[0]["tensors"] == ["hidden_states", "img_ids", "proj_out:output"]
    res = [rem for rem in problems[0]["remedies"] if rem["kind"] == "resolution"]
    assert res and all(rem["measured"] for rem in res)
    assert all(all(length % 2 == 0 for ls in rem["values"]["lengths"].values() for length in ls) for rem in res)


def test_impossible_ulysses_degree_for_the_heads():
    r = plan_model("flux", height=1024, width=1024, text_len=512, ring=1, ulysses=16)
    assert all(t["divisible"] for t in r.to_dict()["tensors"])  # 4096 and 512 divide by 16 ...
    assert [(h["heads"], h["divisible"]) for h in r.to_dict()["heads"]] == [(24, False)]  # ... 24 heads do not
    problems = r.to_dict()["problems"]
    assert len(problems) == 1 and "24 attention heads" in problems[0]["what"]
    degrees = next(rem for rem in problems[0]["remedies"] if rem["kind"] == "degrees")
    assert degrees["values"]["options"]
    assert all(24 % o["ulysses"] == 0 and o["ring"] * o["ulysses"] == 16 for o in degrees["values"]["options"])


def test_checkpoint_config_is_used(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_FLUX))
    r = plan_model(str(tmp_path), height=512, width=512, text_len=64, ring=1, ulysses=4)
    assert r.to_dict()["model"]["source"].endswith("config.json")
    assert _rows(r)["hidden_states"]["length"] == 32 * 32
    # the checkpoint's 2 heads, not Flux's 24
    assert [(h["heads"], h["divisible"]) for h in r.to_dict()["heads"]] == [(2, False)]


def test_video_model_frames_remedy():
    # Wan: (81 - 1) / 4 + 1 = 21 latent frames, 496 / 16 = 31, 848 / 16 = 53: 21 * 31 * 53 = 34503, odd
    r = plan_model("wan", height=496, width=848, text_len=512, ring=2, ulysses=1)
    assert _rows(r)["blocks.0:hidden_states"]["length"] == 34503
    remedies = [rem for p in r.to_dict()["problems"] for rem in p["remedies"]]
    assert {"resolution", "frames"} <= {rem["kind"] for rem in remedies}
    frames = [rem["values"]["frames"] for rem in remedies if rem["kind"] == "frames"]
    assert all((f - 1) % 4 == 0 for f in frames)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ring": 0}, "ring degree"),
        ({"ulysses": -2}, "ulysses degree"),
        ({"ring": 1, "ulysses": 1}, "at least 2"),
        ({"ring": 2, "height": 8}, "height"),
        ({"ring": 2, "text_len": 0}, "text length"),
        ({"ring": 2, "frames": 9}, "video models only"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(BadInput, match=match):
        plan_model("flux", **kwargs)


def test_model_without_input_builder_cannot_be_examined():
    """Every class of 0.39.0 and 0.42.1 has an input builder (MiniMax-H3's since issue 37): a class of no known
    family (none of its ancestors has one) is refused, exit 3."""
    from diffusers.models.modeling_utils import ModelMixin

    from cpdoctor.model_zoo.inputs import builder_for

    assert all(e.builder for e in list_models())
    with pytest.raises(CannotExamine, match="no input builder for NewFamilyTransformer3DModel"):
        builder_for(type("NewFamilyTransformer3DModel", (ModelMixin,), {}))


def test_modules_do_not_import_torch():
    code = (
        "import sys, cpdoctor.cli.plan, cpdoctor.model_zoo.catalog, cpdoctor.examinations.plan.planner; "
        "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, 'imported at module level'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_qwen_json_to_stdout():
    p = _cli("qwen-image", "--height", "1328", "--width", "1328", "--text-len", "77", "--ring", "2", "--json", "-")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)  # nothing but JSON on stdout
    assert doc["verdict"] == "FAIL"
    assert set(doc) >= {"verdict", "model", "settings", "tensors", "problems"}
    # the shape every examination reports in, and every key the plan had before it
    assert set(doc) >= {"exit_code", "findings", "skipped", "heads", "notes", "seconds"} and doc["exit_code"] == 1
    assert [f["verdict"] for f in doc["findings"]] == ["FAIL"] * len(doc["problems"]) == ["FAIL", "FAIL"]
    assert all(f["remedy"] and f["command"].startswith("cpdoctor plan qwen-image ") for f in doc["findings"])
    text = next(t for t in doc["tensors"] if t["name"] == "transformer_blocks.0:encoder_hidden_states")
    assert (text["length"], text["divisible"]) == (77, False)
    remedies = [r for p_ in doc["problems"] for r in p_["remedies"]]
    assert any(r["kind"] == "text_padding" and r["values"]["text_len"] == 78 for r in remedies)
    assert all(set(p_) >= {"what", "remedies"} for p_ in doc["problems"])


def test_cli_flux_passes_with_table_and_json_file(tmp_path):
    out = tmp_path / "plan.json"
    p = _cli("flux", "--height", "1024", "--width", "1024", "--text-len", "512", "--ring", "2", "--ulysses", "2", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "PASS" in p.stdout and "hidden_states" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "PASS" and doc["problems"] == []
    assert {t["name"]: t["per_rank"] for t in doc["tensors"]}["hidden_states"] == 1024


PLAN_BAD_INPUT = [(["fluxx", "--ring", "2"], "flux"), (["flux", "--ring", "0"], "ring"), (["flux", "--ring", "-3"], "ring")]


@pytest.fixture(scope="module")
def bad_plans() -> list:
    """Every bad `cpdoctor plan` line through the CLI's own entry, in one interpreter (tests/cli_many.py)."""
    from conftest import run_cli_many

    return run_cli_many([["plan", *args] for args, _ in PLAN_BAD_INPUT])


@pytest.mark.parametrize("index", range(len(PLAN_BAD_INPUT)), ids=[" ".join(a) for a, _ in PLAN_BAD_INPUT])
def test_cli_bad_input_is_one_line_exit_2(bad_plans, index):
    p, needle = bad_plans[index], PLAN_BAD_INPUT[index][1]
    assert p.code == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr


def test_cli_list_json():
    p = _cli("--list", "--json", "-")
    assert p.returncode == 0, p.stderr
    names = {m["short_name"] for m in json.loads(p.stdout)["models"]}
    assert {"flux", "qwen-image", "wan"} <= names
