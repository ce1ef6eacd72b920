"""examples/train_lora_cp.py runs as the README shows (`torchrun --nproc-per-node 2 examples/train_lora_cp.py`): a
LoRA fine-tune of tiny Flux on a bf16 base with CP 2 on CPU ranks, `cpdoctor.preflight(model=model)` at the top;
the first training step is examined and PASSes (on 0.39.0 after the fix preflight patched in), and the training
goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]


def test_the_lora_example_trains_with_its_first_step_examined():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_lora_cp.py"),
        "--steps",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cpdoctor preflight: CP attention PASS" in proc.stdout
    assert "cpdoctor, first step: PASS: the step matches one fp64 process" in proc.stdout and "for bf16" in proc.stdout
    assert "step 1: loss" in proc.stdout
