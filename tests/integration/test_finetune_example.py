"""examples/finetune_cp.py: a CP fine-tuning loop through real enable_parallelism, pre-flight at the top. With
the installed release's defect the stock curves part from one process; after the pre-flight they coincide."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "finetune_cp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# slowest 20 (issue 28, full tier on 0.42.1, 2 workers on 2 cores): 25 s: the README's fine-tuning example, a few real steps under torchrun with and without the defect
def test_curves_part_with_the_defect_and_coincide_after_the_preflight(tmp_path, has_stale_kv_backward):
    ring = 2 if has_stale_kv_backward else 3  # docs/FACTS.md: 0.39.0 is wrong from ring 2 on, 0.42.1 from ring 3
    out = tmp_path / "curves.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ring), "--master-port", str(_free_port())]
    proc = subprocess.run(
        cmd + [EXAMPLE, "--ring", str(ring), "--steps", "6", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "curves.json").read_text())
    assert summary["preflight"] == {"verdict": "PASS", "before": "FAIL", "fixed": True}
    gaps = summary["max_rel_gap"]
    assert gaps["CP, stock diffusers"]["grad_norm"] > 1e-3  # wrong gradients from the first step
    assert gaps["CP, after cpdoctor.preflight"]["grad_norm"] < 1e-4 and gaps["CP, after cpdoctor.preflight"]["loss"] < 1e-5
    assert len(summary["curves"]["single process"]["loss"]) == 6
    step = summary["step"]  # cpdoctor.watch_step on each CP run's first step
    assert (
        step["CP, stock diffusers"]["verdict"] == "FAIL"
        and "inputs, loss and reduction are right" in step["CP, stock diffusers"]["diagnosis"]
    )
    assert step["CP, after cpdoctor.preflight"]["verdict"] == "PASS"
