"""CPU stand-ins for the CUDA attention kernels diffusers' GPU backends call, keeping each kernel's contract.

The CP defects of diffusers' `_native_flash`, `_native_cudnn` and `flash` backends live in its Python glue
around the kernel call (argument order, layouts, which tensors it saves), not inside the kernels
(docs/FACTS.md). A stand-in that keeps the kernel's contract exposes them on a CPU. What is kept, per op:
the argument list and order and the return tuple (the installed torch's schemas,
`torch.ops.aten.<op>.default._schema`), output shapes and dtypes, LSE shape and padding and the returned
philox seed/offset tensors (torch/_meta_registrations.py: `meta__scaled_dot_product_flash_attention`,
`meta__scaled_dot_product_cudnn_attention`, `meta__scaled_dot_product_efficient_attention`,
`meta__efficient_attention_forward` and their backwards), the dtypes and shapes the real kernel refuses (the
TORCH_CHECKs of flash-attn's `mha_fwd` / `mha_bwd` in csrc/flash_attn/flash_api.cpp, which torch vendors for
its flash kernel), and the RNG effect: with dropout > 0 the real kernels take a philox (seed, offset) from the
device generator and advance it; here the CPU default generator is drawn from (its state advances,
deterministically) and the drawn value seeds the dropout mask, which the backward replays from the returned
seed/offset. Dropout keeps an element when a uniform uint8 is <= floor(keep_prob·255) (flash-attn's
`p_dropout_in_uint8_t`), so a dropout of 1e-30 keeps everything, as on the GPU, but still advances the
generator. Numerics come from torch's CPU kernels in fp32 (`_scaled_dot_product_flash_attention_for_cpu` and
its backward) or explicit fp32 softmax math (dropout, bottom-right causal), cast to the kernel's dtype.

Not emulated: the CUDA kernels' own arithmetic (tiling, bf16 rounding of P), varlen / paged / windowed /
softcap / ALiBi variants (they raise NotImplementedError), and the exact wording of errors the real kernels
raise outside flash-attn's checks (cuDNN's are paraphrased). This module imports no diffusers: PyTorch's own
context parallel and ring-flash-attention call the same aten ops and flash-attn entry points.

`install()` registers the aten stand-ins for the CPU dispatch key through `torch.library` (idempotent);
`flash_attn_path()` is the folder to put on sys.path (before importing diffusers) for the flash-attn 2
stand-in package (`flash_attn.flash_attn_interface`, version `2.6.3+cpdoctor.standin`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from cpdoctor.vocabulary import ALL, HALF, DType

__all__ = ["install", "uninstall", "installed", "flash_attn_path", "activate", "ATEN_OPS", "EMULATED_BACKENDS", "FLASH_ATTN_VERSION"]

EMULATED_BACKENDS = ("_native_flash", "_native_cudnn", "flash")
"""The diffusers backends whose CUDA kernels these stand-ins take the place of (aten flash, aten cuDNN, flash-attn 2)."""

FLASH_ATTN_VERSION = "2.6.3+cpdoctor.standin"
"""What `importlib.metadata.version("flash_attn")` says with the stand-in on sys.path (diffusers requires >= 2.6.3)."""

_HALF = tuple(dtype.torch for dtype in HALF)


# --------------------------------------------------------------------------------------------------------
# RNG: the philox (seed, offset) the real kernels take from the device generator
# --------------------------------------------------------------------------------------------------------


def philox_draw(counter_offset: int) -> tuple[int, int]:
    """(seed, offset) for one kernel call with dropout: the real kernels call
    `gen->philox_cuda_state(counter_offset)`, which returns the generator's seed and offset and advances the
    offset. The CPU default generator has no offset, so one 62-bit value is drawn from it (its state
    advances, deterministically) and serves as the offset; `counter_offset` is recorded with it."""
    drawn = int(torch.randint(0, 2**62, (1,), dtype=torch.int64)[0])
    return drawn, int(counter_offset)


def _keep_threshold(dropout_p: float) -> int:
    """flash-attn's `p_dropout_in_uint8_t = floor((1 - p) * 255)`: an element is kept when its uniform uint8 is
    at most this; 255 keeps everything (dropout 1e-30)."""
    return int(math.floor((1.0 - dropout_p) * 255.0))


def _dropout_mask(seed: int, offset: int, shape: tuple[int, ...], dropout_p: float) -> torch.Tensor | None:
    """The keep mask (True = kept) a philox (seed, offset) yields, or None when every element is kept."""
    threshold = _keep_threshold(dropout_p)
    if dropout_p <= 0.0 or threshold >= 255:
        return None
    gen = torch.Generator().manual_seed((seed ^ (offset * 0x9E3779B97F4A7C15)) & (2**63 - 1))
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int16) <= threshold


# --------------------------------------------------------------------------------------------------------
# Numerics: attention in fp32, layout (B, H, S, D)
# --------------------------------------------------------------------------------------------------------


def _additive(bias: torch.Tensor | None) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dtype == torch.bool:
        return torch.zeros(bias.shape, dtype=torch.float32).masked_fill_(~bias, float("-inf"))
    return bias.float()


def _causal_bias(sq: int, sk: int, bottom_right: bool) -> torch.Tensor:
    shift = sk - sq if bottom_right else 0
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=shift)
    return torch.zeros(sq, sk).masked_fill_(~keep, float("-inf"))


def _bias_with_causal(bias: torch.Tensor | None, sq: int, sk: int, is_causal: bool, bottom_right: bool) -> torch.Tensor | None:
    add = _additive(bias)
    if is_causal:
        c = _causal_bias(sq, sk, bottom_right)
        add = c if add is None else add + c
    return add


def _fast_path(is_causal: bool, bottom_right: bool, sq: int, sk: int, mask: Any) -> bool:
    return mask is None and (not is_causal or not bottom_right or sq == sk)


def _expand_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GQA: repeat K/V heads to the query's (the real kernels accept H_q a multiple of H_kv)."""
    return x if x.shape[1] == q.shape[1] else x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)


