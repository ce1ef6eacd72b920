"""A Ulysses attention for diffusers that never calls a backend's backward op: a drop-in replacement for
`TemplatedUlyssesAttention`.

Why. diffusers' Ulysses template runs the backend's own `forward_op` with `_save_ctx=True` and, in backward,
its `backward_op(ctx, grad_out)`. Where that op is wrong, Ulysses is wrong: 0.39.0's `_native_flash` and
`_native_cudnn` backward ops transpose K/V that their forward already saved in the kernel's layout, so the
kernel sees sequence and heads swapped and raises (docs/FACTS.md). Replacing the ring alone left those
backends crashing under Ulysses after `--patch`.

What. The same all-to-alls as diffusers (heads scattered, sequence gathered: (B, S/W, H, D) → (B, S, H/W, D),
and back), the same mask handling (a key mask of the local length is all-gathered over the Ulysses group), and
in between the fixed ring's own `ring_forward`/`ring_backward` run as a ring of one (`GroupComm.alone()`): one
block, computed by the backend's fused kernel with explicit q, k, v, out and LSE (block_kernels.py). Same
`apply(...)` signature and outputs (out, or (out, lse) with lse (B, S/W, H)).

When it steps aside. For a backend without a fused block kernel (`native`, `_native_math`, anything
unknown) the fix's block would be exact fp32 math, O(S²) memory at the full sequence length: there the
original class runs, untouched (`UlyssesAttention.original`, the class patch.py put aside). Attention dropout also goes
to the original (a block recomputed in backward would need its forward's RNG state), and so does a fused
kernel that cannot be found here (`KernelUnavailable`).
"""

from __future__ import annotations

from typing import Any

import torch

from cpdoctor.fix import block_kernels
from cpdoctor.fix.comm import GroupComm, all_gather_last
from cpdoctor.fix.ring import ChunkMasks, RingSetup, ring_backward, ring_forward


def heads_to_sequence(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """(B, S_local, H, D) sequence shards → (B, S, H/W, D): this rank's heads, every rank's sequence (rank
    order). Works on any trailing shape after H."""
    if comm.world == 1:
        return x
    b, s_local, h = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, s_local, comm.world, h // comm.world, *rest).movedim(2, 0).contiguous()
    got = comm.wait(comm.all_to_all(send.view(-1))).view(send.shape)  # part p: rank p's sequence, my heads
    return got.movedim(0, 1).reshape(b, comm.world * s_local, h // comm.world, *rest)


def sequence_to_heads(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """The inverse of `heads_to_sequence`: (B, S, H/W, D) → (B, S/W, H, D); an LSE travels as (B, S, H/W, 1)."""
    if comm.world == 1:
        return x
    b, s, h_local = x.shape[:3]
    rest = x.shape[3:]
    s_local = s // comm.world
    send = x.reshape(b, comm.world, s_local, h_local, *rest).movedim(1, 0).contiguous()
    got = comm.wait(comm.all_to_all(send.view(-1))).view(send.shape)  # part p: my sequence, rank p's heads
    return got.movedim(0, 2).reshape(b, s_local, comm.world * h_local, *rest)


def gather_key_mask(attn_mask: torch.Tensor | None, local_keys: int, comm: GroupComm) -> torch.Tensor | None:
    """A mask over this rank's keys only (last dim = the local length) becomes the mask over all keys, as
    diffusers does; any other mask is passed on as given."""
    if attn_mask is None or attn_mask.shape[-1] != local_keys or comm.world == 1:
        return attn_mask
    return all_gather_last(attn_mask, comm)


class _FixedUlysses(torch.autograd.Function):
    """The all-to-alls around one fused block (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kernel: block_kernels.BlockKernel,
        scale: float,
        return_lse: bool,
        comm: GroupComm,
    ):
        mask = gather_key_mask(attn_mask, key.shape[1], comm)
        q, k, v = (heads_to_sequence(x, comm) for x in (query, key, value))
        alone = GroupComm.alone()
        masks = ChunkMasks(mask, k.shape[1], alone)
        ctx.setup = RingSetup(masks, kernel, alone, scale, q.dtype)
        out, lse = ring_forward(q, k, v, ctx.setup)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm = comm
        out_local = sequence_to_heads(out, comm)
        if return_lse:
            lse_local = sequence_to_heads(lse.unsqueeze(-1), comm).squeeze(-1)
            ctx.mark_non_differentiable(lse_local)
            return out_local, lse_local
        return out_local

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *args: Any):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dout = heads_to_sequence(grad_out.to(q.dtype), ctx.comm)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.setup)
        dq, dk, dv = (sequence_to_heads(x, ctx.comm).to(grad_out.dtype) for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None


class _PutAside:
    """`UlyssesAttention.original`: read from the patch's own state (`cpdoctor.fix.put_aside.STATE`), so the class
    holds no state of its own and a revert leaves nothing behind."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        from cpdoctor.compat.diffusers import ULYSSES_CLASS
        from cpdoctor.fix.put_aside import STATE

        return STATE.original(ULYSSES_CLASS)


class UlyssesAttention:
    """cpdoctor's Ulysses attention with diffusers' `TemplatedUlyssesAttention.apply` signature."""

    original = _PutAside()
    """The class this one replaced (None when the patch is not applied): it runs wherever the fix has no fused kernel."""

    # diffusers' TemplatedUlyssesAttention.apply signature, which the patch replaces
    @classmethod
    def apply(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        return_lse: bool,
        forward_op: Any,
        backward_op: Any,
        _parallel_config: Any = None,
    ):
        # diffusers' TemplatedUlyssesAttention.apply arguments, in its positional order
        args = (
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_lse,
            forward_op,
            backward_op,
            _parallel_config,
        )
        kernel = None
        if not (dropout_p or is_causal or enable_gqa):
            try:
                kernel = block_kernels.select(forward_op, _parallel_config)
            except block_kernels.KernelUnavailable:  # e.g. flash-attn's low-level functions not found: diffusers' own way
                kernel = None
        if kernel is None or not kernel.fused:
            if cls.original is None:
                raise RuntimeError(
                    "cpdoctor's Ulysses attention has no original class to hand this call to (apply it through cpdoctor.fix.patch)"
                )
            return cls.original.apply(*args)
        comm = GroupComm.ulysses(_parallel_config) or GroupComm.alone()
        return _FixedUlysses.apply(
            query, key, value, attn_mask, kernel, block_kernels.default_scale(query.shape[-1], scale), return_lse, comm
        )
