"""Store the run behind README's "torch-native CP trainers": `cpdoctor step` on torchtitan's own FLUX step
(examples/torchtitan_flux_step.py, torchtitan 0.3.0, unmodified `FluxTrainer.forward_backward_step`), two runs
each, at dp 1 × cp 2 and dp 2 × cp 2: the correct step, the two planted faults and torchtitan's own seeding.

    nice -n 19 python benchmarks/record_titan_step.py      # writes benchmarks/results/titan_step.json

Each row is one `cpdoctor step ... --ring 2 --dp D --json -`: its exit code, wall time, and per CP group the
verdict, the worst rank's gradient error against the run without CP, the uniform factor and the inputs named
wrong with their ranks. The examinations are seeded: the table runs twice and `deterministic` says whether the
second pass gave the same verdicts, errors and factors exactly (the convention's stand-in for repetitions); the
times are one run each (the first pass), indicative only. Needs torchtitan (docs/TORCHTITAN.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchtitan_flux_step.py"
ROWS = (
    ("step", 1),
    ("step", 2),
    ("step_input_fault", 1),
    ("step_reduction_fault", 1),
    ("step_reduction_fault", 2),
    ("step_titan_seeding", 1),
    ("step_titan_seeding", 2),
)
"""(the example's function, dp): CP 2 each."""


def examined(function: str, dp: int, env: dict) -> dict:
    """One `cpdoctor step` of the example, reduced to what the README quotes."""
    cmd = [sys.executable, "-m", "cpdoctor", "step", f"{EXAMPLE}:{function}", "--ring", "2", "--dp", str(dp), "--json", "-"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = round(time.perf_counter() - started, 1)
    report = json.loads(proc.stdout)
    return {
        "row": f"{function} dp{dp}xcp2",
        "function": function,
        "dp": dp,
        "cp": 2,
        "exit": proc.returncode,
        "wall_s": wall,
        "groups": [
            {
                "probe": f["probe"],
                "verdict": f["verdict"],
                "grads": f["tensors"].get("grads", {}).get("rel_err"),
                "factor": (f.get("details") or {}).get("factor"),
                "inputs_wrong": (f.get("details") or {}).get("inputs_differ", {}),
                "diagnosis": f["diagnosis"],
            }
            for f in report["findings"]
        ],
    }


def numbers(rows: list[dict]) -> list:
    """What a second pass must give exactly (not the wall times)."""
    return [[r["exit"], [(g["verdict"], g["grads"], g["factor"], g["inputs_wrong"]) for g in r["groups"]]] for r in rows]


def main() -> None:
    load_before = run_record.load_average()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = [examined(f, dp, env) for f, dp in ROWS]
    again = [examined(f, dp, env) for f, dp in ROWS]
    result = {
        "what": "cpdoctor step on torchtitan 0.3.0's FluxTrainer.forward_backward_step, tiny FLUX, fp32, gloo CPU ranks, CP 2",
        "command": "nice -n 19 python benchmarks/record_titan_step.py",
        "machine": run_record.machine(),
        "versions": {p: version(p) for p in ("torch", "torchtitan", "diffusers")},
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "deterministic": numbers(first) == numbers(again),
        "spread": "none: seeded steps; `deterministic` says whether a second pass gave the same numbers; times: one run each",
        "rows": first,
    }
    path = ROOT / "benchmarks" / "results" / "titan_step.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False))
    print(path)


if __name__ == "__main__":
    main()
