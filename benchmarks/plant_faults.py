"""Issue 28, item 4: the slow tests made cheaper still fail when the code is wrong. For each, the fault it guards
against is planted in a copy of the repository (one exact text replacement in the product's code), the test runs
there, and it must fail; the same test on the unchanged copy must pass. Nothing is planted in this checkout.

    python benchmarks/plant_faults.py [--only NAME ...]   -> benchmarks/results/planted_faults_<release>.json

Each row: the test (pytest node id), what it was made cheaper by, the fault, and the two exit codes (0 clean, 1 with
the fault) with the first failing assertion's line. A replacement whose text is not found is an error (the product
moved): the table must be brought up to date, never skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Plant:
    name: str
    test: str
    cheaper_by: str
    fault: str
    path: str
    old: str
    new: str


PLANTS = (
    Plant(
        "doctor",
        "tests/integration/test_doctor.py::test_doctor_alone_names_the_defects_of_this_diffusers",
        "the doctor's checks of one world size share one launch whatever their kind, ranks forked warm (5 launches -> 3)",
        "a shared launch hands each request the findings of the request before it (cases mixed up across kinds)",
        "cpdoctor/examinations/runner.py",
        "for (i, case), finding in zip(owned, judged):",
        "for (i, case), finding in zip(owned, judged[1:] + judged[:1]):",
    ),
    Plant(
        "model-emulated",
        "tests/integration/test_model_emulated.py",
        "one suite (one launch per world size) instead of a launch per model and backend",
        "a shared launch hands each request the findings of the request before it (cases mixed up across models)",
        "cpdoctor/examinations/runner.py",
        "for (i, case), finding in zip(owned, judged):",
        "for (i, case), finding in zip(owned, judged[1:] + judged[:1]):",
    ),
    Plant(
        "malformed-suites",
        "tests/integration/test_suite.py::test_malformed_suite_is_one_line_and_exit_2",
        "the malformed suites run through the CLI's entry in one interpreter (tests/cli_many.py), not one process each",
        "bad input exits 1 instead of 2",
        "cpdoctor/cli/__init__.py",
        "        code = 2\n",
        "        code = 1\n",
    ),
    Plant(
        "launch-hang",
        "tests/integration/test_launch.py::test_a_rank_that_hangs_is_a_hang_within_the_timeout",
        "ranks fork from the warm server instead of starting fresh interpreters",
        "a warm rank keeps the fork server's environment instead of the job's (its rank, world and fault variables)",
        "cpdoctor/launch/warm.py",
        "    os.environ.clear()\n    os.environ.update(env)\n",
        "    pass\n",
    ),
    Plant(
        "step-compile",
        "tests/integration/test_step_compile.py",
        "inductor compiles in each rank's process, the watched compile hitting the plain one's FX graph cache",
        "the watcher's forward hooks are traced by dynamo (issue 29's setStorage failure under aot_eager)",
        "cpdoctor/examinations/step/watcher/record.py",
        "register_forward_pre_hook(torch.compiler.disable(self._pre), with_kwargs=True))\n"
        "        self._handles.append(self.module.register_forward_hook(torch.compiler.disable(self._post)))",
        "register_forward_pre_hook(self._pre, with_kwargs=True))\n        self._handles.append(self.module.register_forward_hook(self._post))",
    ),
)


def copy_tree(dst: str) -> None:
    shutil.copytree(
        ROOT, dst, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", ".pytest_cache", "results"), symlinks=True
    )


def run_test(tree: str, test: str) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "CPDOCTOR_TESTS": "full"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", test],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    first = next((line.strip() for line in proc.stdout.splitlines() if re.match(r"^E\s", line)), "")
    return proc.returncode, first[:300], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PLANTS], default=[p.name for p in PLANTS])
    args = parser.parse_args()
    load_before = run_record.load_average()
    rows = []
    for plant in (p for p in PLANTS if p.name in args.only):
        with tempfile.TemporaryDirectory() as tmp:
            tree = os.path.join(tmp, "repo")
            copy_tree(tree)
            clean_code, _, clean_s = run_test(tree, plant.test)
            path = os.path.join(tree, plant.path)
            text = open(path).read()
            if text.count(plant.old) != 1:
                raise SystemExit(f"{plant.name}: the text to replace is not found once in {plant.path}: bring PLANTS up to date")
            with open(path, "w") as fh:
                fh.write(text.replace(plant.old, plant.new))
            faulty_code, failure, faulty_s = run_test(tree, plant.test)
        row = {
            "name": plant.name,
            "test": plant.test,
            "cheaper_by": plant.cheaper_by,
            "fault": plant.fault,
            "planted_in": plant.path,
            "exit_clean": clean_code,
            "exit_with_fault": faulty_code,
            "caught": clean_code == 0 and faulty_code == 1,
            "first_failure": failure,
            "seconds": [round(clean_s, 1), round(faulty_s, 1)],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    import diffusers

    out = os.path.join(HERE, "results", f"planted_faults_{diffusers.__version__}.json")
    if os.path.exists(out) and len(args.only) < len(PLANTS):  # --only: the other rows stay as they were measured
        with open(out) as fh:
            kept = {r["name"]: r for r in json.load(fh)["rows"]}
        rows = [next((r for r in rows if r["name"] == p.name), kept.get(p.name)) for p in PLANTS]
        rows = [r for r in rows if r is not None]
    run_record.write_results(
        out,
        "each cheapened test on a copy of the repository, clean and with the fault it guards against planted",
        rows,
        load_before,
        "plant_faults.py",
    )


if __name__ == "__main__":
    main()
