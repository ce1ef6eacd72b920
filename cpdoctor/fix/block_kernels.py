"""One attention block, forward and backward, from explicit tensors, for each backend the ring may be handed.

The fixed ring (ring.py) never goes through a backend's `backward_op` and its saved context: that is where
diffusers' ring bugs live (0.39.0 recomputes every step from the tensors saved at step 0; some ops transpose
twice or save no LSE; the flash-attn op forces dropout 1e-30 to get an LSE and so advances the RNG). Instead
it asks this module for a `BlockKernel` chosen by the forward op it was handed (which backend's op it is,
as `compat.forward_op_kind` names it), and calls the fused kernel underneath with explicit q, k, v, out and
LSE:

| forward op of backend           | forward / backward                                                                  |
|---------------------------------|-------------------------------------------------------------------------------------|
| `cpdoctor_cpu` (cpdoctor's own) | aten `_scaled_dot_product_flash_attention_for_cpu[_backward]`                       |
| `_native_flash`                 | aten `_scaled_dot_product_flash_attention[_backward]`                               |
| `_native_cudnn`                 | aten `_scaled_dot_product_cudnn_attention[_backward]`, LSE always on                |
| `_native_efficient`             | aten `_efficient_attention_forward/_backward`, LSE always on                        |
| `flash`, `flash_hub`            | the flash-attn functions diffusers calls (`compat.flash_attn_functions`), dropout 0 |
| `native`                        | exact math in fp32 (SDPA returns no LSE)                                            |
| anything else                   | the backend's own forward op (must return an LSE) + exact fp32 math                 |

Conventions: a kernel works in its own layout, (B, H, S, D) ("bhsd", `seq_dim` 2) or (B, S, H, D) ("bshd",
`seq_dim` 1); its LSE is float32 and shaped like `out[..., 0]` in that layout. Masks arrive 4-D in SDPA's
convention, (B|1, H|1, Sq|1, Sk), boolean (True = attend) or additive float. `scale` is always a float.
Dropout is always 0 (the ring refuses dropout): no kernel advances any RNG state.

The CUDA paths cannot run on a CPU-only machine; they follow the aten schemas of torch 2.x and fail with a
clear message naming the op when it is missing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from cpdoctor.compat import diffusers as compat


class KernelUnavailable(RuntimeError):
    """The fused op a kernel needs does not exist in this torch / flash-attn install."""


def _aten(name: str) -> Callable:
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        raise KernelUnavailable(f"torch {torch.__version__} has no aten::{name}, which the fixed ring needs for this backend")
    return op


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Boolean (True = attend) or additive mask -> additive mask of `dtype`."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _pad_last_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """A view of `x` whose storage rows are padded to `multiple` elements (mem-efficient kernels need
    aligned bias strides; this is what SDPA's own dispatcher does before calling them)."""
    n = x.shape[-1]
    if n % multiple == 0 and x.stride(-1) == 1:
        return x
    padded = x.new_zeros(*x.shape[:-1], -(-n // multiple) * multiple)
    padded[..., :n] = x
    return padded[..., :n]


class BlockKernel:
    """Base: one block of attention, forward and backward with explicit tensors (see module docstring)."""

    name = "base"
    seq_dim = 2  # bhsd
    fused = True
    """Calls a backend's fused kernel (memory linear in S). False for the exact fp32 math, which holds a whole
    score matrix per block: fine for the ring's blocks, not for Ulysses' one block at the full length."""

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        """Model layout (B, S, H, D) -> this kernel's layout (a view; the same call maps it back)."""
        return x.transpose(1, 2) if self.seq_dim == 2 else x

    def lse_to_layout(self, lse: torch.Tensor) -> torch.Tensor:
        """An LSE in diffusers' (B, S, H) -> this kernel's (shaped like `out[..., 0]`), and back (a view)."""
        return lse.transpose(1, 2) if self.seq_dim == 2 else lse

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # the fused backward's convention (dout, q, k, v, out, lse, ...: aten's and flash-attn's backward ops)
    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class MathKernel(BlockKernel):
    """Exact attention in fp32 from the definition (O(Sq·Sk) memory per block): P = exp(q kᵀ·scale − lse),
    dV = Pᵀ dO, dS = P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)), dQ = scale·dS K, dK = scale·dSᵀ Q. Layout bhsd."""

    name = "math-fp32"
    fused = False

    def _scores(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale)
        if mask is not None:
            s = s + additive_mask(mask, torch.float32)
        return s

    def forward(self, q, k, v, mask, scale):
        s = self._scores(q, k, mask, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
        return torch.matmul(p, v.float()).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        s = self._scores(q, k, mask, scale)
        p = torch.exp(s - lse.float().unsqueeze(-1)).nan_to_num_(0.0)
        do = dout.float()
        dv = torch.matmul(p.transpose(-1, -2), do)
        delta = (do * out.float()).sum(-1, keepdim=True)
        ds = p.mul_(torch.matmul(do, v.float().transpose(-1, -2)).sub_(delta))
        dq = torch.matmul(ds, k.float()).mul_(scale)
        dk = torch.matmul(ds.transpose(-1, -2), q.float()).mul_(scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class BackendForwardKernel(MathKernel):
    """Any other backend: its own forward op for the block forward (it must return an LSE), the exact fp32
    math backward. The op is called in model layout, so this kernel works in bshd."""

    seq_dim = 1

    def __init__(self, forward_op: Callable, parallel_config: Any):
        self.forward_op = forward_op
        self.parallel_config = parallel_config
        self.name = f"{getattr(forward_op, '__name__', 'forward_op')} + math-fp32 backward"

    def forward(self, q, k, v, mask, scale):
        result = compat.call_forward_op(self.forward_op, q, k, v, mask, scale, self.parallel_config)
        if not (isinstance(result, tuple) and len(result) >= 2 and result[1] is not None):
            raise ValueError(f"{self.name}: the backend's forward op returned no LSE, and ring attention needs one to merge blocks")
        out, lse = result[0], result[1]
        if lse.ndim == 4:
            lse = lse.squeeze(-1)
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        # math in bhsd, tensors arrive in bshd
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = MathKernel.backward(self, t(dout), t(q), t(k), t(v), t(out), lse.transpose(1, 2), mask, scale)
        return t(dq), t(dk), t(dv)


class CpuFlashKernel(BlockKernel):
    """torch's fused CPU flash kernel (the cpdoctor_cpu backend), bhsd."""

    name = "aten _scaled_dot_product_flash_attention_for_cpu"

    def forward(self, q, k, v, mask, scale):
        out, lse = _aten("_scaled_dot_product_flash_attention_for_cpu")(
            q, k, v, 0.0, False, attn_mask=additive_mask(mask, q.dtype), scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        return _aten("_scaled_dot_product_flash_attention_for_cpu_backward")(
            dout, q, k, v, out, lse.contiguous(), 0.0, False, attn_mask=additive_mask(mask, q.dtype), scale=scale
        )


class NativeFlashKernel(BlockKernel):
    """aten flash attention (CUDA), bhsd. It takes no mask. The backward takes the forward's sequence metadata
    (identical for every block: all KV chunks have one length) and RNG state (unused at dropout 0)."""

    name = "aten _scaled_dot_product_flash_attention"

    def __init__(self) -> None:
        self.meta: tuple | None = None

    def forward(self, q, k, v, mask, scale):
        if mask is not None:
            raise ValueError("the _native_flash kernel takes no attention mask; use a backend that supports masks (cuDNN, cpdoctor_cpu)")
        out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, _ = _aten("_scaled_dot_product_flash_attention")(
            q, k, v, 0.0, False, False, scale=scale
        )
        self.meta = (cum_q, cum_k, max_q, max_k, rng_state, unused)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if self.meta is None:
            self.forward(q, k, v, mask, scale)
        cum_q, cum_k, max_q, max_k, rng_state, unused = self.meta
        dq, dk, dv = _aten("_scaled_dot_product_flash_attention_backward")(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, False, rng_state, unused, scale=scale
        )
        return dq, dk, dv


class CudnnKernel(BlockKernel):
    """aten cuDNN attention (CUDA), bhsd, always with compute_log_sumexp=True. Depending on torch the LSE
    comes out as (B, H, S) or (B, H, S, 1); the backward gets it back in the shape the forward produced."""

    name = "aten _scaled_dot_product_cudnn_attention"

    def __init__(self) -> None:
        self.meta: tuple | None = None
        self.lse_trailing_dim = False

    def forward(self, q, k, v, mask, scale):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten("_scaled_dot_product_cudnn_attention")(
            q, k, v, additive_mask(mask, q.dtype), True, 0.0, False, False, scale=scale
        )
        self.meta = (cum_q, cum_k, max_q, max_k, seed, offset)
        self.lse_trailing_dim = lse.ndim == 4
        return out, (lse.squeeze(-1) if self.lse_trailing_dim else lse).float()

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if self.meta is None:
            self.forward(q, k, v, mask, scale)
        cum_q, cum_k, max_q, max_k, seed, offset = self.meta
        lse = lse.contiguous()
        if self.lse_trailing_dim:
            lse = lse.unsqueeze(-1)
        dq, dk, dv = _aten("_scaled_dot_product_cudnn_attention_backward")(
            dout, q, k, v, out, lse, seed, offset, additive_mask(mask, q.dtype), cum_q, cum_k, max_q, max_k, 0.0, False, scale=scale
        )
        return dq, dk, dv


class EfficientKernel(BlockKernel):
    """aten memory-efficient attention (CUDA), bshd (its native layout), LSE always on. Its LSE is padded to a
    multiple of 32 queries; the merge sees the real rows and the backward gets the padded shape back."""

    name = "aten _efficient_attention_forward"
    seq_dim = 1

    def __init__(self) -> None:
        self.meta: tuple | None = None

    @staticmethod
    def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        bias = additive_mask(mask, q.dtype)
        if bias is None:
            return None
        b, sq, h, _ = q.shape
        return _pad_last_to(bias, 16).expand(b, h, sq, k.shape[1])

    def forward(self, q, k, v, mask, scale):
        out, lse, seed, offset, *_ = _aten("_efficient_attention_forward")(
            q, k, v, self._bias(mask, q, k), None, None, None, None, 0.0, 0, True, scale=scale
        )
        self.meta = (seed, offset, lse.shape[-1])
        sq = q.shape[1]
        return out, lse[..., :sq].float().transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        if self.meta is None:
            self.forward(q, k, v, mask, scale)
        seed, offset, lse_len = self.meta
        lse_k = lse.new_zeros(lse.shape[0], lse.shape[2], lse_len)
        lse_k[..., : lse.shape[1]] = lse.transpose(1, 2)
        dq, dk, dv, _ = _aten("_efficient_attention_backward")(
            dout, q, k, v, self._bias(mask, q, k), out, None, None, q.shape[1], k.shape[1], lse_k, 0.0, seed, offset, 0, False, scale=scale
        )
        return dq, dk, dv


class FlashAttnKernel(BlockKernel):
    """The flash-attn package (or a hub kernel with its interface), bshd, dropout 0: the LSE comes out of the
    low-level forward regardless of dropout, so nothing forces dropout_p=1e-30 and no philox offset moves."""

    seq_dim = 1

    def __init__(self, fwd: Callable, bwd: Callable, name: str):
        self.fwd, self.bwd, self.name = fwd, bwd, name

    def forward(self, q, k, v, mask, scale):
        if mask is not None:
            raise ValueError("flash-attn takes no attention mask; use a backend that supports masks")
        out, lse, *_ = self.fwd(q, k, v, 0.0, scale, False, -1, -1, 0.0, None, False)
        return out, lse.float().transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.bwd(dout, q, k, v, out, lse.transpose(1, 2).contiguous(), dq, dk, dv, 0.0, scale, False, -1, -1, 0.0, None, False, None)
        d = dout.shape[-1]
        return dq[..., :d], dk[..., :d], dv[..., :d]


def _is_cpdoctor_cpu(forward_op: Callable) -> bool:
    from cpdoctor.cpu_kernels import cpu_backend

    return forward_op is cpu_backend.forward_op


_KERNELS: dict[compat.ForwardOpKind, Callable[[], BlockKernel]] = {
    compat.ForwardOpKind.NATIVE_FLASH: NativeFlashKernel,
    compat.ForwardOpKind.NATIVE_CUDNN: CudnnKernel,
    compat.ForwardOpKind.NATIVE_EFFICIENT: EfficientKernel,
    compat.ForwardOpKind.NATIVE: MathKernel,
}
"""Backends whose fused kernel this module calls directly, by `compat.forward_op_kind`."""


def select(forward_op: Callable, parallel_config: Any = None) -> BlockKernel:
    """The block kernel for the backend whose forward op the ring was handed."""
    if _is_cpdoctor_cpu(forward_op):
        return CpuFlashKernel()
    kind = compat.forward_op_kind(forward_op)
    if kind in _KERNELS:
        return _KERNELS[kind]()
    if kind in (compat.ForwardOpKind.FLASH, compat.ForwardOpKind.FLASH_HUB):
        name = getattr(forward_op, "__name__", kind.value)
        fns = compat.flash_attn_functions(forward_op)
        if fns is None:
            raise KernelUnavailable(
                f"{name}: the flash-attn forward/backward functions are not available here (is flash-attn installed and importable?)"
            )
        package = "flash-attn stand-in" if compat.flash_attn_is_standin() else "flash-attn"
        return FlashAttnKernel(*fns, name=f"{package} ({name})")
    return BackendForwardKernel(forward_op, parallel_config)


def default_scale(head_dim: int, scale: float | None) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
