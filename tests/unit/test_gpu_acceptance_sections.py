"""benchmarks/gpu_acceptance.py's section runner: a section that raises, or outlives its time budget, is a row
with its error and the run goes on (the lent GPU's 10 minutes must not end in a traceback and no table)."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "gpu_acceptance.py")


@pytest.fixture(scope="module")
def acceptance():
    spec = importlib.util.spec_from_file_location("_cpdoctor_test_gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_section_is_a_row_with_its_error(acceptance):
    def body(section):
        section.add({"backend": "x", "verdict": "PASS"})
        raise RuntimeError("kernel refused")

    result = acceptance.run_section("peers", 30, body)
    assert [r.get("verdict") for r in result["rows"]] == ["PASS", None]
    assert result["rows"][-1]["error"] == "RuntimeError: kernel refused"
    assert all(r["section"] == "peers" for r in result["rows"])


def test_a_section_past_its_budget_is_stopped_and_says_so(acceptance):
    def body(section):
        section.add({"seq": 1})
        time.sleep(5)
        section.add({"seq": 2})

    t0 = time.perf_counter()
    result = acceptance.run_section("ring", 0.3, body)
    assert time.perf_counter() - t0 < 2
    assert result["rows"][0] == {"section": "ring", "seq": 1}
    assert "time budget of 0 s spent" in result["rows"][-1]["error"] and len(result["rows"]) == 2


def test_the_budgets_fit_ten_minutes(acceptance):
    assert set(acceptance.BUDGET_S) == set(acceptance.SECTIONS)
    assert sum(acceptance.BUDGET_S.values()) <= 540  # 600 s for the device call, less start and the carry's unpacking
