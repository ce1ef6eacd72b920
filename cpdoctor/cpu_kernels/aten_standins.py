"""The aten stand-ins (`ATEN_OPS`): CPU kernels for the CUDA-only ops of torch's fused attention, each keeping its
op's schema, return tuple, layouts, LSE shape and padding, philox seed/offset tensors and refusals
(torch/_meta_registrations.py: `meta__scaled_dot_product_flash_attention`, `meta__scaled_dot_product_cudnn_attention`,
`meta__scaled_dot_product_efficient_attention`, `meta__efficient_attention_forward` and their backwards; the
installed torch's schemas, `torch.ops.aten.<op>.default._schema`); cpu_kernels/standins.py registers them."""

from __future__ import annotations

from typing import Any

import torch

from cpdoctor.cpu_kernels.standin_checks import HALF_TORCH, check, flash_checks
from cpdoctor.cpu_kernels.standin_math import attention_backward, attention_forward, dropout_draw, dropout_mask, lse_as_kernel_reads_it
from cpdoctor.vocabulary import ALL, DType


def _bhsd_to_bshd(x: torch.Tensor) -> torch.Tensor:
    """The kernels' (B, H, S, D) tensors as flash-attn's checks read them, (B, S, H, D)."""
    return x.transpose(1, 2)


# --------------------------------------------------------------------------------------------------------
# aten::_scaled_dot_product_flash_attention[_backward] (CUDA: attention.cu / attention_backward.cu)
# --------------------------------------------------------------------------------------------------------


def sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """Schema: (query, key, value, dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None) ->
    (output, logsumexp (B, H, Sq) f32, cum_seq_q, cum_seq_k (undefined), max_q, max_k, rng_state (2,) uint64,
    unused () uint64, debug_attn_mask). Layout (B, H, S, D); the kernel runs mha_fwd on the bshd transpose."""
    check(key.size(2) == value.size(2), "Key and Value must have the same sequence length")
    flash_checks(_bhsd_to_bshd(query), _bhsd_to_bshd(key), _bhsd_to_bshd(value))
    batch, heads, sq, _ = query.shape
    sk = key.size(2)
    seed, offset, keep = dropout_draw(batch * heads * 32, (batch, heads, sq, sk), dropout_p)
    out, lse = attention_forward(query, key, value, None, is_causal, scale, keep, 1.0 - dropout_p)
    out = out.to(query.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # bshd memory, like the real one
    rng_state = torch.tensor([seed, offset], dtype=torch.uint64)
    unused = torch.tensor(0, dtype=torch.uint64)
    debug = torch.empty(0, dtype=query.dtype)
    return out, lse, None, None, sq, sk, rng_state, unused, debug


def sdpa_flash_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    """Schema: (grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
    is_causal, philox_seed, philox_offset, *, scale=None) -> (grad_query, grad_key, grad_value), bhsd."""
    flash_checks(_bhsd_to_bshd(query), _bhsd_to_bshd(key), _bhsd_to_bshd(value), backward=True)
    batch, heads, sq, _ = query.shape
    check(tuple(grad_out.shape) == tuple(query.shape), f"dout must have shape {tuple(query.shape)}, got {tuple(grad_out.shape)}")
    check(tuple(out.shape) == tuple(query.shape), f"out must have shape {tuple(query.shape)}, got {tuple(out.shape)}")
    lse = lse_as_kernel_reads_it(logsumexp, (batch, heads, sq), "flash attention backward")
    keep = None
    if dropout_p > 0.0:
        seed, offset = (int(x) for x in philox_seed.tolist()[:2])
        keep = dropout_mask(seed, offset, (batch, heads, sq, key.size(2)), dropout_p)
    dq, dk, dv = attention_backward(grad_out, query, key, value, out, lse, None, is_causal, scale, keep, 1.0 - dropout_p)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# --------------------------------------------------------------------------------------------------------
# aten::_scaled_dot_product_cudnn_attention[_backward]
# --------------------------------------------------------------------------------------------------------


def _cudnn_checks(query, key, value, backward: bool = False) -> None:
    what = "cuDNN SDPA backward" if backward else "cuDNN SDPA"
    check(query.dtype in HALF_TORCH, f"{what}: only fp16 and bf16 inputs are supported, got {query.dtype}")
    check(key.dtype == query.dtype and value.dtype == query.dtype, f"{what}: query, key and value must have the same dtype")
    check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4, f"{what}: query, key and value must be 4-D (B, H, S, D)")
    check(
        key.size(0) == query.size(0) and key.size(3) == query.size(3),
        f"{what}: key {tuple(key.shape)} does not match query {tuple(query.shape)} in batch or head_dim",
    )
    check(
        key.size(2) == value.size(2) and key.size(1) == value.size(1),
        f"{what}: key {tuple(key.shape)} and value {tuple(value.shape)} differ in heads or sequence",
    )
    check(
        query.size(1) % key.size(1) == 0,
        f"{what}: GQA requires the number of heads in key/value ({key.size(1)}) to divide the number of heads in query ({query.size(1)})",
    )


