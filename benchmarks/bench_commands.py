"""Wall time of the commands the README times: the doctor (`cpdoctor`), `cpdoctor run quick`,
`cpdoctor run cuda-emulated --patch`, and `cpdoctor check --ring 3` without and with `--repro DIR` (what the
verified upstream fix costs), each run N times in a fresh process (JSON report to a file), with the number of
findings and the exit codes.

These are single commands as a user runs them, not a comparison: the figure is the median and the spread of
the repetitions on this machine, with its load average (a 2-core machine shared with other jobs reads long).

Usage: python benchmarks/bench_commands.py [--repeats 5] [--only NAME ...]
       -> benchmarks/results/commands_<diffusers version>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COMMANDS = {
    "doctor": ["doctor"],
    "quick": ["run", "quick"],
    "cuda-emulated": ["run", "cuda-emulated", "--patch"],
    "check-ring3": ["check", "--ring", "3"],
    "check-ring3-repro": ["check", "--ring", "3", "--repro", "{tmp}/repro"],
}


def run_once(args: list[str]) -> tuple[float, int, dict]:
    """(wall seconds, exit code, the report's JSON) of `cpdoctor ARGS --json FILE` in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "cpdoctor", *(a.replace("{tmp}", tmp) for a in args), "--json", out],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        with open(out) as fh:
            report = json.load(fh)
    return wall, proc.returncode, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", choices=sorted(COMMANDS), default=list(COMMANDS))
    args = parser.parse_args()
    load_before = run_record.load_average()
    rows = {}
    for name in args.only:
        walls, codes, checks = [], set(), None
        for _ in range(args.repeats):
            wall, code, report = run_once(COMMANDS[name])
            walls.append(wall)
            codes.add(code)
            checks = len(report.get("findings", []))
        rows[name] = {
            "command": "cpdoctor " + " ".join(COMMANDS[name]),
            "wall_s": [round(w, 2) for w in walls],
            **{f"wall_{k}": v for k, v in run_record.summary(walls, 1).items()},
            "exit_codes": sorted(codes),
            "findings": checks,
        }
        print(name, rows[name], flush=True)
    import diffusers

    result = {
        "what": "wall seconds of each command in a fresh process, JSON report to a file; median and [min, max]",
        "rows": rows,
        "reps": args.repeats,
        "machine": run_record.machine(),
        "versions": run_record.versions(),
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/bench_commands.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"commands_{diffusers.__version__}.json"), "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
