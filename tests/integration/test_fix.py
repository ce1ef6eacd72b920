"""The fix: cpdoctor's ring attention patched into the installed diffusers, measured with real gloo ranks.

Every multi-process check goes through `cpdoctor.launch.run_spawned` and the probes (attention: op-level
parity against an fp64 reference; fix_training: a tiny two-layer model's training step against one process).
Cases are batched so each world size launches once. Expectations never read the diffusers version: what
the unpatched ring gets wrong is taken from the patch report, which reads the replaced code.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from cpdoctor.errors import CannotExamine
from cpdoctor.examinations import registry
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.fix_training import FixTrainingRequest
from cpdoctor.launch import Case, Job
from cpdoctor.launch.spawn import run_spawned

TIMEOUT = 240
FP32_EPS = 1e-6
BF16_EPS = 1e-3
FAIL_AT = 1e-2
"""An unpatched case counts as failing when some tensor is off by more than this (the bugs give 7e-2 to 7)."""


def attention_case(patched: bool = True, **kw) -> dict:
    return {"request": AttentionRequest(**kw).validate().to_dict(), "patched": patched}


def _typed(kind: str, case: dict) -> Case:
    """A test's case, written as plain fields, as the launcher's typed Case."""
    fields = dict(case)
    patched = bool(fields.pop("patched", False))
    if kind == "attention":
        return Case(AttentionRequest.from_dict(fields.pop("request")).validate(), patched)
    return Case(FixTrainingRequest(**fields), patched)


def launch(kind: str, cases: list[dict], world: int) -> list[dict]:
    res = run_spawned(Job(registry.get(kind), tuple(_typed(kind, c) for c in cases), "auto", TIMEOUT), world)
    assert len(res.outcomes) == len(cases) and all(o.completed for o in res.outcomes), res.outcomes[-1]
    return [o.evaluated if isinstance(o.evaluated, dict) else dataclasses.asdict(o.evaluated) for o in res.outcomes]


def errors(ev: dict) -> dict[str, tuple[float, float]]:
    return {n: (t["rel_err"], t["baseline_rel_err"]) for n, t in ev["tensors"].items()}


def assert_pass(ev: dict, dtype: str = "fp32") -> None:
    eps = FP32_EPS if dtype == "fp32" else BF16_EPS
    for name, (err, base) in errors(ev).items():
        assert err <= 2 * base + eps, f"{name}: rel err {err:.3e} vs single-process {base:.3e}"


def worst(ev: dict) -> float:
    return max(err for err, _ in errors(ev).values())


# --------------------------------------------------------------------------------------------------------
# One launch per world size (module-scoped)
# --------------------------------------------------------------------------------------------------------

W2 = {
    "fp32": attention_case(ring=2),
    "bf16": attention_case(ring=2, dtype="bf16"),
    "mask": attention_case(ring=2, mask_pad=3),
    "mask_whole_chunk": attention_case(ring=2, mask_pad=300),
    "unpatched": attention_case(patched=False, ring=2),
    "unpatched_mask": attention_case(patched=False, ring=2, mask_pad=3),
    "ulysses2": attention_case(ring=1, ulysses=2),
    "ulysses2_mask": attention_case(ring=1, ulysses=2, mask_pad=3),
    "ulysses2_bf16": attention_case(ring=1, ulysses=2, dtype="bf16"),
}
W3 = {
    "fp32": attention_case(ring=3, seq=513),
    "bf16": attention_case(ring=3, seq=513, dtype="bf16"),
    "mask_whole_chunk": attention_case(ring=3, seq=513, mask_pad=200),
    "unpatched": attention_case(patched=False, ring=3, seq=513),
    "head_passes_mask": attention_case(ring=3, seq=3072, heads=8, head_dim=64, batch=1, mask_pad=40),
}
W4 = {
    "ring4": attention_case(ring=4),
    "ring2_ulysses2": attention_case(ring=2, ulysses=2),
    "ring2_ulysses2_mask": attention_case(ring=2, ulysses=2, mask_pad=3),
    "ring4_mask_whole_chunk": attention_case(ring=4, mask_pad=200),
    "unpatched_ring4": attention_case(patched=False, ring=4),
}
W8 = {
    "ring8": attention_case(ring=8),
    "ring8_mask_whole_chunk": attention_case(ring=8, mask_pad=100),
}
"""Eight ranks, seven hops per pass: the streamed K/V and mask and the dK/dV accumulator all the way round."""
TRAIN2 = {
    "plain": {"ring": 2, "patched": True, "compare_original": True},
    "bool2d": {"ring": 2, "patched": True, "mask": "bool2d"},
    "additive_whole_chunk": {"ring": 2, "patched": True, "mask": "additive", "mask_pad": 40},
    "unpatched_mask": {"ring": 2, "patched": False, "mask": "bool4d"},
    "unpatched": {"ring": 2, "patched": False},
    "ulysses2_bool2d": {"ring": 1, "ulysses": 2, "patched": True, "mask": "bool2d", "compare_original": True},
}
TRAIN4 = {
    "ring4": {"ring": 4, "patched": True},
    "ring2_ulysses2_mask": {"ring": 2, "ulysses": 2, "patched": True, "mask": "bool4d"},
    "unpatched_ring4": {"ring": 4, "patched": False},
}


def _run_named(kind: str, named: dict, world: int) -> dict:
    return dict(zip(named, launch(kind, list(named.values()), world)))


@pytest.fixture(scope="module")
def att2() -> dict:
    return _run_named("attention", W2, 2)


@pytest.fixture(scope="module")
def att3() -> dict:
    return _run_named("attention", W3, 3)


@pytest.fixture(scope="module")
def att8() -> dict:
    return _run_named("attention", W8, 8)


@pytest.fixture(scope="module")
def att4() -> dict:
    return _run_named("attention", W4, 4)


@pytest.fixture(scope="module")
def train2() -> dict:
    return _run_named("fix_training", TRAIN2, 2)


@pytest.fixture(scope="module")
def train4() -> dict:
    return _run_named("fix_training", TRAIN4, 4)


@pytest.fixture(scope="module")
def original_traits() -> dict:
    """What the installed (unpatched) ring does, read from its code by the patch."""
    from cpdoctor.fix import patch

    was = patch.is_patched()
    patch.revert()
    report = patch.apply()
    patch.revert()
    if was:
        patch.apply()
    return report.to_dict()


# --------------------------------------------------------------------------------------------------------
# Op level
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "mask", "mask_whole_chunk"])
def test_ring2_patched_is_exact(att2, name):
    assert_pass(att2[name])


def test_ring2_bf16_patched(att2):
    assert_pass(att2["bf16"], "bf16")


@pytest.mark.parametrize("name,dtype", [("ulysses2", "fp32"), ("ulysses2_mask", "fp32"), ("ulysses2_bf16", "bf16")])
def test_ulysses2_patched(att2, name, dtype):
    """The fixed Ulysses (all-to-all, the backend's fused kernel with explicit layouts, all-to-all back)."""
    assert_pass(att2[name], dtype)


@pytest.mark.parametrize("name,dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("mask_whole_chunk", "fp32")])
def test_ring3_patched(att3, name, dtype):
    assert_pass(att3[name], dtype)


def test_ring3_in_passes_over_heads_with_a_mask(att3, monkeypatch):
    """Chunks large enough for the fixed ring to run over groups of heads (fix/ring.py `head_passes`), with a mask
    that travels with the keys, through diffusers' real templates on gloo: exact."""
    from cpdoctor.fix import ring
    from cpdoctor.launch.spawn import _threads_per_rank

    assert_pass(att3["head_passes_mask"])
    q = torch.empty(1, 1024, 8, 64, device="meta")
    place = dataclasses.make_dataclass("Place", ["rank", "world"])(0, 3)
    threads = int(os.environ.get("OMP_NUM_THREADS") or _threads_per_rank(3))  # what each rank got (spawn.py)
    monkeypatch.setattr(ring, "_parallel_slots", lambda device: threads)
    passes = ring.head_passes(q, q, ring.ChunkMasks(None, 1024, place), place)
    assert len(passes) > 1 or threads > 4, (threads, passes)  # up to 4 threads a rank, the ranks ran in passes


@pytest.mark.parametrize("name", ["ring8", "ring8_mask_whole_chunk"])
def test_ring8_patched(att8, name):
    assert_pass(att8[name])


@pytest.mark.parametrize("name", ["ring4", "ring2_ulysses2", "ring2_ulysses2_mask", "ring4_mask_whole_chunk"])
def test_world4_patched(att4, name):
    assert_pass(att4[name])


def test_unpatched_still_fails_where_it_did(att2, att3, att4, original_traits):
    """The probe's set_patched(False) really gives diffusers' own ring back: its known failures return."""
    assert worst(att2["unpatched_mask"]) > FAIL_AT  # mask not rotated (every release)
    assert worst(att3["unpatched"]) > FAIL_AT  # dK/dV direction (0.42.1) or stale KV (0.39.0)
    assert worst(att4["unpatched_ring4"]) > FAIL_AT
    if original_traits["original_backward_passes_tensors"] is False:  # stale KV: wrong already at ring 2
        assert worst(att2["unpatched"]) > FAIL_AT
    else:
        assert_pass(att2["unpatched"])


def test_unpatched_forward_without_mask_is_right(att2, att3):
    """Where the original forward is right (no mask), the unpatched out passes: the probe is fair."""
    for ev in (att2["unpatched"], att3["unpatched"]):
        err, base = errors(ev)["out"]
        assert err <= 2 * base + FP32_EPS


# --------------------------------------------------------------------------------------------------------
# A training step of a tiny model through dispatch_attention_fn
# --------------------------------------------------------------------------------------------------------

TRAIN_TOL = 2e-6


@pytest.mark.parametrize("name", ["plain", "bool2d", "additive_whole_chunk", "ulysses2_bool2d"])
def test_fix_training_ring2_patched_matches_single_process(train2, name):
    ev = train2[name]
    assert ev["out_rel_err"] < TRAIN_TOL and ev["x_grad_rel_err"] < TRAIN_TOL
    assert ev["worst_param_rel_err"] < TRAIN_TOL, (ev["worst_param"], ev["worst_param_rel_err"])
    assert ev["rng_untouched"]


def test_patched_forward_equals_original_forward(train2):
    """Same blocks, same merge order, same formula: the forward is unchanged where the original is right."""
    assert train2["plain"]["forward_vs_other"] < 1e-6
    assert train2["ulysses2_bool2d"]["forward_vs_other"] < 1e-6  # Ulysses: the same one fused block


@pytest.mark.parametrize("name", ["ring4", "ring2_ulysses2_mask"])
def test_fix_training_world4_patched(train4, name):
    ev = train4[name]
    assert ev["worst_param_rel_err"] < TRAIN_TOL, (ev["worst_param"], ev["worst_param_rel_err"])
    assert ev["out_rel_err"] < TRAIN_TOL and ev["x_grad_rel_err"] < TRAIN_TOL


def test_fix_training_unpatched_fails(train2, train4, original_traits):
    assert train2["unpatched_mask"]["worst_param_rel_err"] > FAIL_AT
    assert train4["unpatched_ring4"]["worst_param_rel_err"] > FAIL_AT
    stale = original_traits["original_backward_passes_tensors"] is False
    assert (train2["unpatched"]["worst_param_rel_err"] > FAIL_AT) == stale


# --------------------------------------------------------------------------------------------------------
# The patch API (in this process)
# --------------------------------------------------------------------------------------------------------


@pytest.fixture
def clean_patch():
    from cpdoctor.fix import patch

    patch.revert()
    yield patch
    patch.revert()


def test_apply_revert_identity_and_idempotence(clean_patch):
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix.ring import RingAttention
    from cpdoctor.fix.ulysses import UlyssesAttention

    patch = clean_patch
    mod = compat.dispatch_module()
    original = mod.TemplatedRingAttention
    assert not patch.is_patched()
    original_ulysses = mod.TemplatedUlyssesAttention
    report = patch.apply()
    assert mod.TemplatedRingAttention is RingAttention and patch.is_patched()
    assert mod.TemplatedUlyssesAttention is UlyssesAttention and UlyssesAttention.original is original_ulysses
    assert [r.name for r in report.replaced] == ["TemplatedRingAttention", "TemplatedUlyssesAttention"]
    assert report.replaced[0].original.endswith("attention_dispatch.TemplatedRingAttention")
    assert any("Ulysses backward runs the backend's own backward op" in r for r in report.reasons) and not report.skipped
    assert "_templated_context_parallel_attention" in report.callers
    assert report.original_gathers_mask is False and report.reasons
    again = patch.apply()
    assert again.already_patched and again.replaced == report.replaced
    assert patch.revert() is True
    assert mod.TemplatedRingAttention is original and mod.TemplatedUlyssesAttention is original_ulysses
    assert UlyssesAttention.original is None
    assert patch.revert() is False
    with patch.patched() as r:
        assert patch.is_patched() and r.replaced
    assert mod.TemplatedRingAttention is original
    patch.set_patched(True)
    patch.set_patched(True)
    assert patch.is_patched()
    patch.set_patched(False)
    patch.set_patched(False)
    assert mod.TemplatedRingAttention is original


def test_refuses_unrecognised_ring(clean_patch, monkeypatch):
    from cpdoctor.compat import diffusers as compat

    patch = clean_patch
    mod = compat.dispatch_module()

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, attn_mask, _parallel_config=None):  # another signature
            return query

    monkeypatch.setattr(mod, "TemplatedRingAttention", Other)
    with pytest.raises(patch.PatchRefused, match="forward has the parameters") as refused:
        patch.apply()
    assert isinstance(refused.value, CannotExamine)  # the CLI's "could not examine" (exit code 3)
    assert mod.TemplatedRingAttention is Other
    report = patch.apply(force=True)
    assert report.forced and "parameters" in report.problem
    patch.revert()
    assert mod.TemplatedRingAttention is Other


def test_unrecognised_ulysses_is_kept_and_reported(clean_patch, monkeypatch):
    """The ring is still fixed; a Ulysses template of another shape stays, and the report says why."""
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix.ring import RingAttention

    patch = clean_patch
    mod = compat.dispatch_module()

    class Other(torch.autograd.Function):
        @staticmethod
        def forward(ctx, query, key, value, _parallel_config=None):  # another signature
            return query

    monkeypatch.setattr(mod, "TemplatedUlyssesAttention", Other)
    report = patch.apply()
    assert mod.TemplatedRingAttention is RingAttention and mod.TemplatedUlyssesAttention is Other
    assert [r.name for r in report.replaced] == ["TemplatedRingAttention"]
    assert len(report.skipped) == 1 and "TemplatedUlyssesAttention" in report.skipped[0] and "parameters" in report.skipped[0]
    assert "kept TemplatedUlyssesAttention" in report.summary()
    patch.revert()
    forced = patch.apply(force=True)  # force is for the ring only: the unknown Ulysses class still stays
    assert mod.TemplatedUlyssesAttention is Other and len(forced.skipped) == 1


def test_a_partly_reverted_patch_keeps_diffusers_classes(clean_patch):
    """The ring put back by hand while the fixed Ulysses stays: a new apply (forced or not) must neither record
    cpdoctor's class as the original nor point the fixed Ulysses at itself; revert gives diffusers' classes back."""
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix.ulysses import UlyssesAttention

    patch = clean_patch
    mod = compat.dispatch_module()
    ring, ulysses = mod.TemplatedRingAttention, mod.TemplatedUlyssesAttention
    patch.apply()
    mod.TemplatedRingAttention = ring
    report = patch.apply(force=True)
    assert mod.TemplatedUlyssesAttention is UlyssesAttention and UlyssesAttention.original is ulysses
    assert [r.original.rsplit(".", 1)[-1] for r in report.replaced] == ["TemplatedRingAttention", "TemplatedUlyssesAttention"]
    assert patch.revert() is True
    assert mod.TemplatedRingAttention is ring and mod.TemplatedUlyssesAttention is ulysses


def test_autopatch_env():
    code = "import cpdoctor.autopatch as a; from cpdoctor.fix import patch; print(patch.is_patched(), a.report is not None)"
    env = {**os.environ, "CPDOCTOR_PATCH": "1"}
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == ["True", "True"]
    lines = [ln for ln in on.stderr.splitlines() if ln.startswith("cpdoctor:")]
    assert len(lines) == 1 and "TemplatedRingAttention" in lines[0]
    env.pop("CPDOCTOR_PATCH")
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert off.stdout.split() == ["False", "False"] and "cpdoctor:" not in off.stderr


# --------------------------------------------------------------------------------------------------------
# Kernels (single process)
# --------------------------------------------------------------------------------------------------------


def _block_inputs(dtype=torch.float32, sq=40, sk=24, masked_rows=False):
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(2, 3, n, 16, generator=g).to(dtype) for n in (sq, sk, sk, sq))
    mask = torch.ones(2, 1, 1, sk, dtype=torch.bool)
    mask[..., -5:] = False
    return q, k, v, do, mask


