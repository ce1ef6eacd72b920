"""`cpdoctor model`: real diffusers model classes through their own `enable_parallelism`, on real gloo ranks.

Tiny Flux and tiny Qwen-Image (random weights seeded alike on every rank), output and every parameter gradient
against the same model in one process in fp64. Cases that share a world size run in one launch (a job's cases
run one after the other in the same processes). The expected verdicts depend on the installed release
(docs/FACTS.md); only this test reads the version, the tool never does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import run_cli, run_cli_many

from cpdoctor import api
from cpdoctor.errors import BadInput
from cpdoctor.examinations import registry
from cpdoctor.launch import Case

TIMEOUT = 240


def launch(*cases: tuple[dict, bool]) -> list:
    """One launch for all `(request fields, patched)` cases; their findings in order (only a stock case under
    checkpointing may crash: diffusers' ring does there, docs/FACTS.md)."""
    reqs = [(api.request_for("model", **fields), patched) for fields, patched in cases]
    jobs = [Case(r, p) for r, p in reqs]
    found = api.run_findings("model", jobs, reqs[0][0].world_size, "cpu", TIMEOUT)
    may_crash = [fields.get("checkpointing") and not patched for fields, patched in cases]
    assert not [f for f, ok in zip(found, may_crash) if f.verdict in ("CRASH", "HANG") and not ok], [f.diagnosis for f in found]
    return found


@pytest.fixture(scope="module")
def patch_refusal() -> str | None:
    """Why `cpdoctor.patch()` refuses the installed diffusers, asked of the patch itself (applied and reverted
    in this process); None when it applies. The patched cases run only where it applies."""
    from cpdoctor.fix import patch

    try:
        with patch.patched():
            return None
    except patch.PatchRefused as exc:
        return str(exc)


def launch_named(cases: dict[str, tuple[dict, bool]], patch_refusal: str | None) -> dict:
    """`launch` for named cases, the patched ones left out where the patch refuses this diffusers."""
    chosen = {name: case for name, case in cases.items() if not (case[1] and patch_refusal)}
    return dict(zip(chosen, launch(*chosen.values()), strict=True))


# slowest 20 (issue 28, full tier on 0.42.1, 2 workers on 2 cores): 16 s: every world-2 model case in one launch (Flux and Qwen-Image, ring and Ulysses, the patch)
@pytest.fixture(scope="module")
def world2(patch_refusal):
    return launch_named(
        dict(
            flux=(dict(model="flux", ring=2), False),
            qwen=(dict(model="qwen-image", ring=2), False),
            qwen_mask=(dict(model="qwen-image", ring=2, mask_pad=3), False),
            flux_fixed=(dict(model="flux", ring=2), True),
            qwen_mask_fixed=(dict(model="qwen-image", ring=2, mask_pad=3), True),
            flux_checkpointing=(dict(model="flux", ring=2, checkpointing=True), False),
            flux_checkpointing_fixed=(dict(model="flux", ring=2, checkpointing=True), True),
        ),
        patch_refusal,
    )


# slowest 20 (issue 28, full tier on 0.42.1, 2 workers on 2 cores): 18 s: every world-4 model case in one launch
@pytest.fixture(scope="module")
def world4(patch_refusal):
    return launch_named(
        dict(
            flux=(dict(model="flux", ring=4), False),
            qwen=(dict(model="qwen-image", ring=4), False),
            flux_fixed=(dict(model="FluxTransformer2DModel", ring=4), True),
        ),
        patch_refusal,
    )


def assert_pass(f):
    assert f.verdict == "PASS", f.diagnosis
    assert f.tensors["out"].rel_err < 1e-6 and f.tensors["grads"].rel_err < 1e-6
    assert "match the single-process fp64 model" in f.diagnosis


def assert_backward_only(f):
    """Forward exact, parameter gradients wrong, and the op level at the same layout says the same."""
    assert f.verdict == "FAIL"
    assert f.tensors["out"].verdict == "PASS" and f.tensors["out"].rel_err < 1e-6
    assert f.tensors["grads"].verdict == "FAIL" and f.tensors["grads"].rel_err > 1e-3
    assert f.tensors["worst_param"].verdict == "FAIL" and f.tensors["worst_param"].rel_err > 0.1
    assert f.tensors["worst_param"].name in f.diagnosis
    assert "forward exact" in f.diagnosis and "backward wrong" in f.diagnosis
    assert "the attention op alone fails at this layout" in f.diagnosis
    assert "cpdoctor.patch()" in f.remedy
    assert f.evidence.op_level[0].verdict == "FAIL"


@pytest.mark.smoke
def test_ring2(world2, has_stale_kv_backward):
    for f in (world2["flux"], world2["qwen"]):
        if has_stale_kv_backward:  # 0.39.0: stale iteration-0 K/V in the ring backward
            assert_backward_only(f)
            assert "`cpdoctor check --ring 2`" in f.diagnosis and "stale iteration-0" in f.diagnosis
        else:  # 0.42.1: exact at ring 2
            assert_pass(f)
    assert world2["flux"].evidence.model.parameter_tensors > 50


def test_text_padding_mask_under_ring(world2):
    f = world2["qwen_mask"]
    assert f.verdict == "FAIL"
    assert f.tensors["out"].verdict == "FAIL" and 1e-3 < f.tensors["out"].rel_err < 0.1
    assert f.tensors["grads"].verdict == "FAIL"
    assert "forward wrong" in f.diagnosis and "padding mask is involved" in f.diagnosis
    assert "`cpdoctor check --ring 2 --mask-pad 3`" in f.diagnosis
    assert [o.command for o in f.evidence.op_level] == ["cpdoctor check --ring 2", "cpdoctor check --ring 2 --mask-pad 3"]


def test_ring2_through_the_models_own_gradient_checkpointing(world2, ring_unpacks_twice, patch_refusal):
    """`cpdoctor model flux --ring 2 --checkpointing`: enable_gradient_checkpointing() wraps every block in torch's
    non-reentrant checkpoint; diffusers' ring crashes there (named), the fixed ring passes."""
    f = world2["flux_checkpointing"]
    assert f.subject.endswith("checkpointing")
    if ring_unpacks_twice:
        assert f.verdict == "CRASH" and f.failure.signature == "ring backward under checkpointing", f.diagnosis
    if not patch_refusal:
        assert_pass(world2["flux_checkpointing_fixed"])


def test_ring4(world4, has_stale_kv_backward):
    for f in (world4["flux"], world4["qwen"]):
        assert_backward_only(f)
        assert "`cpdoctor check --ring 4`" in f.diagnosis
        if not has_stale_kv_backward:  # 0.42.1: dQ exact, dK/dV accumulator sent the wrong way
            assert "wrong way" in f.diagnosis
            assert 1e-3 < f.tensors["grads"].rel_err < 0.2


def test_patch_fixes_the_model(world2, world4, patch_refusal):
    if patch_refusal:
        pytest.skip(patch_refusal)
    for f in (world2["flux_fixed"], world2["qwen_mask_fixed"], world4["flux_fixed"]):
        assert_pass(f)


def test_prepare_fills_small_divisible_shapes():
    flux = api.request_for("model", model="flux", ring=4, ulysses=2)
    assert (flux.height, flux.width, flux.text_len, flux.frames) == (128, 128, 8, None)
    wan = api.request_for("model", model="wan", ring=2)
    assert wan.frames == 5 and wan.height == 128
    # no shape given: the small defaults move to the nearest that divide (plan's measured remedies)
    flux3 = api.request_for("model", model="flux", ring=3)
    assert (flux3.height, flux3.width, flux3.text_len) == (128, 144, 9)
    assert registry.get("model").build_request(model="flux", ulysses=2).ring == 1


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(model="flux", mask_pad=3), "takes no text mask"),
        (dict(model="flux", ring=3, height=128, width=128), "not divisible by ring × ulysses = 3"),
        (dict(model="flux", height=144, width=144), "hidden_states 81"),
        (dict(model="flux", ulysses=4), "do not divide by --ulysses 4"),
        (dict(model="qwen-image", mask_pad=8), "--mask-pad"),
        (dict(model="flux", frames=5), "image model"),
        (dict(model="ltx", ring=2, config="/nonexistent/config.json"), "cannot read --config"),
    ],
)
def test_bad_input_before_any_process(fields, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(")):
        api.request_for("model", **fields)


def test_checkpoint_directory_is_loaded(tmp_path, has_stale_kv_backward):
    """The real loading path: save_pretrained(safe_serialization=True), then the CLI with --patch, JSON out."""
    import torch
    from hub_cache import TINY_FLUX

    from cpdoctor.model_zoo.catalog import resolve_model

    torch.manual_seed(3)
    model = resolve_model("flux").cls(**TINY_FLUX)
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    run = run_cli("model", str(tmp_path), "--ring", "2", "--patch", "--json", "-")
    data = run.json
    finding = data["findings"][0]
    assert finding["details"]["model"]["source"] == str(tmp_path)
    assert set(finding["tensors"]) == {"out", "grads", "worst_param"}
    assert data["request"]["height"] == 128 and data["request"]["text_len"] == 8
    assert data["verdict"] == "PASS" and run.code == data["exit_code"] == 0, finding["diagnosis"]
    assert data["before"]["verdict"] == ("FAIL" if has_stale_kv_backward else "PASS")


def test_bad_input_from_the_command_line(tmp_path):
    torch_free = tmp_path / "bin_only"
    torch_free.mkdir()
    (torch_free / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (torch_free / "diffusion_pytorch_model.bin").write_bytes(b"")
    cases = (([str(torch_free)], "no safetensors weights"), (["fluxx"], "unknown model 'fluxx'; closest: flux"))
    runs = run_cli_many([["model", *args, "--ring", "2"] for args, _ in cases])  # one interpreter: they end in the parent
    for run, (_, words) in zip(runs, cases, strict=True):
        assert run.code == 2, run
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], run.stderr
        assert "Traceback" not in run.stderr


def test_model_help_does_not_import_torch():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['cpdoctor', 'model', '--help']\n"
        "try:\n    runpy.run_module('cpdoctor', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ, COLUMNS="200")
    ).stdout
    assert "--mask-pad" in out
    assert out.strip().endswith("HEAVY="), out
