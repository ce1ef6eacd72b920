"""Wall time of `cpdoctor check --ring 2` vs a bare hand-written torchrun script doing the same comparison
once (benchmarks/bare_ring_check.py), measured side by side, alternating, on this machine.

Target: cpdoctor ≤ 1.0 × the bare script (it was 1.08–1.16× while every rank's environment line carried torch's TorchVersion,
whose unpickling made the parent import torch, 2.7 s, after the ranks were done). Writes benchmarks/results/check_speed.json.
Usage: python benchmarks/bench_check.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script
from side_by_side import alternate  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = run_record.load_average()
    bare = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29533",
        os.path.join(HERE, "bare_ring_check.py"),
    ]
    ours = [sys.executable, "-m", "cpdoctor", "check", "--ring", "2", "--json", os.devnull]
    t_bare, t_ours = alternate(bare, ours, args.repeats)
    paired = [o / b for o, b in zip(t_ours, t_bare)]
    result = {
        "bare_torchrun_s": [round(t, 3) for t in t_bare],
        "cpdoctor_check_s": [round(t, 3) for t in t_ours],
        "median_bare_s": round(statistics.median(t_bare), 3),
        "median_cpdoctor_s": round(statistics.median(t_ours), 3),
        "ratio": round(statistics.median(t_ours) / statistics.median(t_bare), 3),
        "target_ratio": 1.0,
        "bare_spread_s": run_record.summary(t_bare)["spread"],
        "cpdoctor_spread_s": run_record.summary(t_ours)["spread"],
        "paired_ratio": run_record.summary(paired),
        "reps": args.repeats,
        "machine": run_record.machine(),
        "versions": run_record.versions(),
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": f"python benchmarks/bench_check.py --repeats {args.repeats}",
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "check_speed.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