def sdpa_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """Schema: (query, key, value, attn_bias?, compute_log_sumexp, dropout_p=0., is_causal=False,
    return_debug_mask=False, *, scale=None) -> (output, logsumexp (B, H, Sq, 1) f32 — undefined without
    compute_log_sumexp —, cum_seq_q, cum_seq_k (undefined), max_q, max_k, philox_seed () i64,
    philox_offset () i64, debug_attn_mask (undefined)). Layout (B, H, S, D)."""
    _cudnn_checks(query, key, value)
    batch, heads, sq, _ = query.shape
    sk = key.size(2)
    seed, offset, keep = dropout_draw(batch * heads * sq * sk, (batch, heads, sq, sk), dropout_p)
    out, lse = attention_forward(query, key, value, attn_bias, is_causal, scale, keep, 1.0 - dropout_p)
    lse_out = lse.unsqueeze(-1).contiguous() if compute_log_sumexp else None
    seed_t, offset_t = torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)
    return out.to(query.dtype), lse_out, None, None, sq, sk, seed_t, offset_t, None


def sdpa_cudnn_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    """Schema: (grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
    cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None) -> (dq, dk, dv), bhsd; the LSE is read as
    (B, H, Sq[, 1]) without strides."""
    _cudnn_checks(query, key, value, backward=True)
    batch, heads, sq, _ = query.shape
    lse = lse_as_kernel_reads_it(logsumexp, (batch, heads, sq), "cuDNN SDPA backward")
    keep = None
    if dropout_p > 0.0:
        keep = dropout_mask(int(philox_seed), int(philox_offset), (batch, heads, sq, key.size(2)), dropout_p)
    dq, dk, dv = attention_backward(grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, keep, 1.0 - dropout_p)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# --------------------------------------------------------------------------------------------------------
# aten memory-efficient attention: _scaled_dot_product_efficient_attention[_backward] (bhsd) and
# _efficient_attention_forward/_backward (bshd). LSE padded to a multiple of 32 queries.
# --------------------------------------------------------------------------------------------------------


def _efficient_checks(q, k, v) -> None:  # bshd
    check(DType.of_torch(q.dtype) in ALL, f"mem-efficient attention: unsupported dtype {q.dtype}")
    check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
    check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query, key and value must be 4-D")
    check(q.size(0) == k.size(0) and q.size(3) == k.size(3), "query and key must have the same batch size and head_dim")
    check(k.size(1) == v.size(1) and k.size(2) == v.size(2), "key and value must have the same sequence length and heads")
    check(q.size(2) == k.size(2), f"mem-efficient attention: query has {q.size(2)} heads and key {k.size(2)} (no GQA)")


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _efficient_forward_bshd(q, k, v, bias, dropout_p, is_causal, bottom_right, compute_lse, scale):
    _efficient_checks(q, k, v)
    batch, sq, heads, _ = q.shape
    sk = k.size(1)
    seed, offset, keep = dropout_draw(batch * heads * sq * sk, (batch, heads, sq, sk), dropout_p)
    out, lse = attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias, is_causal, scale, keep, 1.0 - dropout_p, bottom_right
    )
    lse_pad = torch.full((batch, heads, _pad32(sq) if compute_lse else 0), float("inf"))
    if compute_lse:
        lse_pad[..., :sq] = lse
    out = out.transpose(1, 2).to(q.dtype).contiguous()
    return out, lse_pad, torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)


def _efficient_backward_bshd(dout, q, k, v, bias, out, logsumexp, dropout_p, seed, offset, is_causal, bottom_right, scale):
    _efficient_checks(q, k, v)
    batch, sq, heads, _ = q.shape
    check(
        logsumexp is not None and logsumexp.numel() > 0,
        "mem-efficient attention backward: logsumexp is empty (forward without compute_log_sumexp)",
    )
    check(logsumexp.shape[-1] >= sq, f"mem-efficient attention backward: logsumexp {tuple(logsumexp.shape)} shorter than the {sq} queries")
    lse = logsumexp[..., :sq]
    keep = dropout_mask(int(seed), int(offset), (batch, heads, sq, k.size(1)), dropout_p) if dropout_p > 0.0 else None
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = attention_backward(t(dout), t(q), t(k), t(v), t(out), lse, bias, is_causal, scale, keep, 1.0 - dropout_p, bottom_right)
    return t(dq).to(q.dtype), t(dk).to(k.dtype), t(dv).to(v.dtype)


