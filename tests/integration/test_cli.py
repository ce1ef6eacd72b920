"""The command line as a user meets it: exit codes, one-line errors, JSON contract, a light --help."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import run_cli


def test_help_does_not_import_torch_or_diffusers():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['cpdoctor', '--help']\n"
        "try:\n    runpy.run_module('cpdoctor', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "check" in out
    assert out.strip().endswith("HEAVY="), out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--ring", "0"], "at least 1"),
        (["--ring", "1", "--ulysses", "1"], "ring × ulysses ≥ 2"),
        (["--ring", "3", "--seq", "100"], "does not divide"),
        (["--ulysses", "3", "--heads", "8"], "does not divide by --ulysses"),
        (["--mask-pad", "600"], "--mask-pad"),
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "nan"], "positive, finite"),
        (["--timeout", "inf"], "positive, finite"),
        (["--json", "/nonexistent-dir/r.json"], "cannot write --json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    run = run_cli("check", *args, timeout=60)
    assert run.code == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("option, word", [("--dtype", "fp64"), ("--device", "tpu"), ("--impl", "megatron"), ("--kernel", "fa3")])
def test_a_word_outside_the_vocabulary_is_refused_by_the_parser(option, word):
    """typer refuses it before the command runs: exit 2, its own message naming the option and the choices."""
    run = run_cli("check", option, word, timeout=60)
    assert run.code == 2, run
    assert f"Invalid value for '{option}'" in run.stderr and f"'{word}' is not one of" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.smoke
def test_unknown_backend_names_the_closest():
    run = run_cli("check", "--backend", "_native_flsh")
    assert run.code == 2, run
    assert "unknown attention backend '_native_flsh'" in run.stderr and "_native_flash" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_json_to_stdout_is_the_contract(has_stale_kv_backward):
    run = run_cli("check", "--ring", "2", "--json", "-")
    data = run.json  # stdout holds JSON alone: no table
    assert data["verdict"] == ("FAIL" if has_stale_kv_backward else "PASS")
    assert run.code == (1 if has_stale_kv_backward else 0)
    assert data["exit_code"] == run.code
    env = data["environment"]
    for key in ("torch", "diffusers", "device", "world_size", "backend"):
        assert key in env
    assert env["world_size"] == 2 and env["backend"] == "cpdoctor_cpu"
    (finding,) = data["findings"]
    for key in ("probe", "verdict", "diagnosis", "remedy", "tensors"):
        assert key in finding
    assert set(finding["tensors"]) == {"out", "dq", "dk", "dv"}
    for t in finding["tensors"].values():
        for key in ("rel_err", "max_abs", "worst_rank", "nonfinite"):
            assert key in t


def test_table_shows_every_tensor_and_the_verdict_line(tmp_path):
    out = tmp_path / "r.json"
    run = run_cli("check", "--ulysses", "2", "--json", str(out))
    assert run.code == 0, run.stderr
    for word in ("out", "dQ", "dK", "dV", "rel L2 err", "max abs err", "worst rank", "NaN/Inf", "verdict PASS"):
        assert word in run.stdout
    assert '"verdict": "PASS"' in out.read_text()


@pytest.mark.smoke
def test_unsupported_backend_exits_3():
    run = run_cli("check", "--backend", "flash", "--json", "-")
    assert run.code == 3
    assert run.json["verdict"] == "UNSUPPORTED"
    assert "flash-attn" in run.json["findings"][0]["diagnosis"]
    # answered by the parent from diffusers' own requirement check, before any rank starts
    assert run.json["wall_s"] == 0 and "process_group" not in run.json["environment"]


def test_version():
    run = run_cli("--version", timeout=30)
    assert run.code == 0 and run.stdout.startswith("cpdoctor ")


@pytest.mark.smoke
def test_backend_without_a_backward_here_is_unsupported():
    run = run_cli("check", "--backend", "flex", "--json", "-")
    assert run.code == 3, run.stderr
    assert run.json["verdict"] == "UNSUPPORTED"
