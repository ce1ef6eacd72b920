"""The step examination's rules, fed numbers (no process, no model): each measured relation gives its own
diagnosis and remedy, and the factor is named from the job's degrees, not from the name of a fault."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.examinations.step.judge import GRAD_TOLERANCE, block_of, factor_candidates, step_finding  # noqa: E402
from cpdoctor.examinations.step.measure import (  # noqa: E402
    InputDiff,
    ParamError,
    RankGrad,
    StepNumbers,
    best_factor,
    groups_of,
    input_diffs,
    own_shard_only,
    reference_out_grad,
)
from cpdoctor.examinations.step.record import InputPrint, PeerRecord  # noqa: E402
from cpdoctor.report import Verdict  # noqa: E402

TOL = GRAD_TOLERANCE["fp32"]


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
    )  # fmt: skip
    return dataclasses.replace(base, **over)


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
    f = step_finding(numbers(grads=grads((0.3, 1.3, 1e-7), (0.3, 1.3, 1e-7))))
    assert "exactly" not in f.diagnosis and "gradients are wrong" in f.diagnosis


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


def test_per_shard_loss_names_the_factor():
    n = numbers(out_grad_differ=(1,), out_grad_spread=1.4, out_grad_own_shard=True, grads=grads((1.0, 2.0, 1e-7), (1.0, 2.0, 1e-7)))
    f = step_finding(n)
    assert "covers only its own shard" in f.diagnosis and "= cp = 2" in f.diagnosis
    assert f.remedy.count("compute the loss on the full gathered output") == 1


def test_rng_consumed_unevenly_names_who():
    n = numbers(ranks=(0, 1, 2, 3), ring=4, rng_after_groups=((0, 1, 3), (2,)), grads=grads(*[(1e-7, 1.0, 1e-7)] * 4))
    f = step_finding(n)
    assert f.verdict is Verdict.FAIL and "rank 2 consumed random numbers" in f.diagnosis


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
    assert torch.allclose(reference_out_grad([_rec(0, a), _rec(1, b)]).float(), g / 2)
    assert torch.allclose(reference_out_grad([_rec(0, g), _rec(1, g)]).float(), g)


def test_input_diffs_and_groups():
    r0 = _rec(0, None, inputs=(InputPrint("hidden_states", "aa", 1.0), InputPrint("timestep", "t", None)))
    r1 = _rec(1, None, inputs=(InputPrint("hidden_states", "bb", 1.0), InputPrint("timestep", "t", None)))
    assert input_diffs([r0, r1]) == (InputDiff("hidden_states", (0,), (1,)),)
    assert groups_of(["x", "y", "x"], (0, 1, 2)) == ((0, 2), (1,))


def _rec(rank: int, out_grad, inputs=()) -> PeerRecord:
    return PeerRecord(rank, 1, 1, inputs, "r", "r", out_grad, torch.zeros(1))


def test_a_model_without_cp_is_bad_input():
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.step import model_degrees

    with pytest.raises(BadInput, match="no context parallelism enabled"):
        model_degrees(torch.nn.Linear(2, 2))
