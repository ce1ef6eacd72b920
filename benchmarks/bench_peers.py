"""A peer check's wall time beside `cpdoctor check --emulate --backend flash` at the same layout (issue 16: at
most 1.5× it), both through the Python API the CLI calls, alternated, each in its own launch.

Layout: B1 S240 H4 D32, bf16, ring 2 (and ring 4), not causal. The attention check examines diffusers' `flash`
backend on the flash-attn stand-in; the peer checks examine ring-flash-attn's basic ring and yunchang's
basic ring on the same stand-in, and torch's context_parallel on the aten flash stand-in. Wall time is the
whole `api.examine` call (launch, imports, the case, the report), median of --reps.

Usage: python benchmarks/bench_peers.py [--reps 3] [--rings 2 4] [--out benchmarks/results/peers_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cpdoctor import api
from cpdoctor.examinations import registry
from cpdoctor.vocabulary import Kind

SHAPE = dict(batch=1, seq=240, heads=4, head_dim=32, dtype="bf16")

CHECKS = {
    "diffusers flash (--emulate)": (Kind.ATTENTION, dict(backend="flash", emulate=True)),
    "ring-flash-attn basic": (Kind.PEER, dict(impl="ring-flash-attn", variant="basic")),
    "yunchang basic": (Kind.PEER, dict(impl="yunchang", variant="basic")),
    "torch allgather (flash)": (Kind.PEER, dict(impl="torch", kernel="flash")),
}


def time_check(kind: Kind, fields: dict, ring: int) -> tuple[float, str]:
    request = registry.get(kind).build_request(**SHAPE, **fields, ring=ring)
    start = time.perf_counter()
    report = api.examine(request, timeout_s=300)
    return time.perf_counter() - start, report.verdict.value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rings", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "peers_cpu.json"))
    args = parser.parse_args()
    results: dict[str, dict[str, dict]] = {}
    for ring in args.rings:
        times: dict[str, list[float]] = {name: [] for name in CHECKS}
        verdicts: dict[str, str] = {}
        for _ in range(args.reps):
            for name, (kind, fields) in CHECKS.items():
                wall, verdicts[name] = time_check(kind, fields, ring)
                times[name].append(wall)
        base = statistics.median(times["diffusers flash (--emulate)"])
        results[f"ring {ring}"] = {
            name: {
                "median_s": round(statistics.median(t), 2),
                "runs_s": [round(x, 2) for x in t],
                "ratio": round(statistics.median(t) / base, 2),
                "verdict": verdicts[name],
            }
            for name, t in times.items()
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"shape": SHAPE, "results": results}, indent=2))
    for layout, rows in results.items():
        print(layout)
        for name, row in rows.items():
            print(f"  {name:30} {row['median_s']:6.2f} s  ×{row['ratio']:.2f}  {row['verdict']}")


if __name__ == "__main__":
    main()
