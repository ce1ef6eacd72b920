"""A correct ring attention for diffusers: a drop-in replacement for `TemplatedRingAttention`.

Same `apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
backward_op, _parallel_config)` and the same outputs (out, or (out, lse) with lse (B, S, H)), so diffusers'
ring and ring × Ulysses paths call it unchanged once patch.py has put it in place of the module global.

The algorithm is three plain functions, each readable on its own: `ring_forward`, `ring_backward` and the
LSE `merge`; `comm.GroupComm` is all the communication they do, and `RingAttention` (the autograd Function) only
unpacks diffusers' arguments, calls them and saves what backward needs. Per ring rank r of W (inputs are
this rank's sequence shard, model layout (B, S, H, D)):

forward   all-gather K and V (one buffer, already in the kernel's layout, in flight while the local block
          runs); all-gather the key mask the same way, so KV chunk j is always paired with rank j's mask;
          for j = r, r+1, ... compute the block (out_j, lse_j) with the backend's kernel and merge in fp32
          (`convert_to_fp32`) with the stable form  out -= sigmoid(lse_j - lse)·(out - out_j),
          lse -= logsigmoid(lse - lse_j).
backward  re-gather K and V; for every chunk j compute the block's dQ, dK_j, dV_j from explicit tensors: q,
          the chunk, the GLOBAL merged out and fp32 lse (kernels.py; never the backend op's saved context);
          sum dQ locally. dK_j/dV_j belong to rank j; a `DkvStrategy` gets them there. Default
          (`DkvStrategy.RING`): one fp32 accumulator travels to rank r−1 after every step, the direction
          that follows the keys (at step i rank r holds chunk r+i, which rank r−1 holds at step i+1), and one
          final hop brings each chunk's sum home; the hop overlaps the next block's compute.
          `DkvStrategy.REDUCE_SCATTER` writes every chunk's dK/dV into a (W, |K|+|V|) buffer and
          reduce-scatters it once: no direction at all, but O(W) memory and a collective nothing hides. Both
          are exact at every W; measured (benchmarks/README.md, ring 2 and 4, S 4096) the ring is as fast or
          faster and needs 0.81–0.84× the built-in ring's peak memory, the reduce-scatter 0.95× at W = 2 but
          1.11× at W = 4: hence the default. `cpdoctor.fix.patch.apply(dkv=...)` chooses.

Chunks whose keys are all masked are skipped; rows with no allowed key in a chunk get lse = −inf for that
block (the fused CPU kernel reports lse 0 and out 0 there, which would otherwise be merged as a real block).
Dropout is refused (a block recomputed in backward would need its own RNG state); causal and GQA are refused
by diffusers before the ring is reached.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cpdoctor.compat import diffusers as compat
from cpdoctor.fix import kernels
from cpdoctor.fix.comm import GroupComm, all_gather_last


class DkvStrategy(str, enum.Enum):
    """How each KV chunk's dK/dV reach the rank that owns the chunk (see the module docstring)."""

    RING = "ring"
    """One accumulator per chunk travels to rank r−1 after every step, then one final hop (the default)."""
    REDUCE_SCATTER = "reduce_scatter"
    """Every chunk's dK/dV in a (W, |K|+|V|) buffer, reduce-scattered once at the end."""


# ----------------------------------------------------------------------------------------------------------
# What travels: the key mask of every chunk, K and V packed in one buffer
# ----------------------------------------------------------------------------------------------------------


