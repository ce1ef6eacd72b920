"""What the real kernels refuse, in their order and wording: the checks flash-attn 2's mha_fwd / mha_bwd make
(csrc/flash_attn/flash_api.cpp; torch vendors the same code under
aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp), and the flash-attn features the stand-ins do not
emulate. Tensors here are (B, S, H, D)."""

from __future__ import annotations

from typing import Any

import torch

from cpdoctor.vocabulary import HALF

HALF_TORCH = tuple(dtype.torch for dtype in HALF)
"""The dtypes flash-attn and cuDNN take (torch's)."""

# --------------------------------------------------------------------------------------------------------
# The checks flash-attn 2's mha_fwd / mha_bwd make (csrc/flash_attn/flash_api.cpp; torch vendors the same
# code under aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp). Tensors here are (B, S, H, D).
# --------------------------------------------------------------------------------------------------------


def check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def flash_checks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> None:
    """mha_fwd / mha_bwd's TORCH_CHECKs on bshd tensors, in their order and wording."""
    check(q.dtype in HALF_TORCH, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "query, key and value must be 4-D (batch_size, seqlen, num_heads, head_size)")
    batch, _, heads, head = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    check(batch > 0, "batch size must be positive")
    check(head <= 256, f"FlashAttention {'backward' if backward else 'forward'} only supports head dimension at most 256")
    check(head % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    check(
        tuple(k.shape) == (batch, seqlen_k, heads_k, head),
        f"key must have shape (batch_size, seqlen_k, num_heads_k, head_size) = {(batch, seqlen_k, heads_k, head)}, got {tuple(k.shape)}",
    )
    check(
        tuple(v.shape) == (batch, seqlen_k, heads_k, head),
        f"value must have shape (batch_size, seqlen_k, num_heads_k, head_size) = {(batch, seqlen_k, heads_k, head)}, got {tuple(v.shape)}",
    )


def flash_attn_unsupported(window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Any, causal: bool) -> None:
    """The flash-attn features the stand-in does not emulate (NotImplementedError rather than a wrong number)."""
    if alibi_slopes is not None or softcap != 0.0:
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate ALiBi or softcap")
    if window_size_left >= 0 or (window_size_right >= 0 and not (causal and window_size_right == 0)):
        raise NotImplementedError("cpdoctor's flash-attn stand-in does not emulate sliding windows")