def sdpa_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """Schema: (query, key, value, attn_bias?, compute_log_sumexp, dropout_p=0., is_causal=False, *, scale=None)
    -> (output bhsd, log_sumexp (B, H, ceil32(Sq)) or (B, H, 0), philox_seed () i64, philox_offset () i64)."""
    out, lse, seed, offset = _efficient_forward_bshd(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_bias, dropout_p, is_causal, False, compute_log_sumexp, scale
    )
    return out.transpose(1, 2), lse, seed, offset


def sdpa_efficient_backward(
    grad_out_,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    """Schema: (grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
    grad_input_mask bool[4], is_causal=False, *, scale=None) -> (dq, dk, dv, grad_bias (undefined))."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = _efficient_backward_bshd(
        t(grad_out_),
        t(query),
        t(key),
        t(value),
        attn_bias,
        t(out),
        logsumexp,
        dropout_p,
        philox_seed,
        philox_offset,
        is_causal,
        False,
        scale,
    )
    if attn_bias is not None and grad_input_mask[3]:
        raise NotImplementedError("cpdoctor's stand-in does not compute the attention bias gradient")
    return t(dq), t(dk), t(dv), None


def _mask_type(custom_mask_type: int) -> tuple[bool, bool]:
    """(is_causal, bottom_right) of xformers' custom_mask_type: 0 none, 1 causal from the top left, 2 from the
    bottom right."""
    if custom_mask_type not in (0, 1, 2):
        raise RuntimeError(f"invalid custom_mask_type {custom_mask_type}")
    return custom_mask_type != 0, custom_mask_type == 2


def _no_varlen(*tensors: Any, what: str) -> None:
    if any(t is not None for t in tensors):
        raise NotImplementedError(f"cpdoctor's stand-in of {what} does not emulate varlen / windowed inputs")


def efficient_attention_forward(
    query,
    key,
    value,
    bias,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    custom_mask_type,
    compute_log_sumexp=False,
    *,
    scale=None,
    seqlen_k=None,
    window_size=None,
):
    """Schema: (query, key, value, bias?, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q?, max_seqlen_k?, dropout_p,
    custom_mask_type, compute_log_sumexp=False, *, scale=None, seqlen_k=None, window_size=None) -> (output bshd,
    logsumexp (B, H, ceil32(Sq)), philox_seed, philox_offset, max_seqlen_batch_q, max_seqlen_batch_k)."""
    _no_varlen(cu_seqlens_q, cu_seqlens_k, seqlen_k, window_size, what="_efficient_attention_forward")
    causal, bottom_right = _mask_type(custom_mask_type)
    out, lse, seed, offset = _efficient_forward_bshd(query, key, value, bias, dropout_p, causal, bottom_right, compute_log_sumexp, scale)
    return out, lse, seed, offset, query.size(1), key.size(1)


def efficient_attention_backward(
    grad_out_,
    query,
    key,
    value,
    bias,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    dropout_p,
    philox_seed,
    philox_offset,
    custom_mask_type,
    bias_requires_grad,
    *,
    scale=None,
    num_splits_key=None,
    window_size=None,
    shared_storage_dqdkdv=False,
):
    """Schema: (grad_out_, query, key, value, bias?, out, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q, max_seqlen_k,
    logsumexp, dropout_p, philox_seed, philox_offset, custom_mask_type, bias_requires_grad, *, scale=None,
    num_splits_key=None, window_size=None, shared_storage_dqdkdv=False) -> (dq, dk, dv, grad_bias), bshd."""
    _no_varlen(cu_seqlens_q, cu_seqlens_k, window_size, what="_efficient_attention_backward")
    if bias_requires_grad:
        raise NotImplementedError("cpdoctor's stand-in does not compute the attention bias gradient")
    causal, bottom_right = _mask_type(custom_mask_type)
    dq, dk, dv = _efficient_backward_bshd(
        grad_out_, query, key, value, bias, out, logsumexp, dropout_p, philox_seed, philox_offset, causal, bottom_right, scale
    )
    return dq, dk, dv, torch.empty(())


ATEN_OPS = {
    "_scaled_dot_product_flash_attention": sdpa_flash,
    "_scaled_dot_product_flash_attention_backward": sdpa_flash_backward,
    "_scaled_dot_product_cudnn_attention": sdpa_cudnn,
    "_scaled_dot_product_cudnn_attention_backward": sdpa_cudnn_backward,
    "_scaled_dot_product_efficient_attention": sdpa_efficient,
    "_scaled_dot_product_efficient_attention_backward": sdpa_efficient_backward,
    "_efficient_attention_forward": efficient_attention_forward,
    "_efficient_attention_backward": efficient_attention_backward,
}
"""aten op -> its CPU stand-in."""
