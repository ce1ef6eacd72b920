"""`preflight(model=...)`: the job's degrees come from the model, the attention examination runs with them, and
the first training step is armed with a judge that stops a wrong step (the step examination itself is tested
on gloo ranks in tests/integration/test_step_targets.py; here only the wiring, with the examinations stubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cpdoctor import api
from cpdoctor.examinations import step
from cpdoctor.report import Environment, Finding, Report, Verdict


def report(verdict: Verdict) -> Report:
    return Report.of([Finding("x", verdict, f"{verdict} diagnosis")], Environment(), SimpleNamespace(to_dict=dict))


def test_preflight_with_a_model_reads_its_degrees_and_arms_the_first_step(monkeypatch):
    asked, armed = {}, []
    monkeypatch.setattr(step, "model_degrees", lambda model: (3, 2))
    monkeypatch.setattr(step, "arm_first_step", lambda model, judge, **options: armed.append((model, judge)))

    def check(**fields):
        asked.update(fields)
        return report(Verdict.PASS)

    monkeypatch.setattr(api, "check_attention", check)
    model = object()
    assert api.preflight(model=model).verdict is Verdict.PASS
    assert (asked["ring"], asked["ulysses"]) == (3, 2)
    ((armed_model, judge),) = armed
    assert armed_model is model
    judge(report(Verdict.PASS))  # a right step goes on
    with pytest.raises(api.PreflightFailed, match="the first CP training step does not match one process — FAIL"):
        judge(report(Verdict.FAIL))
    with pytest.warns(UserWarning, match="could not be examined"):
        judge(report(Verdict.UNSUPPORTED))
    with pytest.warns(UserWarning, match="could not be examined"):  # cpdoctor's own crash: the job goes on
        judge(report(Verdict.CRASH))
    with pytest.warns(UserWarning, match="first training step: WARN diagnosis"):  # two readings: said, not stopped
        judge(report(Verdict.WARN))


def test_preflight_without_watching_the_first_step_arms_nothing(monkeypatch):
    armed = []
    monkeypatch.setattr(step, "model_degrees", lambda model: (2, 1))
    monkeypatch.setattr(step, "arm_first_step", lambda model, judge, **options: armed.append(judge))
    monkeypatch.setattr(api, "check_attention", lambda **fields: report(Verdict.PASS))
    api.preflight(model=object(), watch_first_step=False)
    assert armed == []
