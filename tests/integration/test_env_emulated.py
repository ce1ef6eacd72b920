"""`cpdoctor env --emulate`: the CUDA backends' ops run on CPU through the kernel stand-ins, so their
capabilities are measured by running them (not on meta), with the defects of the installed release."""

from __future__ import annotations

from conftest import run_cli


def test_env_emulated_runs_the_gpu_backends_ops(has_stale_kv_backward):
    run = run_cli("env", "--emulate", "--json", "-")
    data = run.json
    assert "emulated on CPU" in data["environment"]["emulated"] and "not examined" in data["environment"]["emulated"]
    rows = {r["name"]: r for r in data["backends"]}
    for name in ("_native_flash", "_native_cudnn", "flash"):
        op = rows[name]["op"]
        assert op["measured_on"] == "cpu" and rows[name]["runs_here"], (name, op)  # run, not only shaped on meta
    findings = " ".join(f["diagnosis"] for f in data["findings"])
    if has_stale_kv_backward:  # docs/FACTS.md item 5: 0.39.0's glue around the kernels
        assert rows["flash"]["op"]["rng_advanced"] is True  # forced dropout 1e-30 moves the generator
        assert "Number of heads in key/value must divide" in rows["_native_flash"]["op"]["backward_error"]
        assert rows["_native_cudnn"]["op"]["saved_lse"] is False
        assert run.code == 1 and "LSE" in findings
    else:
        for name in ("_native_flash", "_native_cudnn", "flash"):
            op = rows[name]["op"]
            assert op["rng_advanced"] is False and op["backward_error"] is None and op["saved_lse"] is True, (name, op)
