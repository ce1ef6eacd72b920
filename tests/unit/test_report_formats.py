"""JUnit XML and Markdown renderings of a report, read back with a JUnit parser (junitparser, the schema CI
systems read) rather than compared as strings."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from cpdoctor.report import Environment, FailureEvidence, Finding, JudgedRow, Report, RunResult, Verdict
from cpdoctor.report.junit import to_junit
from cpdoctor.report.markdown import to_markdown

ROW = JudgedRow(1.16, 3.0, 0, worst_rank=1, baseline_rel_err=4.2e-7, tolerance=9.6e-7, verdict=Verdict.FAIL)


def report() -> Report:
    findings = [
        Finding("attention ring=2", Verdict.PASS, "exact", tensors={"dk": replace(ROW, rel_err=4e-7, verdict=Verdict.PASS)}),
        Finding(
            "attention ring=3",
            Verdict.FAIL,
            "the dK/dV accumulator travels the wrong way",
            "cpdoctor.patch()",
            tensors={"dk": ROW},
            command="cpdoctor check --ring 3 --patch",
        ),
        Finding("attention ring=2 backend=flash", Verdict.UNSUPPORTED, "install flash-attn>=2.6.3", "install it"),
        Finding(
            "attention ring=4",
            Verdict.CRASH,
            "rank 1 raised: RuntimeError: boom",
            "read the traceback below",
            failure=FailureEvidence(tracebacks={1: "Traceback (most recent call last):\n  boom"}),
        ),
        Finding("attention ring=2 mask", Verdict.HANG, "rank 1 did not finish within 25 s", "raise --timeout"),
    ]
    return Report.of(findings, Environment.from_dict({"torch": "2.13", "diffusers": "0.42.1"}), SimpleNamespace(to_dict=dict), wall_s=12.5)


def test_junit_parses_with_one_testcase_per_finding(tmp_path):
    junitparser = pytest.importorskip("junitparser")
    path = tmp_path / "r.xml"
    path.write_text(to_junit(report(), "run"))
    xml = junitparser.JUnitXml.fromfile(str(path))
    (suite,) = list(xml)
    assert suite.name == "cpdoctor run" and suite.tests == 5 and suite.failures == 1 and suite.errors == 2 and suite.skipped == 1
    cases = {c.name: c for c in suite}
    assert cases["attention ring=2"].is_passed
    (failure,) = cases["attention ring=3"].result
    assert isinstance(failure, junitparser.Failure) and "wrong way" in failure.message and "1.16e+00" in failure.text
    (error,) = cases["attention ring=4"].result
    assert isinstance(error, junitparser.Error) and "boom" in error.text
    (skipped,) = cases["attention ring=2 backend=flash"].result
    assert isinstance(skipped, junitparser.Skipped) and "flash-attn" in skipped.message
    assert {p.name: p.value for p in suite.properties()}["diffusers"] == "0.42.1"


def test_junit_keeps_the_unpatched_verdict_in_system_out(tmp_path):
    junitparser = pytest.importorskip("junitparser")
    after = Report.of(
        [Finding("attention ring=3", Verdict.PASS, "exact")],
        Environment(),
        SimpleNamespace(to_dict=dict),
        before=RunResult.of([Finding("attention ring=3", Verdict.FAIL, "wrong way")]),
    )
    path = tmp_path / "r.xml"
    path.write_text(to_junit(after, "check"))
    (case,) = list(list(junitparser.JUnitXml.fromfile(str(path)))[0])
    assert case.is_passed and "before the patch: FAIL — wrong way" in case.system_out


def test_markdown_has_a_summary_and_the_failing_tables():
    text = to_markdown(report(), "run")
    assert text.startswith("### cpdoctor run: CRASH (exit 1)")
    assert "| 2 | `attention ring=3` | **FAIL** |" in text
    assert "| dK | 1.16e+00 | 3.00e+00 | 9.60e-07 | 4.20e-07 | 1 | 0 | **FAIL** |" in text
    assert "Look closer: `cpdoctor check --ring 3 --patch`" in text and "<summary>rank 1 traceback</summary>" in text


def test_the_command_renderers_read_every_part_of_the_environment():
    """`cpdoctor env`'s table and Markdown, the doctor's header, a suite's table and every report's environment line,
    fed reports in process (the environment's parts, not a flat bag: a renderer reading a field the wrong way raises)."""
    import io

    from rich.console import Console

    from cpdoctor.cli import doctor as doctor_cli
    from cpdoctor.cli import env as env_cli
    from cpdoctor.cli import run as run_cli
    from cpdoctor.report import environment_line, render
    from cpdoctor.report.sections import DoctorSummary

    facts = {"torch": "2.x", "diffusers": "0.x", "python": "3.x", "device": "cpu", "process_group": "gloo"}
    everything = Environment.from_dict({**facts, "probe_device": "cpu", "probe_dtype": "fp32", "backend": "flash"})
    out = Console(file=io.StringIO(), width=200)
    env_report = Report.of(report().findings, everything, SimpleNamespace(to_dict=dict), backends=(), peers=())
    env_cli.render(env_report, out)
    assert "attention backends on cpu (fp32)" in out.file.getvalue()
    assert "Attention backends on cpu (fp32)" in env_cli.markdown(env_report)
    assert environment_line(everything) == "torch 2.x · diffusers 0.x · device cpu · pg gloo · backend flash"
    doctor_cli._header(everything, DoctorSummary(0, None, "flash", 3, (), ()), out)
    assert "torch 2.x · diffusers 0.x · python 3.x" in out.file.getvalue() and "device cpu · process group gloo" in out.file.getvalue()
    suite = Report.of(report().findings, everything, SimpleNamespace(suite="quick", source="quick.yaml", to_dict=dict))
    run_cli.render_suite(suite, out)
    render(suite, out)
