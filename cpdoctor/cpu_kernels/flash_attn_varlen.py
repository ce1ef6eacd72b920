"""The varlen half of cpdoctor's flash-attn 2 stand-in (flash_attn_standin/flash_attn/flash_attn_interface.py
re-exports it) and its packed (qkv / kv) entry points. Importable without the stand-in package on sys.path.

ring-flash-attn 0.1.8 (ring_flash_attn_varlen.py, zigzag_ring_flash_attn_varlen.py, llama3_flash_attn_varlen.py)
and yunchang 0.6.4 (ring/ring_flash_attn_varlen.py, ring/zigzag_ring_flash_attn_varlen.py) import
`_flash_attn_varlen_forward` / `_flash_attn_varlen_backward` at import time, so neither package imports
without them; both call them with keyword arguments built from `inspect.getfullargspec` of the function, so
the argument names are part of the contract.

Contracts (Dao-AILab/flash-attention v2.7.4, flash_attn/flash_attn_interface.py — the 2.7 signatures this
stand-in's dense `_flash_attn_forward(..., window_size_left, window_size_right, ...)` already follows):
- `_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
  return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False) -> (out,
  softmax_lse, S_dmask, rng_state)`; q (total_q, H, D), k/v (total_k, H_k, D), out like q, softmax_lse
  (H, total_q) float32 (`_flash_attn_varlen_forward_fake` and mha_varlen_fwd:
  `softmax_lse = torch::empty({num_heads, total_q}, ...)`), S_dmask (B, H, round128(max_q), round128(max_k))
  with return_softmax, else empty; rng_state (2,) int64.
- `_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
  alibi_slopes, deterministic, rng_state=None, zero_tensors=False) -> softmax_d` (H, total_q + 128·B) float32
  (`_flash_attn_varlen_backward_fake`), dq/dk/dv written in place.
- One sequence per `cu_seqlens` span: sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q and
  cu_seqlens_k[i]:cu_seqlens_k[i+1] of k/v; causal is aligned to the bottom right of each sequence's
  (s_q, s_k) block (flash_attn_varlen_func's docstring), and a row with no key to attend gets out 0 and
  lse +inf (csrc/flash_attn/src/softmax.h: `lse = (sum == 0.f || sum != sum) ? INFINITY : ...`).
- The checks are mha_varlen_fwd / mha_varlen_bwd's (csrc/flash_attn/flash_api.cpp v2.7.4): fp16/bf16 only,
  same dtypes, cu_seqlens int32 of shape (B + 1), contiguous last dimension, q (total_q, H, D), k/v
  (total_k, H_k, D), H a multiple of H_k, head size a multiple of 8 and at most 256.
- The autograd Functions and the `flash_attn_*_func` wrappers are flash_attn_interface.py's
  (FlashAttnVarlenFunc, FlashAttnQKVPackedFunc, ...), reduced to calls of the functions above.

Not emulated (NotImplementedError): paged KV (block_table), leftpad_k, seqused_k, windows, softcap, ALiBi.
"""

from __future__ import annotations

from typing import Optional

import torch

from cpdoctor.cpu_kernels import standin_checks, standin_math, standins
from cpdoctor.cpu_kernels.standin_checks import check
from cpdoctor.vocabulary import HALF, DType

_require_emulation = standins.flash_attn_require_emulation
_unsupported = standin_checks.flash_attn_unsupported


