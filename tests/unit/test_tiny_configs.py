"""Tiny configs derived from the class (cpdoctor/model_zoo/shrink.py, tiny.py) and the plan-fit finding
(cpdoctor/model_zoo/plan_fit.py): the search's arithmetic on plain numbers, the search itself against a trial whose
rules a test can read, and a plan measured against real diffusers classes built on the meta device (no weights)."""

from __future__ import annotations

import pytest

from cpdoctor.model_zoo import shrink
from cpdoctor.model_zoo.shrink import Relation, Tie


def test_spread_keeps_the_sum_the_floor_and_the_parity():
    assert shrink.spread((16, 56, 56), 6, 2) == (2, 2, 2)
    assert shrink.spread((16, 56, 56), 32, 2) == (4, 14, 14)
    assert sum(shrink.spread((44, 42, 42), 12, 2)) == 12
    assert shrink.spread((16, 56, 56), 5, 2) is None  # even parts cannot sum to an odd number
    assert shrink.spread((16, 56, 56), 4, 2) is None  # three parts of at least 2
    assert shrink.spread((3, 5), 4, 1) == (2, 2)  # odd parts: any integers


def test_candidates_smallest_first_below_the_value():
    assert list(shrink.candidates(6, 2)) == [2, 3, 4, 5]
    big = list(shrink.candidates(128, 2))
    assert big[:3] == [2, 3, 4] and big[-1] == 64 and 32 in big and all(v < 128 for v in big)
    assert list(shrink.candidates(2, 2)) == []
    tuples = list(shrink.candidates((16, 56, 56), 2))
    assert tuples[0] == (2, 2, 2) and all(sum(t) < 128 for t in tuples)


def test_size_keys_read_from_names_and_values():
    defaults = dict(
        num_layers=19, num_attention_heads=24, attention_head_dim=128, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
        patch_size=2, in_channels=64, out_channels=None, guidance_embeds=False, rope_theta=10000, num_refiner_layers=2,
    )  # fmt: skip
    keys = shrink.size_keys(defaults, stack_keys={"num_layers"})
    assert keys == {
        "num_attention_heads": 2, "attention_head_dim": 2, "joint_attention_dim": 2, "axes_dims_rope": 2, "in_channels": 2,
        "num_refiner_layers": 1,
    }  # fmt: skip


def test_relations_among_the_defaults_and_how_a_move_keeps_them():
    defaults = dict(heads=32, head_dim=64, cross_dim=2048, axes=(16, 24, 24), in_channels=128, out_channels=128)
    keys = dict.fromkeys(defaults, 2)
    rels = shrink.relations(defaults, keys)
    assert Relation("head_dim", ("axes",), Tie.SUM) in rels
    assert Relation("cross_dim", ("heads", "head_dim"), Tie.PRODUCT) in rels
    assert Relation("in_channels", ("out_channels",), Tie.EQUAL) in rels
    moved = shrink.follow(defaults, "head_dim", 8, rels, keys)
    assert moved is not None and moved["axes"] == (2, 2, 4) and moved["cross_dim"] == 32 * 8
    assert shrink.follow(defaults, "head_dim", 5, rels, keys) is None  # even axes cannot sum to 5


def _toy_trial(config):
    """An architecture whose rules the test can read: the rope axes sum to the head dim, the cross width is heads x
    head dim, the heads are even, the head dim at least 4 (else the trial's own error); in_channels free. Its cost
    is what a meta build would count."""
    if sum(config["axes"]) != config["head_dim"]:
        return None, "RuntimeError: rope does not fit the head dim"
    if config["cross_dim"] != config["heads"] * config["head_dim"]:
        return None, "RuntimeError: a and b must have same reduction dim"
    if config["head_dim"] < 4:
        return None, "RuntimeError: head dim too small"
    if config["heads"] % 2:
        return None, "an attention with odd heads"
    return config["heads"] * config["head_dim"] * 10 + config["cross_dim"] + config["in_channels"] * 3, None


def test_the_search_finds_the_smallest_config_the_trial_accepts_and_says_why_it_stopped():
    defaults = dict(heads=24, head_dim=128, cross_dim=3072, axes=(16, 56, 56), in_channels=64)
    floors = dict.fromkeys(defaults, 2)
    search = shrink.Shrinking(_toy_trial, dict(defaults), floors, shrink.relations(defaults, floors))
    found = search.run()
    assert found == dict(heads=2, head_dim=6, cross_dim=12, axes=(2, 2, 2), in_channels=2)
    assert search.stopped["head_dim"].startswith("5 fails: head_dim = sum(axes) cannot hold")
    assert search.stopped["cross_dim"] == "follows cross_dim = heads x head_dim"
    assert search.stopped["heads"] == "the floor (2)"
    assert search.trials < 40


