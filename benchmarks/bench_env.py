"""Wall time of `cpdoctor env` (target: under 3 s on the 2-core development machine), median of N runs,
next to the bare cost of `import torch, diffusers` measured in the same run.

Usage: python benchmarks/bench_env.py [--repeats 5]   -> benchmarks/results/env_speed_<diffusers version>.json
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
    env_cmd = [sys.executable, "-m", "cpdoctor", "env", "--json", os.devnull]
    import_cmd = [sys.executable, "-c", "import torch, diffusers.models.attention_dispatch"]
    t_env, t_import = alternate(env_cmd, import_cmd, args.repeats)
    import diffusers

    result = {
        "cpdoctor_env_s": [round(t, 3) for t in t_env],
        "import_torch_diffusers_s": [round(t, 3) for t in t_import],
        "median_env_s": round(statistics.median(t_env), 3),
        "median_import_s": round(statistics.median(t_import), 3),
        "target_s": 3.0,
        "env_spread_s": run_record.summary(t_env)["spread"],
        "import_spread_s": run_record.summary(t_import)["spread"],
        "reps": args.repeats,
        "machine": run_record.machine(),
        "versions": run_record.versions(),
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": f"python benchmarks/bench_env.py --repeats {args.repeats}",
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"env_speed_{diffusers.__version__}.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
