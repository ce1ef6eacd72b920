"""A correct ring attention for diffusers: a drop-in replacement for `TemplatedRingAttention`.

Same `apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
backward_op, _parallel_config)` and the same outputs (out, or (out, lse) with lse (B, S, H)), so diffusers'
ring and ring × Ulysses paths call it unchanged once patch.py has put it in place of the module global.

The algorithm, per ring rank r of W (inputs are this rank's sequence shard, model layout (B, S, H, D)):

forward   all-gather K and V (one buffer, already in the kernel's layout, in flight while the local block
          runs); all-gather the key mask the same way, so KV chunk j is always paired with rank j's mask;
          for j = r, r+1, ... compute the block (out_j, lse_j) with the backend's kernel and merge in fp32
          (`convert_to_fp32`) with the stable form  out -= sigmoid(lse_j - lse)·(out - out_j),
          lse -= logsigmoid(lse - lse_j).
backward  re-gather K and V; for every chunk j compute the block's dQ, dK_j, dV_j from explicit tensors: q,
          the chunk, the GLOBAL merged out and fp32 lse (kernels.py; never the backend op's saved context);
          sum dQ locally. dK_j/dV_j belong to rank j. Default (`DKV_METHOD = "ring"`): one fp32 accumulator
          travels to rank r−1 after every step, the direction that follows the keys (at step i rank r holds
          chunk r+i, which rank r−1 holds at step i+1), and one final hop brings each chunk's sum home; the
          hop overlaps the next block's compute. `"reduce_scatter"` writes every chunk's dK/dV into a
          (W, |K|+|V|) buffer and reduce-scatters it once: no direction at all, but O(W) memory and a
          collective nothing hides. Both are exact at every W; measured (benchmarks/README.md, ring 2 and 4,
          S 4096) the ring is as fast or faster and needs 0.81–0.84× the built-in ring's peak memory, the
          reduce-scatter 0.95× at W = 2 but 1.11× at W = 4: hence the default.

Chunks whose keys are all masked are skipped; rows with no allowed key in a chunk get lse = −inf for that
block (the fused CPU kernel reports lse 0 and out 0 there, which would otherwise be merged as a real block).
Dropout is refused (a block recomputed in backward would need its own RNG state); causal and GQA are refused
by diffusers before the ring is reached.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from cpdoctor.compat import diffusers as compat
from cpdoctor.fix import kernels

DKV_METHODS = ("reduce_scatter", "ring")
DKV_METHOD = os.environ.get("CPDOCTOR_RING_DKV", "ring")
"""How the per-chunk dK/dV reach their owner (module attribute; the env var exists for the benchmark)."""


_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
"""torch renamed the functional collectives (the old names warn); same signatures."""


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _all_gather_last(x: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, in group-rank order (bool sent as uint8)."""
    is_bool = x.dtype == torch.bool
    send = x.to(torch.uint8) if is_bool else x
    got = _wait(_all_gather(send.contiguous(), 0, group))
    out = torch.cat(got.chunk(world, dim=0), dim=-1)
    return out.bool() if is_bool else out


class _Masks:
    """The key mask of every KV chunk, from the local shards every rank was handed."""

    def __init__(self, attn_mask: torch.Tensor | None, chunk_len: int, parallel_config: Any):
        self.full = None
        self.chunk_len = chunk_len
        self.all_empty: list[bool] = []
        self.any_empty: list[bool] = []
        self.empty: torch.Tensor | None = None
        if attn_mask is None:
            return
        world = compat.ring_degree(parallel_config)
        m = attn_mask
        if m.ndim == 2:
            m = m[:, None, None, :]
        elif m.ndim == 3:
            m = m[:, None]
        if m.ndim != 4:
            raise ValueError(f"ring attention: an attention mask must be 2-, 3- or 4-D, got shape {tuple(attn_mask.shape)}")
        length = m.shape[-1]
        if length != world * chunk_len:
            if m.shape[-2] != 1:
                raise ValueError(
                    f"ring attention: a mask with a query dimension ({tuple(attn_mask.shape)}) must cover all "
                    f"{world * chunk_len} keys; a per-shard one cannot be rotated with the keys"
                )
            ulysses = compat.ulysses_degree(parallel_config)
            if ulysses > 1 and length * ulysses == chunk_len:
                # ring × Ulysses: the Ulysses all-to-all gathered the keys of this ring rank, not the mask
                m = _all_gather_last(m, compat.ulysses_group(parallel_config), ulysses)
                length = m.shape[-1]
            if length != chunk_len:
                raise ValueError(f"ring attention: the mask covers {length} keys but this rank holds {chunk_len}")
            m = _all_gather_last(m, compat.ring_group(parallel_config), world)
        self.full = m
        allowed = m if m.dtype == torch.bool else m != float("-inf")
        empty = ~allowed.unflatten(-1, (world, chunk_len)).any(-1)  # (B|1, H|1, Sq|1, W)
        flat = empty.flatten(0, -2)
        self.all_empty = flat.all(0).tolist()
        self.any_empty = flat.any(0).tolist()
        self.empty = empty

    def chunk(self, j: int) -> torch.Tensor | None:
        if self.full is None:
            return None
        return self.full[..., j * self.chunk_len : (j + 1) * self.chunk_len]

    def skip(self, j: int) -> bool:
        return bool(self.all_empty) and self.all_empty[j]

    def empty_rows(self, j: int, seq_dim: int) -> torch.Tensor | None:
        """Rows with no allowed key in chunk j, shaped to broadcast with an lse of the kernel's layout."""
        if not self.any_empty or not self.any_empty[j]:
            return None
        e = self.empty[..., j]  # (B|1, H|1, Sq|1)
        return e if seq_dim == 2 else e.transpose(1, 2)


