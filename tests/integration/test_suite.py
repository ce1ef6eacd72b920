"""`cpdoctor run SUITE`: the shipped quick suite on the installed release, --patch, and malformed suites."""

from __future__ import annotations

import pytest
from conftest import run_cli, run_cli_many


def test_quick_suite_verdicts(has_stale_kv_backward, tmp_path):
    junit, markdown = tmp_path / "quick.xml", tmp_path / "quick.md"
    run = run_cli("run", "quick", "--json", "-", "--junit", str(junit), "--markdown", str(markdown))
    data = run.json
    # the same run as a CI test report: one testcase per check, FAIL as <failure>, parsed as CI systems do
    junitparser = pytest.importorskip("junitparser")
    (suite,) = list(junitparser.JUnitXml.fromfile(str(junit)))
    errors = [(f["subject"], f["diagnosis"]) for f in data["findings"] if f["verdict"] in ("CRASH", "HANG")]
    assert suite.tests == 5 and suite.failures == sum(f["verdict"] == "FAIL" for f in data["findings"]) and suite.errors == 0, errors
    assert "padding mask" in markdown.read_text() and markdown.read_text().startswith("### cpdoctor run: FAIL (exit 1)")
    verdicts = [f["verdict"] for f in data["findings"]]
    # ring 2, ring 3, Ulysses 2, ring 2 × Ulysses 2, ring 2 with a padding mask
    if has_stale_kv_backward:
        assert verdicts == ["FAIL", "FAIL", "PASS", "FAIL", "FAIL"]
    else:
        assert verdicts == ["PASS", "FAIL", "PASS", "PASS", "FAIL"]
        assert "wrong way round the ring" in data["findings"][1]["diagnosis"]
    assert "padding mask" in data["findings"][4]["diagnosis"]
    assert run.code == data["exit_code"] == 1
    assert data["suite"] == "quick"


@pytest.mark.smoke
def test_patched_suite_side_by_side(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: mini\nchecks:\n  - attention: {ring: 3, dtype: bf16}\n  - attention: {ring: 3, mask_pad: 5}\n")
    run = run_cli("run", str(path), "--patch", "--json", "-")
    data = run.json
    assert [f["verdict"] for f in data["before"]["findings"]] == ["FAIL", "FAIL"]
    assert [f["verdict"] for f in data["findings"]] == ["PASS", "PASS"]
    assert run.code == 0


MALFORMED = [
    ("checks: [attention: {ring: 2}\n", "not valid YAML"),
    ("checks: []\n", "non-empty list under 'checks'"),
    ("checks:\n  - attentoin: {ring: 2}\n", "unknown kind 'attentoin'"),
    ("checks:\n  - attention: {ring: 0}\n", "check 1 (attention): --ring must be at least 1"),
    ("checks:\n  - attention: {rings: 2}\n", "unknown attention-request keys: rings"),
    ("checks:\n  - attention: {ring: 3, seq: 100}\n", "does not divide"),
    ("checks:\n  - model: {model: fluxx, ring: 2}\n", "check 1 (model)"),
    ("name: x\nchekcs: []\n", "unknown top-level keys chekcs"),
    ("checks:\n  - attention: {ring: 2.5}\n", "--ring must be an integer, got 2.5"),
    ("checks:\n  - attention: {ring: 2, heads: 2.0}\n", "--heads must be an integer"),
]


@pytest.fixture(scope="module")
def malformed_runs(tmp_path_factory) -> list:
    """Every malformed suite through the CLI's own entry, in one interpreter (tests/cli_many.py): they end in the
    parent, before any rank starts."""
    tmp = tmp_path_factory.mktemp("malformed")
    paths = []
    for i, (text, _) in enumerate(MALFORMED):
        paths.append(tmp / f"bad{i}.yaml")
        paths[-1].write_text(text)
    return run_cli_many([["run", str(path)] for path in paths])


@pytest.mark.parametrize("index", range(len(MALFORMED)), ids=[words for _, words in MALFORMED])
def test_malformed_suite_is_one_line_and_exit_2(malformed_runs, index):
    run, words = malformed_runs[index], MALFORMED[index][1]
    assert run.code == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_unknown_suite_name():
    run = run_cli("run", "quik", timeout=60)
    assert run.code == 2 and "did you mean quick" in run.stderr


def test_every_shipped_suite_loads():
    from cpdoctor import suite

    names = suite.shipped()
    assert {"quick", "training", "flux", "qwen-image"} <= set(names)
    for name in names:
        loaded = suite.load(name)
        assert loaded.checks and loaded.description
        # attention checks validate without launching anything
        attention = [fields for kind, fields in loaded.checks if kind == "attention"]
        from cpdoctor.api import build_request

        for fields in attention:
            assert build_request(**fields).world_size >= 2
