"""cpdoctor's CPU backend calls torch's fused CPU flash kernel exactly as the fixed ring's kernel does: views,
no layout copies (bench_ring.py's memory ratio then compares the rings, not two ways of calling one kernel)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpdoctor.cpu_kernels import cpu_backend
from cpdoctor.fix import block_kernels

B, S, H, D = 1, 96, 4, 32


class _Copies(TorchDispatchMode):
    """Every op that materialises a new tensor of at least `numel` elements from another (a layout copy)."""

    COPYING = ("clone", "copy_", "_to_copy", "contiguous")

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.COPYING and isinstance(out, torch.Tensor) and out.numel() >= self.numel:
            self.seen.append(name)
        return out


class _Ctx:
    """What an autograd Function's ctx offers the ops."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(B, S, H, D, generator=gen).to(dtype) for _ in range(4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_ops_copy_nothing_chunk_sized(dtype: torch.dtype, masked: bool) -> None:
    q, k, v, g = _inputs(dtype)
    mask = torch.ones(B, S, dtype=torch.bool) if masked else None
    ctx = _Ctx()
    with _Copies(q.numel()) as mode:
        out, lse = cpu_backend.forward_op(ctx, q, k, v, mask, return_lse=True)
        cpu_backend.backward_op(ctx, g)
        cpu_backend.backward_op(ctx, g, query=q, key=k, value=v, out=out, lse=lse)
    assert mode.seen == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_results_as_the_fixed_rings_kernel(dtype: torch.dtype) -> None:
    q, k, v, g = _inputs(dtype)
    ctx = _Ctx()
    out, lse = cpu_backend.forward_op(ctx, q, k, v, return_lse=True)
    grads = cpu_backend.backward_op(ctx, g)
    kernel = block_kernels.CpuFlashKernel()
    t = kernel.to_layout
    scale = block_kernels.default_scale(D, None)
    out_f, lse_f = kernel.forward(t(q), t(k), t(v), None, scale)
    grads_f = kernel.backward(t(g), t(q), t(k), t(v), out_f, lse_f, None, scale)
    assert torch.equal(out, t(out_f)) and torch.equal(lse, kernel.lse_to_layout(lse_f))
    assert all(torch.equal(a, t(b)) for a, b in zip(grads, grads_f))
