"""A report's JSON is a contract (README): the doctor's and a check's reports, built from fed findings and numbers
(no process), serialise to exactly the JSON that cpdoctor wrote before `Finding` was frozen (the files under
tests/unit/golden/ were written by this module's `reports()` at that commit, 2fe9154, and are compared whole;
rewritten once since, when issue 30 added what it documents, and diffed key by key: the request's `checkpointing`
key and the doctor's sixth check, ring 2 under checkpointing, nothing else). A report of each typed section
(report/sections.py: a check's warnings, advice and upstream fix, a suite's name, env's backends and peers, a
plan) serialises to the text main (954b298) wrote for the same ingredients through `Report.extra`
(golden/sections_*.json).

Every place that used to change a finding after building it is on the way: the doctor's `command`, a failure
finding's `emulated` (attention) and `command` (peer), the runner's per-case `environment`, and `Report.of`'s; and
every place that changed a report after building it: the doctor (which builds its own from the suite's run) and
`--repro` (whose upstream fix is a field given to the report it builds)."""

from __future__ import annotations

import json
import pathlib

from cpdoctor import doctor
from cpdoctor.compat.backends import BackendFacts
from cpdoctor.examinations import registry, runner
from cpdoctor.examinations.attention.judge import attention_finding
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.env.backend_table import BackendRow, Cell, OpProbe
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.peer.request import build_request as peer_request
from cpdoctor.examinations.runner import SuiteRun
from cpdoctor.launch.jobs import Case, CaseOutcome, FailureKind, RankFailure
from cpdoctor.model_zoo.splits.measure import SplitKind
from cpdoctor.model_zoo.splits.result import HeadsCheck, Plan, Problem, Remedy, SkippedRow, SplitRow
from cpdoctor.peer_impls.installed import PeerInfo
from cpdoctor.report import Finding, Report, TensorRow, Verdict
from cpdoctor.report.environment import AttentionBackend, Environment
from cpdoctor.report.sections import UpstreamFixOutcome
from cpdoctor.suite import SuiteRequest, build_requests
from cpdoctor.vocabulary import Kind

GOLDEN = pathlib.Path(__file__).parent / "golden"
ENV = Environment.from_dict({"torch": "2.x", "diffusers": "0.x", "device": "cpu", "world_size": 2})
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

    def examine_suite(suite, *, patch: bool, timeout_s: float, on_tick=None):  # api.examine_suite, answered
        def finding(req, fixed: bool) -> Finding:
            bad = req.ring == 3 and not fixed
            verdict = Verdict.FAIL if bad else Verdict.PASS
            return Finding(
                f"check ring {req.ring}",
                verdict,
                "dK/dV wrong" if bad else "exact",
                environment=ENV.replace(attention=AttentionBackend("cpdoctor_cpu")),
            )

        requests = build_requests(suite, patch)
        after = [finding(r, fixed=patch) for r in requests]
        before = [finding(r, fixed=False) for r in requests] if patch else None
        return SuiteRequest(suite.name, suite.source, patch, tuple(requests)), SuiteRun(after, before, ENV, 0.0, 3)

    monkeypatch.setattr("cpdoctor.api.examine_suite", examine_suite)
    monkeypatch.setattr(doctor, "_torchrun_world", lambda: None)
    monkeypatch.setattr(doctor, "peer_checks", lambda device="auto": ())
    return doctor.run_doctor(patch=patch, accelerators=0)


# ---------------------------------------------------------------------------------------------------- sections
# The reports of each typed section (report/sections.py), built from the same ingredients as main (954b298) built
# them through `Report.extra` (its runner's `warnings_seen`, repro's dict, env's and plan's rows): the
# sections_*.json files under golden/ are what main wrote.

SECTION_REQ = AttentionRequest(ring=3, seq=513)
SECTION_FINDINGS = [Finding("check ring 3", Verdict.FAIL, "dK/dV wrong", "cpdoctor check --ring 3 --patch")]
WARNINGS = {"UserWarning: the ring saw a mask": 3, "FutureWarning: an old name": 1}
ADVICE = ("set OMP_NUM_THREADS to 1 per rank",)
FIX = ("the fix verified: ring 3 passes on a patched copy", "/tmp/repro/fix.diff")


