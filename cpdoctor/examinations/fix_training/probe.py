"""One training step of a tiny attention model under CP vs the same step in one process.

The model is two attention layers (qkv projection, diffusers' `dispatch_attention_fn` with the parallel
config, output projection, residual). Every rank builds identical parameters and full inputs from the seed,
runs its sequence shard forward and backward (loss = Σ out ⊙ target), and reports its output shard, its input
gradient shard and every parameter gradient summed over the CP group (each rank back-propagates only its own
tokens). Rank 0 runs the same step on the full sequence without CP and measures the difference. With
`compare_original` each rank also reruns the forward with diffusers' own ring (patch reverted for the call)
and reports how far the two forwards are apart. Numbers only.

A case: its `FixTrainingRequest` (the fields and their defaults), patched or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cpdoctor.launch.jobs import Case, CaseNumbers, RankResult
from cpdoctor.report.environment import Environment

if TYPE_CHECKING:
    from cpdoctor.examinations.fix_training import FixTrainingRequest
    from cpdoctor.launch.context import DistContext


@dataclass
class StepShard(RankResult):
    """One rank's CP step: its output and input-gradient shards, the parameter gradients summed over the CP
    group (rank 0), whether the RNG stayed put, and (with compare_original) how far the other ring's forward is."""

    flat_rank: int
    out: Any
    x_grad: Any
    grads: dict[str, Any] | None
    rng_untouched: bool
    forward_vs_other: float | None = None


@dataclass
class TrainingNumbers(CaseNumbers):
    """The CP step against the same step in one process (relative L2 errors; the worst parameter named)."""

    out_rel_err: float
    x_grad_rel_err: float
    param_rel_err: dict[str, float]
    worst_param: str
    worst_param_rel_err: float
    rng_untouched: bool
    forward_vs_other: float | None = None
    environment: Environment = field(default_factory=Environment)


MASKS = (None, "bool4d", "bool2d", "additive")
"""The masks a case may give the model (`FixTrainingRequest.mask`)."""


def _request(case: Case) -> FixTrainingRequest:
    """The step's settings (the case's request, as built), refused on the rank with BadInput where the layout cannot
    shard them."""
    from cpdoctor.errors import BadInput

    req: FixTrainingRequest = case.request
    if req.seq % req.world_size or req.heads % req.ulysses:
        raise BadInput("train step: seq must divide by ring × ulysses and heads by ulysses")
    if req.mask not in MASKS:
        raise BadInput(f"train step: unknown mask kind {req.mask!r}")
    return req


def _model(req: FixTrainingRequest) -> Any:
    import torch

    from cpdoctor.compat import diffusers as compat

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inner = req.heads * req.head_dim
            self.to_qkv = torch.nn.Linear(req.dim, 3 * inner)
            self.to_out = torch.nn.Linear(inner, req.dim)

        def forward(self, x: Any, mask: Any, parallel_config: Any) -> Any:
            b, s, _ = x.shape
            q, k, v = self.to_qkv(x).view(b, s, 3, req.heads, req.head_dim).unbind(2)
            o = compat.dispatch_module().dispatch_attention_fn(
                q, k, v, attn_mask=mask, backend=req.backend, parallel_config=parallel_config
            )
            return x + self.to_out(o.flatten(2))

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(req.layers))

        def forward(self, x: Any, mask: Any = None, parallel_config: Any = None) -> Any:
            for layer in self.layers:
                x = layer(x, mask, parallel_config)
            return x

    from cpdoctor.examinations.measurement import torch_dtype

    torch.manual_seed(req.seed)
    return Tiny().to(torch_dtype(req.dtype))


def _inputs(req: FixTrainingRequest) -> dict:
    import torch

    from cpdoctor.examinations.measurement import torch_dtype

    gen = torch.Generator().manual_seed(req.seed + 1)
    dtype = torch_dtype(req.dtype)
    shape = (req.batch, req.seq, req.dim)
    x, target = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    mask = None
    if req.mask:
        keep = torch.ones(req.batch, req.seq, dtype=torch.bool)
        keep[:, req.seq - req.mask_pad :] = False
        if req.mask == "bool2d":
            mask = keep
        elif req.mask == "bool4d":
            mask = keep[:, None, None, :]
        else:
            mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))[:, None, None, :]
    return {"x": x, "target": target, "mask": mask}


