"""The step examination's rules, fed numbers and events (no process, no model): each measured relation gives its
own diagnosis and remedy; what the gradients must be comes from the events (the means on the loss and what the
peers' output gradients are, the reductions, a GradScaler's unscaling, a clip divided out), never from how round
or large a number is. One run FAILs only on what it observed: a number whose meaning only its value tells (a
literal equal to a power of the degrees) is read both ways, and a verdict it decides is a WARN naming it and the
two-run command; so is one that rests on a loss the watcher cannot read through, or on a reduction it saw but could
not read (a comm hook), which is named instead of the attention."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.examinations.step.judgment.diagnosis import block_of  # noqa: E402
from cpdoctor.examinations.step.judgment.factors import Expectation, Reduction, expectation  # noqa: E402
from cpdoctor.examinations.step.judgment.inputs import InputDiff, input_diffs  # noqa: E402
from cpdoctor.examinations.step.judgment.judge import step_finding  # noqa: E402
from cpdoctor.examinations.step.judgment.measure import (  # noqa: E402
    OutGrad,
    ParamError,
    RankGrad,
    StepNumbers,
    best_factor,
    groups_of,
    own_shard_only,
    reference_out_grads,
)
from cpdoctor.examinations.step.judgment.signature import factor_candidates  # noqa: E402
from cpdoctor.examinations.step.watcher.events import (  # noqa: E402
    BackwardRoot,
    ClipNorm,
    Collective,
    DDPReduce,
    EventLog,
    GradScale,
    LossFactor,
    LossTerm,
    Op,
    Source,
    Unobserved,
)
from cpdoctor.examinations.step.watcher.group import StepGroup  # noqa: E402
from cpdoctor.examinations.step.watcher.messages import InputPrint, PeerRecord  # noqa: E402
from cpdoctor.report import Verdict  # noqa: E402
from cpdoctor.vocabulary import DType  # noqa: E402

TOL = DType.FP32.grad_tolerance


def grads(*rows: tuple[float, float, float]) -> tuple[RankGrad, ...]:
    """(rel_err, factor, residual) per rank, ranks 0, 1, ..."""
    return tuple(RankGrad(r, e, e, 0, c, res) for r, (e, c, res) in enumerate(rows))


def numbers(**over) -> StepNumbers:
    """A correct step at ring 2, dp 1; `over` replaces fields."""
    base = StepNumbers(
        ranks=(0, 1), ring=2, ulysses=1, dp=1, dtype="fp32", forwards=(1, 1), backwards=(1, 1), inputs_differ=(),
        rng_before_groups=((0, 1),), rng_after_groups=((0, 1),), out_grad_spread=0.0, out_grad_differ=(),
        out_rel_err=2e-7, out_max_abs=1e-7, grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)), peer_spread=0.0,
        sum_rel_err=1.0, params=(ParamError("x_embedder.weight", 1e-7, 8), ParamError("transformer_blocks.0.attn.to_q.weight", 1e-7, 8)),
        out_numel=64,
    )  # fmt: skip
    n = dataclasses.replace(base, **over)
    return n if "params_scaled" in over else dataclasses.replace(n, params_scaled=n.params)


def test_correct_step_passes():
    f = step_finding(numbers())
    assert f.verdict is Verdict.PASS and "matches one fp64 process" in f.diagnosis and not f.remedy


def test_inputs_differ_names_the_input_the_ranks_and_the_seed():
    n = numbers(
        inputs_differ=(InputDiff("timestep", (0,), (1,)),),
        rng_before_groups=((0,), (1,)),
        rng_after_groups=((0,), (1,)),
        grads=grads((0.3, 0.9, 0.2), (0.3, 0.9, 0.2)),
    )
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL
    assert "timestep on rank 1" in f.diagnosis and "seeded per rank" in f.diagnosis
    assert "data-parallel rank" in f.remedy
    assert "consumed" not in f.diagnosis  # the states differed before the step: not an uneven consumption


def test_two_runs_judge_inputs_against_the_run_without_cp_and_say_what_each_is():
    """A trainer that shards the tokens itself (torchtitan): its shards are right; a timestep drawn on one CP rank
    is named with what it is instead, against the run without CP; a correct step says which inputs were shards."""
    from cpdoctor.examinations.step.judgment.input_layouts import GroupInput, Placement
    from cpdoctor.examinations.step.judgment.inputs import InputsJudged
    from cpdoctor.peer_impls.layouts import Layout

    img = GroupInput("img", Placement.SHARD, dim=1, layout=Layout.CONTIGUOUS)
    wrong = GroupInput("timesteps", Placement.WRONG, wrong=((1, "differs from the run without CP's (max |Δ| 0.3)"),))
    diff = InputDiff("timesteps", (0,), (1,), wrong.describe())
    judged = InputsJudged(None, 0, (img, wrong), (diff,), True, False)
    f = step_finding(numbers(inputs_differ=(diff,), inputs_judged=judged, grads=grads((0.3, 0.9, 0.2), (0.3, 0.9, 0.2))))
    assert f.verdict is Verdict.FAIL and "not what the run without CP fed it" in f.diagnosis
    assert "timesteps: rank 1: differs from the run without CP's" in f.diagnosis
    assert "img: each rank's contiguous shard along dim 1" in f.diagnosis and "which must all feed the same" not in f.diagnosis
    right = InputsJudged(0, 0, (img, GroupInput("timesteps", Placement.REPLICATED)), (), True, True)
    f = step_finding(numbers(inputs_judged=right, recomputed=False, reference="the same step run without CP"))
    assert f.verdict is Verdict.PASS and "img as each rank's shard, the rest replicated" in f.diagnosis


@pytest.mark.parametrize(
    ("cp", "dp", "factor", "text", "cause"),
    [
        (2, 1, 0.5, "1/cp", "averaged over the CP ranks"),
        (4, 2, 0.25, "1/cp", "averaged over the CP ranks"),
        (2, 1, 2.0, "cp", "normalised by the local shard"),
        (2, 3, 3.0, "dp", "summed over the data-parallel replicas"),
        (2, 2, 0.25, "1/cp·dp", "every rank of the world"),
    ],
)
def test_two_runs_name_a_constant_factor_from_the_degrees(cp, dp, factor, text, cause):
    """Against the same code without CP any uniform factor that is a power of the degrees is a fault."""
    n = numbers(ring=cp, dp=dp, ranks=tuple(range(cp)), grads=grads(*[(abs(factor - 1), factor, 1e-7)] * cp), **TWO_RUNS)
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL
    assert f"factor {text} = {factor:g}" in f.diagnosis and cause in f.diagnosis
    assert f.remedy
    assert "first bad parameter" not in f.diagnosis  # every parameter is off by the factor: no place to name


def test_peers_differ_after_sync_is_the_missing_cp_reduction():
    n = numbers(grads=grads((0.5, 0.5, 0.6), (0.5, 0.5, 0.6)), peer_spread=0.8, sum_rel_err=1e-7)
    f = step_finding(n)
    assert "reduction over the CP group (ranks 0, 1) is missing" in f.diagnosis
    assert "summed over the CP group they are the expected" in f.diagnosis
    assert "all_reduce" in f.remedy


def test_each_group_with_a_multiple_of_its_own_gradients_is_the_missing_dp_averaging():
    """Each replica holds a multiple of its own data's gradient (here half of it: a loss × cp averaged over the CP
    ranks alone): the data-parallel averaging is missing, not the attention."""
    for own in (1e-7,):
        n = numbers(dp=2, grads=grads((0.6, 0.45, 0.4), (0.6, 0.45, 0.4)), own_rel_err=0.5, own_residual=own)
        f = step_finding(n)
        assert (
            f.verdict is Verdict.FAIL and "averaging over the data-parallel ranks is missing" in f.diagnosis and "data-parallel" in f.remedy
        )
        assert "first bad parameter" not in f.diagnosis and f.command is None


def test_output_gradients_differ_is_the_loss():
    n = numbers(out_grad_differ=(1,), out_grad_spread=0.4, out_grads=(OutGrad.DIFFER,), grads=grads((0.2, 0.9, 0.1), (0.2, 0.9, 0.1)))
    f = step_finding(n)
    assert "loss is computed differently on each rank" in f.diagnosis and "rank 1" in f.diagnosis
    assert "full (gathered) model output" in f.remedy


TWO_RUNS = {"recomputed": False, "reference": "the same step run without CP"}
EXACT = grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7))
HALF = grads((0.5, 0.5, 1e-7), (0.5, 0.5, 1e-7))
DOUBLE = grads((1.0, 2.0, 1e-7), (1.0, 2.0, 1e-7))
GROUP = StepGroup(rank=0, world=2, ranks=(0, 1), ring=2, ulysses=1, seq=1, index=1, timeout_s=1.0, cp_groups=((0, 1),))
OUT = (1, 16, 4)
"""The model's output: 64 elements, 16 tokens; this rank's shard at CP 2: 32 elements, 8 tokens."""
SAME, SHARDED = OutGrad.REPLICATED, OutGrad.PER_SHARD


def root(*factors: LossFactor, hidden: tuple[str, ...] = (), param_paths: int = 0) -> BackwardRoot:
    """A backward root with one term through `factors` (root first)."""
    placed = tuple(dataclasses.replace(f, place=i) for i, f in enumerate(factors))
    return BackwardRoot((LossTerm(placed),), hidden, param_paths)


def mean(count: int) -> LossFactor:
    return LossFactor(1 / count, Source.MEAN, count)


def const(value: float) -> LossFactor:
    return LossFactor(value, Source.CONSTANT)


SUM_CP = Collective("all_reduce", Op.SUM, (0, 1), True, 0)
MEAN_CP = DDPReduce((0, 1))
"""DDP over the CP group: its average is 1/cp of the sum a correct step takes."""


def seen(*events, shapes=(SAME,), loss_scale=None) -> Expectation:
    return expectation([EventLog(list(events))], GROUP, OUT, 1, 1, loss_scale, shapes)


def test_a_literal_equal_to_cp_is_read_both_ways_and_never_fails():
    """`loss * 2` at CP 2: cp (then a sum over the CP ranks is 2× one process) or a weight (then it is right): the
    same numbers and events either way, so a WARN naming both readings and the two runs that decide; averaged over the
    CP ranks the readings swap. Neither is a FAIL: `loss * 2` meant as a weight is a correct step."""
    for reduction, g, right, wrong in ((SUM_CP, EXACT, "a weight of the step's own", "cp = 2"), (MEAN_CP, HALF, "cp = 2", "a weight")):
        f = step_finding(numbers(grads=g), seen(root(const(2.0), mean(64)), reduction))
        assert f.verdict is Verdict.WARN, f.diagnosis
        assert "rests on reading the 2 on the loss is cp = 2 or a weight of the step's own" in f.diagnosis
        assert (
            f"right if the 2 on the loss is {right}" in f.diagnosis
            and f"what one process computes if the 2 on the loss is {wrong}" in f.diagnosis
        )
        assert (
            "`cpdoctor step path/to/train.py:fn --ring 2`" in f.remedy and "`cpdoctor step --ring 2 -- <your launch command>`" in f.remedy
        )
        assert "loss_scale=" in f.remedy and f.command is None


def test_half_the_mse_at_cp_2_is_a_warning_whatever_the_reduction():
    """`0.5 * mse` at CP 2, summed over the CP ranks (right: one process weighs it 0.5 too)."""
    f = step_finding(numbers(grads=EXACT), seen(root(const(0.5), mean(64)), SUM_CP))
    assert f.verdict is Verdict.WARN and "the 0.5 on the loss is 1/cp = 0.5 or a weight" in f.diagnosis


def test_a_factor_wrong_under_every_reading_and_made_by_the_reductions_seen_fails():
    """A plain mean averaged over the CP ranks (nothing read), and `loss / cp` averaged over them (wrong whether the
    0.5 is 1/cp or a weight): the reduction the watcher saw makes the factor, a FAIL naming it."""
    f = step_finding(numbers(grads=HALF), seen(root(mean(64)), MEAN_CP))
    assert f.verdict is Verdict.FAIL and "factor 1/cp" in f.diagnosis and "DDP averages over its 2 ranks" in f.diagnosis
    assert "these events make it" in f.diagnosis and "the loss carries no factor of the degrees" in f.diagnosis
    f = step_finding(numbers(grads=HALF), seen(root(const(0.5), mean(64)), MEAN_CP))
    assert f.verdict is Verdict.FAIL and "wrong under every one" in f.diagnosis, f.diagnosis


def test_a_number_that_may_fold_a_degree_in_never_fails_on_that_degree():
    """`loss * cp / 3` (0.667 at cp 2, one number) averaged over the CP ranks is a correct step: read as a weight the
    gradients are 1/cp of one process's, but the number may carry cp, which only its value tells: a WARN naming it
    and the two runs. A number that folds nothing in (1, the micro-batches' mean, the output's count) keeps the FAIL,
    and so does a factor no single degree explains."""
    f = step_finding(numbers(grads=HALF), seen(root(const(2 / 3), mean(64)), MEAN_CP))
    assert f.verdict is Verdict.WARN, f.diagnosis
    assert "if the 0.6667 on the loss is a weight of the step's own" in f.diagnosis and "only its value could tell" in f.diagnosis
    assert "`cpdoctor step path/to/train.py:fn --ring 2`" in f.remedy and "loss_scale=" in f.remedy
    f = step_finding(numbers(grads=HALF), seen(root(mean(64)), MEAN_CP))
    assert f.verdict is Verdict.FAIL, f.diagnosis
    f = step_finding(numbers(grads=HALF), seen(root(const(1 / 64), mean(64)), MEAN_CP))  # 1 / the output's count: folds nothing
    assert f.verdict is Verdict.FAIL, f.diagnosis


def test_a_factor_no_event_makes_is_a_warning_naming_what_was_not_seen():
    """The same 1/cp without a reduction the watcher saw (one inside a compiled region), or with DDP's comm hook
    (which replaces DDP's averaging): what it could not see may be the step's own scaling; the hook is named."""
    f = step_finding(numbers(grads=HALF), seen(root(mean(64))))
    assert f.verdict is Verdict.WARN and "the reductions the watcher saw make 1×, not that" in f.diagnosis
    hook = DDPReduce((0, 1), comm_hook="my_hook")
    f = step_finding(
        numbers(grads=HALF), seen(root(mean(64)), hook, Unobserved("DDP's comm hook my_hook replaces its averaging over ranks 0, 1"))
    )
    assert f.verdict is Verdict.WARN and "DDP's comm hook my_hook" in f.diagnosis


def test_a_hidden_node_on_the_loss_downgrades_even_a_pass():
    """A differentiable all_reduce (a custom autograd Function) on the loss: the numbers match the loss as computed,
    but what one process computes cannot be read through it: a WARN saying so, never a PASS (nor a FAIL)."""
    for g, reduction in ((EXACT, SUM_CP), (HALF, MEAN_CP)):
        f = step_finding(numbers(grads=g), seen(root(mean(64), hidden=("_AllReduceBackward",)), reduction))
        assert f.verdict is Verdict.WARN and "cannot be read: the loss's constants inside _AllReduceBackward" in f.diagnosis, f.diagnosis


def test_a_mean_over_a_part_of_a_replicated_output_is_the_same_in_one_process():
    """A condition image sliced off before the loss (diffusers' Kontext script) or one half of a prior-preservation
    batch: 32 of the 64 elements, this rank's shard's count at CP 2, but every peer's output gradient is the same:
    one loss on the gathered output, averaging the same part in one process (it was read as a mean over the shard)."""
    f = step_finding(numbers(grads=EXACT), seen(root(mean(32)), SUM_CP))
    assert f.verdict is Verdict.PASS and "a mean over 32 of the output's 64 elements, the same part on every CP peer" in f.diagnosis
    assert step_finding(numbers(grads=HALF), seen(root(mean(32)), MEAN_CP)).verdict is Verdict.FAIL


SHARD = {"out_grad_differ": (1,), "out_grad_spread": 1.4, "out_grads": (SHARDED,)}


@pytest.mark.parametrize(("g", "reduction", "verdict"), [(EXACT, SUM_CP, Verdict.FAIL), (HALF, MEAN_CP, Verdict.PASS)])
def test_a_per_shard_mean_is_observed_cp(g, reduction, verdict):
    """Each peer's output gradient confined to its own shard and a mean over its shard's 32 elements (`F.mse_loss(
    shard)`): one process averages 64, so the loss carries cp; summed over the CP ranks that is 2× (FAIL), averaged
    it is right."""
    f = step_finding(numbers(**SHARD, grads=g), seen(root(mean(32)), reduction, shapes=(SHARDED,)))
    assert f.verdict is verdict, f.diagnosis
    if verdict is Verdict.FAIL:
        assert "covers only its own shard" in f.diagnosis and "factor cp = 2" in f.diagnosis and "averaging its own shard" in f.diagnosis
        assert f.remedy.count("compute the loss on the full gathered output") == 1
    else:
        assert "the loss carries 2 = cp (a per-shard loss averaging its own shard" in f.diagnosis


@pytest.mark.parametrize(("count", "verdict"), [(64, Verdict.PASS), (32, Verdict.WARN)])
def test_a_per_shard_sum_normalised_by_a_count_is_read_by_its_value(count, verdict):
    """`shard.sum() / out.numel()` (the full count: the same in one process) PASSes summed over the CP ranks;
    `shard.sum() / shard.numel()` is a number equal to 1 / this rank's shard's count: read both ways, a WARN."""
    f = step_finding(numbers(**SHARD, grads=EXACT), seen(root(const(1 / count)), SUM_CP, shapes=(SHARDED,)))
    assert f.verdict is verdict, f.diagnosis
    if verdict is Verdict.WARN:
        assert "1/32, this rank's shard's count (64 / cp)" in f.diagnosis


def test_a_gradient_side_normaliser_says_what_it_is():
    """The step's own code divides the gradients: by the output's count (the same in one process, said in the PASS),
    or by this rank's shard's (read both ways: a WARN; it used to be absorbed as the step's own scaling)."""
    full = GradScale(1 / 64, "the backward and the end of the watch")
    f = step_finding(numbers(grads=grads((1.0, 1 / 64, 1e-7), (1.0, 1 / 64, 1e-7))), seen(root(mean(64)), SUM_CP, full))
    assert f.verdict is Verdict.PASS and "scaled the gradients by 0.01562" in f.diagnosis and "the same in one process" in f.diagnosis
    shard = GradScale(1 / 32, "the backward and the end of the watch")
    f = step_finding(numbers(grads=grads((1.0, 1 / 32, 1e-7), (1.0, 1 / 32, 1e-7))), seen(root(mean(64)), SUM_CP, shard))
    assert f.verdict is Verdict.WARN and "the 0.03125 on the gradients" in f.diagnosis and "shard's count" in f.diagnosis


def test_two_runs_name_the_reduction_that_makes_the_factor():
    """torchtitan's FSDP with its default division (a mean over dp_shard × cp), against the same step without CP:
    the reduction the watcher saw makes the factor, which the diagnosis says (not an unseen scaling)."""
    e = Expectation(reductions=(Reduction("FSDP2 sums over its 2 ranks (the CP group) and divides by 2", 0.5),))
    f = step_finding(numbers(grads=HALF, **TWO_RUNS), e)
    assert f.verdict is Verdict.FAIL and "factor 1/cp" in f.diagnosis and "these events make it" in f.diagnosis
    unseen = step_finding(numbers(grads=HALF, **TWO_RUNS), Expectation())
    assert unseen.verdict is Verdict.FAIL and "the watcher did not see makes part of it" in unseen.diagnosis


def test_explicit_loss_scale_decides():
    """`loss_scale=` says the loss's factor of the degrees: nothing is read, the verdict is the numbers'."""
    said = seen(root(const(2.0), mean(64)), MEAN_CP, loss_scale=2.0)
    assert step_finding(numbers(grads=HALF), said).verdict is Verdict.PASS
    said = seen(root(const(2.0), mean(64)), SUM_CP, loss_scale=2.0)
    assert step_finding(numbers(grads=EXACT), said).verdict is Verdict.FAIL


@pytest.mark.parametrize("scale", [65536.0, 1024.0, 8.0, 3.0])
def test_grad_scaler_unscaled_before_the_read_passes_whatever_its_scale(scale):
    """The scale comes from GradScaler.unscale_'s event, so a small one is no different from a large one."""
    e = dataclasses.replace(seen(root(mean(64)), SUM_CP), scale=scale, unscaled=scale)
    f = step_finding(numbers(grads=grads(*[(1.0, 1 / scale, 1e-7)] * 2)), e)
    assert f.verdict is Verdict.PASS and f"GradScaler's scale {scale:g}" in f.diagnosis


def test_grad_scaler_still_scaled_at_the_read_passes():
    e = dataclasses.replace(seen(root(mean(64)), SUM_CP), scale=1024.0)
    assert step_finding(numbers(grads=EXACT), e).verdict is Verdict.PASS


def test_a_skipped_optimizer_step_is_not_examined_never_a_fail():
    """GradScaler found inf: the gradients (and the output gradients) are inf; nothing else is said."""
    e = Expectation(scale=2.0**40, skipped="the GradScaler found inf/NaN in the gradients (scale 1.1e+12): it skips this optimizer step")
    inf = tuple(RankGrad(r, float("nan"), float("inf"), 10, float("nan"), float("nan")) for r in (0, 1))
    f = step_finding(numbers(grads=inf, out_grad_differ=(1,), out_grad_spread=float("nan"), peer_spread=float("nan")), e)
    assert f.verdict is Verdict.UNSUPPORTED and f.diagnosis.startswith("not examined: the GradScaler found inf/NaN")
    assert "loss is computed differently" not in f.diagnosis


def test_a_clip_is_reported_and_never_hides_a_misplaced_reduction():
    """The gradients reach the judge before the clip (its coefficient divided out on every rank): a 1/cp under an
    active clip is a FAIL, a right step under the same clip a PASS that says how much it clipped."""
    clip = (ClipNorm(0.01, 2.46, 0.01 / (2.46 + 1e-6)),)
    wrong = dataclasses.replace(seen(root(mean(64)), MEAN_CP), clips=clip)
    f = step_finding(numbers(grads=HALF), wrong)
    assert f.verdict is Verdict.FAIL and "factor 1/cp" in f.diagnosis
    right = step_finding(numbers(grads=EXACT), dataclasses.replace(seen(root(mean(64)), SUM_CP), clips=clip))
    assert right.verdict is Verdict.PASS and "clip_grad_norm_(max_norm=0.01) multiplied the gradients by 0.004065" in right.diagnosis


def test_a_uniform_factor_no_degree_gives_is_a_warning_with_both_readings():
    """Two runs: a uniform 0.37× is no misplaced reduction over this job's ranks: a scale the watcher did not see (a
    manual clip) or a defect, said both ways; its size decides nothing."""
    for factor in (0.37, 0.96, 1.3):
        f = step_finding(numbers(grads=grads(*[(abs(1 - factor), factor, 1e-7)] * 2), **TWO_RUNS))
        assert f.verdict is Verdict.WARN and "no power of this job's degrees" in f.diagnosis, f.diagnosis
        assert "clip_grad_norm_(max_norm" not in f.diagnosis


def test_a_non_uniform_error_names_what_the_watcher_could_not_read_not_the_attention():
    """A non-uniform error while the watcher saw DDP's comm hook, a loss node it cannot read through, or a term of the
    loss on the weights: those are named (WARN), the attention only when nothing else can explain it (FAIL)."""
    wrong = {"grads": grads((0.05, 0.97, 0.05), (0.05, 0.97, 0.05))}
    hook = Unobserved("DDP's comm hook fp16_compress_hook replaces its averaging over ranks 0, 1")
    for events in ((root(mean(64)), DDPReduce((0, 1), "fp16_compress_hook"), hook), (root(mean(64), hidden=("MyFunctionBackward",)),),
                   (root(mean(64), param_paths=1), SUM_CP)):  # fmt: skip
        f = step_finding(numbers(**wrong), seen(*events))
        assert f.verdict is Verdict.WARN and f.command is None, f.diagnosis
        assert "the attention is named only when nothing else can explain an error" in f.diagnosis
    assert "fp16_compress_hook" in step_finding(numbers(**wrong), seen(root(mean(64)), hook)).diagnosis
    f = step_finding(numbers(**wrong), seen(root(mean(64)), SUM_CP))
    assert f.verdict is Verdict.FAIL and f.command == "cpdoctor check --ring 2"


def test_a_two_run_factor_of_the_degrees_fails_whether_it_multiplies_or_divides():
    for cp, dp, factor, text in ((2, 2, 2.0, "cp"), (2, 2, 0.5, "1/cp"), (4, 1, 0.25, "1/cp"), (2, 3, 3.0, "dp"), (2, 3, 1 / 3, "1/dp")):
        n = numbers(ring=cp, dp=dp, ranks=tuple(range(cp)), grads=grads(*[(abs(factor - 1), factor, 1e-7)] * cp), **TWO_RUNS)
        f = step_finding(n)
        assert f.verdict is Verdict.FAIL and f"factor {text} = {factor:g}" in f.diagnosis, f.diagnosis


def test_one_parameter_far_out_fails_although_the_total_is_within():
    params = (ParamError("x_embedder.weight", 1e-7, 8000), ParamError("transformer_blocks.0.attn.to_k.weight", 0.8, 8))
    n = numbers(grads=grads((5e-5, 1.0, 5e-5), (5e-5, 1.0, 5e-5)), params=params)
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL and "transformer_blocks.0.attn.to_k.weight is 0.8" in f.diagnosis


def test_rng_consumed_unevenly_with_exact_gradients_is_a_warning_naming_who():
    n = numbers(ranks=(0, 1, 2, 3), ring=4, rng_after_groups=((0, 1, 3), (2,)), grads=grads(*[(1e-7, 1.0, 1e-7)] * 4))
    f = step_finding(n)
    assert f.verdict is Verdict.WARN and "rank 2 consumed random numbers" in f.diagnosis


def test_gradients_wrong_alone_is_the_attention_with_the_check_command_and_the_first_bad_block():
    params = (
        ParamError("x_embedder.weight", 1e-7, 8),
        ParamError("transformer_blocks.0.attn.to_q.weight", 0.4, 8),
        ParamError("transformer_blocks.1.attn.to_k.weight", 3.0, 8),
    )
    n = numbers(ring=3, ranks=(0, 1, 2), grads=grads(*[(0.05, 0.97, 0.05)] * 3), params=params)
    f = step_finding(n)
    assert "inputs, loss and reduction are right" in f.diagnosis
    assert "`cpdoctor check --ring 3`" in f.diagnosis and f.command == "cpdoctor check --ring 3"
    assert "first bad parameter transformer_blocks.0.attn.to_q.weight" in f.diagnosis and "block transformer_blocks.0" in f.diagnosis
    assert "worst parameter transformer_blocks.1.attn.to_k.weight" in f.diagnosis
    assert "cpdoctor.patch()" in f.remedy
    assert f.tensors["grads"].bad_ranks == (0, 1, 2) and f.tensors["worst_param"].name == "transformer_blocks.1.attn.to_k.weight"


def test_factor_candidates_skip_dimensions_of_one():
    assert {f.text for f in factor_candidates(2, 1)} == {"cp", "1/cp"}
    assert {f.text for f in factor_candidates(1, 2)} == {"dp", "1/dp"}


def test_block_of():
    assert block_of("transformer_blocks.0.attn.to_q.weight") == "transformer_blocks.0"
    assert block_of("x_embedder.weight") == "x_embedder"


# -- the measurements themselves --------------------------------------------------------------------------------


def test_best_factor_and_residual():
    ref = torch.randn(100, dtype=torch.float64)
    c, res = best_factor(0.5 * ref, ref)
    assert c == pytest.approx(0.5) and res < 1e-12
    c, res = best_factor(ref + torch.randn(100, dtype=torch.float64), ref)
    assert res > 0.1


def test_own_shard_only_and_reference_out_grad():
    g = torch.randn(1, 8, 3)
    a, b = g.clone(), g.clone()
    a[:, 4:] = 0
    b[:, :4] = 0
    assert own_shard_only([a, b], dim=1)
    assert not own_shard_only([g, g], dim=1)
    assert torch.allclose(reference_out_grads([_rec(0, a), _rec(1, b)], 1)[0].float(), g)  # disjoint pieces: their sum
    assert torch.allclose(reference_out_grads([_rec(0, g), _rec(1, g)], 1)[0].float(), g)  # one loss: the common one


def test_input_diffs_and_groups():
    r0 = _rec(0, None, inputs=(InputPrint("hidden_states", "aa", 1.0), InputPrint("timestep", "t", None)))
    r1 = _rec(1, None, inputs=(InputPrint("hidden_states", "bb", 1.0), InputPrint("timestep", "t", None)))
    assert input_diffs([r0, r1]) == (InputDiff("hidden_states", (0,), (1,)),)
    assert groups_of(["x", "y", "x"], (0, 1, 2)) == ((0, 2), (1,))


def _rec(rank: int, out_grad, inputs=()) -> PeerRecord:
    return PeerRecord(rank, 1, 1, inputs, "r", "r", (out_grad,), torch.zeros(1))


def test_a_model_without_cp_is_bad_input():
    """preflight(model=) examines one run: a diffusers class without CP is told to enable it; a model whose CP is
    not diffusers' is told why one run cannot examine it and which two-run command does."""
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.step import model_degrees

    diffusers = pytest.importorskip("diffusers")
    tiny = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip
    with pytest.raises(BadInput, match="no context parallelism enabled"):
        model_degrees(tiny)
    with pytest.raises(BadInput, match="Linear cannot be examined in one run.*cpdoctor step path/to/train.py:step --ring 2"):
        model_degrees(torch.nn.Linear(2, 2))


def test_a_crash_of_the_cp_attention_in_a_step_is_the_attentions_defect_with_its_check():
    """A watched step that raised torch's CheckpointError from diffusers' ring backward: named as the attention's
    defect (not the user's crash), with the `cpdoctor check` that raises it alone at the job's degrees."""
    from test_failures import RING_BACKWARD_TB

    from cpdoctor.examinations.step.watcher.agree import crash
    from cpdoctor.examinations.step.watcher.group import StepGroup

    group = StepGroup(rank=0, world=4, ranks=(0, 1), ring=2, ulysses=1, seq=1, index=0, timeout_s=5.0)
    f = crash(group, {r: RING_BACKWARD_TB for r in range(4)}, "the step raised")
    assert f.verdict == "CRASH" and f.command == "cpdoctor check --ring 2 --checkpointing"
    assert "inside diffusers' CP attention on rank 0, 1, 2, 3, the attention's defect and not the step's own error" in f.diagnosis
    assert "(rank 0, 1, 2, 3: torch.utils.checkpoint.CheckpointError" in f.diagnosis  # one line said once
    assert "`cpdoctor check --ring 2 --checkpointing` shows it alone" in f.diagnosis and f.remedy.startswith("cpdoctor.patch()")
    assert f.failure.signature == "ring backward under checkpointing"
    own = crash(group, {1: "Traceback ...\nValueError: the user's step failed"}, "the step raised")
    assert own.command is None and own.diagnosis == "the step raised on rank 1 (rank 1: ValueError: the user's step failed)"


def test_a_number_is_read_every_way_its_value_fits():
    """`shard.sum() / 32` at CP 2: 1/32 is 1 / this rank's shard's count (64 / cp), and 1/cp over the 16 tokens; both
    are readings beside a weight, and the verdict is a FAIL only where every one is wrong."""
    e = seen(root(const(1 / 32)), SUM_CP, shapes=(SHARDED,))
    (literal,) = e.readings.literals
    assert [m for _, m in literal.degrees] == ["1/32, this rank's shard's count (64 / cp)", "1/cp / 16"]
    assert {o.loss_power for o in e.readings.outcomes()} == {1.0, 2.0, 0.5}


def test_the_steps_own_division_by_a_degree_is_part_of_its_reduction():
    """`p.grad /= dp * cp` after a sum over the world at dp 2 × cp 2: a change of the gradients the watcher saw on the
    tensors by 1/(cp·dp) (nothing else its value fits): observed, with the sum a mean over every rank. `loss * cp`
    then is right under one reading of its 2 (WARN); a plain loss is wrong, a FAIL made by what was seen."""
    group = StepGroup(rank=0, world=4, ranks=(0, 1), ring=2, ulysses=1, seq=1, index=1, timeout_s=1.0, cp_groups=((0, 1), (2, 3)))
    world = Collective("all_reduce", Op.SUM, (0, 1, 2, 3), True, 0)
    mean_world = GradScale(0.25, "dist.all_reduce over ranks 0, 1, 2, 3 and the end of the watch")
    for loss, verdict in (((const(2.0), mean(64)), Verdict.WARN), ((mean(64),), Verdict.FAIL)):
        e = expectation([EventLog([root(*loss), world, mean_world])], group, OUT, 1, 1, None, (SAME,))
        assert not [lit for lit in e.readings.literals if not lit.on_loss] and e.events_factor == 0.5
        assert "scaled the gradients by 0.25 = 1/cp²" in e.reductions[0].text
        f = step_finding(numbers(dp=2, grads=HALF), e)
        assert f.verdict is verdict, f.diagnosis


def test_the_steps_own_division_by_its_micro_batches_is_read_not_taken_for_a_reduction():
    """`p.grad /= accum` after accumulating 2 micro-batches at CP 2: 0.5 is 1/cp and 1 / the micro-batches, the same
    in one process: read both ways (WARN), never the observed reduction that would FAIL this right step."""
    div = GradScale(0.5, "dist.all_reduce over ranks 0, 1 and the end of the watch")
    e = expectation([EventLog([root(mean(64)), root(mean(64)), SUM_CP, div])], GROUP, OUT, 1, 2, None, (SAME, SAME))
    assert [r.factor for r in e.reductions] == [1.0] and e.readings.literals[0].weight == "the mean over its 2 micro-batches"
    f = step_finding(numbers(grads=HALF), e)
    assert f.verdict is Verdict.WARN and "the 0.5 on the gradients" in f.diagnosis, f.diagnosis
