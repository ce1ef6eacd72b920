"""Store the step matrix's run behind the README: tests/integration/test_step_matrix.py's steps, each run with CP
inside `watch_step` (4 gloo ranks) and in one process, the expected verdict from the two runs' gradients and the
one-run judge's; the counts of each (expected, watcher) pair over the whole matrix and over the spellings issue 36
added, how many right steps FAIL and wrong ones PASS, which verdicts rest on a reading (WARN), and the correct steps
run again under what `preflight(model=)` arms (how many it stopped), with the machine, the versions and the load.

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
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from step_matrix import ARMED_SUFFIX, NEW_SPELLINGS, VARIANTS  # noqa: E402


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


def counts(rows: dict) -> dict:
    """The (expected, watcher) pairs, and the two counts the one-run judge promises to keep at 0."""
    pairs: dict[str, int] = {}
    for r in rows.values():
        pairs[f"{r['expected']}->{r['watcher']}"] = pairs.get(f"{r['expected']}->{r['watcher']}", 0) + 1
    right_fail = sorted(n for n, r in rows.items() if r["expected"] == "PASS" and r["watcher"] == "FAIL")
    wrong_pass = sorted(n for n, r in rows.items() if r["expected"] == "FAIL" and r["watcher"] == "PASS")
    return {
        "steps": len(rows),
        "pairs": pairs,
        "right_steps_that_fail": right_fail,
        "right_fail_count": len(right_fail),
        "wrong_steps_that_pass": wrong_pass,
        "wrong_pass_count": len(wrong_pass),
        "warn_resting_on_a_reading": sorted(n for n, r in rows.items() if r["watcher"] == "WARN"),
    }


def main() -> None:
    load_before = run_record.load_average()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first, wall1 = matrix_once(env)
    again, wall2 = matrix_once(env)
    slim = {
        n: {
            "expected": r["expected"],
            "watcher": r["watcher"]["verdict"],
            "error": r["error"],
            "tolerance": r["tolerance"],
            "reading": VARIANTS[n.removesuffix(ARMED_SUFFIX)].reading,
        }
        for n, r in first.items()
    }
    watched = {n: r for n, r in slim.items() if not n.endswith(ARMED_SUFFIX)}
    armed = {n: {**r, "stopped": first[n]["watcher"].get("stopped")} for n, r in slim.items() if n.endswith(ARMED_SUFFIX)}
    result = {
        "what": "tests/integration/test_step_matrix.py: each step with CP (4 gloo ranks, watch_step) and in one process per replica; "
        "the ARMED correct steps again with CP under preflight(model=)'s armed watch",
        "machine": run_record.machine(),
        "versions": {p: version(p) for p in ("torch", "diffusers", "peft", "accelerate")},
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/record_step_matrix.py",
        "deterministic": {n: (r["expected"], r["watcher"]["verdict"]) for n, r in first.items()}
        == {n: (r["expected"], r["watcher"]["verdict"]) for n, r in again.items()},
        "spread": "none: a seeded matrix; `deterministic` says whether a second run gave the same verdicts",
        "pytest_wall_s": [wall1, wall2],
        "steps": len(watched),
        "pairs": counts(watched)["pairs"],
        "whole_matrix": counts(watched),
        "issue_36_spellings": counts({n: r for n, r in watched.items() if n in NEW_SPELLINGS}),
        "preflight": {
            "steps": len(armed),
            "stopped": sorted(n for n, r in armed.items() if r["stopped"]),
            "stopped_count": sum(1 for r in armed.values() if r["stopped"]),
            "pairs": counts(armed)["pairs"],
        },
        "matrix": slim,
        "diagnoses": {n: r["watcher"]["diagnosis"] for n, r in first.items()},
    }
    path = ROOT / "benchmarks" / "results" / f"step_matrix_{version('diffusers')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
