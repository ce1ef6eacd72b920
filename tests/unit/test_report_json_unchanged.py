"""A report's JSON is a contract (README): the doctor's and a check's reports, built from fed findings and numbers
(no process), serialise to exactly the JSON that cpdoctor wrote before `Finding` was frozen (the files under
tests/unit/golden/ were written by this module's `reports()` at that commit, 2fe9154, and are compared whole;
rewritten once since, when issue 30 added what it documents, and diffed key by key: the request's `checkpointing`
key and the doctor's sixth check, ring 2 under checkpointing, nothing else).

Every place that used to change a finding after building it is on the way: the doctor's `command`, a failure
finding's `emulated` (attention) and `command` (peer), the runner's per-case `environment`, and `Report.of`'s."""

from __future__ import annotations

import json
import pathlib

from cpdoctor import doctor
from cpdoctor.compat.backends import BackendFacts
from cpdoctor.examinations import registry, runner
from cpdoctor.examinations.attention.judge import attention_finding
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.peer.request import build_request as peer_request
from cpdoctor.launch.jobs import Case, CaseOutcome, FailureKind, RankFailure
from cpdoctor.report import Finding, Report, RunResult, TensorRow, Verdict
from cpdoctor.report.environment import Environment
from cpdoctor.suite import SuiteRequest, build_requests
from cpdoctor.vocabulary import Kind

GOLDEN = pathlib.Path(__file__).parent / "golden"
ENV = Environment(torch="2.x", diffusers="0.x", device="cpu", world_size=2)
BASE = 4e-7


def _rows(world: int, **errors: float) -> dict[str, TensorRow]:
    return {
        n: TensorRow(
            errors.get(n, BASE),
            errors.get(n, BASE),
            0,
            worst_rank=0,
            per_rank_rel_err=(errors.get(n, BASE),) * world,
            baseline_rel_err=BASE,
        )
        for n in ("out", "dq", "dk", "dv")
    }


def _check_report() -> Report:
    """`cpdoctor check --ring 3`: a FAIL judged from numbers, a CRASH of an emulated case, a peer's CRASH, each case's
    findings through the runner (which sets where they ran), the report through `Report.of`."""
    req = AttentionRequest(ring=3, seq=513)
    facts = BackendFacts(
        "cpdoctor_cpu", registered=True, cp_registered=True, routes_cp=True, runs_here=True, returns_lse=True, has_backward=True
    )
    measured = Measurement("cpdoctor_cpu", facts, ENV, _rows(3, dk=1.16, dv=0.93))
    judged = attention_finding(req, measured)
    crash = [RankFailure(1, FailureKind.CRASH, "RuntimeError: boom", "Traceback (most recent call last):\n  RuntimeError: boom\n")]
    emulated = Case(AttentionRequest(ring=2, backend="flash", emulate=True))
    attention_crash = runner.outcome_findings_in(CaseOutcome(emulated, failures=crash), timeout_s=60.0)
    peer = Case(peer_request(impl="ring-flash-attn", ring=2))
    peer_crash = registry.get(Kind.PEER).failure_findings(peer, crash, 60.0)
    return Report.of([judged, *attention_crash, *peer_crash], ENV, req)


def _doctor_report(monkeypatch, patch: bool) -> Report:
    """The doctor on a CPU (no accelerator, no peer), its suite answered by fed findings: the diffusers checks at
    ring 3 fail (before the fix too), the others pass; with `patch` every check passes after the fix."""

    def run_suite(suite, *, patch: bool, timeout_s: float, on_tick=None) -> Report:  # api.run_suite, answered
        def finding(req, fixed: bool) -> Finding:
            bad = req.ring == 3 and not fixed
            verdict = Verdict.FAIL if bad else Verdict.PASS
            return Finding(
                f"check ring {req.ring}", verdict, "dK/dV wrong" if bad else "exact", environment=ENV.replace(backend="cpdoctor_cpu")
            )

        requests = build_requests(suite, patch)
        after = [finding(r, fixed=patch) for r in requests]
        before = RunResult.of([finding(r, fixed=False) for r in requests]) if patch else None
        request = SuiteRequest(suite.name, suite.source, patch, tuple(requests))
        return Report.of(after, ENV, request, before=before, extra={"suite": suite.name})

    monkeypatch.setattr("cpdoctor.api.run_suite", run_suite)
    monkeypatch.setattr(doctor, "_torchrun_world", lambda: None)
    monkeypatch.setattr(doctor, "peer_checks", lambda device="auto": ())
    return doctor.run_doctor(patch=patch, accelerators=0)


def reports(monkeypatch) -> dict[str, str]:
    """name -> the report's JSON, as `--json` writes it (the versions installed here read as "x", so that both CI
    environments compare the same text)."""
    monkeypatch.setattr(runner, "installed_version", lambda name: "x")
    monkeypatch.setattr(runner.platform, "python_version", lambda: "3.x")
    monkeypatch.setattr(runner, "visible_gpus", lambda: 0)
    return {
        "check.json": _check_report().to_json(),
        "doctor.json": _doctor_report(monkeypatch, patch=False).to_json(),
        "doctor_patch.json": _doctor_report(monkeypatch, patch=True).to_json(),
    }


def test_the_json_of_a_check_and_of_the_doctor_is_what_it_was(monkeypatch):
    for name, text in reports(monkeypatch).items():
        assert json.loads(text) == json.loads((GOLDEN / name).read_text()), name
