"""Op-level CP parity: diffusers' real dispatch_attention_fn on sequence shards vs the full sequence.

Every rank builds the same full inputs from the seed, runs its shard forward and backward through
`dispatch_attention_fn(..., backend=..., parallel_config=...)` (diffusers' own ring / Ulysses / unified
templates), and hands out, dQ, dK, dV back. Rank 0 then computes, once, the fp64 reference on the full
sequence and the same backend's single-process result in the probe dtype (the error the kernel makes without
CP, which sets the tolerance), and measures every rank's shard against the reference. Numbers only: the
verdict is made elsewhere (judge.py).
"""

from __future__ import annotations

from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.measurement import Measurement, compare, rank_environment, torch_dtype
from cpdoctor.launch.jobs import Case

TENSORS = ("out", "dq", "dk", "dv")


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


def prepare_emulation(req: AttentionRequest) -> None:
    """With `emulate`, the CUDA kernels' CPU stand-ins are put in place before diffusers is imported (the
    flash-attn stand-in must be on sys.path when diffusers checks for flash-attn at import time); without it,
    stand-ins a previous case of this process installed are removed, so nothing changes."""
    from cpdoctor.kernels import standins

    if req.emulate:
        standins.activate()
    elif standins.installed():
        standins.uninstall()


def select_backend(req: AttentionRequest, device: Any) -> tuple[str, Any]:
    """The backend name to examine and its facts; BadInput for a name this diffusers does not know."""
    import difflib

    from cpdoctor.compat import backends
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.kernels import cpu_backend

    cpu_backend.register()
    dtype = torch_dtype(req.dtype)
    heads = req.heads // req.ulysses
    if req.backend == backends.AUTO:
        name, seen = backends.resolve_auto(device, dtype, heads, req.head_dim, req.ring, emulated=req.emulate)
        if name is None:
            reasons = "; ".join(f"{f.name}: {f.unsupported_reason(req.ring) or 'not CP-capable'}" for f in seen)
            return "auto", backends.BackendFacts("auto", registered=True, requirement_error=f"no CP-capable backend runs here ({reasons})")
        return name, seen[-1]
    if compat.backend_member(req.backend) is None:
        names = compat.registered_backend_names()
        close = difflib.get_close_matches(req.backend, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else f" (known: {', '.join(sorted(names))})"
        raise BadInput(f"unknown attention backend {req.backend!r}{hint}")
    facts = backends.examine_backend(req.backend, device, dtype, heads, req.head_dim)
    facts.emulated = req.emulate
    return req.backend, facts


def run_rank(case: Case, ctx: Any) -> dict:
    """This rank's shard of out/dQ/dK/dV through diffusers' CP attention (CPU tensors), or why it cannot run."""
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix import patch as fix_patch

    req: AttentionRequest = case.request.validate()
    prepare_emulation(req)
    dispatch = compat.dispatch_module()
    fix_patch.set_patched(case.patched, dkv=case.options.get("dkv"))
    name, facts = select_backend(req, ctx.device)
    reason = facts.unsupported_reason(req.ring)
    if reason:
        return {"unsupported": reason, "backend": name, "facts": facts.to_dict()}
    mesh = ctx.cp_mesh(req.ring, req.ulysses)
    config = compat.setup_parallel_config(req.ring, req.ulysses, ctx.rank, ctx.world_size, ctx.device, mesh)
    flat = compat.flat_cp_rank(config)
    inputs = make_inputs(req)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return x.chunk(req.world_size, dim=1)[flat].to(ctx.device)

    q, k, v = (shard(inputs[n]).requires_grad_(True) for n in ("q", "k", "v"))
    mask = None if inputs["mask"] is None else inputs["mask"].chunk(req.world_size, dim=-1)[flat].to(ctx.device)
    rng_before = device_rng_state(ctx.device)
    out = dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend=name, parallel_config=config)
    out.backward(shard(inputs["grad_out"]))
    grads = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    found = {**facts.to_dict(), "rng_advanced": not torch.equal(rng_before, device_rng_state(ctx.device))}
    return {"flat_rank": flat, "backend": name, "facts": found, **{n: t.detach().cpu() for n, t in grads.items()}}


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


def evaluate(case: Case, payloads: list[dict], ctx: Any) -> Measurement:
    """On rank 0: measure every rank's shard against the fp64 reference, and the same backend's
    single-process error (the baseline the tolerance is built from)."""
    import torch

    req: AttentionRequest = case.request
    first = payloads[0]
    backend = first["backend"]
    result = Measurement(backend, first["facts"], rank_environment(ctx, backend, req))
    unsupported = [p["unsupported"] for p in payloads if "unsupported" in p]
    if unsupported:
        result.unsupported = unsupported[0]
        return result
    inputs = make_inputs(req)
    ref = reference(inputs)
    try:
        base = single_process(inputs, backend, ctx.device)
        baseline = {n: compare(base[n], ref[n])["rel_err"] for n in TENSORS}
    except Exception as exc:  # noqa: BLE001 - a backend without a local path still gets a dtype-only tolerance
        baseline = {n: None for n in TENSORS}
        result.baseline_error = f"{type(exc).__name__}: {exc}"
    order = sorted(range(len(payloads)), key=lambda r: payloads[r]["flat_rank"])
    tensors = {}
    for n in TENSORS:
        ref_shards = ref[n].chunk(len(payloads), dim=1)
        per_rank = [compare(payloads[r][n], ref_shards[payloads[r]["flat_rank"]]) for r in range(len(payloads))]
        whole = compare(torch.cat([payloads[r][n] for r in order], dim=1), ref[n])
        worst = max(range(len(per_rank)), key=lambda r: per_rank[r]["rel_err"])
        tensors[n] = {
            **whole,
            "worst_rank": worst,
            "per_rank_rel_err": [p["rel_err"] for p in per_rank],
            "baseline_rel_err": baseline[n],
        }
    result.tensors = tensors
    return result