def backend_rows():
    ok = BackendFacts(
        "cpdoctor_cpu", registered=True, cp_registered=True, routes_cp=True, runs_here=True, returns_lse=True, has_backward=True
    )
    op = OpProbe(
        measured_on="cpu",
        saved_lse=True,
        grad_shapes_ok=True,
        grad_shapes=[[1, 16, 2, 32]] * 3,
        rel_err={"out": 1e-7, "dq": 2e-7, "dk": 2e-7, "dv": 2e-7},
        tolerance=1e-6,
        rng_advanced=False,
    )
    missing = BackendFacts("flash", registered=True, requirement_error="flash-attn is not installed")
    return [
        BackendRow("cpdoctor_cpu", ok, True, op, Cell(True), Cell(True), Cell(True)),
        BackendRow("flash", missing, True, None, Cell(False, "not installed"), Cell(False, "not installed"), Cell(None)),
    ]


def peers():
    return [
        PeerInfo(
            "ring-flash-attn",
            "ring-flash-attn",
            "0.1.x",
            "0.1.x",
            "pip install ring-flash-attn",
            ("basic", "zigzag"),
            ("flash",),
            False,
            ("basic",),
        ),
        PeerInfo("yunchang", "yunchang", "0.6.x", None, "pip install yunchang", ("ring",), ("fa",), True, ()),
    ]


def plan():
    settings = {"height": 1328, "width": 1328, "text_len": 77, "frames": None, "ring": 2, "ulysses": 1, "world_size": 2, "forwards": 3}
    tensors = [
        SplitRow("hidden_states", "", SplitKind.SPLIT, 1, 6889, 3444.5, False, 1, ["resolution"]),
        SplitRow("proj_out:output", "proj_out", SplitKind.GATHER, 1, 6889, 3444.5, False, 1),
    ]
    problem = Problem(
        "image tokens: 6889 do not divide by 2",
        ["hidden_states"],
        [
            Remedy("resolution", "1344x1328", True, {"height": 1344, "width": 1328}),
            Remedy("ring_anything", "ContextParallelConfig(...)", False, {}),
        ],
    )
    p = Plan(
        {"short_name": "qwen-image", "class_name": "QwenImageTransformer2DModel"},
        settings,
        tensors,
        [SkippedRow("txt_ids", "not split at these settings")],
        [HeadsCheck(24, 24, 1, True, "config")],
        [problem],
        ["a note"],
        0.12345,
    )
    return p


def section_reports() -> dict[str, Report]:
    """name -> a report with each section: a check's (the ranks' warnings and advice, --repro's upstream fix), a
    suite's (its name, its warnings), env's (backend and peer rows), a plan's (its own keys)."""
    items = list(WARNINGS.items())
    outcomes = [CaseOutcome(Case(SECTION_REQ), warnings=dict(items[:1])), CaseOutcome(Case(SECTION_REQ), warnings=dict(items[1:]))]
    warnings = runner.warnings_seen(outcomes)
    check = Report.of(
        SECTION_FINDINGS, ENV, SECTION_REQ, wall_s=1.5, warnings=warnings, advice=ADVICE, upstream_fix=UpstreamFixOutcome(True, *FIX)
    )
    request = SuiteRequest("quick", "quick.yaml", False, (SECTION_REQ,))
    suite = Report.of(SECTION_FINDINGS, ENV, request, suite="quick", warnings=warnings)
    env = Report.of([], ENV, SECTION_REQ, backends=tuple(backend_rows()), peers=tuple(peers()))
    measured = plan()
    planned = Report.of([], ENV, SECTION_REQ, wall_s=measured.seconds, plan=measured)
    return {"sections_check.json": check, "sections_suite.json": suite, "sections_env.json": env, "sections_plan.json": planned}


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
        **{name: report.to_json() for name, report in section_reports().items()},
    }


def test_the_json_of_a_check_and_of_the_doctor_is_what_it_was(monkeypatch):
    for name, text in reports(monkeypatch).items():
        assert json.loads(text) == json.loads((GOLDEN / name).read_text()), name
