"""What every class with a `_cp_plan` in the installed diffusers gives (docs/MODELS.md): its tiny config as derived
from the class, the verdicts of its model examination at ring 2, ring 3, Ulysses 2, ring 2 with a padded prompt
(the classes whose forward takes a text mask), ring 2 inside its own gradient checkpointing, each before and after
`--patch`, and the wall time of `cpdoctor model NAME --ring 2` as a user runs it.

The verdicts come from one `cpdoctor run` of a suite of `each: all` checks (`--patch`: every check before and after
the fix; one launch per world size); the examinations are seeded, so their numbers are fixed: the script runs the
ring-2 check of one class twice and records that the two agree (`deterministic`). The wall time is the median of
N fresh `cpdoctor model NAME --ring 2 --json FILE` processes per class (warm ranks, the tiny config derived in
each), with the spread and the machine's load average.

Each class's tiny config is derived in this process (`cpdoctor.model_zoo.tiny.derive`, the first derivation of the
process: its seconds include nothing else) and recorded with what bounded each key. `--tiny` re-derives them alone
and rewrites only the rows' `tiny` of an existing results file (the verdicts and times stay as measured).

Usage: python benchmarks/bench_models.py [--repeats 5] [--only NAME ...] [--tiny]
       -> benchmarks/results/models_<diffusers version>.json
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

CHECKS = {
    "ring2": "ring: 2",
    "ring3": "ring: 3",
    "ulysses2": "ulysses: 2",
    "masked": "ring: 2, mask_pad: 3",
    "checkpointing": "ring: 2, checkpointing: true",
}


def cli(args: list[str], out: str, timeout: float = 3600) -> tuple[float, int, dict]:
    """(wall seconds, exit code, the JSON report) of `cpdoctor ARGS --json OUT` in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cpdoctor", *args, "--json", out],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - start
    if not os.path.exists(out):
        raise RuntimeError(f"cpdoctor {' '.join(args)} wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}")
    with open(out) as fh:
        return wall, proc.returncode, json.load(fh)


def _row(finding: dict | None) -> dict | None:
    if finding is None:
        return None
    tensors = finding.get("tensors", {})
    return {
        "verdict": finding["verdict"],
        "out": tensors.get("out", {}).get("rel_err"),
        "grads": tensors.get("grads", {}).get("rel_err"),
        "diagnosis": finding["diagnosis"][:300],
    }


def verdicts(names: list[str], tmp: str) -> tuple[dict, float]:
    """class -> check -> {before, after} rows, from one `cpdoctor run --patch` of the `each: all` suite."""
    suite = os.path.join(tmp, "models.yaml")
    with open(suite, "w") as fh:
        fh.write("name: models\nchecks:\n" + "".join(f"  - model: {{each: all, {fields}}}\n" for fields in CHECKS.values()))
    wall, _, report = cli(["run", suite, "--patch"], os.path.join(tmp, "suite.json"))
    requests = [next(iter(c.values())) for c in report["request"]["checks"]]
    rows: dict = {}
    for req, before, after in zip(requests, report["before"]["findings"], report["findings"], strict=True):
        check = next(k for k, f in CHECKS.items() if _matches(req, f))
        name = before["details"].get("model", {}).get("short_name") or req["model"]
        if names and name not in names:
            continue
        rows.setdefault(name, {})[check] = {"before": _row(before), "after": _row(after), "shape": _shape(req)}
    return rows, wall


def _matches(req: dict, fields: str) -> bool:
    want = {k.strip(): v.strip() for k, v in (p.split(":") for p in fields.split(","))}
    got = {
        "ring": str(req["ring"]),
        "ulysses": str(req["ulysses"]),
        "mask_pad": str(req["mask_pad"]),
        "checkpointing": str(req["checkpointing"]).lower(),
    }
    defaults = {"ring": "1", "ulysses": "1", "mask_pad": "0", "checkpointing": "false"}
    return all(got[k] == want.get(k, defaults[k]) for k in got)


def _shape(req: dict) -> str:
    frames = f"x{req['frames']}f" if req.get("frames") else ""
    return f"{req['height']}x{req['width']}{frames}, text {req['text_len']}"


def examination_times(names: list[str], repeats: int, tmp: str) -> dict:
    """class -> the wall time of `cpdoctor model NAME --ring 2` over `repeats` fresh processes, and its verdict."""
    out = {}
    for name in names:
        walls, verdict = [], None
        for i in range(repeats):
            wall, code, report = cli(["model", name, "--ring", "2"], os.path.join(tmp, f"{name}-{i}.json"))
            walls.append(wall)
            verdict = report["verdict"]
        out[name] = {"reps": repeats, "wall_s": run_record.summary(walls, 1), "verdict": verdict, "exit_code": code}
    return out


def tiny_configs(names: list[str]) -> dict:
    """class -> its tiny config as derived here (the keys changed, what bounded each, parameters, trials, seconds)."""
    from cpdoctor.model_zoo.catalog import resolve_model
    from cpdoctor.model_zoo.tiny import derive

    return {name: derive(resolve_model(name).cls).to_dict() for name in names}


def deterministic(name: str, tmp: str) -> bool:
    """The same seeded check twice gives the same numbers (what makes one run of a verdict a stored figure)."""
    rows = []
    for i in range(2):
        _, _, report = cli(["model", name, "--ring", "2"], os.path.join(tmp, f"twice-{i}.json"))
        rows.append({k: v["rel_err"] for k, v in report["findings"][0].get("tensors", {}).items()})
    return rows[0] == rows[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--tiny", action="store_true", help="re-derive the tiny configs alone, into the existing results file")
    args = parser.parse_args()
    load_before = run_record.load_average()
    sys.path.insert(0, ROOT)
    from cpdoctor.model_zoo.catalog import list_models

    names = [e.short_name for e in list_models() if not args.only or e.short_name in args.only]
    if args.tiny:
        rewrite_tiny(names, load_before)
        return
    tiny = tiny_configs(names)
    with tempfile.TemporaryDirectory() as tmp:
        checks, suite_s = verdicts(names, tmp)
        times = examination_times(names, args.repeats, tmp)
        same = deterministic(names[0], tmp)
    rows = [{"name": n, "checks": checks.get(n, {}), **times[n], "tiny": tiny[n]} for n in names]
    import diffusers

    path = os.path.join(HERE, "results", f"models_{diffusers.__version__}.json")
    run_record.write_results(
        path,
        "every class with a _cp_plan: tiny config, verdicts before/after --patch, wall time of `cpdoctor model NAME --ring 2`",
        rows,
        load_before,
        "bench_models.py",
    )
    with open(path) as fh:
        data = json.load(fh)
    data.update(deterministic=same, suite_wall_s=round(suite_s, 1), classes=len(names))
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"wrote {path}")


def rewrite_tiny(names: list[str], load_before: list[float]) -> None:
    """The rows' `tiny` re-derived, the rest of the file as it was measured; the rewrite's own record kept."""
    import diffusers

    path = os.path.join(HERE, "results", f"models_{diffusers.__version__}.json")
    with open(path) as fh:
        data = json.load(fh)
    tiny = tiny_configs(names)
    for row in data["rows"]:
        if row["name"] in tiny:
            row["tiny"] = tiny[row["name"]]
    data["tiny_rewritten"] = {
        "load_average": {"before": load_before, "after": run_record.load_average()},
        "command": "python benchmarks/bench_models.py " + " ".join(sys.argv[1:]),
    }
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"rewrote the tiny configs of {path}")


if __name__ == "__main__":
    main()
