"""Every class with a `_cp_plan` in the installed diffusers examined by name (issue 37): a tiny config derived from
the class (cpdoctor/model_zoo/tiny.py), its family's inputs, real gloo ranks through its own `enable_parallelism`.

The classes come from scanning diffusers (MiniMax-H3 exists in 0.42.1, not in 0.39.0); every world-2 case shares
one launch, the ring-3 cases another. Expected verdicts depend on the installed release's ring (docs/FACTS.md:
stale K/V before 0.40, the dK/dV direction at ring >= 3, the unrotated mask, the double unpack under
checkpointing), read by the fixtures of conftest.py, and on three facts of these classes' plans measured here
(docs/MODELS.md): Helios's plan gathers inside its blocks (its gradients are wrong under any attention), and
LTX-2's plan leaves its audio stream whole (its forward crashes under CP).
"""

from __future__ import annotations

import json

import pytest

from cpdoctor import api
from cpdoctor.launch import Case
from cpdoctor.model_zoo.catalog import list_models

TIMEOUT = 480
PRESENT = [e.short_name for e in list_models()]
VIDEO = [n for n in PRESENT if n in {"wan", "chrono-edit", "helios", "ltx", "ltx2", "mini-max-h3"}]
"""The video classes present (the list names what the expectations below are about; the suite finds them itself)."""
CLASSES = [n for n in PRESENT if n not in {"flux", "qwen-image"}]
"""Every class but the two test_model.py examines already (ring 2 and 4, a masked prompt, checkpointing, the patch)."""
PLAN_GATHERS_INSIDE = {"helios"}
AUDIO_LEFT_WHOLE = {"ltx2"}
HEAD_MASKS = {"ltx", "ltx2"}
"""LTX-Video and LTX-2 pass their text mask with a heads dimension, which Ulysses does not split (docs/MODELS.md)."""
ULYSSES = ("wan", "ltx", "helios")
"""Ulysses 2 for one class of each outcome (exact; a per-head mask; a plan that gathers inside its blocks): every
class's is in benchmarks/results/models_*.json (docs/MODELS.md), which the full tier's time does not repeat."""


def launch(cases: dict[str, tuple[dict, bool]]) -> dict:
    """One launch for every named `(request fields, patched)` case; their findings by name."""
    reqs = {name: (api.request_for("model", **fields), patched) for name, (fields, patched) in cases.items()}
    world = {r.world_size for r, _ in reqs.values()}
    assert len(world) == 1, world
    found = api.run_findings("model", [Case(r, p) for r, p in reqs.values()], world.pop(), "cpu", TIMEOUT)
    return dict(zip(reqs, found, strict=True))


@pytest.fixture(scope="module")
def patch_refusal() -> str | None:
    from cpdoctor.fix import patch

    try:
        with patch.patched():
            return None
    except patch.PatchRefused as exc:
        return str(exc)


# slowest: every world-2 case in one launch (7 classes on 0.42.1: ring 2 and Ulysses 2 each, a video class under its
# own gradient checkpointing, stock and patched)
@pytest.fixture(scope="module")
def world2(patch_refusal):
    cases = {f"{n} ring": (dict(model=n, ring=2), False) for n in CLASSES}
    cases |= {f"{n} ulysses": (dict(model=n, ulysses=2), False) for n in ULYSSES if n in CLASSES}
    cases["wan checkpointing"] = (dict(model="wan", ring=2, checkpointing=True), False)
    if not patch_refusal:
        cases["wan checkpointing patched"] = (dict(model="wan", ring=2, checkpointing=True), True)
    return launch(cases)


RING3_SHAPES = {
    "wan": dict(width=144),
    "chrono-edit": dict(width=144),
    "ltx": dict(width=288, text_len=9),
    "ltx2": dict(width=288, text_len=9),
    "mini-max-h3": dict(width=288),
}
"""Shapes that divide by 3 (what `prepare` finds by itself where none is given, test_model.py: given here, the
search's meta forwards are not paid again)."""


@pytest.fixture(scope="module")
def world3():
    return launch({n: (dict(model=n, ring=3, **RING3_SHAPES.get(n, {})), False) for n in VIDEO if n not in PLAN_GATHERS_INSIDE})


def assert_pass(f):
    assert f.verdict == "PASS", f.diagnosis
    assert f.tensors["out"].rel_err < 1e-5 and f.tensors["grads"].rel_err < 1e-5


def assert_backward_wrong(f):
    assert f.verdict == "FAIL", f.diagnosis
    assert f.tensors["out"].verdict == "PASS" and f.tensors["grads"].verdict == "FAIL", f.diagnosis
    assert "forward exact" in f.diagnosis and "backward wrong" in f.diagnosis


