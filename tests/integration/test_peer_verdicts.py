"""Peers on real gloo ranks: ring-flash-attn, yunchang and torch's context_parallel through cpdoctor's kernel
stand-ins, forward and backward, every rank against the fp64 reference. One launch per world size (several
cases each, mixed implementations: a launch costs seconds, a case a fraction of one), so the whole file stays
around a minute on 2 cores. Skips what is not installed (`pip install 'cpdoctor[peers]'`)."""

from __future__ import annotations

import pytest

from cpdoctor import launch
from cpdoctor.examinations.peer import EXAMINATION
from cpdoctor.examinations.peer.request import build_request
from cpdoctor.launch.jobs import Case, Job
from cpdoctor.peers.source import package_root
from cpdoctor.report import Finding, Verdict

RFA = package_root("ring_flash_attn") is not None
YUNCHANG = package_root("yunchang") is not None
TIMEOUT = 240.0

T, R, Y = "torch", "ring-flash-attn", "yunchang"

CASES: dict[int, list[dict]] = {
    2: [
        dict(impl=T, kernel="flash", causal=True),
        dict(impl=T, kernel="cudnn", causal=False, variant="alltoall"),
        dict(impl=T, kernel="efficient", causal=True, dtype="fp32"),  # blocks of 60: not a multiple of 32
        dict(impl=R, variant="basic", causal=False),
        dict(impl=R, variant="zigzag", causal=True),
        dict(impl=R, variant="stripe", causal=True),
        dict(impl=R, variant="basic", causal=False, dtype="fp16"),  # dQ returned in bf16
        dict(impl=Y, ring=1, ulysses=2, causal=False),  # the self-send shim
    ],
    3: [
        dict(impl=T, kernel="flash", causal=True),
        dict(impl=T, kernel="cudnn", causal=True),
        dict(impl=R, variant="basic", causal=True),
        dict(impl=R, variant="zigzag", causal=True),
        dict(impl=R, variant="stripe", causal=True),
        dict(impl=R, variant="llama3", causal=True),
    ],
    4: [
        dict(impl=T, kernel="flash", causal=True),
        dict(impl=T, kernel="cudnn", causal=False),
        dict(impl=R, variant="basic", causal=False),
        dict(impl=R, variant="zigzag", causal=True),
        dict(impl=R, variant="stripe", causal=True),
        dict(impl=Y, ring=2, ulysses=2, causal=False),
        dict(impl=Y, ring=4, causal=True),
    ],
}


def _installed(fields: dict) -> bool:
    return {R: RFA, Y: YUNCHANG}.get(fields["impl"], True)


def _request(world: int, fields: dict):
    fields = dict(fields)
    if "ulysses" not in fields:
        fields["ring"] = world
    return build_request(**fields)


@pytest.fixture(scope="module")
def findings() -> dict[tuple[int, int], Finding]:
    """Every case's finding, keyed by (world, index in CASES[world]); one launch per world size."""
    found = {}
    for world, cases in CASES.items():
        chosen = [(i, Case(_request(world, f))) for i, f in enumerate(cases) if _installed(f)]
        result = launch.run(Job(EXAMINATION, tuple(c for _, c in chosen), "cpu", TIMEOUT), world)
        assert result.bad_input is None and result.cannot_examine is None
        for (i, case), outcome in zip(chosen, result.outcomes):
            if outcome.completed:
                found[world, i] = EXAMINATION.finding(case, outcome.evaluated)
            else:
                found[world, i] = EXAMINATION.failure_findings(case, outcome.failures, TIMEOUT)[0]
    return found


def _get(findings, world, index) -> Finding:
    if not _installed(CASES[world][index]):
        pytest.skip(f"{CASES[world][index]['impl']} is not installed")
    return findings[world, index]


EXPECT_PASS = [(w, i) for w, cases in CASES.items() for i, f in enumerate(cases) if (w, i) not in {(2, 2), (2, 6)}]


@pytest.mark.parametrize(("world", "index"), EXPECT_PASS, ids=[f"{w}-{CASES[w][i]['impl']}-{i}" for w, i in EXPECT_PASS])
def test_targets_pass(findings, world, index):
    f = _get(findings, world, index)
    assert f.verdict is Verdict.PASS, f"{f.subject}: {f.diagnosis}"
    assert set(f.tensors) >= {"out", "dq", "dk", "dv"}
    assert "CUDA kernels emulated on CPU" in f.emulated


def test_every_rank_is_measured_by_token_index(findings):
    f = _get(findings, 4, 3)  # ring-flash-attn zigzag ring 4: the layout that scatters tokens most
    assert len(f.tensors["dk"].per_rank_rel_err) == 4 and "lse" in f.tensors
    assert f.evidence.layout == "zigzag"


def test_ring_flash_attn_basic_returns_dq_in_bf16_in_an_fp16_run(findings):
    f = _get(findings, 2, 6)
    assert f.verdict is Verdict.FAIL
    assert {n for n, row in f.tensors.items() if row.failed} == {"dq"}
    assert "return dq.to(torch.bfloat16)" in f.diagnosis and "ring_flash_attn/ring_flash_attn.py:" in f.diagnosis


def test_torch_efficient_kernel_crashes_on_blocks_not_a_multiple_of_32(findings):
    f = _get(findings, 2, 2)
    assert f.verdict is Verdict.CRASH
    assert "LSE padded to 32" in f.diagnosis and "_context_parallel/_attention.py:" in f.diagnosis
    assert f.command is not None and "--kernel efficient" in f.command


def test_every_shim_is_reported(findings):
    assert "Shimmed: CUDA SDPA routing" in _get(findings, 2, 0).emulated
    yunchang = _get(findings, 2, 7)
    assert "self-send as local copy" in yunchang.emulated and any(s.acted > 0 for s in yunchang.evidence.shims)
    rfa = _get(findings, 2, 3)
    assert "HF adapter stubbed" in rfa.emulated or "Nothing shimmed" in rfa.emulated
