"""Store the runs behind docs/STEP_COMMAND.md's table of the diffusers-style script: `cpdoctor step -- torchrun
--nproc-per-node {nproc} examples/train_flux_lora_cp.py ...`, the script unmodified, at each layout and with each
planted fault (the integration tests run two of these rows; the rest are recorded here, not in CI).

    nice -n 19 python benchmarks/record_step_command.py     # writes benchmarks/results/step_command_<diffusers>.json

Each row is one `cpdoctor step ... --json -`: its exit code, the two launches' wall times, and the finding's
verdict, gradient error against the run without CP, uniform factor and inputs named wrong. The examinations are
seeded: the table runs twice and `deterministic` says whether the second pass gave the same verdicts, errors and
factors exactly; the times are the first pass's, one run each (indicative only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_flux_lora_cp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}", str(SCRIPT)]
ROWS = (
    ("correct ring 2", ["--ring", "2"], ["--ring", "{ring}"]),
    (
        "correct ring 2 x dp 2, DDP, 2 micro-batches",
        ["--ring", "2", "--dp", "2"],
        ["--ring", "{ring}", "--ddp", "--gradient_accumulation_steps", "2"],
    ),
    ("correct Ulysses 2", ["--ulysses", "2"], ["--ulysses", "{ulysses}"]),
    ("correct ring 2, bf16 base, fp32 LoRA", ["--ring", "2"], ["--ring", "{ring}", "--mixed_precision", "bf16"]),
    ("timesteps drawn per rank", ["--ring", "2"], ["--ring", "{ring}", "--fault", "timesteps-per-rank"]),
    ("loss multiplied by cp", ["--ring", "2"], ["--ring", "{ring}", "--fault", "loss-times-cp"]),
    ("no sum over the CP group", ["--ring", "2"], ["--ring", "{ring}", "--fault", "no-cp-sum"]),
)
"""(row, cpdoctor's degrees, the script's arguments)."""


def examined(name: str, degrees: list[str], script_args: list[str], env: dict) -> dict:
    cmd = [sys.executable, "-m", "cpdoctor", "step", *degrees, "--timeout", "300", "--json", "-", "--", *TORCHRUN, *script_args]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = round(time.perf_counter() - started, 1)
    report = json.loads(proc.stdout)
    finding = report["findings"][0]  # the first CP group's (every group's verdict below)
    details = finding.get("details") or {}
    return {
        "row": name,
        "command": "cpdoctor step "
        + " ".join(degrees)
        + " -- torchrun --nproc-per-node {nproc} examples/train_flux_lora_cp.py "
        + " ".join(script_args),
        "exit": proc.returncode,
        "wall_s": wall,
        "runs_wall_s": [r["wall_s"] for r in report.get("runs", [])],
        "verdict": finding["verdict"],
        "verdicts": [f["verdict"] for f in report["findings"]],
        "grads": finding["tensors"].get("grads", {}).get("rel_err"),
        "factor": details.get("factor"),
        "inputs_wrong": details.get("inputs_differ", {}),
        "diagnosis": finding["diagnosis"],
    }


def numbers(rows: list[dict]) -> list:
    return [[r["exit"], r["verdicts"], r["grads"], r["factor"], r["inputs_wrong"]] for r in rows]


def main() -> None:
    load_before = run_record.load_average()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = [examined(*row, env) for row in ROWS]
    again = [examined(*row, env) for row in ROWS]
    out = ROOT / "benchmarks" / "results" / f"step_command_{run_record.versions()['diffusers']}.json"
    what = (
        "cpdoctor step -- torchrun ... examples/train_flux_lora_cp.py: the script unmodified, run without CP then with CP, gloo CPU ranks"
    )
    run_record.write_seeded(str(out), what, first, load_before, "record_step_command.py", numbers(first) == numbers(again))
    print(out)


if __name__ == "__main__":
    main()
