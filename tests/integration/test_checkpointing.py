"""Ring CP inside non-reentrant activation checkpointing (issue 30): the YAML key and `--checkpointing`, diffusers'
ring backward crashing with torch's CheckpointError (named), cpdoctor's fix and Ulysses passing; docs/FACTS.md."""

from __future__ import annotations

from conftest import run_cli, run_cli_many


def test_suite_ring_crashes_under_checkpointing_and_the_patch_and_ulysses_pass(ring_unpacks_twice, tmp_path):
    path = tmp_path / "ckpt.yaml"
    small = "checkpointing: true, seq: 64, heads: 2, batch: 1"  # the defect is in the code path, not the shape
    path.write_text(f"name: ckpt\nchecks:\n  - attention: {{ring: 2, {small}}}\n  - attention: {{ulysses: 2, {small}}}\n")
    run = run_cli("run", str(path), "--patch", "--json", "-")
    data = run.json
    ring, ulysses = data["before"]["findings"]
    assert [c["attention"]["checkpointing"] for c in data["request"]["checks"]] == [True, True]
    assert ring["probe"].endswith("checkpointing")
    if ring_unpacks_twice:
        assert ring["verdict"] == "CRASH", ring["diagnosis"]
        assert "Unpack is being triggered for a tensor that was already unpacked once" in ring["diagnosis"]
        assert "once per ring step" in ring["diagnosis"] and "non-reentrant" in ring["diagnosis"]
        assert ring["details"]["signature"] == "ring backward under checkpointing"
        assert "cpdoctor.patch()" in ring["remedy"] and "Ulysses-only" in ring["remedy"]
    else:
        assert ring["verdict"] == "PASS", ring["diagnosis"]
    assert ulysses["verdict"] == "PASS", ulysses["diagnosis"]  # its backward calls the op once
    assert [f["verdict"] for f in data["findings"]] == ["PASS", "PASS"], [f["diagnosis"] for f in data["findings"]]
    assert run.code == 0  # the verdict of the fixed run


def test_checkpointing_is_diffusers_own_option():
    (peer,) = run_cli_many([["check", "--impl", "torch", "--checkpointing"]])
    assert peer.code == 2 and "--checkpointing applies to --impl diffusers only" in peer.stderr
