"""The step examination's rules, fed numbers (no process, no model): each measured relation gives its own
diagnosis and remedy, and the factor is named from the job's degrees, not from the name of a fault."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.examinations.step.judge import block_of, factor_candidates, step_finding  # noqa: E402
from cpdoctor.examinations.step.loss_graph import Factor, LossReading  # noqa: E402
from cpdoctor.examinations.step.measure import (  # noqa: E402
    InputDiff,
    ParamError,
    RankGrad,
    StepNumbers,
    best_factor,
    groups_of,
    input_diffs,
    own_shard_only,
    reference_out_grads,
)
from cpdoctor.examinations.step.readings import round_norm  # noqa: E402
from cpdoctor.examinations.step.record import InputPrint, PeerRecord  # noqa: E402
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
        out_grad_own_shard=False, out_rel_err=2e-7, out_max_abs=1e-7, grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)), peer_spread=0.0,
        sum_rel_err=1.0, params=(ParamError("x_embedder.weight", 1e-7, 8), ParamError("transformer_blocks.0.attn.to_q.weight", 1e-7, 8)),
        out_numel=64, grad_norm=3.7182818,
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
def test_constant_factor_is_named_from_the_degrees(cp, dp, factor, text, cause):
    n = numbers(ring=cp, dp=dp, ranks=tuple(range(cp)), grads=grads(*[(abs(factor - 1), factor, 1e-7)] * cp))
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL
    assert f"factor {text} = {factor:g}" in f.diagnosis and cause in f.diagnosis
    assert f.remedy
    assert "first bad parameter" not in f.diagnosis  # every parameter is off by the factor: no place to name


def test_a_factor_that_is_not_one_of_the_degrees_is_not_a_reduction():
    """A uniform 1.3×: no misplaced reduction over this job's ranks gives it; the one-run watcher cannot say
    whether the step applied it on purpose, so it says so in a WARN instead of stopping the job."""
    f = step_finding(numbers(grads=grads((0.3, 1.3, 1e-7), (0.3, 1.3, 1e-7))))
    assert f.verdict is Verdict.WARN and "not a misplaced reduction" in f.diagnosis and "gradients are wrong" not in f.diagnosis


def test_peers_differ_after_sync_is_the_missing_cp_reduction():
    n = numbers(grads=grads((0.5, 0.5, 0.6), (0.5, 0.5, 0.6)), peer_spread=0.8, sum_rel_err=1e-7)
    f = step_finding(n)
    assert "reduction over the CP group (ranks 0, 1) is missing" in f.diagnosis
    assert "summed over the CP group they are the expected" in f.diagnosis
    assert "all_reduce" in f.remedy


def test_each_group_with_its_own_gradients_is_the_missing_dp_averaging():
    n = numbers(dp=2, grads=grads((0.3, 0.9, 0.25), (0.3, 0.9, 0.25)), own_rel_err=1e-7)
    f = step_finding(n)
    assert "averaging over the data-parallel ranks is missing" in f.diagnosis and "data-parallel" in f.remedy
    assert "first bad parameter" not in f.diagnosis


def test_output_gradients_differ_is_the_loss():
    n = numbers(out_grad_differ=(1,), out_grad_spread=0.4, grads=grads((0.2, 0.9, 0.1), (0.2, 0.9, 0.1)))
    f = step_finding(n)
    assert "loss is computed differently on each rank" in f.diagnosis and "rank 1" in f.diagnosis
    assert "full (gathered) model output" in f.remedy


SHARD = {"out_grad_differ": (1,), "out_grad_spread": 1.4, "out_grad_own_shard": True}


def test_per_shard_loss_normalised_by_its_shard_names_the_factor():
    """The graph shows a mean over exactly the local shard: the shards' sum weighs the loss cp× one process's."""
    n = numbers(**SHARD, loss=(LossReading((), "mean", 32),), grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)))
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL
    assert "covers only its own shard" in f.diagnosis and "factor cp = 2" in f.diagnosis and "normalised by the local shard" in f.diagnosis
    assert f.remedy.count("compute the loss on the full gathered output") == 1


def test_per_shard_loss_normalised_by_the_full_count_passes():
    n = numbers(**SHARD, loss=(LossReading((Factor(1 / 64, True),), "sum"),), grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)))
    assert step_finding(n).verdict is Verdict.PASS


def test_per_shard_loss_with_a_normaliser_the_graph_hides_is_two_readings():
    n = numbers(**SHARD, loss=(LossReading(()),), grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)))
    f = step_finding(n)
    assert f.verdict is Verdict.WARN and "cannot tell which reading" in f.diagnosis and "loss_scale" in f.remedy


def test_loss_times_cp_then_mean_over_cp_is_the_convention():
    """NeMo Automodel / SimpleTuner: loss × cp, then a mean over the CP ranks: exactly 1/cp of the reference."""
    n = numbers(loss=(LossReading((Factor(2.0, True),), "mean", 64),), grads=grads((0.5, 0.5, 1e-7), (0.5, 0.5, 1e-7)))
    f = step_finding(n)
    assert f.verdict is Verdict.PASS and "multiplied by 2 = cp" in f.diagnosis


def test_mean_over_cp_without_the_factor_is_a_bug():
    n = numbers(loss=(LossReading((), "mean", 64),), grads=grads((0.5, 0.5, 1e-7), (0.5, 0.5, 1e-7)))
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL and "factor 1/cp" in f.diagnosis


def test_loss_times_cp_summed_over_cp_is_two_readings_not_a_fail():
    n = numbers(loss=(LossReading((Factor(2.0, True),), "mean", 64),), grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)))
    f = step_finding(n)
    assert f.verdict is Verdict.WARN and "cannot tell which reading" in f.diagnosis


def test_explicit_loss_scale_decides():
    n = numbers(loss_scale=2.0, grads=grads((0.5, 0.5, 1e-7), (0.5, 0.5, 1e-7)))
    assert step_finding(n).verdict is Verdict.PASS
    n = numbers(loss_scale=2.0, grads=grads((1e-7, 1.0, 1e-7), (1e-7, 1.0, 1e-7)))
    assert step_finding(n).verdict is Verdict.FAIL


def test_grad_scaler_unscaled_before_the_read_passes():
    n = numbers(loss=(LossReading((Factor(65536.0, False),), "mean", 64),), grads=grads(*[(1.0, 1 / 65536, 1e-7)] * 2))
    f = step_finding(n)
    assert f.verdict is Verdict.PASS and "GradScaler" in f.diagnosis


def test_clipped_gradients_pass_and_an_unround_uniform_factor_warns():
    clipped = numbers(grads=grads(*[(0.7, 0.3, 1e-7)] * 2), grad_norm=1.0000001)
    f = step_finding(clipped)
    assert f.verdict is Verdict.PASS and "clipped" in f.diagnosis
    odd = numbers(grads=grads(*[(0.7, 0.3, 1e-7)] * 2), grad_norm=1.2345678)
    assert step_finding(odd).verdict is Verdict.WARN
    hidden = numbers(grads=grads(*[(0.5, 0.5, 1e-7)] * 2), grad_norm=1.0000001)  # 1/cp on gradients of norm 1.0
    f = step_finding(hidden)
    assert f.verdict is Verdict.WARN and "clip_grad_norm_(max_norm=1)" in f.diagnosis and "averaged over the CP ranks" in f.diagnosis
    assert round_norm(0.5) == 0.5 and round_norm(1.2345678) is None and round_norm(0.010000003) == pytest.approx(0.01)


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
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.step import model_degrees

    with pytest.raises(BadInput, match="no context parallelism enabled"):
        model_degrees(torch.nn.Linear(2, 2))