def assert_plan_gathers_inside(f):
    """Helios: forward exact, gradients wrong whatever the attention does, said as the plan's doing."""
    assert_backward_wrong(f)
    assert "_cp_plan gathers the sequence inside its blocks (blocks.{0..39}.attn1" in f.diagnosis
    assert "inference through this plan is exact" in f.diagnosis


def assert_audio_left_whole(f):
    assert f.verdict == "CRASH", f.diagnosis
    assert f.tracebacks and "transformer_ltx2.py" in f.tracebacks[0]
    assert f.failure.signature == "rotary table not split", f.diagnosis


def assert_head_mask_under_ulysses(f):
    assert f.verdict == "CRASH", f.diagnosis
    assert f.failure.signature == "Ulysses leaves a per-head mask whole", f.diagnosis


def test_every_class_at_ring_2(world2, has_stale_kv_backward):
    for name in CLASSES:
        f = world2[f"{name} ring"]
        if name in AUDIO_LEFT_WHOLE:
            assert_audio_left_whole(f)
            continue
        assert f.subject.startswith(f"model {name} tiny ring=2 "), f.subject
        # the largest is Helios (110k): its plan names 40 blocks by index, each with head dims of 8 (flash's multiple)
        assert f.evidence.model.tiny is not None and f.evidence.model.tiny.parameters < 150_000
        if has_stale_kv_backward:  # 0.39.0: stale iteration-0 K/V, every class
            assert_backward_wrong(f)
            assert "stale iteration-0" in f.diagnosis
        elif name in PLAN_GATHERS_INSIDE:
            assert_plan_gathers_inside(f)
        else:
            assert_pass(f)


def test_ulysses_2(world2):
    for name in (n for n in ULYSSES if n in CLASSES):
        f = world2[f"{name} ulysses"]
        if name in HEAD_MASKS:
            assert_head_mask_under_ulysses(f)
        elif name in PLAN_GATHERS_INSIDE:
            assert_plan_gathers_inside(f)
        else:
            assert_pass(f)


def test_video_classes_at_ring_3(world3, has_stale_kv_backward):
    """Every video class but Helios (its 40 blocks cost most, and its ring 2 and Ulysses 2 say what its plan does)."""
    for name in world3:
        f = world3[name]
        if name in AUDIO_LEFT_WHOLE:
            assert_audio_left_whole(f)
            continue
        assert_backward_wrong(f)
        assert "`cpdoctor check --ring 3`" in f.diagnosis
        if not has_stale_kv_backward:
            assert "wrong way" in f.diagnosis


def test_a_video_class_under_its_own_gradient_checkpointing(world2, ring_unpacks_twice, patch_refusal):
    f = world2["wan checkpointing"]
    if ring_unpacks_twice:
        assert f.verdict == "CRASH" and f.failure.signature == "ring backward under checkpointing", f.diagnosis
    if not patch_refusal:
        assert_pass(world2["wan checkpointing patched"])


@pytest.mark.smoke
def test_ltx_masked_ring_fails_and_the_patch_fixes_it(patch_refusal):
    """`cpdoctor model ltx --ring 2 --mask-pad 3 --patch`: LTX splits a text padding mask, which diffusers' ring does
    not rotate with its keys (both releases); the fixed ring does."""
    cases = {"stock": (dict(model="ltx", ring=2, mask_pad=3), False)}
    if not patch_refusal:
        cases["patched"] = (dict(model="ltx", ring=2, mask_pad=3), True)
    found = launch(cases)
    f = found["stock"]
    assert f.verdict == "FAIL" and f.tensors["out"].verdict == "FAIL", f.diagnosis
    assert "padding mask is involved" in f.diagnosis and "`cpdoctor check --ring 2 --mask-pad 3`" in f.diagnosis
    if not patch_refusal:
        assert_pass(found["patched"])


def test_a_plan_that_does_not_fit_is_its_own_finding_before_any_launch(tmp_path):
    """Helios's plan names its blocks by index up to 39: cut to 2 blocks (--blocks) or configured with 2 layers
    (--config), the plan does not fit; UNSUPPORTED, exit 3, the plan's entry and the model's, no rank started."""
    if "helios" not in PRESENT:
        pytest.skip("this diffusers has no Helios")
    config = tmp_path / "helios.json"
    config.write_text(json.dumps({"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 6, "rope_dim": [2, 2, 2]}))
    for fields in (dict(blocks=2), dict(config=str(config))):
        report = api.check_model(model="helios", ring=2, **fields)
        assert report.exit_code == 3 and report.wall_s == 0, report.findings[0].diagnosis
        (f,) = report.findings
        assert f.verdict == "UNSUPPORTED"
        assert f.evidence.entry == "blocks.2.attn1" and f.evidence.model_has == "blocks holds 2 modules (blocks.0 .. blocks.1)"
        assert "does not fit this model" in f.diagnosis and "every block the plan names" in f.remedy
