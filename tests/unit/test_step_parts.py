"""The step examination's parts that need no process: what the loss graph says in every spelling, what the
factors of the degrees are read as, the observed entry points (GradScaler, clipping, backward; a compiled model
through the hooks), the reference's memory plan, the two runs' contract, the wrappers' names."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from cpdoctor.examinations.step.judgment.factors import expectation  # noqa: E402
from cpdoctor.examinations.step.judgment.measure import OutGrad  # noqa: E402
from cpdoctor.examinations.step.judgment.reference import ReferencePlan, canonical, reference_plan  # noqa: E402
from cpdoctor.examinations.step.runs.two_runs import StepJob, call_arguments, parameters_of, takes_degrees  # noqa: E402
from cpdoctor.examinations.step.watcher.events import (  # noqa: E402
    ClipNorm,
    ClipValue,
    EventLog,
    GradScale,
    InnerStep,
    ScalerScale,
    ScalerStep,
    ScalerUnscale,
    Source,
)
from cpdoctor.examinations.step.watcher.group import StepGroup  # noqa: E402
from cpdoctor.examinations.step.watcher.loss_graph import read_root  # noqa: E402
from cpdoctor.examinations.step.watcher.observe import OBSERVING, Capture, Recorder  # noqa: E402
from cpdoctor.examinations.step.watcher.record import Hooks, compute_dtype, unwrap  # noqa: E402

CP = 2
GROUP = StepGroup(rank=0, world=CP, ranks=(0, 1), ring=CP, ulysses=1, seq=1, index=1, timeout_s=1.0, cp_groups=((0, 1),))
SHARDED, SAME = OutGrad.PER_SHARD, OutGrad.REPLICATED


def _shard(x):
    return x.chunk(CP, dim=1)[0]


SPELLINGS = {
    # name: (loss of (out, target), what the peers' output gradients are, the loss's factor of the degrees at CP 2
    # with one micro-batch under each reading (one value: observed, nothing read))
    "mean": (lambda o, t: F.mse_loss(o, t), SAME, {1.0}),
    "python factor": (lambda o, t: F.mse_loss(o, t) * CP, SAME, {1.0, 2.0}),
    "0-dim tensor factor": (lambda o, t: F.mse_loss(o, t) * torch.tensor(float(CP)), SAME, {1.0, 2.0}),
    "1-element tensor factor": (lambda o, t: F.mse_loss(o, t) * torch.tensor([float(CP)]), SAME, {1.0, 2.0}),
    "factor first": (lambda o, t: torch.tensor(float(CP)) * F.mse_loss(o, t), SAME, {1.0, 2.0}),
    "inside the reduction": (lambda o, t: (CP * (o - t) ** 2).mean(), SAME, {1.0, 2.0}),
    "method call inside": (lambda o, t: ((o - t) ** 2).mul(CP).mean(), SAME, {1.0, 2.0}),
    "divided": (lambda o, t: F.mse_loss(o, t) / CP, SAME, {1.0, 0.5}),
    "half a weight": (lambda o, t: 0.5 * F.mse_loss(o, t), SAME, {1.0, 0.5}),
    "nested means": (lambda o, t: torch.mean(((o - t) ** 2).reshape(1, -1), 1).mean(), SAME, {1.0}),
    "weighted inside": (lambda o, t: (torch.linspace(0, 1, 16).reshape(1, 16, 1) * (o - t) ** 2).mean() * CP, SAME, {1.0, 2.0}),
    "two terms, both × cp": (lambda o, t: F.mse_loss(o, t) * CP + 0.1 * o.pow(2).mean() * CP, SAME, {1.0, 2.0}),
    "a mean over half the output, replicated": (lambda o, t: F.mse_loss(o[:, :8], t[:, :8]), SAME, {1.0}),
    "two halves of the batch, chunked": (lambda o, t: F.mse_loss(*[x.chunk(2, 1)[0] for x in (o, t)]) + F.mse_loss(*[x.chunk(2, 1)[1] for x in (o, t)]), SAME, {1.0}),
    "shard sum / full count": (lambda o, t: (_shard(o) - _shard(t)).pow(2).sum() / o.numel(), SHARDED, {1.0}),
    "shard sum / shard count": (lambda o, t: (_shard(o) - _shard(t)).pow(2).sum() / _shard(o).numel(), SHARDED, {1.0, 2.0, 0.5}),  # 1/32: also 1/cp over the 16 tokens
    "shard mean": (lambda o, t: F.mse_loss(_shard(o), _shard(t)), SHARDED, {2.0}),
    "shard mean / cp": (lambda o, t: F.mse_loss(_shard(o), _shard(t)) / CP, SHARDED, {2.0, 1.0}),
    "a constant that is no degree": (lambda o, t: F.mse_loss(o, t) / 0.707, SAME, {1.0}),
}  # fmt: skip


def _read(loss_fn, shape: OutGrad = SAME, micro: int = 1):
    lin = torch.nn.Linear(4, 4)
    out = lin(torch.randn(1, 16, 4))
    root = read_root(loss_fn(out, torch.randn(1, 16, 4)), {id(out.grad_fn): 0}, frozenset(id(p) for p in lin.parameters()), {})
    return root, expectation([EventLog([root])], GROUP, tuple(out.shape), 1, micro, shapes=(shape,)).readings


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_is_read_by_what_was_observed_and_each_number_both_ways(name):
    """A mean is observed (the elements it averaged, with what the peers' output gradients are); a number equal to a
    power of the degrees is read every way its value fits (a weight of the step's own, or each power); any other
    number is the same in one process."""
    loss_fn, shape, powers = SPELLINGS[name]
    root, readings = _read(loss_fn, shape)
    assert root.terms and not root.hidden and not root.param_paths and not readings.unknown
    assert {o.loss_power for o in readings.outcomes()} == powers, [lit.both_ways() for lit in readings.literals]
    assert (readings.certain_power is not None) == (len(powers) == 1)


def test_the_factor_over_the_micro_batches_as_one_python_number():
    """`loss * (cp / accum)` is one constant 2/3 with 3 micro-batches (the model's forwards): cp, and the
    accumulation's 1/3; `loss / 2 / cp` with 2 micro-batches is two numbers, each read both ways."""
    _, readings = _read(lambda o, t: F.mse_loss(o, t) * (CP / 3), micro=3)
    assert {o.loss_power for o in readings.outcomes()} == {1.0, 2.0} and "cp / 3 micro-batches" in readings.literals[0].meaning(1)
    _, readings = _read(lambda o, t: F.mse_loss(o, t) / 2 / CP, micro=2)
    assert sorted(o.loss_power for o in readings.outcomes()) == [0.25, 0.5, 0.5, 1.0]
    assert "the mean over its 2 micro-batches" in readings.literals[0].weight


def test_backward_roots_are_not_micro_batches():
    """Three roots of one forward (a loss per term, each with its own backward): the micro-batches are the forwards
    (one), so 2/3 is no degree power over them: a weight, the same in one process (it was read as cp / 3)."""
    lin = torch.nn.Linear(4, 4)
    out = lin(torch.randn(1, 16, 4))
    roots = [read_root(F.mse_loss(out, torch.zeros_like(out)) * (CP / 3), {id(out.grad_fn): 0}, frozenset(), {}) for _ in range(3)]
    readings = expectation([EventLog(roots)], GROUP, tuple(out.shape), 1, 1, shapes=(SAME,)).readings
    assert readings.certain_power == 1.0 and not readings.literals


def test_what_the_walk_cannot_read_is_said():
    _, readings = _read(lambda o, t: F.mse_loss(o, t) * CP + 0.1 * o.pow(2).mean())
    assert [o.loss_power for o in readings.outcomes()] == [1.0, None]  # × cp read as cp: the terms carry different factors
    lin = torch.nn.Linear(4, 4)
    out = lin(torch.randn(1, 16, 4))
    reg = F.mse_loss(out, torch.zeros_like(out)) + 1e-3 * lin.weight.pow(2).sum()
    root = read_root(reg, {id(out.grad_fn): 0}, frozenset(id(p) for p in lin.parameters()), {})
    assert root.param_paths == 1  # a regulariser on the weights: not in the recomputed output gradient
    compiled = torch.compile(lambda o: o.pow(2).mean() * CP, backend="aot_eager")
    root = read_root(compiled(out), {id(out.grad_fn): 0}, frozenset(), {})
    assert root.hidden == ("CompiledFunctionBackward",)
    readings = expectation([EventLog([root])], GROUP, tuple(out.shape), 1, 1, shapes=(SAME,)).readings
    assert readings.unknown and [o.factor for o in readings.outcomes()] == [None]  # a hidden node: nothing to compare with


def test_a_marked_node_is_the_scaler_not_a_constant():
    lin = torch.nn.Linear(4, 4)
    out = lin(torch.randn(1, 16, 4))
    scaled = F.mse_loss(out, torch.zeros_like(out)) * torch.tensor(65536.0)
    root = read_root(scaled, {id(out.grad_fn): 0}, frozenset(), {id(scaled.grad_fn): Source.SCALER})
    assert [f.source for f in root.terms[0].factors][:1] == [Source.SCALER]
    readings = expectation([EventLog([root])], GROUP, tuple(out.shape), 1, 1, shapes=(SAME,)).readings
    assert readings.certain_power == 1.0 and not readings.literals


def _watched(capture: Capture = Capture.VALUE_CLIPS):
    model = torch.nn.Linear(4, 4)
    recorder = Recorder(model, capture)
    hooks = Hooks(model, keep_full=False, snapshot_weights=dict, recorder=recorder).install()
    OBSERVING.enter(recorder)
    return model, recorder, hooks


def _stop(recorder, hooks) -> None:
    hooks.remove()
    OBSERVING.leave(recorder)


def test_the_entry_points_a_step_calls_become_events_and_are_restored():
    """A GradScaler step (scale, unscale_, step), a clip through clip_grad_norm_ bound before the watch, a clip by
    value, and the step's own division of its gradients: each is an event; torch is as it was afterwards."""
    from torch.nn.utils import clip_grad_norm_ as bound_before

    originals = (torch.Tensor.backward, torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_value_)
    model, recorder, hooks = _watched(Capture.EVERY_CLIP)
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        out = model(torch.randn(2, 4))
        scaler.scale(out.pow(2).mean()).backward()
        for p in model.parameters():
            p.grad /= 4  # the step's own scaling, seen by its value between two events
        scaler.unscale_(opt)
        total = bound_before(list(model.parameters()), 1e-3)
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
        scaler.step(opt)
    finally:
        _stop(recorder, hooks)
    log = recorder.log
    assert log.of(ScalerScale) == [ScalerScale(8.0)] and log.unscaled_by == 8.0 and log.of(ScalerUnscale)[0].found_inf is False
    assert log.of(ScalerStep) == [ScalerStep(False)]
    assert [round(e.factor, 6) for e in log.of(GradScale)] == [0.25]
    clip = log.of(ClipNorm)[0]
    assert (
        clip.total_norm == pytest.approx(float(total)) and clip.coefficient == pytest.approx(1e-3 / (float(total) + 1e-6)) and clip.active
    )
    assert log.of(ClipValue) == [ClipValue(1e-4)]
    assert recorder.captured is not None  # the gradients as the first clip found them (two runs' comparison)
    assert [t.factors[0].source for t in log.roots[0].terms] == [Source.SCALER]
    assert (torch.Tensor.backward, torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_value_) == originals


def test_a_skipped_optimizer_step_is_seen_and_announced():
    model, recorder, hooks = _watched()
    skipped = []
    recorder.on_skip = lambda: skipped.append(True)
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.scale(model(torch.randn(2, 4)).sum() * float("inf")).backward()
        scaler.step(opt)
    finally:
        _stop(recorder, hooks)
    assert recorder.log.found_inf and recorder.log.of(ScalerStep) == [ScalerStep(True)] and skipped == [True]


def test_a_compiled_model_runs_through_the_hooks_as_without_them():
    """The hooks and the observation stay out of dynamo: aot_eager compiles the model and the hooks run around it
    (issue 29: the watcher raised `setStorage ... out of bounds` inside a compiled forward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 4)
    plain = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    recorder = Recorder(model)
    hooks = Hooks(model, keep_full=True, snapshot_weights=dict, recorder=recorder).install()
    OBSERVING.enter(recorder)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        compiled(x).pow(2).mean().backward()
    finally:
        _stop(recorder, hooks)
        torch._dynamo.reset()
    assert hooks.forwards == 1 and hooks.backwards == 1 and recorder.log.roots[0].reaches_output
    for p, g in zip(model.parameters(), plain):
        assert torch.allclose(p.grad, g, atol=1e-6)


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
    from cpdoctor.examinations.step.judgment import measure

    x = torch.ones(10)
    x[3] = float("nan")
    x[7] = float("inf")
    assert measure.dots(x, torch.ones(10)).nonfinite == 2 and measure.dots(torch.ones(10), torch.ones(10)).nonfinite == 0
    big = torch.randn(3 * measure.CHUNK + 5, dtype=torch.float64)
    d = measure.dots(big.float(), (0.5 * big).float(), 2.0)
    assert d.d2 < 1e-6 * d.r2 and abs(d.xr / d.r2 - 2.0) < 1e-5  # the slices add up; float32 dots keep ~1e-6


def test_a_watch_closed_by_an_optimizer_step_takes_the_gradients_it_found_and_leaves_the_step_whole():
    """The gradients as the optimizer step found them (the step zeroes them afterwards, inside the watch), and a watch
    closed from that step's hooks while torch iterates them (preflight's armed watch) breaks nothing."""
    model, recorder, hooks = _watched()
    closed = []

    def close(optimizer, args, kwargs) -> None:
        _stop(recorder, hooks)
        OBSERVING.stop_listening(close)
        closed.append(True)

    OBSERVING.listen_steps(close)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).pow(2).mean().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
    opt.step()  # closes the watch from inside the step's hooks
    opt.zero_grad(set_to_none=True)
    opt.step()  # and the next step runs as without a watch
    assert closed == [True] and not OBSERVING.recorders and not OBSERVING.step_listeners
    assert torch.equal(recorder.as_compared().flat, expected)


def test_torch_autograd_grad_is_a_backward_root_when_it_differentiates_the_model():
    """`torch.autograd.grad(loss, model.parameters())` (a generator, read once) is observed as a backward root, so
    the loss's numbers are read (they were assumed to be 1); a grad of something else is not a root of this step."""
    model, recorder, hooks = _watched()
    try:
        out = model(torch.randn(2, 4))
        grads = torch.autograd.grad(out.pow(2).mean() * 2, model.parameters())
        x = torch.randn(2, 4, requires_grad=True)
        torch.autograd.grad(model(x).sum(), x)
    finally:
        _stop(recorder, hooks)
    assert len(grads) == 2 and len(recorder.log.roots) == 1 and recorder.log.roots[0].reaches_output
    assert [f.value for f in recorder.log.roots[0].terms[0].factors if f.source is Source.CONSTANT] == [2.0]
    assert torch.autograd.grad.__name__ == "grad" and not OBSERVING.recorders


def test_each_norm_clip_is_divided_out_of_the_parameters_it_clipped_only():
    """One clip per parameter group (the weight's, then the bias's), each active: the compared gradients are the
    gradients before both clips (they were divided by the product of every clip's coefficient)."""
    model, recorder, hooks = _watched()
    try:
        model(torch.randn(8, 4)).pow(2).mean().backward()
        before = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        torch.nn.utils.clip_grad_norm_([model.weight], 1e-3)
        torch.nn.utils.clip_grad_norm_([model.bias], 1e-4)
    finally:
        _stop(recorder, hooks)
    clips = recorder.log.of(ClipNorm)
    assert [c.params for c in clips] == [1, 1] and all(c.active for c in clips)
    assert torch.allclose(recorder.as_compared().flat, before, rtol=1e-5, atol=0)


def test_an_optimizer_stepping_inside_backward_neither_ends_the_step_nor_narrows_it():
    """An optimizer per parameter stepped from its post-accumulate-grad hook, which zeroes the gradient after: every
    parameter is compared as its own step found it (not one parameter, with the others zero), the watch's own
    optimizer-step capture is not taken, and a step's end waits for the backward (`after_backward`)."""
    model, recorder, hooks = _watched()
    kept, ended = [], []
    recorder.on_inner_step = lambda params: kept.extend(params)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)
        OBSERVING.after_backward(lambda: ended.append(len(kept)))

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    x = torch.randn(8, 4)
    expected = torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))])
    weights = [p.detach().clone() for p in model.parameters()]
    try:
        model(x).pow(2).mean().backward()
    finally:
        _stop(recorder, hooks)
        for h in handles:
            h.remove()
    assert all(p.grad is None for p in model.parameters()) and not all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert recorder.stepped is None and sum(e.params for e in recorder.log.of(InnerStep)) == 2 and len(kept) == 2
    assert ended == [2, 2]  # each callback after the whole backward, not at its step
    compared = recorder.as_compared()
    assert compared.missing == () and torch.allclose(compared.flat, expected, rtol=1e-6, atol=1e-7)
