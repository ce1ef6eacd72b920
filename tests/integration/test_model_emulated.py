"""`cpdoctor model --emulate`: a real model class through enable_parallelism on a CUDA backend's CP code, its
kernels replaced by the CPU stand-ins (0.39.0's _native_flash backward transposes K/V twice: a CRASH)."""

from __future__ import annotations

from conftest import run_cli


def test_model_on_emulated_native_flash(has_stale_kv_backward, tmp_path):
    junit = tmp_path / "model.xml"
    run = run_cli(
        "model", "flux", "--ring", "2", "--backend", "_native_flash", "--dtype", "bf16", "--emulate", "--json", "-", "--junit", str(junit)
    )
    (finding,) = run.json["findings"]
    assert finding["probe"].endswith("emulated") and "not examined: the CUDA kernel itself" in run.json["environment"]["emulated"]
    if has_stale_kv_backward:
        assert finding["verdict"] == "CRASH" and "double transpose" in finding["diagnosis"], finding["diagnosis"]
        assert "<error" in junit.read_text()
    else:
        assert finding["verdict"] == "PASS", finding["diagnosis"]
        assert run.code == 0 and "<failure" not in junit.read_text()


def test_model_ulysses_on_emulated_native_flash_with_the_patch(has_stale_kv_backward):
    """Ulysses runs the backend's own backward op; the fix's Ulysses never does, so the patched run passes on
    every release (0.39.0: the stock run crashes on the double transpose)."""
    run = run_cli("model", "flux", "--ulysses", "2", "--backend", "_native_flash", "--dtype", "bf16", "--emulate", "--patch", "--json", "-")
    (before,) = run.json["before"]["findings"]
    (after,) = run.json["findings"]
    assert after["verdict"] == "PASS", after["diagnosis"]
    assert before["verdict"] == ("CRASH" if has_stale_kv_backward else "PASS"), before["diagnosis"]
    assert run.code == 0
