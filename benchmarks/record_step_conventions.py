"""Store the runs behind the README's step table: the trainers' conventions watched in one run
(tests/integration/conventions_driver.py, 4 gloo ranks) and the two runs of `cpdoctor step
tests/integration/two_run_steps.py:steps --ring 2 --dp 2`, with the machine, the versions and the load average.

    python benchmarks/record_step_conventions.py      # writes benchmarks/results/step_conventions_<diffusers>.json

The one-run examination is run twice: its errors are seeded, fixed numbers, and `deterministic` records whether
the second run gave exactly the same ones (the convention's stand-in for repetitions and spread).
"""

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


def watched_once(env: dict) -> dict:
    """The conventions driver's results (4 ranks, one run each convention), reduced to what the README quotes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "conventions.json"
        driver = ROOT / "tests" / "integration" / "conventions_driver.py"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(driver), str(out), "--patch"],
                       check=True, capture_output=True, env=env, cwd=tmp)  # fmt: skip
        one_run = json.loads(out.read_text())
    return {
        k: {"verdict": v["verdict"], "grads": v.get("grads"), "diagnosis": v["diagnoses"][0] if v.get("diagnoses") else None}
        for k, v in one_run.items()
        if "verdict" in v
    }


def main() -> None:
    load_before = run_record.load_average()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    one_run, again = watched_once(env), watched_once(env)  # seeded: the errors are fixed numbers, shown by a second run
    steps = ROOT / "tests" / "integration" / "two_run_steps.py"
    proc = subprocess.run([sys.executable, "-m", "cpdoctor", "step", f"{steps}:steps", "--ring", "2", "--dp", "2", "--json", "-"],
                          capture_output=True, text=True, env=env, cwd=ROOT)  # fmt: skip
    two = json.loads(proc.stdout)
    result = {
        "what": "tiny Flux, data-parallel 2 x CP 2, 4 gloo ranks, cpdoctor's fixed attention; one run: watch_step; two runs: cpdoctor step",
        "machine": run_record.machine(),
        "versions": {p: version(p) for p in ("torch", "diffusers", "peft", "accelerate")},
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/record_step_conventions.py",
        "deterministic": one_run == again,
        "spread": "none: a seeded examination; `deterministic` says whether a second run gave the same numbers",
        "one_run": one_run,
        "two_runs": [
            {
                "step": f["probe"],
                "verdict": f["verdict"],
                "grads": f["tensors"].get("grads", {}).get("rel_err"),
                "diagnosis": f["diagnosis"],
            }
            for f in two["findings"]
        ],  # fmt: skip
    }
    path = ROOT / "benchmarks" / "results" / f"step_conventions_{version('diffusers')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
