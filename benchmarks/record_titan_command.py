"""Store the runs behind docs/STEP_COMMAND.md's "torchtitan's FLUX trainer, unmodified": `cpdoctor step --ring 2
--emulate torchtitan-cpu -- torchrun --nproc-per-node {nproc} -m torchtitan.train ... --parallelism.
context_parallel_degree {cp}` on torchtitan 0.3.0's own trainer and test config, in a folder set up by
examples/torchtitan_cpu/workspace.py (its test assets, one-layer encoders, torchtitan's seed checkpoint):

- torchtitan's own seeding (FluxTrainer.__init__: distinct seeds over `fsdp`, which holds the CP ranks);
- the one-line change of examples/torchtitan_cpu/synced_seeding.diff (distinct over `batch`), on a copy of torchtitan
  first on PYTHONPATH.

    TORCHTITAN_SOURCE=path/to/torchtitan nice -n 19 python benchmarks/record_titan_command.py
    # writes benchmarks/results/titan_command.json

Each row: its exit code, the wall time of the whole command and of each of its two launches (run 1 without CP on 1
process, run 2 with CP on 2), the verdict, the gradients' error against run 1 and the inputs named wrong. Twice:
`deterministic` says whether the second pass gave the same verdicts, errors and inputs; the times are the first
pass's, one run each (indicative: they follow the shared machine's load, recorded). Needs torchtitan in this
Python (docs/TORCHTITAN.md) and a torchtitan source checkout or bare git directory for its test assets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(os.environ.get("TORCHTITAN_SOURCE", "/work/.mirror/pytorch+torchtitan/repo"))
ROWS = (("torchtitan's own seeding", False), ("the one-line change (synced_seeding.diff)", True))


def examined(ws, name: str, fixed: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(([str(ws.fixed)] if fixed else []) + [str(ROOT)])}
    cmd = [sys.executable, "-m", "cpdoctor", "step", "--ring", "2", "--emulate", "torchtitan-cpu", "--timeout", "600", "--json", "-"]
    started = time.perf_counter()
    proc = subprocess.run([*cmd, "--", *ws.command()], capture_output=True, text=True, env=env, cwd=ws.folder)
    wall = round(time.perf_counter() - started, 1)
    report = json.loads(proc.stdout)
    finding = report["findings"][0]
    details = finding.get("details") or {}
    return {
        "row": name,
        "exit": proc.returncode,
        "wall_s": wall,
        "runs": [{"run": r["run"], "processes": r["processes"], "wall_s": r["wall_s"]} for r in report.get("runs", [])],
        "verdict": finding["verdict"],
        "grads": finding["tensors"].get("grads", {}).get("rel_err"),
        "inputs_wrong": details.get("inputs_differ", {}),
        "compute_dtype": details.get("compute_dtype"),
        "diagnosis": finding["diagnosis"],
    }


def main() -> None:
    load_before = run_record.load_average()
    sys.path.insert(0, str(ROOT / "examples" / "torchtitan_cpu"))
    import workspace

    started = time.perf_counter()
    ws = workspace.prepare(SOURCE, Path(tempfile.mkdtemp(prefix="cpdoctor-titan-")), fixed=True)
    prepared = round(time.perf_counter() - started, 1)
    first = [examined(ws, name, fixed) for name, fixed in ROWS]
    again = [examined(ws, name, fixed) for name, fixed in ROWS]
    same = [[r["exit"], r["verdict"], r["grads"], r["inputs_wrong"]] for r in first] == [
        [r["exit"], r["verdict"], r["grads"], r["inputs_wrong"]] for r in again
    ]
    from importlib.metadata import version

    out = ROOT / "benchmarks" / "results" / "titan_command.json"
    what = "cpdoctor step -- torchtitan 0.3.0's FLUX trainer (python -m torchtitan.train, its test config), CP 2, gloo CPU ranks, --emulate torchtitan-cpu"
    run_record.write_seeded(str(out), what, first, load_before, "record_titan_command.py", same,
                            versions={"torchtitan": version("torchtitan")}, workspace_s=prepared)  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
