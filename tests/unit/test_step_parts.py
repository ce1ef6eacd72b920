"""The step examination's parts that need no process: what the loss graph says, the reference's memory plan, the
two runs' contract (which functions take their degrees, what they are called with), the wrappers' names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.examinations.step.loss_graph import BackwardRoots, read_loss  # noqa: E402
from cpdoctor.examinations.step.reference import ReferencePlan, canonical, reference_plan  # noqa: E402
from cpdoctor.examinations.step.two_runs import StepJob, call_arguments, parameters_of, takes_degrees  # noqa: E402
from cpdoctor.examinations.step.watch import compute_dtype, unwrap  # noqa: E402


def test_read_loss_finds_the_scalars_and_the_reduction():
    x = torch.randn(4, 8, requires_grad=True)
    r = read_loss(torch.nn.functional.mse_loss(x, torch.zeros(4, 8)) * 2 / 4)
    assert r.reduction == "mean" and r.count == 32 and r.constants() == (0.25, 2.0)
    nested = read_loss(x.float().pow(2).reshape(4, -1).mean(1).mean() * torch.tensor(65536.0))
    assert nested.count == 32 and nested.tensor_scale() == 65536.0 and nested.constants() == ()  # GradScaler's scale
    summed = read_loss(x.chunk(2)[0].pow(2).sum() / 64)
    assert summed.reduction == "sum" and summed.constants() == (1 / 64,)
    assert read_loss(x.pow(2).mean() + x.sum()).reduction == "unknown"  # a sum of losses: not read


def test_backward_roots_records_each_root_once_and_restores_torch():
    original = torch.Tensor.backward
    x = torch.randn(3, requires_grad=True)
    roots = BackwardRoots().install()
    try:
        (x.pow(2).mean() * 3).backward()
        torch.autograd.backward(x.pow(2).sum())
    finally:
        roots.remove()
    assert [r.scale for r in roots.readings] == [3.0, 1.0]
    assert torch.Tensor.backward is original


def test_reference_plan_counts_the_copy_and_the_gradients():
    weights = {"a": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(500)}
    plan = reference_plan(weights, trainable=500, precision="fp64", native=True, available=10**9, peers=2)
    assert plan.copy_bytes == 1500 * 8 and plan.grad_bytes == 500 * 12 and plan.native_bytes == 500 * 8
    assert plan.working_bytes == 500 * 4 * 2 and plan.total == 12000 + 6000 + 4000 + 4000
    assert plan.fits and not ReferencePlan(10, 10, 0, 15).fits and "needs" in plan.text()


def test_which_functions_take_their_degrees(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("def a(watch):\n    pass\n\ndef b(watch_step, cp, dp):\n    pass\n\ndef c(job):\n    pass\n")
    assert not takes_degrees(parameters_of(str(script), "a"))
    assert takes_degrees(parameters_of(str(script), "b")) and takes_degrees(parameters_of(str(script), "c"))
    job = StepJob(ring=2, ulysses=2, dp=3, watch_step=print, with_cp=True)
    assert job.cp == 4
    assert call_arguments(("watch",), job) == ((print,), {})
    assert call_arguments(("watch_step", "cp", "dp"), job) == ((), {"watch_step": print, "cp": 4, "dp": 3})
    assert call_arguments(("job",), job) == ((), {"job": job})


def test_wrapper_names_and_unwrapping():
    assert canonical("transformer_blocks.0._checkpoint_wrapped_module.attn.to_q.weight") == "transformer_blocks.0.attn.to_q.weight"
    assert canonical("_orig_mod.x_embedder.weight") == "x_embedder.weight"

    class Model(torch.nn.Linear):
        config: dict = {}

    inner = Model(2, 2)
    wrapped = torch.nn.Module()
    wrapped.module = inner
    assert unwrap(wrapped) is inner
    compiled = torch.nn.Module()
    compiled._orig_mod = inner
    assert unwrap(compiled) is inner


def test_compute_dtype_is_the_least_precise():
    m = torch.nn.Linear(2, 2)
    assert compute_dtype(m, ["float32"]) == "fp32"
    assert compute_dtype(m, ["bfloat16"]) == "bf16"  # autocast with fp32 weights
    assert compute_dtype(m.to(torch.float16), []) == "fp16"


def test_dots_in_slices_count_non_finite_values_only_when_there_are_some():
    from cpdoctor.examinations.step import measure

    x = torch.ones(10)
    x[3] = float("nan")
    x[7] = float("inf")
    assert measure.dots(x, torch.ones(10)).nonfinite == 2 and measure.dots(torch.ones(10), torch.ones(10)).nonfinite == 0
    big = torch.randn(3 * measure.CHUNK + 5, dtype=torch.float64)
    d = measure.dots(big.float(), (0.5 * big).float(), 2.0)
    assert d.d2 < 1e-6 * d.r2 and abs(d.xr / d.r2 - 2.0) < 1e-5  # the slices add up; float32 dots keep ~1e-6
