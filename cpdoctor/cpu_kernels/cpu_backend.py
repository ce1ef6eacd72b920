"""cpdoctor's own CPU attention backend, registered into diffusers' registry as `cpdoctor_cpu`.

No stock diffusers backend can run ring attention on a CPU (docs/FACTS.md): `native` has no LSE and the fused
CUDA kernels have no CPU implementation. torch ships a fused CPU flash kernel with an explicit backward
(`_scaled_dot_product_flash_attention_for_cpu[_backward]`, O(S) memory, fp32 LSE), so this backend wraps it
in diffusers' op contract and lets diffusers' *own* templates (ring, Ulysses, unified) run on CPU.

The backward op honours both calling conventions on purpose: `backward_op(ctx, grad_out)` reads the
tensors saved at the first ring step (what 0.39.0's ring does), and the keyword form with `query=, key=,
value=, out=, lse=` uses the tensors given (what 0.42.1's ring does). That way a probe on CPU reproduces
exactly what each release does with its built-in ops, bugs included.

The ops hand the kernel views (no layout copies), exactly as the fixed ring's `fix.kernels.CpuFlashKernel`
calls the same aten ops: a benchmark of diffusers' ring against the fixed ring on this backend compares rings,
not two ways of calling one kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from cpdoctor.compat import diffusers as compat

NAME = "cpdoctor_cpu"


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """Model layout (B, S, H, D) -> kernel layout (B, H, S, D), as a view: the CPU flash kernel takes the
    strided tensor SDPA would hand it and gives bit-identical results (checked in fp32 and bf16, with and
    without a mask); a contiguous copy of q, k, v, out and dO at every ring step would be memory diffusers'
    ring is charged for in a benchmark and the fixed ring, whose kernel takes views too, is not."""
    return x.transpose(1, 2)


def additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype, seq_k: int) -> torch.Tensor | None:
    """The CPU kernel takes an additive mask of the query dtype; diffusers passes boolean key masks as
    (B, S_k) or (B, 1, 1, S_k) (True = attend)."""
    if attn_mask is None:
        return None
    if attn_mask.ndim == 2 and attn_mask.shape[-1] == seq_k:
        attn_mask = attn_mask[:, None, None, :]
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(dtype)


# diffusers' forward-op contract (attention_dispatch's `_*_forward_op(ctx, query, key, value, ...)`)
def forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
):
    """diffusers' forward-op contract on torch's fused CPU flash kernel; lse is (B, S, H) float32."""
    if dropout_p:
        raise ValueError("cpdoctor_cpu does not implement dropout (its kernel's backward takes no RNG state)")
    if enable_gqa:
        raise ValueError("cpdoctor_cpu does not implement GQA")
    mask = additive_mask(attn_mask, query.dtype, key.shape[1])
    out_t, lse_t = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _kernel_layout(query), _kernel_layout(key), _kernel_layout(value), 0.0, is_causal, attn_mask=mask, scale=scale
    )
    out = out_t.transpose(1, 2)
    lse = lse_t.transpose(1, 2)
    if _save_ctx:
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask = attn_mask
        ctx.is_causal = is_causal
        ctx.scale = scale
    return (out, lse) if return_lse else out


def block_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one attention block from explicit tensors, all in model layout; lse (B, S, H)."""
    mask = additive_mask(attn_mask, query.dtype, key.shape[1])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _kernel_layout(grad_out.to(query.dtype)),
        _kernel_layout(query),
        _kernel_layout(key),
        _kernel_layout(value),
        _kernel_layout(out.to(query.dtype)),
        lse.transpose(1, 2).contiguous().float(),
        0.0,
        is_causal,
        attn_mask=mask,
        scale=scale,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def backward_op(
    ctx: Any,
    grad_out: torch.Tensor,
    *args: Any,
    query: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    **kwargs: Any,
):
    """diffusers' backward-op contract: explicit tensors when given, the saved ones otherwise."""
    saved_q, saved_k, saved_v, saved_out, saved_lse = ctx.saved_tensors
    return block_backward(
        grad_out,
        saved_q if query is None else query,
        saved_k if key is None else key,
        saved_v if value is None else value,
        saved_out if out is None else out,
        saved_lse if lse is None else lse,
        ctx.attn_mask,
        ctx.is_causal,
        ctx.scale,
    )


class _LocalAttention(torch.autograd.Function):
    """Single-process attention through the same kernel (no CP): the baseline a CP run is held to."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale):  # type: ignore[override]
        out, lse = forward_op(ctx, query, key, value, attn_mask, 0.0, is_causal, scale, False, True)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        dq, dk, dv = backward_op(ctx, grad_out)
        return dq, dk, dv, None, None, None


# diffusers' backend-function contract (the keywords dispatch_attention_fn passes a registered backend)
def cpdoctor_cpu_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config: Any = None,
):
    """The backend function diffusers dispatches to. With a parallel config it goes through diffusers'
    templated CP attention, looked up at call time (so cpdoctor's patch applies to it as to any backend)."""
    if _parallel_config is None:
        out, lse = _LocalAttention.apply(query, key, value, attn_mask, is_causal, scale)
        return (out, lse) if return_lse else out
    # diffusers' TemplatedAttention call, in the templates' positional order
    return compat.templated_attention()(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        return_lse,
        forward_op=forward_op,
        backward_op=backward_op,
        _parallel_config=_parallel_config,
    )


def register() -> str:
    """Add `cpdoctor_cpu` to diffusers' registry (idempotent); returns its name."""
    if compat.backend_member(NAME) is None:
        compat.add_backend(NAME, cpdoctor_cpu_attention, supports_context_parallel=True)
    return NAME
