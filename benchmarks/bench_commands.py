"""Wall time of the commands the README times: the doctor (`cpdoctor`), `cpdoctor run quick`,
`cpdoctor run cuda-emulated --patch`, and `cpdoctor check --ring 3` without and with `--repro DIR` (what the
verified upstream fix costs), each run N times in a fresh process (JSON report to a file), with the number of
findings and the exit codes.

Each command runs as a user runs it (warm ranks: forked from the server the CLI starts, launch/warm.py) and, in
the same repetition, with CPDOCTOR_WARM=0 (every rank a fresh interpreter, as before issue 28): the baseline of the
ratio `warm / cold`, and the check that both give the same verdicts. The figures are the median and the spread of
the repetitions on this machine, with its load average (a 2-core machine shared with other jobs reads long).

Usage: python benchmarks/bench_commands.py [--repeats 5] [--only NAME ...]
       -> benchmarks/results/commands_<diffusers version>.json
`--only` re-measures the commands named and keeps the file's other rows as they were measured: each row carries
its own load averages, date and command line.
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


def run_once(args: list[str], cold: bool = False) -> tuple[float, int, dict]:
    """(wall seconds, exit code, the report's JSON) of `cpdoctor ARGS --json FILE` in a fresh process (`cold`: with
    CPDOCTOR_WARM=0)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "cpdoctor", *(a.replace("{tmp}", tmp) for a in args), "--json", out],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, **({"CPDOCTOR_WARM": "0"} if cold else {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        with open(out) as fh:
            report = json.load(fh)
    return wall, proc.returncode, report


def _verdicts(report: dict) -> list:
    """Every finding's verdict, and those before the patch: what warm and cold runs must agree on."""
    before = (report.get("before") or {}).get("findings", [])
    return [f["verdict"] for f in report.get("findings", [])] + ["before:" + f["verdict"] for f in before]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="+", choices=sorted(COMMANDS), default=list(COMMANDS))
    args = parser.parse_args()
    import diffusers

    path = os.path.join(HERE, "results", f"commands_{diffusers.__version__}.json")
    kept = {}
    if os.path.exists(path) and len(args.only) < len(COMMANDS):
        with open(path) as fh:
            kept = {k: v for k, v in json.load(fh)["rows"].items() if k not in args.only}
    load_before = run_record.load_average()
    rows = {}
    for name in args.only:
        row_load = run_record.load_average()
        walls, colds, codes, checks, same = [], [], set(), None, True
        for _ in range(args.repeats):
            wall, code, report = run_once(COMMANDS[name])
            cold_wall, cold_code, cold_report = run_once(COMMANDS[name], cold=True)
            walls.append(wall)
            colds.append(cold_wall)
            codes.add(code)
            checks = len(report.get("findings", []))
            same = same and code == cold_code and _verdicts(report) == _verdicts(cold_report)
        rows[name] = {
            "command": "cpdoctor " + " ".join(COMMANDS[name]),
            "wall_s": [round(w, 2) for w in walls],
            **{f"wall_{k}": v for k, v in run_record.summary(walls, 1).items()},
            "cold_wall_s": [round(w, 2) for w in colds],
            **{f"cold_wall_{k}": v for k, v in run_record.summary(colds, 1).items()},
            **{f"warm_over_cold_{k}": v for k, v in run_record.summary([w / c for w, c in zip(walls, colds)], 2).items()},
            "same_verdicts_warm_and_cold": same,
            "exit_codes": sorted(codes),
            "findings": checks,
            "launches": (report.get("doctor") or {}).get("launches"),
            "load_average": {"before": row_load, "after": run_record.load_average()},
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "reps": args.repeats,
            "command_line": "python benchmarks/bench_commands.py " + " ".join(sys.argv[1:]),
        }
        print(name, rows[name], flush=True)
    rows = {name: (rows.get(name) or kept[name]) for name in COMMANDS if name in rows or name in kept}
    result = {
        "what": "wall seconds of each command in a fresh process, JSON report to a file, warm ranks and (paired, same "
        "repetition) CPDOCTOR_WARM=0; median and [min, max]",
        "rows": rows,
        "reps": args.repeats,
        "machine": run_record.machine(),
        "versions": run_record.versions(),
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/bench_commands.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
