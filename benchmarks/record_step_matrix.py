"""Store the step matrix's run behind the README: tests/integration/test_step_matrix.py's 51 steps, each run with CP
inside `watch_step` (4 gloo ranks) and in one process, the expected verdict from the two runs' gradients and the
watcher's; the counts of each (expected, watcher) pair, with the machine, the versions and the load average.

    python benchmarks/record_step_matrix.py      # writes benchmarks/results/step_matrix_<diffusers>.json

The matrix is seeded: it runs twice and `deterministic` records whether the second run gave the same verdicts
and errors (the convention's stand-in for repetitions and spread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]


def matrix_once(env: dict) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "matrix.json"
        test = ROOT / "tests" / "integration" / "test_step_matrix.py"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
            capture_output=True, text=True, env={**env, "CPDOCTOR_TESTS": "full", "CPDOCTOR_MATRIX_OUT": str(out)}, cwd=ROOT,
        )  # fmt: skip
        if not out.exists():
            raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
        table = json.loads(out.read_text())
        wall = next((float(w.split(" in ")[1].split("s")[0]) for w in proc.stdout.splitlines()[-1:] if " in " in w), float("nan"))
        return table, wall


def main() -> None:
    load_before = run_record.load_average()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first, wall1 = matrix_once(env)
    again, wall2 = matrix_once(env)
    slim = {
        n: {"expected": r["expected"], "watcher": r["watcher"]["verdict"], "error": r["error"], "tolerance": r["tolerance"]}
        for n, r in first.items()
    }
    pairs: dict[str, int] = {}
    for r in slim.values():
        pairs[f"{r['expected']}->{r['watcher']}"] = pairs.get(f"{r['expected']}->{r['watcher']}", 0) + 1
    result = {
        "what": "tests/integration/test_step_matrix.py: each step with CP (4 gloo ranks, watch_step) and in one process per replica",
        "machine": run_record.machine(),
        "versions": {p: version(p) for p in ("torch", "diffusers", "peft", "accelerate")},
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/record_step_matrix.py",
        "deterministic": {n: (r["expected"], r["watcher"]["verdict"]) for n, r in first.items()}
        == {n: (r["expected"], r["watcher"]["verdict"]) for n, r in again.items()},
        "spread": "none: a seeded matrix; `deterministic` says whether a second run gave the same verdicts",
        "pytest_wall_s": [wall1, wall2],
        "steps": len(slim),
        "pairs": pairs,
        "matrix": slim,
        "diagnoses": {n: r["watcher"]["diagnosis"] for n, r in first.items()},
    }
    path = ROOT / "benchmarks" / "results" / f"step_matrix_{version('diffusers')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
