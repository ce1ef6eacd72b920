"""`cpdoctor step --ulysses 2 -- torchrun --nproc-per-node {nproc} examples/train_flux_lora_cp.py --ulysses {ulysses}`: a
diffusers-style LoRA script, unmodified, run twice (without CP, then with CP), its first optimizer step captured in
every rank through the startup module and judged as two runs are.

Every expectation about the step comes from the script's own step code run in this process: which of the model's
inputs each CP rank draws differently from CP rank 0 (`draw_batch` with each rank's layout) is what the judge must
name; the correct script draws none apart and PASSes. The failure paths: a command that never reaches an optimizer
step (UNSUPPORTED, exit 3), a rank that raises (CRASH naming it, its traceback), a rank that sleeps (HANG naming it,
the process tree killed, nothing left behind; a two-rank job without diffusers), bad input (exit 2, one line). Two
launches per judged command: the planted faults' other cases are recorded by benchmarks/record_step_command.py
(results/step_command_<release>.json), not run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_flux_lora_cp.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}", str(SCRIPT), "--ulysses", "{ulysses}"]
"""Ulysses 2: diffusers' Ulysses attention is right in both CI releases (0.39.0's ring backward is not: docs/FACTS.md),
so the verdict is the script's own; the ring's rows are recorded in benchmarks/results/step_command_*.json."""


def cpdoctor_step(*args: str, timeout: float = 300) -> tuple[int, dict | None, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "cpdoctor", "step", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    return proc.returncode, report, proc.stderr


def leftover_processes() -> list[str]:
    """The script's processes still alive (none may be once a command ends)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(SCRIPT) in line]


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(SCRIPT.parent))
    import train_flux_lora_cp

    return train_flux_lora_cp


def differing_inputs(script, argv: list[str], cp: int) -> dict[str, list[int]]:
    """{input: the CP ranks whose value differs from CP rank 0's} when the script's own `draw_batch` draws the first
    micro-batch of its first step on each rank of one CP group (data-parallel rank 0), in this process."""
    args = script.parse_args(argv)
    drawn = [script.draw_batch(args, script.Layout(rank=r, dp=1, ring=1, ulysses=cp, dp_rank=0), 0, 0)["inputs"] for r in range(cp)]
    out: dict[str, list[int]] = {}
    for name, first in drawn[0].items():
        if isinstance(first, torch.Tensor):
            ranks = [r for r in range(1, cp) if not torch.equal(drawn[r][name], first)]
            if ranks:
                out[name] = ranks
    return out


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(None, id="correct"),
        # what this FAIL rests on (inputs drawn apart) is the script's, the same with either release or build of torch
        pytest.param("timesteps-per-rank", id="timesteps-per-rank", marks=pytest.mark.once),
    ],
)
def test_the_script_is_judged_as_its_own_one_process_draws_say(script, fault):
    extra = ["--fault", fault] if fault else []
    expected = differing_inputs(script, ["--ulysses", "2", *extra], cp=2)
    code, report, err = cpdoctor_step("--ulysses", "2", "--timeout", "120", "--json", "-", "--", *TORCHRUN, *extra)
    assert report is not None, err[-3000:]
    (finding,) = report["findings"]
    assert [r["processes"] for r in report["runs"]] == [1, 2] and [r["exit_code"] for r in report["runs"]] == [0, 0]
    at = len(TORCHRUN) - 2  # the script's own --ulysses, from {ulysses}
    assert report["runs"][0]["command"][at : at + 2] == ["--ulysses", "1"] and report["runs"][1]["command"][at : at + 2] == [
        "--ulysses",
        "2",
    ]
    if not expected:
        assert code == 0 and finding["verdict"] == "PASS", finding["diagnosis"]
        assert "the same step run without CP" in finding["diagnosis"]
        assert finding["tensors"]["grads"]["rel_err"] < 1e-5
    else:
        assert code == 1 and finding["verdict"] == "FAIL", finding["diagnosis"]
        assert finding["details"]["inputs_differ"] == expected, finding["diagnosis"]
    assert not leftover_processes()


@pytest.mark.once
def test_a_rank_that_raises_is_a_crash_naming_it_with_its_traceback():
    code, report, err = cpdoctor_step("--ulysses", "2", "--timeout", "60", "--json", "-", "--", *TORCHRUN, "--crash-rank", "0")
    assert code == 1 and report is not None, err[-2000:]
    (finding,) = report["findings"]
    assert finding["verdict"] == "CRASH" and finding["diagnosis"].startswith("rank 0 raised: RuntimeError: planted crash on rank 0")
    assert "run 1" in finding["probe"] and "planted crash" in finding["details"]["tracebacks"]["0"]
    assert len(report["runs"]) == 1 and not leftover_processes()