class _KV:
    """This rank's K and V packed into one buffer in the kernel's layout, and the all-gather of it."""

    def __init__(self, kernel: kernels.BlockKernel, key: torch.Tensor, value: torch.Tensor, group: Any, world: int):
        self.k_shape = kernel.to_layout(key).shape
        self.v_shape = kernel.to_layout(value).shape
        self.nk, self.nv = key.numel(), value.numel()
        self.world = world
        buf = torch.empty(self.nk + self.nv, dtype=key.dtype, device=key.device)
        buf[: self.nk].view(self.k_shape).copy_(kernel.to_layout(key))
        buf[self.nk :].view(self.v_shape).copy_(kernel.to_layout(value))
        self.local = self._split(buf)
        self._pending = _all_gather(buf, 0, group) if world > 1 else buf
        self._gathered: torch.Tensor | None = None

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[: self.nk].view(self.k_shape), flat[self.nk :].view(self.v_shape)

    def chunk(self, j: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if j == rank:
            return self.local
        n = self.nk + self.nv
        return self._split(self.gathered()[j * n : (j + 1) * n])

    def gathered(self) -> torch.Tensor:
        """Wait for the all-gather (also called once at the end, so no collective is left unwaited when
        every remote chunk was masked out)."""
        if self._gathered is None:
            self._gathered = _wait(self._pending)
        return self._gathered


def _merge(out: torch.Tensor, lse: torch.Tensor, out_j: torch.Tensor, lse_j: torch.Tensor, guard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold block j into the running (out, lse): out -= sigmoid(lse_j − lse)·(out − out_j) and
    lse −= logsigmoid(lse − lse_j), in place on out. `guard` handles −inf rows (masked chunks)."""
    w = torch.sigmoid(lse_j - lse)
    if guard:
        w = w.nan_to_num_(0.0)
    diff = out - out_j
    diff.mul_(w.unsqueeze(-1))
    out.sub_(diff)
    new_lse = lse - F.logsigmoid(lse - lse_j)
    if guard:
        new_lse = torch.where(torch.isneginf(lse), lse_j, new_lse)
    return out, new_lse


class RingAttention(torch.autograd.Function):
    """cpdoctor's fixed ring attention (see the module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
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
        if dropout_p:
            raise ValueError("cpdoctor's ring attention does not implement attention dropout (dropout_p must be 0)")
        if is_causal:
            raise ValueError("cpdoctor's ring attention does not implement causal attention")
        if enable_gqa:
            raise ValueError("cpdoctor's ring attention does not implement GQA")
        group = compat.ring_group(_parallel_config)
        world = compat.ring_degree(_parallel_config)
        rank = compat.ring_rank(_parallel_config)
        kernel = kernels.select(forward_op, _parallel_config)
        scale = kernels.default_scale(query.shape[-1], scale)
        # Like the original: convert_to_fp32 merges in fp32; without it the merge follows type promotion with
        # the fp32 lse (so it is fp32 too for half inputs), while the backward accumulates in the grad dtype.
        to_fp32 = compat.convert_to_fp32(_parallel_config)
        acc_dtype = torch.float32 if to_fp32 else torch.promote_types(query.dtype, torch.float32)
        sd = kernel.seq_dim

        kv = _KV(kernel, key, value, group, world)
        masks = _Masks(attn_mask, key.shape[1], _parallel_config)
        q = kernel.to_layout(query).contiguous()
        out = lse = None
        for i in range(world):
            j = (rank + i) % world
            if masks.skip(j):
                continue
            k_j, v_j = kv.chunk(j, rank)
            out_j, lse_j = kernel.forward(q, k_j, v_j, masks.chunk(j), scale)
            lse_j = lse_j.float()
            empty = masks.empty_rows(j, sd)
            if empty is not None:
                lse_j = lse_j.masked_fill(empty, float("-inf"))
                out_j = out_j.masked_fill(empty.unsqueeze(-1), 0.0)
            if out is None:
                out = out_j if out_j.dtype == acc_dtype else out_j.to(acc_dtype)
                lse = lse_j
            else:
                out, lse = _merge(out, lse, out_j, lse_j, guard=masks.full is not None)
        kv.gathered()
        if out is None:  # every key masked for every row
            out = torch.zeros_like(q, dtype=acc_dtype)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        out = out.to(query.dtype)

        ctx.save_for_backward(query, key, value, out, lse)
        ctx.kernel = kernel
        ctx.masks = masks
        ctx.scale = scale
        ctx.parallel_config = _parallel_config
        ctx.acc_dtype = torch.float32 if to_fp32 else query.dtype
        result = kernel.to_layout(out)
        if return_lse:
            lse_out = lse.transpose(1, 2) if sd == 2 else lse
            ctx.mark_non_differentiable(lse_out)
            return result, lse_out
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *args: Any):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        kernel: kernels.BlockKernel = ctx.kernel
        masks: _Masks = ctx.masks
        pc = ctx.parallel_config
        group, world, rank = compat.ring_group(pc), compat.ring_degree(pc), compat.ring_rank(pc)
        acc_dtype = ctx.acc_dtype

        kv = _KV(kernel, key, value, group, world)
        q = kernel.to_layout(query).contiguous()
        dout = kernel.to_layout(grad_out.to(query.dtype)).contiguous()
        out = out.contiguous()
        n = kv.nk + kv.nv
        method = DKV_METHOD
        if method not in DKV_METHODS:
            raise ValueError(f"CPDOCTOR_RING_DKV must be one of {DKV_METHODS}, got {method!r}")
        dq = None
        if method == "reduce_scatter":
            grads = torch.empty(world, n, dtype=acc_dtype, device=q.device)
        else:
            send_to_prev = [(s - 1) % world for s in range(world)]
            pending = None
        for i in range(world):
            j = (rank + i) % world
            if masks.skip(j):
                dk_j = dv_j = None
            else:
                k_j, v_j = kv.chunk(j, rank)
                dq_j, dk_j, dv_j = kernel.backward(dout, q, k_j, v_j, out, lse, masks.chunk(j), ctx.scale)
                if dq is None:
                    dq = dq_j if dq_j.dtype == acc_dtype else dq_j.to(acc_dtype)
                else:
                    dq.add_(dq_j)
            if method == "reduce_scatter":
                row = grads[j]
                if dk_j is None:
                    row.zero_()
                else:
                    row[: kv.nk].view(kv.k_shape).copy_(dk_j)
                    row[kv.nk :].view(kv.v_shape).copy_(dv_j)
            else:
                if i == 0:  # start chunk r's accumulator
                    acc = torch.empty(n, dtype=acc_dtype, device=q.device)
                    if dk_j is None:
                        acc.zero_()
                    else:
                        acc[: kv.nk].view(kv.k_shape).copy_(dk_j)
                        acc[kv.nk :].view(kv.v_shape).copy_(dv_j)
                else:  # chunk j's accumulator, from rank r+1
                    acc = _wait(pending)
                    if dk_j is not None:
                        acc[: kv.nk].view(kv.k_shape).add_(dk_j)
                        acc[kv.nk :].view(kv.v_shape).add_(dv_j)
                pending = funcol.permute_tensor(acc, send_to_prev, group) if world > 1 else acc
        kv.gathered()
        if method == "reduce_scatter":
            dkv = _wait(_reduce_scatter(grads.view(-1), "sum", 0, group)) if world > 1 else grads[0]
        else:
            dkv = _wait(pending)
        if dq is None:
            dq = torch.zeros_like(q, dtype=acc_dtype)
        dk = dkv[: kv.nk].view(kv.k_shape)
        dv = dkv[kv.nk :].view(kv.v_shape)
        dq, dk, dv = (kernel.to_layout(x).to(grad_out.dtype) for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
