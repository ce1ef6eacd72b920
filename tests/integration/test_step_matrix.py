"""The step matrix against ground truth nobody typed: every variant of tests/integration/step_matrix.py (loss
spellings, reductions, clipping, GradScaler, accumulation, dtypes, compile) runs once with CP on 4 gloo ranks inside
`cpdoctor.watch_step`, and once in one process per data-parallel replica without CP. Each variant's expected
verdict comes from comparing the two runs' gradients before clipping: equal within the dtype's tolerance → the
watcher must PASS; not equal → it must FAIL, or WARN where the variant holds something the watcher cannot read
(and the WARN must say so); non-finite in one process too (the GradScaler's first step overflowed) → not
examined (UNSUPPORTED). Two launches for the whole matrix (one torchrun world, one process).

The matrix is the full tier (CPDOCTOR_TESTS=full); one case of it, on two ranks, runs in the default tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("step_matrix.py")
sys.path.insert(0, str(Path(__file__).parent))

from step_matrix import SMOKE, VARIANTS  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
"""The dtype's tolerance (cpdoctor's DType.grad_tolerance, spelled here so the test does not read the product)."""


def _rel(a, b) -> float:
    d = float((a.double() - b.double()).norm())
    n = float(b.double().norm())
    return d / n if n else d


def run_matrix(tmp: Path, names: list[str], world: int) -> tuple[dict, dict, dict]:
    """Both runs of `names`: (the watcher's results, each CP group leader's gradients, the one-process ones)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    only = ["--only", ",".join(names)]
    one = subprocess.Popen(
        [sys.executable, str(DRIVER), "one", str(tmp), *only], env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    cp = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), str(DRIVER), "cp", str(tmp), *only],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp,
    )
    one_out, _ = one.communicate(timeout=900)
    assert (tmp / "cp.json").exists(), cp.stdout[-3000:] + cp.stderr[-3000:]
    assert (tmp / "one.pt").exists(), one_out[-3000:]
    results = json.loads((tmp / "cp.json").read_text())
    leaders = {}
    for rank in range(world):
        for name, g in torch.load(tmp / f"cp_rank{rank}.pt").items():
            leaders.setdefault(name, []).append(g)
    truth = torch.load(tmp / "one.pt")
    return results, leaders, truth


def expected(name: str, leaders: dict, truth: dict) -> tuple[str, float, float]:
    """(the verdict the step deserves, its worst CP group's error from one process, the tolerance)."""
    v = VARIANTS[name]
    g = truth["grads"][name]
    if not bool(torch.isfinite(g).all()):
        return "UNSUPPORTED", float("nan"), float("nan")
    dtype = "fp16" if v.scaler else ("bf16" if v.dtype in ("bf16", "lora") else "fp32")
    tol = TOLERANCE[dtype]
    if name in truth["fp32"]:  # a half step: its own one-process rounding (×4, as a kernel's rule) may be larger
        tol = max(tol, 4 * _rel(g, truth["fp32"][name]) + 2.0**-7)
    worst = max(_rel(f, g) for f in leaders[name])
    return ("PASS" if worst <= tol else "FAIL"), worst, tol


def acceptable(name: str, got: dict, want: str) -> bool:
    if got["verdicts"] and any(v != got["verdicts"][0] for v in got["verdicts"]):
        return False  # every CP group must say the same of the same step
    if got["verdict"] == want:
        return True
    unreadable = VARIANTS[name].unobservable and got["verdict"] == "WARN" and got["not_read"] and "could not be read" in got["diagnosis"]
    return bool(unreadable)


# slowest 20 (issue 28, full tier on 0.42.1, 2 workers on 2 cores): 80 s: the whole matrix (51 steps) in two launches, 4 ranks with CP and one process, ground truth for every case
@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    names = [n for n in VARIANTS if n != SMOKE]
    results, leaders, truth = run_matrix(tmp_path_factory.mktemp("matrix"), names, 4)
    table = {n: (*expected(n, leaders, truth), results[n]) for n in names}
    summary: dict[str, int] = {}
    for want, _err, _tol, got in table.values():
        summary[f"{want}->{got['verdict']}"] = summary.get(f"{want}->{got['verdict']}", 0) + 1
    print("\nstep matrix (expected->watcher):", json.dumps(summary, sort_keys=True))
    for name, (want, err, tol, got) in table.items():
        print(f"  {name}: expected {want} (error {err:.2g}, tolerance {tol:.2g}), watcher {got['verdict']}")
    out = os.environ.get("CPDOCTOR_MATRIX_OUT")
    if out:  # benchmarks/record_step_matrix.py keeps the table
        Path(out).write_text(
            json.dumps({n: {"expected": w, "error": e, "tolerance": t, "watcher": g} for n, (w, e, t, g) in table.items()}, indent=1)
        )
    return table


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != SMOKE])
def test_the_watcher_agrees_with_one_process(matrix, name):
    want, err, tol, got = matrix[name]
    assert got["verdict"] != "RAISED", got.get("traceback")
    assert acceptable(name, got, want), (
        f"{name}: one process says {want} (error {err:.3g}, tolerance {tol:.3g}); watcher: {got['verdict']}: {got['diagnosis']}"
    )


def test_the_matrix_has_both_answers_of_every_kind(matrix):
    """The matrix is not all right or all wrong: each axis has steps one process calls right and wrong."""
    wants = [w for w, *_ in matrix.values()]
    assert wants.count("PASS") >= 20 and wants.count("FAIL") >= 12 and "UNSUPPORTED" in wants


@pytest.mark.smoke
def test_one_case_on_two_ranks(tmp_path):
    """The default tier's case of the matrix: a loss × cp summed over CP on two ranks (its gradients are cp× one
    process's: FAIL, and the watcher names the loss's factor)."""
    results, leaders, truth = run_matrix(tmp_path, [SMOKE], 2)
    want, err, tol = expected(SMOKE, leaders, truth)
    got = results[SMOKE]
    assert want == "FAIL" and got["verdict"] == "FAIL", (want, err, got)
    assert "factor cp = 2" in got["diagnosis"] and "the constant 2" in got["diagnosis"], got["diagnosis"]