def test_a_relation_the_defaults_only_happen_to_meet_is_dropped():
    # in_channels 128 = the sum of the axes too (Flux2's coincidence): moving in_channels alone passes, so it is free
    defaults = dict(heads=2, head_dim=128, cross_dim=256, axes=(32, 32, 32, 32), in_channels=128)
    floors = dict.fromkeys(defaults, 2)
    search = shrink.Shrinking(_toy_trial, dict(defaults), floors, shrink.relations(defaults, floors))
    assert search.run()["in_channels"] == 2
    assert all(r.total != "in_channels" for r in search.rels)


def test_a_class_whose_defaults_fail_cannot_be_shrunk():
    search = shrink.Shrinking(lambda cfg: (None, "TypeError: no"), dict(heads=4), {"heads": 2}, [])
    with pytest.raises(ValueError, match="defaults themselves fail: TypeError: no"):
        search.run()


# -- the plan against a model built from a config, on the meta device ------------------------------------------


def _meta(name: str, **config):
    pytest.importorskip("diffusers")
    from cpdoctor.model_zoo.catalog import build_model, list_models, resolve_model

    if name not in {e.short_name for e in list_models()}:
        pytest.skip(f"this diffusers has no {name}")
    return build_model(resolve_model(name).cls, config, device="meta")


def test_helios_with_fewer_blocks_than_its_plan_names_does_not_fit():
    from cpdoctor.model_zoo.plan_fit import plan_misfit

    misfit = plan_misfit(_meta("helios", num_layers=2, num_attention_heads=2, attention_head_dim=6, rope_dim=(2, 2, 2)))
    assert misfit is not None
    assert (misfit.entry, misfit.plan_says) == ("blocks.2.attn1", "gathers its output")
    assert misfit.model_has == "blocks holds 2 modules (blocks.0 .. blocks.1)"
    assert misfit.entries_not_fitting == 3 * 38  # attn1, attn2 and ffn of blocks 2..39
    assert "blocks.2.attn1" in misfit.line() and "before any attention runs" in misfit.line()
    assert plan_misfit(_meta("helios", num_layers=40, num_attention_heads=2, attention_head_dim=6, rope_dim=(2, 2, 2))) is None


def test_a_plan_naming_a_missing_module_or_an_input_the_forward_does_not_take():
    torch = pytest.importorskip("torch")
    from cpdoctor.model_zoo.plan_fit import plan_misfit

    split = pytest.importorskip("diffusers.models._modeling_parallel").ContextParallelInput(split_dim=1, expected_dims=3)

    class Block(torch.nn.Module):
        def forward(self, hidden_states, temb=None):  # noqa: ANN001
            return hidden_states

    class Toy(torch.nn.Module):
        _cp_plan = {"blocks.0": {"hidden_states": split}}

        def __init__(self, n: int) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(n)])

    assert plan_misfit(Toy(1)) is None
    assert plan_misfit(Toy(0)).model_has == "blocks holds 0 modules"
    Toy._cp_plan = {"blocks.*": {"encoder_hidden_states": split}}
    assert plan_misfit(Toy(2)).model_has == "Block.forward takes hidden_states, temb, not 'encoder_hidden_states'"
    Toy._cp_plan = {"norm_out": {"hidden_states": split}}
    assert plan_misfit(Toy(2)).model_has == "the model (Toy) has no submodule 'norm_out' (it has blocks)"


def test_the_weights_a_rank_builds_first_are_the_weights_it_builds_again():
    """Regression: the survey's first build (a meta build that still draws torch.randn for parameters such as Wan's
    scale_shift_table) ran after the seed, so a rank's first case of a class got other weights than the reference."""
    torch = pytest.importorskip("torch")
    from cpdoctor.examinations.model import spec as spec_module
    from cpdoctor.examinations.model.build import build_model
    from cpdoctor.examinations.model.request import ModelRequest
    from cpdoctor.model_zoo.catalog import resolve_model
    from cpdoctor.model_zoo.inputs import builder_for

    cls = resolve_model("wan").cls
    config = dict(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1
    )
    spec = spec_module.ModelSpec(cls, "wan", cls.__name__, config, "test", builder_for(cls))
    spec_module.SURVEYS.clear()
    req = ModelRequest(model="wan", blocks=1)
    first, again = (build_model(spec, req, "cpu", torch.float32).state_dict() for _ in range(2))
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_a_class_it_cannot_shrink_says_why():
    """CannotShrink (exit 3) with the trial's own error, for a class whose forward refuses even its defaults."""
    pytest.importorskip("diffusers")
    from cpdoctor.errors import CannotExamine
    from cpdoctor.model_zoo import tiny
    from cpdoctor.model_zoo.catalog import resolve_model

    class RefusingWan(resolve_model("wan").cls):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003
            raise RuntimeError("this forward refuses every input")

    with pytest.raises(
        tiny.CannotShrink,
        match="cannot derive a tiny RefusingWan: the class's defaults themselves fail: RuntimeError: this forward refuses",
    ):
        tiny.derive(RefusingWan)
    assert issubclass(tiny.CannotShrink, CannotExamine)


