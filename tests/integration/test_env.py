"""`cpdoctor env` on the installed diffusers, through the real CLI in a subprocess: what it finds must be what
docs/FACTS.md measured. The installed release is read here only to pick the expected findings; the tool never does."""

from __future__ import annotations

import os
import time

import pytest
from conftest import run_cli


@pytest.fixture(scope="module")
def env_run():
    t0 = time.perf_counter()
    run = run_cli("env", "--json", "-", timeout=120)
    wall = time.perf_counter() - t0
    print(f"\n`cpdoctor env --json -` wall time {wall:.2f} s (in-process examination {run.json['wall_s']:.2f} s)")
    return run


@pytest.fixture(scope="module")
def data(env_run):
    return env_run.json


@pytest.fixture(scope="module")
def rows(data):
    return {r["name"]: r for r in data["backends"]}


@pytest.fixture(scope="module")
def findings(data):
    return {f["probe"]: f for f in data["findings"]}


def test_exit_code_and_contract(env_run, data):
    assert env_run.code == data["exit_code"]
    # Both releases under test have ring defects in the installed code: env reports a problem.
    assert data["verdict"] == "FAIL" and env_run.code == 1, data["verdict"]
    assert set(data) >= {"verdict", "exit_code", "environment", "backends", "findings", "wall_s"}
    # the Report every examination returns: its request, and a command field on every finding
    assert data["request"] == {"kind": "env", "device": "auto", "dtype": "auto", "emulate": False}
    for f in data["findings"]:
        assert set(f) >= {"probe", "verdict", "diagnosis", "remedy", "command"}
        assert f["verdict"] in ("PASS", "FAIL", "WARN", "INFO")
        if f["verdict"] in ("FAIL", "WARN"):
            assert f["remedy"], f


def test_environment_facts(data):
    import diffusers
    import torch

    env = data["environment"]
    assert env["torch"] == torch.__version__
    assert env["diffusers"] == diffusers.__version__
    assert env["attention_packages"]["flash-attn"] == "not installed"
    assert env["world"]["torchrun"] is False
    assert env["probe_device"] == "cpu" and env["probe_dtype"] == "fp32"
    assert env["gloo"] is True
    # What torch itself reports: a CUDA build of torch has NCCL (and says its version) even on a machine without
    # a GPU; a CPU build has none.
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        assert env["nccl"] == (".".join(map(str, version)) if isinstance(version, tuple) else str(version))
        assert env["nccl"][0].isdigit()
    else:
        assert env["nccl"] == "not available"


def test_one_row_per_registered_backend(rows):
    from cpdoctor.compat import diffusers as compat

    assert set(rows) == set(compat.registered_backend_names()) | {"cpdoctor_cpu"}


def test_cpdoctor_cpu_does_everything_here(rows):
    r = rows["cpdoctor_cpu"]
    assert r["installed"] and r["cp_capable"] and r["runs_here"]
    assert r["returns_lse"] is True and r["has_backward"] is True
    assert r["op"]["measured_on"] == "cpu" and r["op"]["saved_lse"] is True and r["op"]["rng_advanced"] is False
    assert max(r["op"]["rel_err"].values()) <= r["op"]["tolerance"] < 1e-5
    assert r["ring"]["ok"] and r["ulysses"]["ok"] and r["training"]["ok"]


def test_native_has_no_lse_so_no_ring(rows):
    r = rows["native"]
    assert r["runs_here"] and r["cp_capable"] and r["returns_lse"] is False
    assert r["ring"]["ok"] is False and "LSE" in r["ring"]["why"]
    assert r["ulysses"]["ok"] is True
    # It saves no LSE and needs none: its backward recomputes the attention.
    assert r["op"]["saved_lse"] is False and r["training"]["ok"] is True


def test_native_math_is_not_cp_capable_and_ignores_the_config(rows):
    r = rows["_native_math"]
    assert r["runs_here"] and not r["cp_capable"]
    assert r["accepts_parallel_config"] is True and r["facts"]["routes_cp"] is False
    assert r["ring"]["ok"] is False and "ignores" in r["ring"]["why"]


