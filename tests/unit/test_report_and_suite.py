"""Report rendering and JSON, overall verdicts, and suite validation: no processes."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from cpdoctor.errors import BadInput
from cpdoctor.report import Environment, ExitCode, FailureEvidence, Finding, JudgedRow, Report, RunResult, Verdict, overall, render


def finding(verdict: str, **kw) -> Finding:
    return Finding("attention ring=2", verdict, f"{verdict} diagnosis", "remedy", **kw)


@pytest.mark.parametrize(
    "verdicts,expected",
    [
        (["PASS", "PASS"], (Verdict.PASS, ExitCode.OK)),
        (["PASS", "FAIL"], (Verdict.FAIL, ExitCode.FOUND)),
        (["FAIL", "HANG"], (Verdict.HANG, ExitCode.FOUND)),
        (["HANG", "CRASH"], (Verdict.CRASH, ExitCode.FOUND)),
        (["UNSUPPORTED"], (Verdict.UNSUPPORTED, ExitCode.CANNOT_EXAMINE)),
        (["UNSUPPORTED", "PASS"], (Verdict.PASS, ExitCode.OK)),
        (["WARN", "INFO", "PASS"], (Verdict.WARN, ExitCode.OK)),
    ],
)
def test_overall(verdicts, expected):
    assert overall([finding(v) for v in verdicts]) == expected


def test_json_keys_and_plain_strings():
    row = JudgedRow(2.19, 3.0, 0, worst_rank=1, baseline_rel_err=4e-7, tolerance=1e-6, verdict=Verdict.FAIL)
    before = RunResult.of([finding("FAIL", tensors={"dq": row})])
    report = Report.of(
        [finding("PASS")],
        Environment.from_dict({"torch": "x"}),
        SimpleNamespace(to_dict=lambda: {"ring": 2}),
        before=before,
        wall_s=1.23456,
    )
    data = json.loads(report.to_json())
    assert {"verdict", "exit_code", "environment", "request", "findings", "wall_s", "before"} <= set(data)
    assert data["verdict"] == "PASS" and data["exit_code"] == 0 and data["wall_s"] == 1.235
    assert data["before"]["findings"][0]["tensors"]["dq"]["verdict"] == "FAIL"
    assert set(data["findings"][0]) >= {"probe", "verdict", "diagnosis", "remedy", "tensors", "details", "command"}


def test_render_shows_before_and_after_and_tracebacks():
    from rich.console import Console

    crash = finding("CRASH", failure=FailureEvidence(tracebacks={1: "Traceback (most recent call last): boom"}))
    report = Report.of(
        [finding("PASS", tensors={"dq": JudgedRow(4e-7, 3.0, 0, worst_rank=1, baseline_rel_err=4e-7, tolerance=1e-6)})],
        Environment.from_dict({"torch": "2.x", "world_size": 2}),
        SimpleNamespace(to_dict=dict),
        before=RunResult.of([crash]),
    )
    buf = io.StringIO()
    render(report, Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    assert "before the patch: CRASH" in text and "after the patch: verdict PASS" in text and "ranks 2" in text
    assert "dQ" in text and "4.00e-07" in text
    report2 = Report.of([crash], Environment(), SimpleNamespace(to_dict=dict))
    buf = io.StringIO()
    render(report2, Console(file=buf, width=200, color_system=None))
    assert "--- rank 1 traceback ---" in buf.getvalue() and "boom" in buf.getvalue()


def test_verdict_formats_as_its_value():
    assert f"{Verdict.FAIL}" == "FAIL" and str(Verdict.HANG) == "HANG" and Verdict("PASS") is Verdict.PASS


def _suite(tmp_path, text: str) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text,message",
    [
        ("checks: [", "not valid YAML"),
        ("name: x\n", "non-empty list under 'checks'"),
        ("checks:\n  - attention: {ring: 2}\nextra: 1\n", "unknown top-level keys extra"),
        ("checks:\n  - atention: {ring: 2}\n", "unknown kind 'atention'"),
        ("checks:\n  - fix_training: {ring: 2}\n", "unknown kind 'fix_training'"),
        ("checks:\n  - attention: 2\n", "must be a mapping"),
        ("checks:\n  - {attention: {ring: 2}, model: {}}\n", "must be one mapping"),
    ],
)
def test_malformed_suites_are_bad_input(tmp_path, text, message):
    from cpdoctor import suite

    with pytest.raises(BadInput) as info:
        suite.load(_suite(tmp_path, text))
    assert message in str(info.value)


def test_attention_checks_validate_without_launching(tmp_path):
    from cpdoctor import suite

    loaded = suite.load(_suite(tmp_path, "checks:\n  - attention: {ring: 2, seq: 511}\n"))
    with pytest.raises(BadInput, match="check 1 \\(attention\\): --seq 511 does not divide"):
        suite.build_requests(loaded, patch=False)
    loaded = suite.load(_suite(tmp_path, "checks:\n  - attention: {ring: 3, mask_pad: 3}\n"))
    (req,) = suite.build_requests(loaded, patch=True)
    assert req.kind == "attention" and req.seq == 513 and req.patch is True