def test_a_suite_check_for_each_video_class_present():
    """`each: video` becomes one check per video class of the installed diffusers (scanned, never listed), kept
    where the check's fields apply: `mask_pad` to the classes whose forward takes a text mask."""
    pytest.importorskip("diffusers")
    from cpdoctor.errors import BadInput
    from cpdoctor.model_zoo.catalog import list_models
    from cpdoctor.suite import _each, load
    from cpdoctor.vocabulary import Kind

    video = {"wan", "chrono-edit", "helios", "ltx", "ltx2", "mini-max-h3"} & {e.short_name for e in list_models()}
    expanded = _each((Kind.MODEL, {"each": "video", "ring": 3}), "s.yaml", 1)
    assert {f["model"] for _, f in expanded} == video and all(f["ring"] == 3 and "each" not in f for _, f in expanded)
    masked = _each((Kind.MODEL, {"each": "video", "ring": 2, "mask_pad": 3}), "s.yaml", 1)
    assert {f["model"] for _, f in masked} == {"ltx", "ltx2"} & video
    assert {f["model"] for _, f in _each((Kind.MODEL, {"each": "image", "ring": 2}), "s.yaml", 1)} == {"flux", "flux2", "qwen-image"}
    with pytest.raises(BadInput, match="check 4: each: must be one of video, image, all"):
        _each((Kind.MODEL, {"each": "audio"}), "s.yaml", 4)
    assert [c[1] for c in load("video").checks][:2] == [{"each": "video", "ring": 2}, {"each": "video", "ring": 3}]


def test_a_tiny_config_runs_on_flash_kernels_head_dims_a_multiple_of_8():
    """Regression: Flux derived with head dim 6 (rope axes 2+2+2) and `cpdoctor model flux --backend _native_flash
    --emulate` stopped on flash's own check (head size a multiple of 8) as UNSUPPORTED. The trial refuses such a
    head dim; the derived config's attentions all run on flash."""
    pytest.importorskip("diffusers")
    from cpdoctor.model_zoo import tiny
    from cpdoctor.model_zoo.catalog import full_config, resolve_model

    cls = resolve_model("flux").cls
    base = dict(num_layers=1, num_single_layers=1, num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8)
    cost, why = tiny.Trial(cls)(full_config(cls, {**base, "attention_head_dim": 6, "axes_dims_rope": (2, 2, 2)}))
    assert cost is None and why == "an attention of head dim 6: flash kernels take multiples of 8"
    cost, why = tiny.Trial(cls)(full_config(cls, {**base, "attention_head_dim": 8, "axes_dims_rope": (2, 2, 4)}))
    assert why is None and cost > 0
    derived = tiny.derive(cls).config
    assert derived["attention_head_dim"] % shrink.HEAD_DIM_MULTIPLE == 0


class _QwenBefore037:
    """The signature Qwen-Image's class had in diffusers 0.36.0 (transformer_qwenimage.py): its forward still takes
    `txt_seq_lens`, and its pipeline passes it and the text mask on every call."""

    _cp_plan: dict = {}

    def __init__(self, in_channels: int = 4, joint_attention_dim: int = 8, guidance_embeds: bool = False) -> None: ...

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, timestep=None,
                img_shapes=None, txt_seq_lens=None, guidance=None, attention_kwargs=None, return_dict=True): ...  # fmt: skip


class _Flux2Before037:
    """The signature Flux2's class had in diffusers 0.36.0 (transformer_flux2.py): no `guidance_embeds` switch, the
    guidance always embedded (its forward calls `guidance.to(...)`)."""

    _cp_plan: dict = {}

    def __init__(self, in_channels: int = 4, joint_attention_dim: int = 8) -> None: ...

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, img_ids=None, txt_ids=None, guidance=None,
                joint_attention_kwargs=None, return_dict=True): ...  # fmt: skip


def test_packed_image_inputs_follow_the_signature_of_the_release():
    """What an older release's forward needs is read from its signature, as its pipeline passes it: Qwen-Image's
    `txt_seq_lens` with the all-ones mask (0.36.0's CP hook raises on a plan input the call leaves out), and Flux2's
    guidance where the class has no switch; with the switch, its value decides (off: no guidance)."""
    from cpdoctor.model_zoo.inputs.base import InputShape
    from cpdoctor.model_zoo.inputs.image import PACKED_IMAGE

    config = {"in_channels": 4, "joint_attention_dim": 8, "guidance_embeds": False}
    qwen = PACKED_IMAGE.build(_QwenBefore037, config, InputShape(64, 64, 8, batch=2)).kwargs
    assert qwen["txt_seq_lens"] == [8, 8] and tuple(qwen["encoder_hidden_states_mask"].shape) == (2, 8)
    assert "guidance" not in qwen
    flux2 = PACKED_IMAGE.build(_Flux2Before037, {"in_channels": 4, "joint_attention_dim": 8}, InputShape(64, 64, 8)).kwargs
    assert tuple(flux2["guidance"].shape) == (1,) and "txt_seq_lens" not in flux2
