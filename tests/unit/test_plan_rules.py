"""`cpdoctor plan`'s arithmetic, wording and findings on numbers, and its measuring on a tiny module on the meta
device: no diffusers, no process group.

The remedy search is run end to end against a stand-in measurer whose lengths follow Qwen-Image's arithmetic
(image tokens (H/16)·(W/16), text tokens T, a text mask split once it is passed), so the expected remedies are
the ones `tests/test_plan.py` measures with the real model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cpdoctor.errors import BadInput
from cpdoctor.examinations.plan import judge
from cpdoctor.model_zoo.splits import remedies
from cpdoctor.model_zoo.splits.measure import Key, MeasuredSplits, SplitKind
from cpdoctor.model_zoo.splits.plan import check_int
from cpdoctor.model_zoo.splits.result import HeadsCheck, Plan, Problem, Remedy
from cpdoctor.report import Environment, ExitCode, Report, Verdict

NOTHING_ASKED = SimpleNamespace(to_dict=dict)  # a report's request: anything with to_dict

IMG = Key("", "hidden_states", SplitKind.SPLIT, 1)
TXT = Key("", "encoder_hidden_states", SplitKind.SPLIT, 1)
MASK = Key("", "encoder_hidden_states_mask", SplitKind.SPLIT, 1)


# ------------------------------------------------------------------------------------------------ arithmetic


def test_divisors_and_per_rank():
    assert remedies.divisors(24) == [1, 2, 3, 4, 6, 8, 12, 24]
    assert remedies.divisors(83) == [1, 83]
    assert remedies.per_rank(6889, 2) == 3444.5
    assert remedies.per_rank(4096, 4) == 1024 and isinstance(remedies.per_rank(4096, 4), int)
    assert remedies.per_rank(77, 3) == 25.67


def test_degree_options():
    # 77 = 7 · 11: up to 8 ranks only 7 divides it, and Ulysses 7 does not divide 24 heads
    assert remedies.degree_options([77], [24], ring=2, ulysses=1) == [(7, 1)]
    assert remedies.degree_options([6889], [24], ring=2, ulysses=1) == []  # 6889 = 83²
    # the same 16 ranks first, nearest degrees first; Ulysses 16 itself does not divide 24 heads
    assert remedies.degree_options([4096, 512], [24], ring=1, ulysses=16) == [(2, 8), (4, 4), (8, 2), (16, 1)]
    assert remedies.degree_options([4096], [24], ring=2, ulysses=2, limit=3) == [(1, 4), (4, 1), (1, 2)]


def test_degrees_remedies():
    some = remedies.degrees_remedy([77], [77, 6889], [24], ring=2, ulysses=1)
    assert some.text == "degrees that divide these lengths and the heads: ring=7 x ulysses=1"
    assert some.values == {"options": [{"ring": 7, "ulysses": 1, "all_divide": False}]}
    everything = remedies.degrees_remedy([77], [77, 154], [24], ring=2, ulysses=1)
    assert everything.text.endswith("ring=7 x ulysses=1 (everything divides)")
    none = remedies.degrees_remedy([6889], [6889], [24], ring=2, ulysses=1)
    assert (none.text, none.values) == ("no ring x ulysses up to 8 ranks divides 6889", {"options": []})
    heads = remedies.heads_degrees_remedy([4096, 512], [24], ring=1, ulysses=16)
    assert (
        heads.text
        == "degrees whose Ulysses group divides the heads (and every length): ring=2 x ulysses=8, ring=4 x ulysses=4, ring=8 x ulysses=2, ring=16 x ulysses=1"
    )
    assert remedies.heads_degrees_remedy([37], [24], ring=1, ulysses=16) is None  # 37 is prime


def test_resolution_and_frame_candidates():
    cands = remedies.resolution_candidates(1328, 1328, 16)
    assert cands[:4] == [(1328, 1344), (1344, 1328), (1312, 1328), (1328, 1312)]
    assert len(cands) == 17 * 17 - 1 and (1328, 1328) not in cands
    assert min(min(c) for c in remedies.resolution_candidates(32, 48, 16)) == 16  # never below one step
    assert remedies.frame_candidates(81, 4, 1)[:4] == [85, 77, 89, 73]
    assert remedies.frame_candidates(5, 4, 1) == [9, 1, 13, 17, 21, 25, 29, 33, 37]


def test_text_padding_wording():
    assert remedies.padding_advice(77, 78, "encoder_hidden_states_mask", ring=2) == (
        "pad the text to 78 tokens and mark the 1 padding token(s) in `encoder_hidden_states_mask` "
        "(under ring attention the mask must follow the KV chunks: see the note)"
    )
    assert remedies.padding_advice(77, 80, "mask", ring=1) == "pad the text to 80 tokens and mark the 3 padding token(s) in `mask`"
    assert remedies.padding_advice(77, 78, None, ring=2).startswith("pad the text to 78 tokens; this model's forward takes no text mask")


def test_problem_wording():
    lengths = {IMG: {6889: 1}, TXT: {77: 1}, Key("pos", "output[1]", SplitKind.SPLIT, 0): {77: 1}}
    keys = {TXT, Key("pos", "output[1]", SplitKind.SPLIT, 0)}
    assert remedies.tokens_what(("text",), keys, lengths, ring=2, ulysses=1) == (
        "text tokens: encoder_hidden_states 77, pos:output[1] 77 do not split over 2 ranks (ring 2 x ulysses 1)"
    )
    assert remedies.tokens_what(("frames", "text"), {IMG}, lengths, 2, 2).startswith("tokens that depend on frames and text: ")
    assert remedies.tokens_what((), {IMG}, lengths, 2, 2).startswith("fixed-size tokens: hidden_states 6889 do not split over 4 ranks")
    assert remedies.heads_what(HeadsCheck(24, 24, 16, False, "attention calls")) == (
        "24 attention heads do not split over ulysses=16 (Ulysses scatters heads across its group; divisors of 24: 2, 3, 4, 6, 8, 12, 24)"
    )
    assert "(6 key/value heads)" in remedies.heads_what(HeadsCheck(24, 6, 16, False, "attention calls"))
    groups = remedies.group_by_dependency({IMG, TXT}, {IMG: ["resolution"], TXT: ["text"]})
    assert groups == {("resolution",): {IMG}, ("text",): {TXT}}


def test_fmt_lengths():
    m = MeasuredSplits({IMG: {6972: 1}, TXT: {78: 1}}, {}, set(), 1328, 1344, None, 78)
    assert remedies.fmt_lengths(m, {IMG}, 2) == "6972 -> 3486 per rank"
    assert remedies.fmt_lengths(m, {IMG, TXT}, 4) == "encoder_hidden_states 78 -> 19.5, hidden_states 6972 -> 1743"


def test_check_int():
    assert check_int("ring degree", 3, 1) == 3
    for bad, words in ((True, "must be an integer"), (2.0, "must be an integer"), (0, "at least 1")):
        with pytest.raises(BadInput, match=words):
            check_int("ring degree", bad, 1)


# ------------------------------------------------------------------------------------------------ the search


class _Model:
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None):  # noqa: ANN001
        raise AssertionError("never called: the stand-in measurer computes the lengths")


class _Measurer:
    """Qwen-Image's arithmetic: (H/16)·(W/16) image tokens, T text tokens, the mask split once it is passed."""

    cls = _Model
    full_config: dict = {}
    shallow = False

    def __init__(self):
        self.calls = []

    def measure(self, height, width, text_len, frames, text_mask=False):  # noqa: ANN001
        self.calls.append((height, width, text_len, text_mask))
        lengths = {IMG: {(height // 16) * (width // 16): 1}, TXT: {text_len: 1}}
        if text_mask:
            lengths[MASK] = {text_len: 1}
        return MeasuredSplits(lengths, {}, {(24, 24)}, height, width, frames, text_len)

    def make_shallow(self, reference, text_mask):  # noqa: ANN001
        return True


def _search(height=1328, width=1328, text_len=77, ring=2, ulysses=1, heads=24):
    meas = _Measurer()
    builder = SimpleNamespace(
        resolution_multiple=lambda cfg: 16, text_mask_param="encoder_hidden_states_mask", frames_step=None, frames_offset=1
    )
    hc = [HeadsCheck(heads, heads, ulysses, heads % ulysses == 0, "attention calls")]
    s = remedies.Search(meas, builder, meas.measure(height, width, text_len, None), hc, ring, ulysses)
    s.fields = set()  # no "anything" modes: this test does not look at the installed diffusers
    return s


def test_search_finds_the_measured_ways_out_of_qwen_image_1328_text77_ring2():
    found = remedies.find_problems(_search())
    assert found.depends == {IMG: ["resolution"], TXT: ["text"]}
    assert found.notes == []
    image, text = found.problems
    assert image.tensors == ["hidden_states"] and text.tensors == ["encoder_hidden_states"]
    assert [(r.kind, r.text) for r in image.remedies] == [
        ("resolution", "1328x1344: 6972 -> 3486 per rank"),
        ("resolution", "1344x1328: 6972 -> 3486 per rank"),
        ("resolution", "1312x1328: 6806 -> 3403 per rank"),
        ("degrees", "no ring x ulysses up to 8 ranks divides 6889"),
    ]
    pad = text.remedies[0]
    assert pad.values == {"text_len": 78, "pad": 1, "mask": "encoder_hidden_states_mask"}
    assert pad.text.endswith(": 78 -> 39 per rank")  # the mask, split once passed, is 78 long too
    assert text.remedies[1].text == "degrees that divide these lengths and the heads: ring=7 x ulysses=1"


def test_search_for_heads_only():
    found = remedies.find_problems(_search(height=1024, width=1024, text_len=512, ring=1, ulysses=16))
    assert found.depends == {} and len(found.problems) == 1
    assert found.problems[0].tensors == ["attention heads"]
    assert found.problems[0].remedies[0].values["options"][0] == {"ring": 2, "ulysses": 8, "all_divide": True}


def test_nothing_to_find_when_everything_divides():
    s = _search(height=1024, width=1024, text_len=512, ring=2, ulysses=2)
    assert remedies.find_problems(s).problems == [] and s.meas.calls == [(1024, 1024, 512, False)]


# ------------------------------------------------------------------------------------------------ findings


SETTINGS = {"height": 1328, "width": 1328, "text_len": 77, "frames": None, "ring": 2, "ulysses": 1, "world_size": 2}


def _plan(problems):
    return Plan({"short_name": "qwen-image"}, dict(SETTINGS), [], [], [], problems, [])


def test_each_problem_is_a_fail_finding_with_its_ways_out_and_a_command():
    text = Problem(
        "text tokens: ...",
        ["encoder_hidden_states"],
        [
            Remedy("text_padding", "pad the text to 78 tokens", True, {"text_len": 78, "pad": 1, "mask": None}),
            Remedy("ring_anything", "ContextParallelConfig(...)", False, {}),
        ],
    )
    image = Problem(
        "image tokens: ...",
        ["hidden_states", "img_ids"],
        [
            Remedy("resolution", "no resolution within 8 steps of 16 px makes these divide", True, {}),
            Remedy("degrees", "degrees ...", True, {"options": [{"ring": 4, "ulysses": 1, "all_divide": True}]}),
        ],
    )
    findings = judge.plan_findings(_plan([text, image]), "/ckpt dir")
    assert [(f.subject, f.verdict) for f in findings] == [
        ("plan: encoder_hidden_states", Verdict.FAIL),
        ("plan: hidden_states, img_ids", Verdict.FAIL),
    ]
    assert findings[0].remedy == "text_padding: pad the text to 78 tokens; ring_anything: ContextParallelConfig(...) (predicted)"
    assert findings[0].command == "cpdoctor plan '/ckpt dir' --height 1328 --width 1328 --text-len 78 --ring 2 --ulysses 1"
    assert findings[1].command == "cpdoctor plan '/ckpt dir' --height 1328 --width 1328 --text-len 77 --ring 4 --ulysses 1"
    report = Report.of(findings, Environment(), NOTHING_ASKED, plan=_plan([text, image]))
    assert (report.verdict, report.exit_code) == (Verdict.FAIL, ExitCode.FOUND)
    assert report.to_dict()["problems"][1]["tensors"] == ["hidden_states", "img_ids"]


def test_no_problem_is_one_pass_finding():
    findings = judge.plan_findings(_plan([]), "flux")
    assert [(f.subject, f.verdict, f.diagnosis) for f in findings] == [
        ("plan: every split", Verdict.PASS, "every split divides over 2 ranks")
    ]
    assert Report.of(findings, Environment(), NOTHING_ASKED).exit_code == ExitCode.OK
    assert Remedy("ulysses_anything", "x", True, {"ring": 1, "ulysses": 2}).settings() is None


# ------------------------------------------------------------------------------------------------ measuring on meta


def test_recorder_and_spy_on_a_tiny_module_on_the_meta_device():
    torch = pytest.importorskip("torch")
    from cpdoctor.model_zoo.splits.measure import SplitRecorder, attention_spy

    split = SimpleNamespace(split_dim=1, expected_dims=3, split_output=False)
    rope = SimpleNamespace(split_dim=0, expected_dims=2, split_output=True)
    gather = SimpleNamespace(gather_dim=1, expected_dims=3)

    class Tiny(torch.nn.Module):
        _cp_plan = {"": {"hidden_states": split, "context": split}, "rope": {0: rope}, "proj": gather}

        def __init__(self):
            super().__init__()
            self.rope = torch.nn.Identity()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, hidden_states, context=None):  # noqa: ANN001
            self.rope((torch.empty(hidden_states.shape[1], 4, device="meta"),))
            q = hidden_states.view(1, hidden_states.shape[1], 2, 4).transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            return self.proj(out.transpose(1, 2).reshape(1, -1, 8))

    model = Tiny().to("meta")
    recorder = SplitRecorder(model, model._cp_plan)
    with torch.no_grad(), attention_spy() as heads:
        model(torch.empty(1, 6, 8, device="meta"))
    recorder.remove()
    assert {k.name: v for k, v in recorder.lengths.items()} == {"hidden_states": {6: 1}, "rope:output[0]": {6: 1}, "proj:output": {6: 1}}
    assert recorder.skipped == {"context": "not passed (None)"}
    assert heads == {(2, 2)}