# the fused kernels' argument convention (aten's _scaled_dot_product_*_attention, flash-attn's _flash_attn_*)
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    keep: torch.Tensor | None = None,
    keep_prob: float = 1.0,
    bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32, lse fp32 (B, H, Sq)) of softmax(q kᵀ·scale + bias) v, dropout applied by `keep`."""
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf = q.float(), _expand_kv(q, k).float(), _expand_kv(q, v).float()
    sq, sk = q.shape[2], k.shape[2]
    if keep is None and _fast_path(is_causal, bottom_right, sq, sk, None):
        qf, kf, vf = qf.contiguous(), kf.contiguous(), vf.contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf, kf, vf, 0.0, is_causal, attn_mask=_additive(bias), scale=scale
        )
        return out, lse.contiguous()  # the CPU kernel's LSE is strided (B, S, H) underneath; the CUDA kernels' is not
    s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
    add = _bias_with_causal(bias, sq, sk, is_causal, bottom_right)
    if add is not None:
        s = s + add
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    if keep is not None:
        p = p * keep / keep_prob
    return torch.matmul(p, vf), lse


# the fused backward's convention (dout, q, k, v, out, lse, ...: aten's and flash-attn's backward ops)
def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    keep: torch.Tensor | None = None,
    keep_prob: float = 1.0,
    bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 dQ, dK, dV from explicit q, k, v, out and lse (B, H, Sq), as every fused backward computes them."""
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    hq, hk = q.shape[1], k.shape[1]
    kf, vf = _expand_kv(q, k).float(), _expand_kv(q, v).float()
    sq, sk = q.shape[2], k.shape[2]
    if keep is None and _fast_path(is_causal, bottom_right, sq, sk, None):
        c = lambda x: x.float().contiguous()  # noqa: E731 - the CPU kernel wants one layout for all of them
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            c(dout), c(q), c(kf), c(vf), c(out), c(lse), 0.0, is_causal, attn_mask=_additive(bias), scale=scale
        )
    else:
        qf, do, of = q.float(), dout.float(), out.float()
        s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
        add = _bias_with_causal(bias, sq, sk, is_causal, bottom_right)
        if add is not None:
            s = s + add
        p = torch.exp(s - lse.float().unsqueeze(-1)).nan_to_num_(0.0)
        pd = p if keep is None else p * keep / keep_prob
        dv = torch.matmul(pd.transpose(-1, -2), do)
        dp = torch.matmul(do, vf.transpose(-1, -2))
        if keep is not None:
            dp = dp * keep / keep_prob
        delta = (do * of).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, kf).mul_(scale)
        dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
    if hq != hk:  # GQA: sum the repeated heads' gradients back
        g = hq // hk
        dk = dk.unflatten(1, (hk, g)).sum(2)
        dv = dv.unflatten(1, (hk, g)).sum(2)
    return dq, dk, dv