def varlen_checks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> None:
    """mha_varlen_fwd / mha_varlen_bwd's TORCH_CHECKs, in their order and wording (flash_api.cpp v2.7.4)."""
    check(DType.of_torch(q.dtype) in HALF, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    check(cu_seqlens_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q must have shape (total_q, num_heads, head_size)")
    batch = cu_seqlens_q.numel() - 1
    total_q, heads, head = q.shape
    total_k, heads_k = k.shape[0], k.shape[1]
    check(batch > 0, "batch size must be positive")
    check(head <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(head % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    check(tuple(k.shape) == (total_k, heads_k, head), "k must have shape (total_k, num_heads_k, head_size)")
    check(tuple(v.shape) == (total_k, heads_k, head), "v must have shape (total_k, num_heads_k, head_size)")
    check(tuple(cu_seqlens_k.shape) == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")


def _no_paging(block_table, leftpad_k, seqused_k) -> None:
    if block_table is not None or leftpad_k is not None or seqused_k is not None:
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate paged KV, leftpad_k or seqused_k")


def _spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = [int(x) for x in cu.tolist()]
    return list(zip(bounds[:-1], bounds[1:]))


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(query rows, key rows) of every sequence that has both (an empty one has nothing to attend)."""
    return [(sq, sk) for sq, sk in zip(_spans(cu_seqlens_q), _spans(cu_seqlens_k)) if sq[1] > sq[0] and sk[1] > sk[0]]


def _seq(x: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """Rows `span` of a (total, H, D) tensor as the (1, H, s, D) the dense numerics take."""
    return x[span[0] : span[1]].transpose(0, 1).unsqueeze(0)


def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _require_emulation(q)
    varlen_checks(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _unsupported(window_size_left, window_size_right, softcap, alibi_slopes, causal)
    _no_paging(block_table, leftpad_k, seqused_k)
    if dropout_p > 0.0:
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate dropout in the varlen interface")
    if return_softmax:
        raise RuntimeError("return_softmax is only supported when p_dropout > 0.0")
    total_q, heads, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((heads, total_q), float("inf"), dtype=torch.float32)
    with torch.no_grad():
        for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
            o, seq_lse = standin_math.attention_forward(
                _seq(q, sq), _seq(k, sk), _seq(v, sk), None, causal, softmax_scale, bottom_right=True
            )
            out[sq[0] : sq[1]] = o[0].transpose(0, 1).to(q.dtype)
            lse[:, sq[0] : sq[1]] = torch.where(torch.isneginf(seq_lse[0]), float("inf"), seq_lse[0])
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out, lse, s_dmask, torch.tensor([0, 0], dtype=torch.int64)


def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _require_emulation(q)
    varlen_checks(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _unsupported(window_size_left, window_size_right, softcap, alibi_slopes, causal)
    if dropout_p > 0.0:
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate dropout in the varlen interface")
    total_q, heads, _ = q.shape
    check(tuple(out.shape) == tuple(q.shape), "out must have shape (total_q, num_heads, head_size)")
    check(tuple(dout.shape) == tuple(q.shape), "dout must have shape (total_q, num_heads, head_size)")
    lse = standin_math.lse_as_kernel_reads_it(softmax_lse, (heads, total_q), "flash-attn varlen backward")
    batch = cu_seqlens_q.numel() - 1
    softmax_d = torch.zeros((heads, total_q + 128 * batch), dtype=torch.float32)
    with torch.no_grad():
        grads = _grads_by_sequence(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        for dst, src in zip((dq, dk, dv), grads):
            if dst is not None:
                dst.copy_(src)
        softmax_d[:, :total_q] = (dout.float() * out.float()).sum(-1).transpose(0, 1)
    return softmax_d


def _grads_by_sequence(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale) -> tuple[torch.Tensor, ...]:
    """fp32 dQ, dK, dV of the packed sequences, each sequence's backward on its own (bottom-right causal)."""
    gq, gk, gv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        seq_lse = lse[:, sq[0] : sq[1]].unsqueeze(0).contiguous()  # +inf on a row without keys: P = exp(s - inf) = 0
        a, b, c = standin_math.attention_backward(
            _seq(dout, sq), _seq(q, sq), _seq(k, sk), _seq(v, sk), _seq(out, sq), seq_lse, None, causal, softmax_scale, bottom_right=True
        )
        gq[sq[0] : sq[1]] = a[0].transpose(0, 1)
        gk[sk[0] : sk[1]] += b[0].transpose(0, 1)
        gv[sk[0] : sk[1]] += c[0].transpose(0, 1)
    return gq, gk, gv


_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward
"""flash-attn registers these as torch custom ops (torch >= 2.4) and falls back to the plain functions."""


class FlashAttnVarlenFunc(torch.autograd.Function):
    """flash_attn_interface.py's FlashAttnVarlenFunc: saves q, k, v, out, lse, cu_seqlens for its backward."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        block_table,
    ):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, softmax_lse, s_dmask, rng_state = _wrapped_flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
            block_table=block_table,
        )
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.dropout_p, ctx.softmax_scale, ctx.causal = (
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
        )
        ctx.window_size, ctx.softcap, ctx.alibi_slopes, ctx.deterministic = window_size, softcap, alibi_slopes, deterministic
        return out if not return_softmax else (out, softmax_lse, s_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _wrapped_flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        return (dq, dk, dv) + (None,) * 13


# flash-attn 2.6.3's public signature (flash_attn_interface), which the stand-in must accept as callers pass it
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash-attn's public varlen entry: q (total_q, H, D), k/v (total_k, H_k, D); with return_attn_probs also
    (softmax_lse (H, total_q), S_dmask)."""
    return FlashAttnVarlenFunc.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
    )


# flash-attn 2.6.3's public signature (flash_attn_interface), which the stand-in must accept as callers pass it
def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, H, D), one cu_seqlens for q and k."""
    return flash_attn_varlen_func(
        qkv[:, 0],
        qkv[:, 1],
        qkv[:, 2],
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


# flash-attn 2.6.3's public signature (flash_attn_interface), which the stand-in must accept as callers pass it
def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """kv (total_k, 2, H_k, D)."""
    return flash_attn_varlen_func(
        q,
        kv[:, 0],
        kv[:, 1],
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )
