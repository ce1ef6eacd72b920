"""torchtitan's own FLUX step (examples/torchtitan_flux_step.py, torchtitan 0.3.0) at several layouts, by hand,
without cpdoctor: each layout runs under torchrun, gathers every gradient whole (`full_tensor()`), and is
compared with the same step without CP (1 process for dp 1, 2 processes for dp 2) name by name.

    python benchmarks/bench_titan_layouts.py                  # every row; writes benchmarks/results/titan_layouts.json
    python benchmarks/bench_titan_layouts.py --rows cp2 cp2-titan-seeding

Rows: the correct step at dp 1 × cp 2, dp 1 × cp 4 and dp 2 × cp 2; the planted input fault (noise and timestep
drawn per CP rank) and reduction fault (FSDP's mean over dp_shard × cp) at cp 2; torchtitan's own seeding
(`FluxTrainer.__init__`'s `set_determinism`) at cp 2 and dp 2 × cp 2. Each row: wall time of the torchrun,
largest resident set of one process (getrusage of the waited children), the relative L2 error of all gradients
against the run without CP, the least-squares factor, the worst parameter. The errors are those of seeded steps:
the whole table runs twice and `deterministic` says whether the second pass gave the same errors exactly (in place
of repetitions); the times and memory are one run each, indicative only. Run it under `nice -n 19` on a shared
machine. Needs torchtitan (docs/TORCHTITAN.md)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchtitan_flux_step.py"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_record import machine  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    cp: int
    dp: int
    args: tuple[str, ...] = ()
    baseline_args: tuple[str, ...] = ()
    """What the run without CP of this row gets (torchtitan's seeding is compared with itself at cp 1)."""


ROWS = (
    Row("cp2", 2, 1),
    Row("cp4", 4, 1),
    Row("dp2-cp2", 2, 2),
    Row("cp2-input-fault", 2, 1, ("--plant", "input")),
    Row("cp2-reduction-fault", 2, 1, ("--plant", "reduction")),
    Row("cp2-titan-seeding", 2, 1, ("--seeding", "torchtitan"), ("--seeding", "torchtitan")),
    Row("dp2-cp2-titan-seeding", 2, 2, ("--seeding", "torchtitan"), ("--seeding", "torchtitan")),
)


def torchrun(cp: int, dp: int, args: tuple[str, ...], out: str, port: int) -> tuple[float, float, str]:
    """(wall s, largest child RSS MiB, rank 0's line) of one torchrun of the example."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cp * dp}", f"--master-port={port}", str(EXAMPLE)]
    cmd += ["--cp", str(cp), "--dp", str(dp), *args, "--out", out]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rss = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("cp ")), "")
    return wall, rss, line


def table(rows: list[Row], compare: Any, torch: Any) -> list[dict]:
    """One pass over the rows: each row's baseline (the run without CP, once per kind) and its run with CP."""
    results: list[dict] = []
    baselines: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(rows):
            key = (row.dp, row.baseline_args)
            if key not in baselines:
                path = os.path.join(tmp, f"base-{len(baselines)}.pt")
                wall, rss, line = torchrun(1, row.dp, row.baseline_args, path, 29700 + 2 * i)
                baselines[key] = torch.load(path)
                name = f"without CP, dp {row.dp} {' '.join(row.baseline_args)}".strip()
                results.append({"row": name, "wall_s": round(wall, 1), "rss_mib": round(rss), "line": line})
            path = os.path.join(tmp, f"{row.name}.pt")
            wall, rss, line = torchrun(row.cp, row.dp, row.args, path, 29701 + 2 * i)
            c = compare(torch.load(path), baselines[key])
            results.append(
                {
                    **asdict(row),
                    "wall_s": round(wall, 1),
                    "rss_mib": round(rss),
                    "line": line,
                    "rel_err": float(f"{c.rel_err:.3e}"),
                    "factor": round(c.factor, 6),
                    "worst": c.worst.name if c.worst else None,
                    "worst_rel_err": float(f"{c.worst.rel_err:.3e}") if c.worst else None,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


ERRORS = ("rel_err", "factor", "worst", "worst_rel_err")


def main() -> None:
    import torch
    import torchtitan

    from cpdoctor.examinations.step.watcher.full_grads import compare

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", default=[r.name for r in ROWS])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "titan_layouts.json"))
    args = p.parse_args()
    rows = [r for r in ROWS if r.name in args.rows]
    load_before = os.getloadavg()
    results = table(rows, compare, torch)
    again = table(rows, compare, torch)
    record = {
        "what": "torchtitan 0.3.0 FluxTrainer.forward_backward_step, tiny FLUX, fp32, gloo CPU ranks, by hand (no cpdoctor)",
        "command": "nice -n 19 python benchmarks/bench_titan_layouts.py",
        "machine": machine(),
        "versions": {
            "torch": str(torch.__version__),
            "torchtitan": getattr(torchtitan, "__version__", "?"),
            "python": sys.version.split()[0],
        },
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "deterministic": all(a.get(k) == b.get(k) for a, b in zip(results, again) for k in ERRORS),
        "spread": "none: seeded steps; `deterministic` says whether a second pass gave the same errors; times and memory: one run each",
        "rows": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
