"""Wall time of `cpdoctor env` (target: under 3 s on the 2-core development machine), median of N runs,
next to the bare cost of `import torch, diffusers` measured in the same run.

Usage: python benchmarks/bench_env.py [--repeats 5]   -> benchmarks/results/env_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from side_by_side import alternate  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env_cmd = [sys.executable, "-m", "cpdoctor", "env", "--json", os.devnull]
    import_cmd = [sys.executable, "-c", "import torch, diffusers.models.attention_dispatch"]
    t_env, t_import = alternate(env_cmd, import_cmd, args.repeats)
    import diffusers
    import torch

    result = {
        "cpdoctor_env_s": [round(t, 3) for t in t_env],
        "import_torch_diffusers_s": [round(t, 3) for t in t_import],
        "median_env_s": round(statistics.median(t_env), 3),
        "median_import_s": round(statistics.median(t_import), 3),
        "target_s": 3.0,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", f"env_speed_{diffusers.__version__}.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
