"""`cpdoctor step FILE:steps --ring 2 --dp 2` with a function that takes its degrees: two runs (the same job
without CP on 2 processes, then with CP on 4), the gradients compared parameter by parameter as each run's clip
found them. Five watched steps in one launch pair (tests/integration/two_run_steps.py): a convention with an
active clip PASSes, the same step without its × cp FAILs with the factor, with or without the clip (the clip
scales both runs to the same norm: compared after it, the 1/cp would hide), a LoRA step on a bf16 base with
accumulation PASSes, weights that differ between the two runs are UNSUPPORTED (never a FAIL blaming CP)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
STEPS = Path(__file__).with_name("two_run_steps.py")


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "cpdoctor", "step", f"{STEPS}:steps", "--ring", "2", "--dp", "2", "--json", "-", "--timeout", "240"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    data["exit"] = proc.returncode
    return data


def _step(report: dict, index: int) -> list[dict]:
    found = [f for f in report["findings"] if f["probe"].startswith(f"training step {index},")]
    assert len(found) == 2, [f["probe"] for f in report["findings"]]  # one per CP group
    return found


def test_the_request_says_two_runs(report):
    assert report["request"]["role"] == "with_cp" and report["request"]["world_size"] == 4
    assert report["exit"] == 1  # the faulty step fails the run


def test_loss_times_cp_with_ddp_over_the_whole_mesh_passes(report):
    for f in _step(report, 1):
        assert f["verdict"] == "PASS" and "the same step run without CP" in f["diagnosis"], f
        assert "the step clipped: clip_grad_norm_(max_norm=0.5)" in f["diagnosis"], f  # the clip acts: it is said


def test_the_mean_over_cp_without_the_factor_fails_with_it(report):
    for f in _step(report, 2):
        assert f["verdict"] == "FAIL" and "factor 1/cp = 0.5" in f["diagnosis"], f


def test_lora_on_a_bf16_base_with_accumulation_passes(report):
    for f in _step(report, 3):
        assert f["verdict"] == "PASS" and "bf16" in f["diagnosis"], f


def test_an_active_clip_never_hides_the_mean_over_cp(report):
    for f in _step(report, 5):
        assert f["verdict"] == "FAIL" and "factor 1/cp = 0.5" in f["diagnosis"], f


def test_weights_that_differ_between_the_runs_are_not_judged(report):
    for f in _step(report, 4):
        assert f["verdict"] == "UNSUPPORTED" and "depend on the CP layout" in f["diagnosis"], f
