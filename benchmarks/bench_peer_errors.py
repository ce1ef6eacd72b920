"""The peers' errors against the ring degree: `cpdoctor check --impl IMPL --ring R --json FILE` for each peer and
ring, each case's worst relative error over out / LSE / dQ / dK / dV and its tolerance. Peer defaults: bf16,
B1 S240 H4 D32, basic variant, not causal; CPU ranks on cpdoctor's stand-ins.

The inputs are seeded, so an error is a fixed number, not a sample: instead of repetitions the script runs the
first case twice and records whether the two reports agree exactly (`deterministic`).

With --variants it runs instead the layouts README.md's peer section lists: ring-flash-attn's basic, zigzag,
stripe and llama3 varlen rings at ring 2, 3 and 4, causal and not (a case the peer refuses is recorded as
refused), yunchang's Ulysses 2 x ring 2, ring 3 x Ulysses 2 and ring 4, torch's `context_parallel` on the flash
and cuDNN kernels at 2, 3 and 4 ranks.

Usage: nice -n 19 python benchmarks/bench_peer_errors.py [--impls ring-flash-attn] [--rings 2 3 4 5 6]
    -> benchmarks/results/peer_errors_cpu.json
       nice -n 19 python benchmarks/bench_peer_errors.py --variants --out benchmarks/results/peer_variants_cpu.json
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


VARIANT_CASES = (
    [
        {"impl": "ring-flash-attn", "variant": v, "ring": r, "causal": c}
        for v in ("basic", "zigzag", "stripe", "llama3")
        for r in (2, 3, 4)
        for c in (False, True)
    ]
    + [
        {"impl": "yunchang", "ring": 2, "ulysses": 2},
        {"impl": "yunchang", "ring": 3, "ulysses": 2},
        {"impl": "yunchang", "ring": 4},
    ]
    + [{"impl": "torch", "kernel": k, "ring": r} for k in ("flash", "cudnn") for r in (2, 3, 4)]
)


def examine(impl: str, ring: int, **options) -> dict:
    """One check's verdict, its worst tensor, that tensor's relative error and tolerance, and its wall time;
    `options` (variant, kernel, ulysses, causal) become the CLI's options. A case the peer refuses (exit 2,
    no report) is recorded as refused."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "cpdoctor", "check", "--impl", impl, "--ring", str(ring), "--json", out]
        for key, value in options.items():
            cmd += [f"--{key}"] if value is True else [f"--no-{key}"] if value is False else [f"--{key}", str(value)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        if not os.path.exists(out):
            return {"verdict": "refused", "exit_code": proc.returncode, "message": proc.stderr.strip()[-400:]}
        with open(out) as fh:
            report = json.load(fh)
    tensors = {name: t for f in report["findings"] for name, t in f.get("tensors", {}).items()}
    worst = max(tensors, key=lambda n: tensors[n]["rel_err"]) if tensors else None
    return {
        "verdict": report["verdict"],
        "worst_tensor": worst,
        "worst_rel_err": tensors[worst]["rel_err"] if worst else None,
        "tolerance": tensors[worst]["tolerance"] if worst else None,
        "rel_err": {n: t["rel_err"] for n, t in tensors.items()},
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", nargs="+", default=["ring-flash-attn"])
    parser.add_argument("--rings", nargs="+", type=int, default=[2, 3, 4, 5, 6])
    parser.add_argument("--variants", action="store_true", help="the layouts README's peer section lists")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "peer_errors_cpu.json"))
    args = parser.parse_args()
    load_before = run_record.load_average()
    cases = VARIANT_CASES if args.variants else [{"impl": i, "ring": r} for i in args.impls for r in args.rings]
    rows = []
    for case in cases:
        rows.append({**case, **examine(**case)})
        print(json.dumps(rows[-1]), flush=True)
    first_again = examine(**cases[0])
    errors = [r["worst_rel_err"] for r in rows if r.get("worst_rel_err") is not None]
    tolerances = [r["tolerance"] for r in rows if r.get("tolerance") is not None]
    result = {
        "what": "cpdoctor check --impl IMPL --ring R: the worst relative error over out/LSE/dQ/dK/dV, peer defaults "
        "(bf16, B1 S240 H4 D32, basic variant, not causal), CPU ranks on cpdoctor's stand-ins",
        "deterministic": first_again.get("rel_err") == rows[0].get("rel_err"),
        "worst_rel_err_spread": [min(errors), max(errors)] if errors else None,
        "tolerance_spread": [min(tolerances), max(tolerances)] if tolerances else None,
        "verdicts": {v: sum(r["verdict"] == v for r in rows) for v in sorted({r["verdict"] for r in rows})},
        "rows": rows,
        "machine": run_record.machine(),
        "versions": run_record.versions(),
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/bench_peer_errors.py --impls " + " ".join(args.impls) + " --rings " + " ".join(map(str, args.rings)),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
