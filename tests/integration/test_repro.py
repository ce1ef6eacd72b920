"""`cpdoctor check --repro DIR`: the written repro needs only torch and diffusers, runs under plain torchrun, and
reproduces the FAIL numbers cpdoctor reported."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from conftest import run_cli


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_repro_reproduces_the_ring3_figures(tmp_path):
    out = tmp_path / "repro"
    run = run_cli("check", "--ring", "3", "--repro", str(out), "--json", "-")
    assert run.code == 1 and run.json["verdict"] == "FAIL"
    reported = {n: t["rel_err"] for n, t in run.json["findings"][0]["tensors"].items()}
    script = (out / "repro.py").read_text()
    assert "import cpdoctor" not in script and "from cpdoctor" not in script
    issue = (out / "ISSUE.md").read_text()
    for heading in ("### Describe the bug", "### Reproduction", "### Logs", "### System Info"):
        assert heading in issue
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(_free_port()), str(out / "repro.py")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,  # not the project: the script must not find cpdoctor's sources
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in reported:
            measured[parts[0]] = float(parts[1])
    assert set(measured) == set(reported), proc.stdout
    for name in ("dk", "dv"):
        assert reported[name] > 0.1 and abs(measured[name] - reported[name]) <= 0.01 * reported[name], (name, measured, reported)
    assert "REPRODUCED" in proc.stdout and "NOT REPRODUCED" not in proc.stdout