def _lse_as_kernel_reads_it(lse: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """The fused backwards read the LSE through a bare pointer, without its strides (docs/FACTS.md): whatever
    layout the caller passes, the kernel sees its storage as a contiguous tensor of `shape`."""
    if lse is None:
        raise RuntimeError(f"{what}: logsumexp is undefined (the forward was run without computing it)")
    if lse.dtype != torch.float32:
        raise RuntimeError(f"{what}: logsumexp must be float32, got {lse.dtype}")
    need = math.prod(shape)
    if lse.untyped_storage().nbytes() // 4 - lse.storage_offset() < need:
        raise RuntimeError(f"{what}: logsumexp has {lse.numel()} elements, the kernel reads {need} {tuple(shape)}")
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return lse.as_strided(shape, strides, lse.storage_offset())


# --------------------------------------------------------------------------------------------------------
# The checks flash-attn 2's mha_fwd / mha_bwd make (csrc/flash_attn/flash_api.cpp; torch vendors the same
# code under aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp). Tensors here are (B, S, H, D).
# --------------------------------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def flash_checks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> None:
    """mha_fwd / mha_bwd's TORCH_CHECKs on bshd tensors, in their order and wording."""
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query, key and value must be 4-D (batch_size, seqlen, num_heads, head_size)")
    batch, _, heads, head = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    _check(batch > 0, "batch size must be positive")
    _check(head <= 256, f"FlashAttention {'backward' if backward else 'forward'} only supports head dimension at most 256")
    _check(head % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(
        tuple(k.shape) == (batch, seqlen_k, heads_k, head),
        f"key must have shape (batch_size, seqlen_k, num_heads_k, head_size) = {(batch, seqlen_k, heads_k, head)}, got {tuple(k.shape)}",
    )
    _check(
        tuple(v.shape) == (batch, seqlen_k, heads_k, head),
        f"value must have shape (batch_size, seqlen_k, num_heads_k, head_size) = {(batch, seqlen_k, heads_k, head)}, got {tuple(v.shape)}",
    )


def flash_attn_require_emulation(q: torch.Tensor) -> None:
    """Outside an emulated examination the flash-attn stand-in behaves as the real flash-attn does with CPU
    tensors (mha_fwd's CHECK_DEVICE), so a process that imported it earlier cannot run `flash` unannounced."""
    if not installed():
        raise RuntimeError("Input tensor must be on CUDA device (cpdoctor's flash-attn stand-in is only active under --emulate)")


def flash_attn_unsupported(window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Any, causal: bool) -> None:
    """The flash-attn features the stand-in does not emulate (NotImplementedError rather than a wrong number)."""
    if alibi_slopes is not None or softcap != 0.0:
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate ALiBi or softcap")
    if window_size_left >= 0 or (window_size_right >= 0 and not (causal and window_size_right == 0)):
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate sliding windows")


def _bhsd_to_bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


# --------------------------------------------------------------------------------------------------------
# aten::_scaled_dot_product_flash_attention[_backward] (CUDA: attention.cu / attention_backward.cu)
# --------------------------------------------------------------------------------------------------------


def sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """Schema: (query, key, value, dropout_p=0., is_causal=False, return_debug_mask=False, *, scale=None) ->
    (output, logsumexp (B, H, Sq) f32, cum_seq_q, cum_seq_k (undefined), max_q, max_k, rng_state (2,) uint64,
    unused () uint64, debug_attn_mask). Layout (B, H, S, D); the kernel runs mha_fwd on the bshd transpose."""
    _check(key.size(2) == value.size(2), "Key and Value must have the same sequence length")
    flash_checks(_bhsd_to_bshd(query), _bhsd_to_bshd(key), _bhsd_to_bshd(value))
    batch, heads, sq, _ = query.shape
    sk = key.size(2)
    seed, offset, keep = 0, 0, None
    if dropout_p > 0.0:
        seed, offset = philox_draw(batch * heads * 32)
        keep = _dropout_mask(seed, offset, (batch, heads, sq, sk), dropout_p)
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
    _check(tuple(grad_out.shape) == tuple(query.shape), f"dout must have shape {tuple(query.shape)}, got {tuple(grad_out.shape)}")
    _check(tuple(out.shape) == tuple(query.shape), f"out must have shape {tuple(query.shape)}, got {tuple(out.shape)}")
    lse = _lse_as_kernel_reads_it(logsumexp, (batch, heads, sq), "flash attention backward")
    keep = None
    if dropout_p > 0.0:
        seed, offset = (int(x) for x in philox_seed.tolist()[:2])
        keep = _dropout_mask(seed, offset, (batch, heads, sq, key.size(2)), dropout_p)
    dq, dk, dv = attention_backward(grad_out, query, key, value, out, lse, None, is_causal, scale, keep, 1.0 - dropout_p)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# --------------------------------------------------------------------------------------------------------
# aten::_scaled_dot_product_cudnn_attention[_backward]
# --------------------------------------------------------------------------------------------------------


def _cudnn_checks(query, key, value, backward: bool = False) -> None:
    what = "cuDNN SDPA backward" if backward else "cuDNN SDPA"
    _check(query.dtype in _HALF, f"{what}: only fp16 and bf16 inputs are supported, got {query.dtype}")
    _check(key.dtype == query.dtype and value.dtype == query.dtype, f"{what}: query, key and value must have the same dtype")
    _check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4, f"{what}: query, key and value must be 4-D (B, H, S, D)")
    _check(
        key.size(0) == query.size(0) and key.size(3) == query.size(3),
        f"{what}: key {tuple(key.shape)} does not match query {tuple(query.shape)} in batch or head_dim",
    )
    _check(
        key.size(2) == value.size(2) and key.size(1) == value.size(1),
        f"{what}: key {tuple(key.shape)} and value {tuple(value.shape)} differ in heads or sequence",
    )
    _check(
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
    seed, offset, keep = 0, 0, None
    if dropout_p > 0.0:
        seed, offset = philox_draw(batch * heads * sq * sk)
        keep = _dropout_mask(seed, offset, (batch, heads, sq, sk), dropout_p)
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
    lse = _lse_as_kernel_reads_it(logsumexp, (batch, heads, sq), "cuDNN SDPA backward")
    keep = None
    if dropout_p > 0.0:
        keep = _dropout_mask(int(philox_seed), int(philox_offset), (batch, heads, sq, key.size(2)), dropout_p)
    dq, dk, dv = attention_backward(grad_out, query, key, value, out, lse, attn_bias, is_causal, scale, keep, 1.0 - dropout_p)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# --------------------------------------------------------------------------------------------------------
# aten memory-efficient attention: _scaled_dot_product_efficient_attention[_backward] (bhsd) and
# _efficient_attention_forward/_backward (bshd). LSE padded to a multiple of 32 queries.
# --------------------------------------------------------------------------------------------------------


def _efficient_checks(q, k, v) -> None:  # bshd
    _check(DType.of_torch(q.dtype) in ALL, f"mem-efficient attention: unsupported dtype {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
    _check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query, key and value must be 4-D")
    _check(q.size(0) == k.size(0) and q.size(3) == k.size(3), "query and key must have the same batch size and head_dim")
    _check(k.size(1) == v.size(1) and k.size(2) == v.size(2), "key and value must have the same sequence length and heads")
    _check(q.size(2) == k.size(2), f"mem-efficient attention: query has {q.size(2)} heads and key {k.size(2)} (no GQA)")


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


def _efficient_forward_bshd(q, k, v, bias, dropout_p, is_causal, bottom_right, compute_lse, scale):
    _efficient_checks(q, k, v)
    batch, sq, heads, _ = q.shape
    sk = k.size(1)
    seed, offset, keep = 0, 0, None
    if dropout_p > 0.0:
        seed, offset = philox_draw(batch * heads * sq * sk)
        keep = _dropout_mask(seed, offset, (batch, heads, sq, sk), dropout_p)
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
    _check(
        logsumexp is not None and logsumexp.numel() > 0,
        "mem-efficient attention backward: logsumexp is empty (forward without compute_log_sumexp)",
    )
    _check(logsumexp.shape[-1] >= sq, f"mem-efficient attention backward: logsumexp {tuple(logsumexp.shape)} shorter than the {sq} queries")
    lse = logsumexp[..., :sq]
    keep = _dropout_mask(int(seed), int(offset), (batch, heads, sq, k.size(1)), dropout_p) if dropout_p > 0.0 else None
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


# --------------------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------------------

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


class StandinLibrary:
    """The aten stand-ins registered with torch's dispatcher in this process. Lifetime: one instance, `LIBRARY`,
    created at this module's import, holding nothing; `install` registers the stand-ins once (a second install
    is a no-op returning the same ops); `uninstall` destroys the registration, after which the CUDA-only ops are
    missing on CPU again and the next `install` registers them afresh. Nothing survives an uninstall."""

    def __init__(self) -> None:
        self.library: Any = None
        """The `torch.library.Library` holding the registrations, or None."""
        self.ops: list[str] = []
        """The aten ops registered (an op that already had a CPU kernel in this torch is left alone)."""

    @property
    def installed(self) -> bool:
        return self.library is not None

    def install(self) -> list[str]:
        if self.library is None:
            lib = torch.library.Library("aten", "IMPL")
            done = []
            for name, fn in ATEN_OPS.items():
                packet = getattr(torch.ops.aten, name, None)
                if packet is None or torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), "CPU"):
                    continue
                lib.impl(name, fn, "CPU")
                done.append(name)
            self.library, self.ops = lib, done
        return list(self.ops)

    def uninstall(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library, self.ops = None, []


LIBRARY = StandinLibrary()


def installed() -> bool:
    return LIBRARY.installed


def install() -> list[str]:
    """Register every aten stand-in for the CPU dispatch key (idempotent); returns the ops registered. An op
    that already has a CPU kernel in this torch is left alone."""
    return LIBRARY.install()


def uninstall() -> None:
    """Remove the registrations (the CUDA-only ops are again missing on CPU)."""
    LIBRARY.uninstall()


def flash_attn_path() -> str:
    """The folder holding the flash-attn 2 stand-in package (`flash_attn/`) and its dist-info."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "flash_attn_standin")


def activate() -> None:
    """Everything an emulating process needs, before it imports diffusers: the flash-attn stand-in first on
    sys.path (diffusers checks flash-attn's version and imports it at import time) and the aten stand-ins."""
    import sys

    path = flash_attn_path()
    if path not in sys.path:
        sys.path.insert(0, path)
        import importlib

        importlib.invalidate_caches()
    install()
