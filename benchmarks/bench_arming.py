"""The cost of `cpdoctor step -- <command>`'s arming, in the same run: one short training script (tiny Flux, LoRA,
STEPS forward + backward passes and no optimizer step, so no capture is triggered) run as a plain Python process
three ways, interleaved, REPS times each:

- `without`: nothing of cpdoctor on its PYTHONPATH;
- `present`: the startup folder (cpdoctor/launch/startup) first on PYTHONPATH, CPDOCTOR_STEP_DIR unset (a process of
  the user's outside `cpdoctor step`: the startup module only chains the next sitecustomize);
- `armed`: the same with CPDOCTOR_STEP_DIR set (arm.json of a run without CP): torch's import arms the capture, the
  global hooks see every module call, and the model's first forward with gradients starts a candidate that records
  every forward and backward (what happens before the first optimizer step in a real run).

Two figures per process, each as CPU time (user + system: what the process itself spent, which the other work on a
shared machine barely changes, unlike its wall time) and as wall time: the whole process (interpreter start to exit:
imports, arming, the loop; the child's rusage) and the loop alone (the script's own clocks around the STEPS passes).
Ratios against `without` in the same repetition, medians over the repetitions with their spread.

    nice -n 19 python benchmarks/bench_arming.py          # writes benchmarks/results/arming.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ROOT / "cpdoctor" / "launch" / "startup"
REPS = 7
STEPS = 50
MODES = ("without", "present", "armed")
FIGURES = ("process_cpu_s", "process_s", "loop_cpu_s", "loop_s")

SCRIPT = f"""
import sys, time
sys.path.insert(0, {str(ROOT / "examples")!r})
import torch
import train_flux_lora_cp as ex
args = ex.parse_args([])
layout = ex.Layout(rank=0, dp=1, ring=1, ulysses=1, dp_rank=0)
model = ex.build_transformer(args, layout)
params = [p for p in model.parameters() if p.requires_grad]
started, cpu = time.perf_counter(), time.process_time()
for step in range({STEPS}):
    batch = ex.draw_batch(args, layout, step, 0)
    ex.loss_of(args, layout, model(**batch["inputs"])[0], batch).backward()
print("LOOP", time.perf_counter() - started, time.process_time() - cpu)
"""


def run(mode: str, run_dir: str) -> dict[str, float]:
    """One process of `mode`: its CPU and wall time, whole and for the loop alone."""
    import resource

    env = {k: v for k, v in os.environ.items() if k not in ("CPDOCTOR_STEP_DIR", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != STARTUP.resolve()]
    path.append(str(ROOT))
    if mode != "without":
        path.insert(0, str(STARTUP))
    if mode == "armed":
        env["CPDOCTOR_STEP_DIR"] = run_dir
    env["PYTHONPATH"] = os.pathsep.join(path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    loop = next((line.split()[1:] for line in done.stdout.splitlines() if line.startswith("LOOP")), None)
    if done.returncode != 0 or loop is None:
        raise SystemExit(f"{mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"process_cpu_s": cpu, "process_s": wall, "loop_cpu_s": float(loop[1]), "loop_s": float(loop[0])}


def arm_folder() -> str:
    from cpdoctor.examinations.step.runs.capture import ArmSpec
    from cpdoctor.examinations.step.runs.request import Role

    folder = tempfile.mkdtemp(prefix="cpdoctor-arming-")
    ArmSpec(Role.WITHOUT_CP, os.path.join(folder, "saved"), 1, 1, 1, 300.0).write(folder)
    return folder


def main() -> None:
    load_before = run_record.load_average()
    sys.path.insert(0, str(ROOT))
    folder = arm_folder()
    seen: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    run("without", folder)  # warm the page cache once, not counted
    for _ in range(REPS):
        for mode in MODES:  # interleaved: a change of the machine's load hits every mode alike
            seen[mode].append(run(mode, folder))
    rows = []
    for mode in MODES:
        row: dict = {"mode": mode, "reps": REPS, "steps": STEPS}
        for figure in FIGURES:
            values = [r[figure] for r in seen[mode]]
            ratios = [r[figure] / b[figure] for r, b in zip(seen[mode], seen["without"])]
            row[figure] = run_record.summary(values)
            row[figure.replace("_s", "_x")] = run_record.summary(ratios)
        row["loop_cpu_ms_per_step"] = round(1000 * statistics.median(r["loop_cpu_s"] for r in seen[mode]) / STEPS, 2)
        rows.append(row)
    out = ROOT / "benchmarks" / "results" / "arming.json"
    run_record.write_results(
        str(out),
        f"cpdoctor step -- cmd's startup module: a tiny-Flux LoRA script ({STEPS} forward+backward, no optimizer step) without it, present unarmed, armed",
        rows,
        load_before,
        "bench_arming.py",
    )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