def _step(model: Any, x: Any, target: Any, mask: Any, parallel_config: Any) -> tuple[Any, Any]:
    x = x.clone().requires_grad_(True)
    out = model(x, mask, parallel_config)
    (out.float() * target.float()).sum().backward()
    return out.detach(), x.grad.detach()


def _rng_states() -> list:
    """The CPU generator's state and every CUDA generator's (an attention step at dropout 0 moves none)."""
    import torch

    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return states


def run_rank(case: Case, ctx: DistContext) -> StepShard:
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix import patch as fix_patch

    req = _request(case)
    cpu_backend.register()
    fix_patch.set_patched(case.patched)
    mesh = ctx.cp_mesh(req.ring, req.ulysses)
    config = compat.setup_parallel_config(req.ring, req.ulysses, ctx.rank, ctx.world_size, ctx.device, mesh)
    flat = compat.flat_cp_rank(config)
    world = req.ring * req.ulysses
    inputs = _inputs(req)

    def shard(t: Any) -> Any:
        return None if t is None else t.chunk(world, dim=-1 if t is inputs["mask"] else 1)[flat].to(ctx.device)

    model = _model(req).to(ctx.device)
    x, target, mask = shard(inputs["x"]), shard(inputs["target"]), shard(inputs["mask"])
    rng_before = _rng_states()
    out, x_grad = _step(model, x, target, mask, config)
    rng_untouched = all(torch.equal(a, b) for a, b in zip(rng_before, _rng_states()))
    grads = {n: ctx.all_sum_cpu(p.grad.detach()) for n, p in model.named_parameters()}
    payload = StepShard(flat, out.cpu(), x_grad.cpu(), grads if ctx.rank == 0 else None, rng_untouched)
    if req.compare_original:
        was = fix_patch.is_patched()
        fix_patch.set_patched(not was)
        try:
            with torch.no_grad():
                other = model(x, mask, config)
        finally:
            fix_patch.set_patched(was)
        diff = (other.double() - out.double()).norm().item() / (out.double().norm().item() or 1.0)
        payload.forward_vs_other = diff
    return payload


def _rel(x: Any, ref: Any) -> float:
    ref = ref.double()
    return (x.double() - ref).norm().item() / (ref.norm().item() or 1.0)


def evaluate(case: Case, payloads: list[StepShard], ctx: DistContext) -> TrainingNumbers:
    """Rank 0: the CP step against the single-process step (relative L2 errors, worst parameter named)."""
    import torch

    req = _request(case)
    inputs = _inputs(req)
    model = _model(req).to(ctx.device)
    out, x_grad = _step(
        model,
        inputs["x"].to(ctx.device),
        inputs["target"].to(ctx.device),
        None if inputs["mask"] is None else inputs["mask"].to(ctx.device),
        None,
    )
    order = sorted(range(len(payloads)), key=lambda r: payloads[r].flat_rank)
    cp_out = torch.cat([payloads[r].out for r in order], dim=1)
    cp_x_grad = torch.cat([payloads[r].x_grad for r in order], dim=1)
    grads = payloads[0].grads or {}
    param_errs = {n: _rel(grads[n], p.grad.cpu()) for n, p in model.named_parameters()}
    worst = max(param_errs, key=lambda n: param_errs[n])
    others = [p.forward_vs_other for p in payloads if p.forward_vs_other is not None]
    return TrainingNumbers(
        out_rel_err=_rel(cp_out, out.cpu()),
        x_grad_rel_err=_rel(cp_x_grad, x_grad.cpu()),
        param_rel_err=param_errs,
        worst_param=worst,
        worst_param_rel_err=param_errs[worst],
        rng_untouched=all(p.rng_untouched for p in payloads),
        forward_vs_other=max(others) if others else None,
    )
