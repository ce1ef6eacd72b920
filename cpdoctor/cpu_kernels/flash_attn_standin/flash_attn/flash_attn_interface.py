"""CPU stand-in of flash-attn 2's Python interface (flash_attn/flash_attn_interface.py), the entry points
diffusers' `flash` backend and ring-flash-attention call, with the signatures of flash-attn 2.6.3 onward
(Dao-AILab/flash-attention, flash_attn/flash_attn_interface.py: `_flash_attn_forward(q, k, v, dropout_p,
softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax) -> (out,
softmax_lse, S_dmask, rng_state)`, `_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
rng_state=None) -> softmax_d`, writing dq/dk/dv in place; `flash_attn_func(q, k, v, dropout_p=0.0,
softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
return_attn_probs=False)`). Layout (B, S, H, D); softmax_lse (B, H, Sq) float32 whatever the dropout;
rng_state (2,) int64 (seed, offset). The checks are mha_fwd / mha_bwd's (csrc/flash_attn/flash_api.cpp);
with dropout_p > 0 the forward draws its philox state from the generator (counter offset B·H·32), which
advances it, as the real one does. Causal masks are aligned to the bottom right (flash-attn >= 2.1).
Numerics: cpdoctor.cpu_kernels.standins (fp32, cast to the input dtype). Windows, softcap and ALiBi are not
emulated (NotImplementedError). The varlen entry points, the packed variants and their autograd Functions
(ring-flash-attn and yunchang import them at import time) live in cpdoctor/cpu_kernels/flash_attn_varlen.py and
are re-exported here."""

from __future__ import annotations

from typing import Optional

import torch

from cpdoctor.cpu_kernels import standin_checks, standin_math, standins


def _round_multiple(x: int, m: int) -> int:
    return (x + m - 1) // m * m


_require_emulation = standins.flash_attn_require_emulation
_unsupported = standin_checks.flash_attn_unsupported


def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _require_emulation(q)
    standin_checks.flash_checks(q, k, v)
    _unsupported(window_size_left, window_size_right, softcap, alibi_slopes, causal)
    if return_softmax and not dropout_p > 0.0:
        raise RuntimeError("return_softmax is only supported when p_dropout > 0.0")
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    seed, offset, keep = standin_math.dropout_draw(batch * heads * 32, (batch, heads, sq, sk), dropout_p)
    with torch.no_grad():
        out, lse = standin_math.attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, causal, softmax_scale, keep, 1.0 - dropout_p, bottom_right=True
        )
    out = out.transpose(1, 2).to(q.dtype).contiguous()
    if return_softmax:
        s_dmask = _softmax_with_dropout_signs(q, k, lse, softmax_scale, causal, keep)
    else:
        s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.tensor([seed, offset], dtype=torch.int64)
    return out, lse, s_dmask, rng_state


def _softmax_with_dropout_signs(q, k, lse, scale, causal, keep) -> torch.Tensor:
    """What mha_fwd returns as S_dmask with return_softmax: the softmax (B, H, round128(Sq), round128(Sk)) in the
    input dtype, dropped elements negated."""
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]
    with torch.no_grad():
        s = (
            torch.matmul(q.transpose(1, 2).float(), standin_math.expand_kv(q.transpose(1, 2), k.transpose(1, 2)).float().transpose(-1, -2))
            * scale
        )
        if causal:
            s = s + standin_math.causal_bias(sq, sk, bottom_right=True)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
        if keep is not None:
            p = torch.where(keep, p, -p)
        full = torch.zeros((batch, heads, _round_multiple(sq, 128), _round_multiple(sk, 128)), dtype=q.dtype)
        full[..., :sq, :sk] = p.to(q.dtype)
    return full


def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    _require_emulation(q)
    standin_checks.flash_checks(q, k, v, backward=True)
    _unsupported(window_size_left, window_size_right, softcap, alibi_slopes, causal)
    batch, sq, heads, _ = q.shape
    if tuple(dout.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
        raise RuntimeError(f"dout and out must have shape (batch_size, seqlen_q, num_heads, head_size) = {tuple(q.shape)}")
    lse = standin_math.lse_as_kernel_reads_it(softmax_lse, (batch, heads, sq), "flash-attn backward")
    keep = None
    if dropout_p > 0.0:
        if rng_state is None:
            raise RuntimeError("flash-attn backward with dropout needs the forward's rng_state")
        seed, offset = (int(x) for x in rng_state.tolist()[:2])
        keep = standin_math.dropout_mask(seed, offset, (batch, heads, sq, k.shape[1]), dropout_p)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    with torch.no_grad():
        gq, gk, gv = standin_math.attention_backward(
            t(dout), t(q), t(k), t(v), t(out), lse, None, causal, softmax_scale, keep, 1.0 - dropout_p, bottom_right=True
        )
        for dst, src in ((dq, gq), (dk, gk), (dv, gv)):
            if dst is not None:
                dst.copy_(t(src))
        softmax_d = torch.zeros((batch, heads, _round_multiple(sq, 128)), dtype=torch.float32)
        softmax_d[..., :sq] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    return softmax_d


_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_backward = _flash_attn_backward
"""flash-attn registers these as torch custom ops (torch >= 2.4) and falls back to the plain functions."""


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_softmax):
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, softmax_lse, s_dmask, rng_state = _wrapped_flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size[0],
            window_size[1],
            softcap,
            alibi_slopes,
            return_softmax and dropout_p > 0,
        )
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state)
        ctx.dropout_p, ctx.softmax_scale, ctx.causal = dropout_p, softmax_scale, causal
        ctx.window_size, ctx.softcap, ctx.alibi_slopes, ctx.deterministic = window_size, softcap, alibi_slopes, deterministic
        return out if not return_softmax else (out, softmax_lse, s_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _wrapped_flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
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
        return dq, dk, dv, None, None, None, None, None, None, None, None


# flash-attn 2.6.3's public signature (flash_attn_interface), which the stand-in must accept as callers pass it
def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's public entry, (B, S, H, D); with return_attn_probs also (softmax_lse, S_dmask)."""
    return FlashAttnFunc.apply(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


# flash-attn 2.6.3's public signature (flash_attn_interface), which the stand-in must accept as callers pass it
def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (B, S, 3, H, D): flash_attn_func on its three slices (flash-attn's FlashAttnQKVPackedFunc computes the
    same and packs the gradient the same way)."""
    return flash_attn_func(
        qkv[:, :, 0],
        qkv[:, :, 1],
        qkv[:, :, 2],
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
def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """kv (B, S_k, 2, H_k, D)."""
    return flash_attn_func(
        q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )


# The varlen half lives in cpdoctor.cpu_kernels.flash_attn_varlen (importable with or without this package on sys.path).
from cpdoctor.cpu_kernels.flash_attn_varlen import (  # noqa: E402
    FlashAttnVarlenFunc,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    _wrapped_flash_attn_varlen_backward,
    _wrapped_flash_attn_varlen_forward,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__all__ = [
    "FlashAttnFunc",
    "FlashAttnVarlenFunc",
    "_flash_attn_backward",
    "_flash_attn_forward",
    "_flash_attn_varlen_backward",
    "_flash_attn_varlen_forward",
    "_wrapped_flash_attn_backward",
    "_wrapped_flash_attn_forward",
    "_wrapped_flash_attn_varlen_backward",
    "_wrapped_flash_attn_varlen_forward",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]
