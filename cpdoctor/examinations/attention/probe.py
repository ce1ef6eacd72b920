"""Op-level CP parity: diffusers' real dispatch_attention_fn on sequence shards vs the full sequence.

Every rank builds the same full inputs from the seed, runs its shard forward and backward through
`dispatch_attention_fn(..., backend=..., parallel_config=...)` (diffusers' own ring / Ulysses / unified
templates), and hands out, dQ, dK, dV back. Rank 0 then computes, once, the fp64 reference on the full
sequence and the same backend's single-process result in the probe dtype (the error the kernel makes without
CP, which sets the tolerance), and measures every rank's shard against the reference. Numbers only: the
verdict is made elsewhere (judge.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cpdoctor.attempt import Attempt
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.backend_choice import NotRunnable, no_backend_here, prepare_emulation, select_backend
from cpdoctor.examinations.judging import emulation_note
from cpdoctor.examinations.measurement import Measurement, compare, rank_environment, sharded_row, torch_dtype
from cpdoctor.launch.jobs import Case, RankResult

if TYPE_CHECKING:
    from cpdoctor.launch.context import DistContext

TENSORS = ("out", "dq", "dk", "dv")


@dataclass
class AttentionShard(RankResult):
    """One rank's shard of out, dQ, dK, dV (CPU tensors) through diffusers' CP attention, and what the run showed
    of the backend (its facts, whether the device's RNG moved)."""

    flat_rank: int
    backend: str
    facts: Any  # compat.backends.BackendFacts
    out: Any
    dq: Any
    dk: Any
    dv: Any
    rng_advanced: bool = False


def make_inputs(req: AttentionRequest) -> dict[str, Any]:
    """Full-sequence q, k, v, upstream gradient (model layout B, S, H, D, already rounded to the probe dtype)
    and the key-padding mask (B, 1, 1, S; True = attend), identical on every rank for a given seed."""
    import torch

    gen = torch.Generator().manual_seed(req.seed)
    shape = (req.batch, req.seq, req.heads, req.head_dim)
    dtype = torch_dtype(req.dtype)
    tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name in ("q", "k", "v", "grad_out")}
    mask = None
    if req.mask_pad:
        mask = torch.ones(req.batch, 1, 1, req.seq, dtype=torch.bool)
        mask[..., req.seq - req.mask_pad :] = False
    tensors["mask"] = mask
    return tensors


def run_rank(case: Case, ctx: DistContext) -> RankResult:
    """This rank's shard of out/dQ/dK/dV through diffusers' CP attention (CPU tensors), or why it cannot run."""
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix import patch as fix_patch

    req: AttentionRequest = case.request  # validated where it was built (AttentionRequest.of)
    prepare_emulation(req)
    dispatch = compat.dispatch_module()
    fix_patch.set_patched(case.patched)
    name, facts = select_backend(req, ctx.device)
    unsupported = no_backend_here(facts, req.ring)
    if unsupported is not None:
        return NotRunnable(name, facts, unsupported)
    mesh = ctx.cp_mesh(req.ring, req.ulysses)
    config = compat.setup_parallel_config(req.ring, req.ulysses, ctx.rank, ctx.world_size, ctx.device, mesh)
    flat = compat.flat_cp_rank(config)
    inputs = make_inputs(req)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(req.world_size, dim=1)[flat].to(ctx.device)

    q, k, v = (shard(inputs[n]).requires_grad_(True) for n in ("q", "k", "v"))
    mask = None if inputs["mask"] is None else inputs["mask"].chunk(req.world_size, dim=-1)[flat].to(ctx.device)
    rng_before = device_rng_state(ctx.device)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend=name, parallel_config=config)

    out = checkpointed(attend, q, k, v) if req.checkpointing else attend(q, k, v)
    out.backward(shard(inputs["grad_out"]))
    advanced = not torch.equal(rng_before, device_rng_state(ctx.device))
    cpu = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    return AttentionShard(flat, name, facts, *cpu, rng_advanced=advanced)


def checkpointed(fn: Any, *args: Any) -> Any:
    """`fn(*args)` under torch's non-reentrant activation checkpointing, as diffusers' own
    `enable_gradient_checkpointing()` runs a block (its default `_gradient_checkpointing_func`): the forward keeps no
    activations, the backward recomputes them and unpacks each saved tensor once."""
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def device_rng_state(device: Any) -> Any:
    """The state of the generator the device's kernels draw dropout from (the CPU's for the stand-ins)."""
    import torch

    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def reference(inputs: dict[str, Any]) -> dict[str, Any]:
    """Exact attention on the full sequence in fp64 (math kernel), with gradients."""
    import torch

    q, k, v = (inputs[n].double().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=inputs["mask"])
    out.backward(inputs["grad_out"].double().transpose(1, 2))
    return {n: t.detach().transpose(1, 2) for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def single_process(inputs: dict[str, Any], backend: str, device: Any) -> dict[str, Any]:
    """The same backend without CP, in the probe dtype, on the full sequence."""
    from cpdoctor.compat import diffusers as compat

    q, k, v = (inputs[n].to(device).requires_grad_(True) for n in ("q", "k", "v"))
    mask = None if inputs["mask"] is None else inputs["mask"].to(device)
    out = compat.dispatch_module().dispatch_attention_fn(q, k, v, attn_mask=mask, backend=backend)
    out.backward(inputs["grad_out"].to(device))
    return {n: t.detach().cpu() for n, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def evaluate(case: Case, results: list[RankResult], ctx: DistContext) -> Measurement:
    """On rank 0: measure every rank's shard against the fp64 reference, and the same backend's
    single-process error (the baseline the tolerance is built from)."""
    req: AttentionRequest = case.request
    first = results[0]
    emulated = emulation_note(first.backend) if req.emulate else None
    result = Measurement(first.backend, first.facts, rank_environment(ctx, first.backend, req, emulated))
    refused = next((r for r in results if isinstance(r, NotRunnable)), None)
    if refused is not None:
        result.unsupported = refused.unsupported
        return result
    shards: list[AttentionShard] = results  # type: ignore[assignment]
    result.rng_advanced = any(s.rng_advanced for s in shards)
    inputs = make_inputs(req)
    ref = reference(inputs)
    baseline: dict[str, float | None] = dict.fromkeys(TENSORS)
    # a backend without a local path still gets a dtype-only tolerance
    tried = Attempt.of(lambda: single_process(inputs, first.backend, ctx.device))
    if tried.ok:
        baseline = {n: compare(tried.value[n], ref[n]).rel_err for n in TENSORS}
    result.baseline_error = tried.why()
    order = sorted(range(len(shards)), key=lambda r: shards[r].flat_rank)
    for n in TENSORS:
        ref_shards = ref[n].chunk(len(shards), dim=1)
        mine = [getattr(s, n) for s in shards]
        refs = [ref_shards[s.flat_rank] for s in shards]
        result.tensors[n] = sharded_row(mine, order, refs, ref[n], dim=1, baseline=baseline[n])
    return result
