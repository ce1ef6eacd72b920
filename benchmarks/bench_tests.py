"""Wall time of the README's test command (issue 28: the default tier in at most 5 minutes on 2 cores, median of
3; 5 by the figures' convention), and of the full tier CI runs, each in this checkout's environment, with the pass counts and the slowest tests.

    python benchmarks/bench_tests.py [--repeats 5] [--full]
        -> benchmarks/results/tests_<diffusers version>.json (`default` and, with --full, `full` rows)

The command is the README's own (`python -m pytest -q`, two xdist workers by pyproject's addopts), the full tier
with CPDOCTOR_TESTS=full as .ci/run exports it; `--durations=20` is added to read the slowest tests (it changes
nothing that runs). A row measured again replaces that row only; each row has its own load averages and date.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_tier(full: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CPDOCTOR_TESTS"}
    if full:
        env["CPDOCTOR_TESTS"] = "full"
    before = run_record.load_average()
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=20"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    out = proc.stdout
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", summary)}
    slowest = re.findall(r"^(\d+\.\d+)s (call|setup|teardown)\s+(\S+)$", out, re.M)
    return {
        "wall_s": round(wall, 1),
        "exit": proc.returncode,
        "counts": counts,
        "slowest": [{"s": float(s), "phase": phase, "test": test} for s, phase, test in slowest],
        "failed": re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M),
        "load_average": {"before": before, "after": run_record.load_average()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="runs of the default tier (0: none)")
    parser.add_argument("--full", action="store_true", help="also the full tier, once")
    args = parser.parse_args()
    import diffusers

    path = os.path.join(HERE, "results", f"tests_{diffusers.__version__}.json")
    rows = {}
    load_before = run_record.load_average()
    if os.path.exists(path):
        with open(path) as fh:
            rows = json.load(fh)["rows"]
    if args.repeats:
        runs = [run_tier(full=False) for _ in range(args.repeats)]
        for run in runs:
            print("default", run["wall_s"], run["exit"], run["counts"], flush=True)
        walls = [r["wall_s"] for r in runs]
        rows["default"] = {
            "command": "python -m pytest -q",
            "wall_s": walls,
            **{f"wall_{k}": v for k, v in run_record.summary(walls, 1).items()},
            "reps": args.repeats,
            "runs": runs,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
    if args.full:
        run = run_tier(full=True)
        print("full", run["wall_s"], run["exit"], run["counts"], flush=True)
        rows["full"] = {"command": "CPDOCTOR_TESTS=full python -m pytest -q", **run, "date": time.strftime("%Y-%m-%d %H:%M")}
    run_record.write_results(
        path,
        "wall seconds of the README's test command (default tier, repeated) and of the full tier, in this environment",
        rows,
        load_before,
        "bench_tests.py",
    )


if __name__ == "__main__":
    main()
