"""What every CPU stand-in of a CUDA attention kernel computes with (cpu_kernels/standins.py says which kernels and
which of their contracts are kept): the philox (seed, offset) the real kernels draw and the dropout mask it yields,
attention forward and backward in fp32 on torch's CPU kernels or explicit softmax math (dropout, bottom-right
causal), and the LSE as the fused backwards read it. Imports no diffusers."""

from __future__ import annotations

import math
from typing import Any

import torch

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


def keep_threshold(dropout_p: float) -> int:
    """flash-attn's `p_dropout_in_uint8_t = floor((1 - p) * 255)`: an element is kept when its uniform uint8 is
    at most this; 255 keeps everything (dropout 1e-30)."""
    return int(math.floor((1.0 - dropout_p) * 255.0))


def dropout_mask(seed: int, offset: int, shape: tuple[int, ...], dropout_p: float) -> torch.Tensor | None:
    """The keep mask (True = kept) a philox (seed, offset) yields, or None when every element is kept."""
    threshold = keep_threshold(dropout_p)
    if dropout_p <= 0.0 or threshold >= 255:
        return None
    gen = torch.Generator().manual_seed((seed ^ (offset * 0x9E3779B97F4A7C15)) & (2**63 - 1))
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.int16) <= threshold


def dropout_draw(counter_offset: int, shape: tuple[int, ...], dropout_p: float) -> tuple[int, int, torch.Tensor | None]:
    """A forward kernel's dropout: (seed, offset, keep mask) drawn as the real kernel draws them (`philox_draw`), or
    (0, 0, None) without dropout (nothing drawn, the generator untouched)."""
    if dropout_p <= 0.0:
        return 0, 0, None
    seed, offset = philox_draw(counter_offset)
    return seed, offset, dropout_mask(seed, offset, shape, dropout_p)


# --------------------------------------------------------------------------------------------------------
# Numerics: attention in fp32, layout (B, H, S, D)
# --------------------------------------------------------------------------------------------------------


def additive(bias: torch.Tensor | None) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.dtype == torch.bool:
        return torch.zeros(bias.shape, dtype=torch.float32).masked_fill_(~bias, float("-inf"))
    return bias.float()


def causal_bias(sq: int, sk: int, bottom_right: bool) -> torch.Tensor:
    shift = sk - sq if bottom_right else 0
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=shift)
    return torch.zeros(sq, sk).masked_fill_(~keep, float("-inf"))


def bias_with_causal(bias: torch.Tensor | None, sq: int, sk: int, is_causal: bool, bottom_right: bool) -> torch.Tensor | None:
    add = additive(bias)
    if is_causal:
        c = causal_bias(sq, sk, bottom_right)
        add = c if add is None else add + c
    return add


def fast_path(is_causal: bool, bottom_right: bool, sq: int, sk: int, mask: Any) -> bool:
    return mask is None and (not is_causal or not bottom_right or sq == sk)


def expand_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GQA: repeat K/V heads to the query's (the real kernels accept H_q a multiple of H_kv)."""
    return x if x.shape[1] == q.shape[1] else x.repeat_interleave(q.shape[1] // x.shape[1], dim=1)


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The kernels' default scale, 1/sqrt(head dim), unless one is given."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def scores(
    qf: torch.Tensor, kf: torch.Tensor, bias: torch.Tensor | None, is_causal: bool, bottom_right: bool, scale: float
) -> torch.Tensor:
    """q kᵀ·scale plus the bias and the causal mask, fp32 (B, H, Sq, Sk): what the explicit forward and backward
    both take the softmax of."""
    s = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)
    add = bias_with_causal(bias, qf.shape[2], kf.shape[2], is_causal, bottom_right)
    return s if add is None else s + add


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
    scale = softmax_scale(q, scale)
    qf, kf, vf = q.float(), expand_kv(q, k).float(), expand_kv(q, v).float()
    sq, sk = q.shape[2], k.shape[2]
    if keep is None and fast_path(is_causal, bottom_right, sq, sk, None):
        qf, kf, vf = qf.contiguous(), kf.contiguous(), vf.contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf, kf, vf, 0.0, is_causal, attn_mask=additive(bias), scale=scale
        )
        return out, lse.contiguous()  # the CPU kernel's LSE is strided (B, S, H) underneath; the CUDA kernels' is not
    s = scores(qf, kf, bias, is_causal, bottom_right, scale)
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
    scale = softmax_scale(q, scale)
    hq, hk = q.shape[1], k.shape[1]
    kf, vf = expand_kv(q, k).float(), expand_kv(q, v).float()
    sq, sk = q.shape[2], k.shape[2]
    if keep is None and fast_path(is_causal, bottom_right, sq, sk, None):
        c = lambda x: x.float().contiguous()  # noqa: E731 - the CPU kernel wants one layout for all of them
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            c(dout), c(q), c(kf), c(vf), c(out), c(lse), 0.0, is_causal, attn_mask=additive(bias), scale=scale
        )
    else:
        qf, do, of = q.float(), dout.float(), out.float()
        p = torch.exp(scores(qf, kf, bias, is_causal, bottom_right, scale) - lse.float().unsqueeze(-1)).nan_to_num_(0.0)
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


def lse_as_kernel_reads_it(lse: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
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