def test_flash_is_not_installed_here(rows):
    r = rows["flash"]
    assert r["installed"] is False and "flash-attn" in r["facts"]["requirement_error"]
    assert r["ring"]["ok"] is False and r["ulysses"]["ok"] is False and r["training"]["ok"] is False


def test_known_defects_of_the_installed_release(findings, has_stale_kv_backward):
    stale = findings["ring backward: rotated K/V"]
    assert stale["verdict"] == ("FAIL" if has_stale_kv_backward else "PASS")
    assert stale["command"] == "cpdoctor check --ring 2"
    # The dK/dV direction defect is in both releases' code (in 0.39.0 behind the stale K/V one).
    direction = findings["ring backward: dK/dV direction"]
    assert direction["verdict"] == "FAIL" and direction["command"] == "cpdoctor check --ring 3"
    assert "cpdoctor.patch()" in direction["remedy"]
    mask = findings["ring forward: mask rotation"]
    assert mask["verdict"] == "FAIL" and "--mask-pad" in mask["command"]
    dispatch = findings["dispatch: CP check"]
    assert dispatch["verdict"] == "WARN" and "_native_math" in dispatch["diagnosis"]
    assert findings["uneven sequence lengths"]["verdict"] == "INFO"


def test_backend_op_defects_seen_on_the_meta_device(findings, rows, has_stale_kv_backward):
    """0.39.0's cuDNN forward skips the LSE unless asked and its fused backward ops return dK/dV in kernel layout;
    no CPU kernel exists for them, so env establishes both on the meta device (kernel arguments and shapes)."""
    cudnn_lse = findings.get("_native_cudnn: LSE for backward")
    flash_bwd = findings.get("_native_flash: backward")
    assert rows["_native_cudnn"]["op"]["measured_on"] == "meta"
    if has_stale_kv_backward:
        assert cudnn_lse and cudnn_lse["verdict"] == "FAIL" and "compute_log_sumexp=False" in cudnn_lse["diagnosis"]
        assert flash_bwd and flash_bwd["verdict"] == "FAIL" and "kernel layout" in flash_bwd["diagnosis"]
        assert rows["_native_cudnn"]["op"]["lse_not_requested"] is True
    else:
        assert cudnn_lse is None and flash_bwd is None
        assert rows["_native_cudnn"]["op"]["lse_not_requested"] is False
        assert rows["_native_flash"]["op"]["grad_shapes_ok"] is True
    assert findings["CP ops on this device"]["verdict"] == "PASS"


def test_markdown_block():
    run = run_cli("env", "--markdown", "-", timeout=120)
    assert run.code == 1, run.stderr
    out = run.stdout
    assert out.startswith("### `cpdoctor env`: FAIL (exit 1)")
    row = next(line for line in out.splitlines() if line.startswith("| `cpdoctor_cpu` |"))
    assert row.count("✓") >= 8 and "✗" not in row
    assert "| `native` |" in out and "**FAIL** ring backward: dK/dV direction" in out
    assert "`cpdoctor check --ring 3`" in out


def test_bad_input_is_one_line_and_exit_2():
    run = run_cli("env", "--markdown", "-", "--json", "-", timeout=60)
    assert run.code == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "stdout" in lines[0], run.stderr


@pytest.mark.parametrize("option, word", [("--dtype", "fp64"), ("--device", "tpu")])
def test_a_word_outside_the_vocabulary_is_refused_by_the_parser(option, word):
    run = run_cli("env", option, word, timeout=60)
    assert run.code == 2, run
    assert f"Invalid value for '{option}'" in run.stderr and f"'{word}' is not one of" in run.stderr, run.stderr


def test_cuda_asked_for_without_one_cannot_examine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    run = run_cli("env", "--device", "cuda", timeout=60)
    assert run.code == 3, run
    assert run.stderr.strip().startswith("cpdoctor: cannot examine:") and len(run.stderr.strip().splitlines()) == 1


def test_without_diffusers_one_line_and_exit_2(tmp_path):
    """A missing required package is bad input (errors.BadInput, exit 2), said in one line without a traceback."""
    fake = tmp_path / "diffusers"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    run = run_cli("env", env={"PYTHONPATH": path}, timeout=60)
    assert run.code == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpdoctor: error:") and "diffusers" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
