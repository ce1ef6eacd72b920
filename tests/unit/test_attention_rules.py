"""The op-level diagnosis table fed with numbers: each known defect's error signature names that defect, and
a signature that fits none is described plainly (no process, no diffusers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cpdoctor.errors import Unsupported, UnsupportedKind
from cpdoctor.examinations.attention.judge import RULES, RoutingFacts, attention_finding, check_command, diagnose_attention, signature
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.judging import UNSUPPORTED_REMEDIES, diagnose, judge_row
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.report import TensorRow, Verdict

BASE = 4e-7
ROUTES = RoutingFacts(routes_cp=True, cp_registered=True)


def rows(world: int, **errors: float) -> dict[str, TensorRow]:
    """Measured rows: every tensor at the fp32 baseline unless given, on every rank alike."""
    out = {}
    for name in ("out", "dq", "dk", "dv"):
        err = errors.get(name, BASE)
        out[name] = TensorRow(err, err, 0, worst_rank=0, per_rank_rel_err=(err,) * world, baseline_rel_err=BASE)
    return out


def judged(req: AttentionRequest, facts: RoutingFacts | None = None, **errors: float):
    tensors = {n: judge_row(r, req.dtype) for n, r in rows(req.world_size, **errors).items()}
    return diagnose_attention(req, facts or ROUTES, tensors), tensors


def spoken(req: AttentionRequest, facts: RoutingFacts | None = None, **errors: float) -> list[str]:
    tensors = {n: judge_row(r, req.dtype) for n, r in rows(req.world_size, **errors).items()}
    return [r.name for r in diagnose(RULES, signature(req, facts or RoutingFacts(routes_cp=True, cp_registered=None), tensors))[2]]


def test_tolerance_is_twice_the_baseline_plus_eps():
    row = judge_row(rows(2)["out"], "fp32")
    assert row.tolerance == pytest.approx(2 * BASE + 2.0**-23)
    assert row.verdict == Verdict.PASS
    assert judge_row(replace(rows(2)["out"], rel_err=1.1e-6, per_rank_rel_err=(1.1e-6,) * 2), "fp32").verdict == Verdict.FAIL


def test_one_bad_rank_fails_even_when_the_whole_is_fine():
    row = replace(rows(2)["dk"], per_rank_rel_err=(BASE, 1e-3))
    judged_row = judge_row(row, "fp32")
    assert judged_row.verdict == Verdict.FAIL and judged_row.bad_ranks == (1,)


def test_exact_is_pass_with_no_remedy():
    (diagnosis, remedy), _ = judged(AttentionRequest(ring=2))
    assert "match the full-sequence reference" in diagnosis and remedy == ""


def test_dq_exact_dkdv_wrong_at_ring3_is_the_direction():
    req = AttentionRequest(ring=3, seq=513)
    (diagnosis, remedy), _ = judged(req, dk=1.16, dv=0.93)
    assert "wrong way round the ring" in diagnosis and "ring degree 3" in diagnosis and "on all 3 ranks" in diagnosis
    assert remedy.startswith("cpdoctor.patch()") and "ring_degree ≤ 2" in remedy
    assert spoken(req, dk=1.16, dv=0.93) == ["dK/dV direction"]


def test_same_numbers_at_ring2_are_not_the_direction():
    """At ring 2 both directions agree, so dK/dV alone wrong there is something else."""
    (diagnosis, _), _ = judged(AttentionRequest(ring=2), dk=1.0, dv=0.8)
    assert "wrong way" not in diagnosis and "backward wrong" in diagnosis


def test_dq_wrong_under_ring_is_stale_kv():
    (diagnosis, remedy), _ = judged(AttentionRequest(ring=2), dq=2.19, dk=1.71, dv=1.50)
    assert "stale iteration-0" in diagnosis and "forward exact" in diagnosis
    assert "upgrade diffusers" in remedy


def test_forward_wrong_with_mask_is_the_unrotated_mask():
    (diagnosis, remedy), _ = judged(AttentionRequest(ring=2, mask_pad=3), out=7.4e-2, dq=7e-2, dk=7e-2, dv=7e-2)
    assert "rotating the mask" in diagnosis and "Ulysses-only CP" in remedy
    assert "backward" not in diagnosis  # gradients follow the wrong forward: not a defect of their own


def test_backend_that_ignores_cp():
    facts = RoutingFacts(name="_native_math", routes_cp=False, cp_registered=False)
    (diagnosis, remedy), _ = judged(AttentionRequest(ring=2), facts, out=0.98, dq=0.9, dk=0.9, dv=0.9)
    assert "_native_math ignores the parallel config" in diagnosis and "not registered as CP-capable" in diagnosis
    assert "CP-capable backend" in remedy


def test_nonfinite_values_are_named():
    req = AttentionRequest(ring=2)
    tensors = {n: judge_row(r, "fp32") for n, r in rows(2).items()}
    tensors["dq"] = judge_row(replace(rows(2)["dq"], nonfinite=5, rel_err=float("inf"), per_rank_rel_err=(float("inf"),) * 2), "fp32")
    diagnosis, _ = diagnose_attention(req, RoutingFacts(routes_cp=True), tensors)
    assert "5 non-finite values" in diagnosis


def test_finding_carries_the_command_to_look_closer():
    req = AttentionRequest(ring=3, seq=513)
    m = Measurement("cpdoctor_cpu", RoutingFacts(routes_cp=True), {}, rows(3, dk=1.1, dv=0.9))
    finding = attention_finding(req, m)
    assert finding.verdict == Verdict.FAIL and finding.command == "cpdoctor check --ring 3 --patch"  # seq 513 is the default at ring 3
    assert (
        check_command(AttentionRequest(ring=2, ulysses=2, mask_pad=3, dtype="bf16"))
        == "cpdoctor check --ring 2 --ulysses 2 --dtype bf16 --mask-pad 3"
    )


def test_unsupported_has_a_remedy():
    no_lse = Unsupported(UnsupportedKind.NO_LSE, "native has no LSE, and ring attention needs one")
    finding = attention_finding(AttentionRequest(ring=2), Measurement("native", unsupported=no_lse))
    assert finding.verdict == Verdict.UNSUPPORTED and "backend with an LSE" in finding.remedy


def test_every_kind_of_unsupported_has_its_own_remedy():
    assert set(UNSUPPORTED_REMEDIES) == set(UnsupportedKind) and all(UNSUPPORTED_REMEDIES.values())
