"""The verdicts of `cpdoctor check` on the installed diffusers, through real multi-process gloo runs.

Cases that share a world size run in one launch (as the CLI's --patch does), to keep the suite fast; the
findings are built by the same functions the CLI uses.
"""

from __future__ import annotations

import pytest

from cpdoctor import api
from cpdoctor.launch import Case

TIMEOUT = 240


def findings(*requests):
    reqs = [api.build_request(**r) for r in requests]
    found = api.run_findings("attention", [Case(r) for r in reqs], reqs[0].world_size, "cpu", TIMEOUT)
    assert not [f for f in found if f.verdict in ("CRASH", "HANG")], [f.diagnosis for f in found]
    return found


@pytest.fixture(scope="module")
def world2():
    return findings(
        dict(ring=2),
        dict(ring=2, dtype="bf16"),
        dict(ulysses=2),
        dict(ring=2, mask_pad=3),
        dict(ring=2, mask_pad=3, dtype="bf16"),
        dict(ulysses=2, mask_pad=3, dtype="bf16"),
        dict(ring=2, backend="native"),
        dict(ring=2, backend="_native_math"),
        dict(ring=2, backend="_native_flash"),
    )


@pytest.fixture(scope="module")
def world4():
    return findings(dict(ring=4), dict(ring=2, ulysses=2))


def test_ring2(world2, has_stale_kv_backward):
    fp32, bf16 = world2[0], world2[1]
    for f in (fp32, bf16):
        assert f.tensors["out"].verdict == "PASS"
        assert f.tensors["out"].rel_err < (1e-6 if f is fp32 else 1e-2)
    if has_stale_kv_backward:
        for f in (fp32, bf16):
            assert f.verdict == "FAIL"
            assert 1.5 < f.tensors["dq"].rel_err < 3.0 and 1.0 < f.tensors["dk"].rel_err < 2.5
            assert "stale iteration-0" in f.diagnosis and "forward exact" in f.diagnosis
            assert "cpdoctor.patch()" in f.remedy
    else:
        assert fp32.verdict == bf16.verdict == "PASS"
        assert max(t.rel_err for t in fp32.tensors.values()) < 1e-6


def test_ulysses2_is_exact(world2):
    f = world2[2]
    assert f.verdict == "PASS", f.diagnosis
    assert all(t.rel_err < 1e-6 for t in f.tensors.values())


def test_mask_not_rotated_under_ring(world2):
    for f in (world2[3], world2[4]):  # fp32 and bf16: the bf16 tolerance still catches it
        assert f.verdict == "FAIL"
        assert f.tensors["out"].verdict == "FAIL" and f.tensors["out"].rel_err > 1e-2
        assert "padding mask" in f.diagnosis and "rotating the mask" in f.diagnosis
    assert world2[4].tensors["out"].tolerance < 0.03


def test_ulysses_gathers_the_mask(world2):
    f = world2[5]
    assert f.verdict == "PASS", f.diagnosis


def test_native_has_no_lse_for_ring(world2):
    f = world2[6]
    assert f.verdict == "UNSUPPORTED"
    assert "no LSE" in f.diagnosis


def test_native_math_ignores_cp(world2):
    f = world2[7]
    assert f.verdict == "FAIL"
    assert f.tensors["out"].verdict == "FAIL" and f.tensors["out"].rel_err > 0.5
    assert "ignores the parallel config" in f.diagnosis


def test_cuda_kernel_unsupported_on_cpu(world2):
    f = world2[8]
    assert f.verdict == "UNSUPPORTED"
    assert "does not run here" in f.diagnosis


def test_ring4_and_unified(world4, has_stale_kv_backward):
    ring4, unified = world4
    assert ring4.verdict == "FAIL"
    assert ring4.tensors["out"].verdict == "PASS"
    assert ring4.tensors["dk"].verdict == ring4.tensors["dv"].verdict == "FAIL"
    if has_stale_kv_backward:
        assert ring4.tensors["dq"].verdict == "FAIL"
        assert unified.verdict == "FAIL" and "ring inside unified" in unified.diagnosis
    else:
        assert ring4.tensors["dq"].verdict == "PASS"
        assert "wrong way round the ring" in ring4.diagnosis and "ring degree 4" in ring4.diagnosis
        assert unified.verdict == "PASS", unified.diagnosis


def test_ring3_names_the_direction_or_stale_kv(has_stale_kv_backward):
    (f,) = findings(dict(ring=3))
    assert f.verdict == "FAIL"
    assert f.tensors["dk"].rel_err > 0.5 and f.tensors["dv"].rel_err > 0.5
    assert f.tensors["out"].verdict == "PASS"
    if has_stale_kv_backward:
        assert "stale iteration-0" in f.diagnosis
    else:
        assert f.tensors["dq"].verdict == "PASS"
        assert "dQ exact" in f.diagnosis and "wrong way round the ring" in f.diagnosis
    assert "on all 3 ranks" in f.diagnosis
