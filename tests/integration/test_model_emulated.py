"""`cpdoctor model --emulate`: a real model class through enable_parallelism on a CUDA backend's CP code, its
kernels replaced by the CPU stand-ins (0.39.0's _native_flash backward transposes K/V twice: a CRASH).

Both checks run as one suite (`cpdoctor run`, the same `model` requests the command builds): one launch of
fresh interpreters (emulating ranks import diffusers after the stand-ins) instead of two commands, ~10 s less."""

from __future__ import annotations

import pytest
from conftest import run_cli

SUITE = """name: model-emulated
checks:
  - model: {model: flux, ring: 2, backend: _native_flash, dtype: bf16, emulate: true}
  - model: {model: flux, ulysses: 2, backend: _native_flash, dtype: bf16, emulate: true, patch: true}
"""


# slowest 20 (issue 28, full tier on 0.42.1, 2 workers on 2 cores): 19 s: one suite of every emulated model case, one launch per world size
@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model_emulated")
    (tmp / "suite.yaml").write_text(SUITE)
    junit = tmp / "model.xml"
    run = run_cli("run", str(tmp / "suite.yaml"), "--json", "-", "--junit", str(junit))
    return run, junit.read_text()


def test_model_on_emulated_native_flash(emulated, has_stale_kv_backward):
    run, junit = emulated
    finding = run.json["findings"][0]
    assert finding["probe"].endswith("emulated") and "not examined: the CUDA kernel itself" in finding["environment"]["emulated"]
    cases = junit.split("<testcase")[1:]
    if has_stale_kv_backward:
        assert finding["verdict"] == "CRASH" and "double transpose" in finding["diagnosis"], finding["diagnosis"]
        assert "<error" in cases[0]
    else:
        assert finding["verdict"] == "PASS", finding["diagnosis"]
        assert "<failure" not in cases[0] and "<error" not in cases[0]


def test_model_ulysses_on_emulated_native_flash_with_the_patch(emulated, has_stale_kv_backward):
    """Ulysses runs the backend's own backward op; the fix's Ulysses never does, so the patched run passes on
    every release (0.39.0: the stock run crashes on the double transpose)."""
    run, _ = emulated
    before = run.json["before"]["findings"][1]
    after = run.json["findings"][1]
    assert after["verdict"] == "PASS", after["diagnosis"]
    assert before["verdict"] == ("CRASH" if has_stale_kv_backward else "PASS"), before["diagnosis"]
    assert run.json["findings"][1]["probe"].endswith("emulated")
    assert run.code == (1 if has_stale_kv_backward else 0)
