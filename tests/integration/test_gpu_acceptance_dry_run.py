"""benchmarks/gpu_acceptance.py --dry-run: the GPU acceptance run's code paths on the CPU kernel stand-ins, so
the script a lent GPU machine runs cannot rot (its figures here mean nothing; its verdicts do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", "gpu_acceptance.py")


def test_dry_run(tmp_path, has_stale_kv_backward):
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--dry-run", "--layouts", "ring 2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    rows = {r["backend"]: r for r in data["examinations"]}
    assert set(rows) == {"_native_flash", "_native_cudnn", "_native_efficient"}
    for name in ("_native_flash", "_native_cudnn"):
        # docs/FACTS.md item 5: 0.39.0's backward ops transpose K/V twice (a crash); the fix's ring calls the kernels itself
        assert rows[name]["before"] == ("CRASH" if has_stale_kv_backward else "PASS"), rows[name]
        assert rows[name]["after"] == "PASS", rows[name]
    assert rows["_native_efficient"]["before"] == "UNSUPPORTED"  # not registered for CP in these releases
    assert [s["backend"] for s in data["speed"]] == ["_native_flash", "_native_cudnn", "_native_efficient"]
    assert all(s["kernel"]["tflops"] > 0 and s["fix blocks"]["tflops"] > 0 for s in data["speed"])
    assert "CP attention on the kernels" in (tmp_path / "gpu_acceptance.txt").read_text()