STALL = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
if dist.get_rank() == 1:
    time.sleep(10**6)  # stopped before its first training forward
model(torch.ones(2, 4)).sum().backward()
dist.all_reduce(model.weight.grad)  # rank 0 waits here for rank 1
torch.optim.SGD(model.parameters(), lr=0.1).step()
"""
"""A two-rank job (no diffusers: the stall is the subject, not the model) whose rank 1 never reaches its forward."""


@pytest.mark.once
def test_a_rank_that_sleeps_is_a_hang_naming_it_and_nothing_is_left_behind(tmp_path):
    """dp 2: run 1 has two processes; rank 1 sleeps before its first forward while rank 0 waits in the
    data-parallel all_reduce: rank 1 is named, and the whole tree (torchrun and both ranks) is gone."""
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "{nproc}", str(script), "{cp}"]
    code, report, err = cpdoctor_step("--ulysses", "2", "--dp", "2", "--timeout", "5", "--json", "-", "--", *torchrun)
    assert code == 1 and report is not None, err[-2000:]
    (finding,) = report["findings"]
    assert finding["verdict"] == "HANG" and "rank 1 (started, before its first training forward) stopped" in finding["diagnosis"]
    assert "rank 0 was inside the training step" in finding["diagnosis"]
    assert report["runs"][0]["exit_code"] is None
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(script) not in out


@pytest.mark.smoke
@pytest.mark.once
def test_a_command_that_never_steps_examines_nothing():
    """Armed (it imports torch) but no optimizer step: UNSUPPORTED, exit 3, after run 1 alone."""
    code, report, err = cpdoctor_step("--ring", "2", "--json", "-", "--", sys.executable, "-c", "import torch; print({cp})")
    assert code == 3 and report is not None, err[-2000:]
    (finding,) = report["findings"]
    assert finding["verdict"] == "UNSUPPORTED" and "no process of it reached an optimizer step" in finding["diagnosis"]
    assert len(report["runs"]) == 1 and report["runs"][0]["command"][-1] == "import torch; print(1)"


@pytest.mark.once
@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["python", "train.py", "--ring", "2"], "the command is the same in both runs"),
        (["no-such-program-here", "{cp}"], "no program 'no-such-program-here' found"),
    ],
    ids=["no-placeholder", "no-program"],
)
def test_bad_input_is_one_line_and_exit_2(command, said):
    code, report, err = cpdoctor_step("--ring", "2", "--", *command, timeout=60)
    assert code == 2 and report is None and said in err and "Traceback" not in err


# --------------------------------------------------------------------------------------- the startup module alone
STARTUP = ROOT / "cpdoctor" / "launch" / "startup"


@pytest.fixture
def site(tmp_path) -> Path:
    """A user's own sitecustomize, a stand-in `torch` package (so the import hook is seen without importing torch)
    and an entry the arm.json names, which notes that it ran and with which folder."""
    user = tmp_path / "user"
    (user / "torch").mkdir(parents=True)
    (user / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    (user / "torch" / "__init__.py").write_text("print('torch imported')\n")
    (user / "probe_entry.py").write_text(
        "import sys\ndef arm(directory):\n    print('armed after', 'torch' in sys.modules, directory.endswith('run'))\n"
    )
    return tmp_path


def python(site: Path, code: str, armed: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CPDOCTOR_STEP_DIR", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(STARTUP), str(site / "user")])
    if armed:
        run = site / "run"
        run.mkdir(exist_ok=True)
        (run / "arm.json").write_text(json.dumps({"entry": "probe_entry:arm"}))
        env["CPDOCTOR_STEP_DIR"] = str(run)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.once
def test_without_the_variable_the_startup_module_only_chains_the_users(site):
    done = python(site, "import sys; print(sorted(m for m in ('torch', 'cpdoctor', 'probe_entry') if m in sys.modules))", armed=False)
    assert done.stdout.splitlines() == ["user sitecustomize ran", "[]"], done.stderr


@pytest.mark.once
def test_armed_it_calls_the_entry_once_torch_is_imported_and_keeps_a_ranks_traceback(site):
    done = python(site, "import sys; print('before', 'probe_entry' in sys.modules); import torch; import torch", armed=True)
    assert done.stdout.splitlines() == ["user sitecustomize ran", "before False", "torch imported", "armed after True True"], done.stderr
    crashed = python(site, "import os; os.environ['RANK'] = '3'; raise ValueError('planted')", armed=True)
    assert crashed.returncode == 1 and "ValueError: planted" in crashed.stderr  # Python still prints it
    noted = (site / "run" / "raised").glob("*.txt")
    assert [p.read_text().splitlines()[0] for p in noted] == ["ValueError: planted"]
