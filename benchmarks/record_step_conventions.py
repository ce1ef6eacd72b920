"""Store the runs behind the README's step table: the trainers' conventions watched in one run
(tests/integration/conventions_driver.py, 4 gloo ranks) and the two runs of `cpdoctor step
tests/integration/two_run_steps.py:steps --ring 2 --dp 2`, with the machine, the versions and the load average.

    python benchmarks/record_step_conventions.py      # writes benchmarks/results/step_conventions_<diffusers>.json
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "conventions.json"
        driver = ROOT / "tests" / "integration" / "conventions_driver.py"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", str(driver), str(out), "--patch"],
                       check=True, capture_output=True, env=env, cwd=tmp)  # fmt: skip
        one_run = json.loads(out.read_text())
    steps = ROOT / "tests" / "integration" / "two_run_steps.py"
    proc = subprocess.run([sys.executable, "-m", "cpdoctor", "step", f"{steps}:steps", "--ring", "2", "--dp", "2", "--json", "-"],
                          capture_output=True, text=True, env=env, cwd=ROOT)  # fmt: skip
    two = json.loads(proc.stdout)
    result = {
        "what": "tiny Flux, data-parallel 2 x CP 2, 4 gloo ranks, cpdoctor's fixed attention; one run: watch_step; two runs: cpdoctor step",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "versions": {p: version(p) for p in ("torch", "diffusers", "peft", "accelerate")},
        "one_run": {
            k: {"verdict": v["verdict"], "grads": v.get("grads"), "diagnosis": v["diagnoses"][0] if v.get("diagnoses") else None}
            for k, v in one_run.items()
            if "verdict" in v
        },  # fmt: skip
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