class ChunkMasks:
    """The key mask of every KV chunk, from the local shards every rank was handed (gathered in rank order,
    so chunk j always gets rank j's keys' mask), and which chunks and rows it empties."""

    def __init__(self, attn_mask: torch.Tensor | None, chunk_len: int, comm: GroupComm, ulysses: GroupComm | None = None):
        self.full: torch.Tensor | None = None
        self.chunk_len = chunk_len
        self.all_empty: list[bool] = []
        self.any_empty: list[bool] = []
        self.empty: torch.Tensor | None = None
        if attn_mask is None:
            return
        world = comm.world
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
            if ulysses is not None and length * ulysses.world == chunk_len:
                # ring × Ulysses: the Ulysses all-to-all gathered the keys of this ring rank, not the mask
                m = all_gather_last(m, ulysses)
                length = m.shape[-1]
            if length != chunk_len:
                raise ValueError(f"ring attention: the mask covers {length} keys but this rank holds {chunk_len}")
            m = all_gather_last(m, comm)
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
        """Every key of chunk j is masked for every row: nothing to compute."""
        return bool(self.all_empty) and self.all_empty[j]

    def blank_empty_rows(self, j: int, out_j: torch.Tensor, lse_j: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with no allowed key in chunk j get out 0 and lse −inf, so the merge gives that block no weight
        (kernels disagree about what they report there; the CPU flash kernel says lse 0)."""
        if not self.any_empty or not self.any_empty[j]:
            return out_j, lse_j
        e = self.empty[..., j]  # (B|1, H|1, Sq|1)
        e = e if seq_dim == 2 else e.transpose(1, 2)
        return out_j.masked_fill(e.unsqueeze(-1), 0.0), lse_j.masked_fill(e, float("-inf"))


class PackedKV:
    """This rank's K and V packed into one flat buffer in the kernel's layout (one all-gather moves both,
    and every chunk reaches the kernel without a copy), and the same packing for dK/dV buffers."""

    def __init__(self, kernel: kernels.BlockKernel, key: torch.Tensor, value: torch.Tensor, comm: GroupComm):
        self.k_shape = kernel.to_layout(key).shape
        self.v_shape = kernel.to_layout(value).shape
        self.nk = key.numel()
        self.numel = self.nk + value.numel()
        self.comm = comm
        buf = torch.empty(self.numel, dtype=key.dtype, device=key.device)
        buf[: self.nk].view(self.k_shape).copy_(kernel.to_layout(key))
        buf[self.nk :].view(self.v_shape).copy_(kernel.to_layout(value))
        self.local = self.split(buf)
        self._pending = comm.all_gather(buf)
        self._gathered: torch.Tensor | None = None

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the K part and the V part of a packed buffer (any dtype)."""
        return flat[: self.nk].view(self.k_shape), flat[self.nk :].view(self.v_shape)

    def chunk(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of rank j's chunk (the local one without waiting for the all-gather)."""
        if j == self.comm.rank:
            return self.local
        n = self.numel
        return self.split(self.gathered()[j * n : (j + 1) * n])

    def gathered(self) -> torch.Tensor:
        """Wait for the all-gather (also called once at the end, so no collective is left unwaited when
        every remote chunk was masked out)."""
        if self._gathered is None:
            self._gathered = self.comm.wait(self._pending)
        return self._gathered

    def store(self, flat: torch.Tensor, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        """flat := (dk, dv) packed; zeros for a skipped chunk (None)."""
        if dk is None:
            flat.zero_()
        else:
            k, v = self.split(flat)
            k.copy_(dk)
            v.copy_(dv)

    def accumulate(self, flat: torch.Tensor, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        """flat += (dk, dv) packed; nothing for a skipped chunk (None)."""
        if dk is not None:
            k, v = self.split(flat)
            k.add_(dk)
            v.add_(dv)


# ----------------------------------------------------------------------------------------------------------
# The algorithm
# ----------------------------------------------------------------------------------------------------------


def merge(out: torch.Tensor, lse: torch.Tensor, out_j: torch.Tensor, lse_j: torch.Tensor, guard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold block j into the running (out, lse): out -= sigmoid(lse_j − lse)·(out − out_j) and
    lse −= logsigmoid(lse − lse_j), in place on out (the stable form: no exp of a large lse). `guard`
    handles −inf rows (masked chunks), where the formula gives NaN."""
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


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masks: ChunkMasks,
    kernel: kernels.BlockKernel,
    comm: GroupComm,
    scale: float,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries against every rank's keys. q, k, v: this rank's shards, model layout (B, S, H, D).
    Returns out (model layout, q's dtype, merged in `acc_dtype`) and the merged fp32 lse (B, S, H)."""
    kv = PackedKV(kernel, k, v, comm)
    q = kernel.to_layout(q).contiguous()
    out = lse = None
    for i in range(comm.world):
        j = (comm.rank + i) % comm.world  # own chunk first: it needs no communication
        if masks.skip(j):
            continue
        out_j, lse_j = kernel.forward(q, *kv.chunk(j), masks.chunk(j), scale)
        out_j, lse_j = masks.blank_empty_rows(j, out_j, lse_j.float(), kernel.seq_dim)
        if out is None:
            out, lse = out_j.to(acc_dtype), lse_j
        else:
            out, lse = merge(out, lse, out_j, lse_j, guard=masks.full is not None)
    kv.gathered()
    if out is None:  # every key masked for every row
        out = torch.zeros_like(q, dtype=acc_dtype)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return kernel.to_layout(out.to(q.dtype)), kernel.lse_to_layout(lse)


class DkvExchange(Protocol):
    """One backward's dK/dV delivery: `add` is called on every rank at every step i with the gradients of
    the chunk j it holds (None when the chunk was skipped); `result` is then this rank's chunk's total,
    packed like `PackedKV`. Made by `factory(comm, kv, dtype, device)`."""

    def add(self, i: int, j: int, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None: ...

    def result(self) -> torch.Tensor: ...


class RingDkv:
    """`DkvStrategy.RING`: the accumulator of the chunk this rank holds goes to rank r−1, which holds that
    chunk at the next step; after W steps one final hop brings each chunk's sum to its owner."""

    def __init__(self, comm: GroupComm, kv: PackedKV, dtype: torch.dtype, device: torch.device):
        self.comm, self.kv, self.dtype, self.device = comm, kv, dtype, device
        self.pending: torch.Tensor | None = None

    def add(self, i: int, j: int, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        if i == 0:  # start chunk r's accumulator
            acc = torch.empty(self.kv.numel, dtype=self.dtype, device=self.device)
            self.kv.store(acc, dk, dv)
        else:  # chunk j's accumulator, from rank r+1
            acc = self.comm.wait(self.pending)
            self.kv.accumulate(acc, dk, dv)
        self.pending = self.comm.shift(acc, -1)

    def result(self) -> torch.Tensor:
        return self.comm.wait(self.pending)


class ReduceScatterDkv:
    """`DkvStrategy.REDUCE_SCATTER`: row j of a (W, |K|+|V|) buffer holds this rank's dK/dV of chunk j; one
    reduce-scatter sums row j over the ranks onto rank j."""

    def __init__(self, comm: GroupComm, kv: PackedKV, dtype: torch.dtype, device: torch.device):
        self.comm, self.kv = comm, kv
        self.grads = torch.empty(comm.world, kv.numel, dtype=dtype, device=device)

    def add(self, i: int, j: int, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        self.kv.store(self.grads[j], dk, dv)

    def result(self) -> torch.Tensor:
        return self.comm.reduce_scatter(self.grads.view(-1))


DKV_EXCHANGES: dict[DkvStrategy, Callable[[GroupComm, PackedKV, torch.dtype, torch.device], DkvExchange]] = {
    DkvStrategy.RING: RingDkv,
    DkvStrategy.REDUCE_SCATTER: ReduceScatterDkv,
}


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    masks: ChunkMasks,
    kernel: kernels.BlockKernel,
    comm: GroupComm,
    scale: float,
    acc_dtype: torch.dtype,
    dkv: DkvStrategy | Callable[..., DkvExchange] = DkvStrategy.RING,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of this rank's shards (model layout, `acc_dtype`), from what `ring_forward` took and gave
    (out and lse are the global merged ones). `dkv`: a strategy, or any `DkvExchange` factory."""
    kv = PackedKV(kernel, k, v, comm)
    q = kernel.to_layout(q).contiguous()
    dout = kernel.to_layout(dout).contiguous()
    out = kernel.to_layout(out).contiguous()
    lse = kernel.lse_to_layout(lse)
    factory = DKV_EXCHANGES[DkvStrategy(dkv)] if isinstance(dkv, str) else dkv
    exchange = factory(comm, kv, acc_dtype, q.device)
    dq = None
    for i in range(comm.world):
        j = (comm.rank + i) % comm.world
        dk_j = dv_j = None
        if not masks.skip(j):
            dq_j, dk_j, dv_j = kernel.backward(dout, q, *kv.chunk(j), out, lse, masks.chunk(j), scale)
            if dq is None:
                dq = dq_j.to(acc_dtype)
            else:
                dq.add_(dq_j)
        exchange.add(i, j, dk_j, dv_j)
    kv.gathered()
    dk, dv = kv.split(exchange.result())
    if dq is None:
        dq = torch.zeros_like(q, dtype=acc_dtype)
    return kernel.to_layout(dq), kernel.to_layout(dk), kernel.to_layout(dv)


# ----------------------------------------------------------------------------------------------------------
# diffusers' interface
# ----------------------------------------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    """cpdoctor's fixed ring attention (see the module docstring), with diffusers' ring signature."""

    dkv: DkvStrategy = DkvStrategy.RING
    """How backward delivers dK/dV; set by `cpdoctor.fix.patch.apply(dkv=...)`, read when forward runs."""

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
        comm = GroupComm.ring(_parallel_config)
        ulysses = GroupComm.ulysses(_parallel_config) if attn_mask is not None else None
        kernel = kernels.select(forward_op, _parallel_config)
        scale = kernels.default_scale(query.shape[-1], scale)
        masks = ChunkMasks(attn_mask, key.shape[1], comm, ulysses)
        # Like the original: convert_to_fp32 merges in fp32; without it the merge follows type promotion with
        # the fp32 lse (so it is fp32 too for half inputs), while the backward accumulates in the grad dtype.
        to_fp32 = compat.convert_to_fp32(_parallel_config)
        fwd_dtype = torch.float32 if to_fp32 else torch.promote_types(query.dtype, torch.float32)
        out, lse = ring_forward(query, key, value, masks, kernel, comm, scale, fwd_dtype)

        ctx.save_for_backward(query, key, value, out, lse)
        ctx.masks, ctx.kernel, ctx.comm, ctx.scale = masks, kernel, comm, scale
        ctx.acc_dtype = torch.float32 if to_fp32 else query.dtype
        ctx.dkv = RingAttention.dkv
        if return_lse:
            ctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *args: Any):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            grad_out.to(query.dtype), query, key, value, out, lse, ctx.masks, ctx.kernel, ctx.comm, ctx.scale, ctx.acc_dtype, ctx.dkv
        )
        dq, dk, dv = (x.to(grad_out.dtype) for x in (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