def test_kernel_selection():
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix import block_kernels

    def _native_flash_attention_forward_op(*a, **k):  # noqa: N802 - named like diffusers' op
        pass

    def _cudnn_attention_forward_op(*a, **k):
        pass

    def something_else(*a, **k):
        pass

    assert isinstance(block_kernels.select(cpu_backend.forward_op), block_kernels.CpuFlashKernel)
    assert isinstance(block_kernels.select(_native_flash_attention_forward_op), block_kernels.NativeFlashKernel)
    assert isinstance(block_kernels.select(_cudnn_attention_forward_op), block_kernels.CudnnKernel)
    assert type(block_kernels.select(something_else)) is block_kernels.BackendForwardKernel


def test_math_kernel_matches_cpu_flash_kernel():
    from cpdoctor.fix import block_kernels

    q, k, v, do, mask = _block_inputs()
    scale = 16**-0.5
    flash, math_k = block_kernels.CpuFlashKernel(), block_kernels.MathKernel()
    out_f, lse_f = flash.forward(q, k, v, mask, scale)
    out_m, lse_m = math_k.forward(q, k, v, mask, scale)
    assert torch.allclose(out_f, out_m, atol=1e-5) and torch.allclose(lse_f, lse_m, atol=1e-5)
    for a, b in zip(flash.backward(do, q, k, v, out_f, lse_f, mask, scale), math_k.backward(do, q, k, v, out_f, lse_f, mask, scale)):
        assert torch.allclose(a, b, atol=1e-5)


def test_backend_forward_kernel_uses_the_op_and_exact_math_backward():
    """The fallback for unknown backends: their forward op (model layout), the fp32 math backward."""
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix import block_kernels

    q, k, v, do, mask = _block_inputs()
    scale = 16**-0.5
    fb = block_kernels.BackendForwardKernel(cpu_backend.forward_op, None)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = fb.forward(t(q), t(k), t(v), mask, scale)
    ref_out, ref_lse = block_kernels.CpuFlashKernel().forward(q, k, v, mask, scale)
    assert torch.allclose(t(out), ref_out, atol=1e-6) and torch.allclose(lse, t(ref_lse), atol=1e-6)
    got = fb.backward(t(do), t(q), t(k), t(v), out, lse, mask, scale)
    ref = block_kernels.CpuFlashKernel().backward(do, q, k, v, ref_out, ref_lse, mask, scale)
    for a, b in zip(got, ref):
        assert torch.allclose(t(a), b, atol=1e-5)
