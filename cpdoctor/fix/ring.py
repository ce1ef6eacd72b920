"""A correct ring attention for diffusers: a drop-in replacement for `TemplatedRingAttention`.

Same `apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
backward_op, _parallel_config)` and the same outputs (out, or (out, lse) with lse (B, S, H)), so diffusers'
ring and ring × Ulysses paths call it unchanged once patch.py has put it in place of the module global.

The algorithm is three plain functions, each readable on its own: `ring_forward`, `ring_backward` and the
LSE `merge`; `stream` and `comm.GroupComm.shift` are all the communication they do, and `RingAttention` (the
autograd Function) only unpacks diffusers' arguments, calls them and saves what backward needs. Per ring rank
r of W (inputs are this rank's sequence shard, model layout (B, S, H, D)):

forward   pack this rank's K and V (already in the kernel's layout) and, with a key mask, this rank's mask
          chunk into one buffer; at step i = 0 .. W−1 rank r holds chunk j = (r+i) mod W: while the kernel
          computes block j, that buffer is on its way to rank r−1 and chunk j+1 is arriving from rank r+1
          into the buffer step i−1 used (two buffers, whatever W is; the mask always arrives with its keys).
          Each block (out_j, lse_j) is merged in fp32 (`convert_to_fp32`) with the stable form
          out -= sigmoid(lse_j − lse)·(out − out_j), lse −= logsigmoid(lse − lse_j).
backward  stream K/V (and mask) round again; for every chunk j compute the block's dQ, dK_j, dV_j from
          explicit tensors: q, the chunk, the GLOBAL merged out and fp32 lse (block_kernels.py; never the backend
          op's saved context); sum dQ locally. dK_j/dV_j belong to rank j: an fp32 accumulator per chunk
          travels with its keys, to rank r−1 after every step (at step i rank r holds chunk r+i, which rank
          r−1 holds at step i+1), and one final hop brings each chunk's sum home; each hop overlaps the next
          block's backward.

Memory per rank, whatever W is: two K/V buffers, two dK/dV accumulators, dQ and one block's outputs (about
13 local chunks at the backward's peak in fp32, 20 in bf16, where the fp32 accumulators are twice the input's
size; kernels get views, not layout copies, and no block's results are held through the next kernel), for the
heads of one pass: where the chunks are large enough the ring runs over 2-4 groups of heads one after another
(`head_passes`; bit-identical results), which divides that working set by the number of passes. Measured
against diffusers' ring on the same kernel calls (benchmarks/README.md, S 16384, H 8 in 4 passes): 0.283 /
0.177× its peak at ring 4 / 8 in fp32, 0.294 / 0.205× in bf16, and 0.94× (fp32) / 0.93× (bf16) its time at ring 4 (one pass
measured 0.503 / 0.288 and 0.656 / 0.410). Two variants were measured and dropped: the all-gathered K/V this ring used
before (W chunks per rank: 0.75 / 0.82 / 0.88× the built-in ring's memory at S 4096; its one collective saved the
streamed forward's hop latency only at tiny chunks, ~2 ms at ring 4, S 512), and reduce-scattering every
chunk's dK/dV from a (W, |K|+|V|) buffer (W chunks of fp32; 1.11× the built-in ring's memory at ring 4 and no
faster).

Every rank makes every hop, also when it skips a chunk's compute: chunks whose keys are all masked for every
row of this rank are skipped; rows with no allowed key in a chunk get lse = −inf for that block (the fused
CPU kernel reports lse 0 and out 0 there, which would otherwise be merged as a real block). With one rank
(the fixed Ulysses' "ring of one") nothing is communicated. Dropout is refused (a block recomputed in
backward would need its own RNG state); causal and GQA are refused by diffusers before the ring is reached.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from cpdoctor.compat import diffusers as compat
from cpdoctor.fix import block_kernels
from cpdoctor.fix.comm import GroupComm, all_gather_last

# ----------------------------------------------------------------------------------------------------------
# What travels: K, V and the key mask of a chunk packed in one buffer
# ----------------------------------------------------------------------------------------------------------


class Packing:
    """Where each of a few tensors lives in one flat byte buffer, so one transfer moves them all (K, V and a
    chunk's key mask, whatever their dtypes; dK and dV) and unpacking is views, never copies. Parts start at
    64-byte boundaries: each is a contiguous, aligned tensor of its own dtype, as fused kernels want."""

    ALIGN = 64

    def __init__(self, specs: list[tuple[torch.Size, torch.dtype]]) -> None:
        self.parts: list[tuple[int, int, torch.Size, torch.dtype]] = []
        offset = 0
        for shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            self.parts.append((offset, nbytes, shape, dtype))
            offset += -(-nbytes // self.ALIGN) * self.ALIGN
        self.nbytes = offset

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def pack(self, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """A new buffer holding `tensors` (any layout: copied into the packed, contiguous parts)."""
        buf = self.empty(device)
        for part, t in zip(self.unpack(buf), tensors):
            part.copy_(t)
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Views of every part of `buf`."""
        return [buf[offset : offset + nbytes].view(dtype).view(shape) for offset, nbytes, shape, dtype in self.parts]


class ChunkMasks:
    """The attention mask as each KV chunk needs it. A key mask (no query dimension, over this rank's keys)
    travels with its keys: `local` is this rank's chunk of it, packed with K and V. A mask with a query dimension
    that covers every key (or any mask in a ring of one) stays here as `full` and is sliced per chunk. A key mask
    over every key of a ring is refused: which key of the model's order sits in which rank's chunk is unknown
    (stock diffusers refuses it too, with a shape error), and slicing it by rank would be silently wrong.
    For each chunk it also says which rows have no allowed key and whether no row has one, worked out when
    the chunk first arrives and kept for the backward."""

    def __init__(self, attn_mask: torch.Tensor | None, chunk_len: int, comm: GroupComm, ulysses: GroupComm | None = None):
        self.full: torch.Tensor | None = None
        self.local: torch.Tensor | None = None
        self.chunk_len = chunk_len
        self.per_head = False
        """The mask differs between heads: the ring then runs all heads in one pass (`head_passes`)."""
        self._skip: dict[int, bool] = {}
        self._empty_rows: dict[int, torch.Tensor | None] = {}
        if attn_mask is None:
            return
        m = attn_mask
        if m.ndim == 2:
            m = m[:, None, None, :]
        elif m.ndim == 3:
            m = m[:, None]
        if m.ndim != 4:
            raise ValueError(f"ring attention: an attention mask must be 2-, 3- or 4-D, got shape {tuple(attn_mask.shape)}")
        self.per_head = m.shape[1] > 1
        length = m.shape[-1]
        if length == comm.world * chunk_len and comm.world > 1 and m.shape[-2] == 1:
            raise ValueError(
                f"ring attention: the key mask covers all {length} keys of the ring, not this rank's {chunk_len}: the "
                "model's _cp_plan did not split it with the keys, and the order in which the model laid out the ranks' "
                "keys cannot be read from it (a model that joins two streams the plan split, as Qwen-Image's forward "
                "in diffusers 0.37.0 joins text and image, does not lay them out rank by rank); split the mask in "
                "the plan as its keys are split"
            )
        if length == comm.world * chunk_len:
            self.full = m
            return
        if m.shape[-2] != 1:
            raise ValueError(
                f"ring attention: a mask with a query dimension ({tuple(attn_mask.shape)}) must cover all "
                f"{comm.world * chunk_len} keys; a per-shard one cannot be rotated with the keys"
            )
        if ulysses is not None and length * ulysses.world == chunk_len:
            # ring × Ulysses: the Ulysses all-to-all gathered the keys of this ring rank, not the mask
            m = all_gather_last(m, ulysses)
            length = m.shape[-1]
        if length != chunk_len:
            raise ValueError(f"ring attention: the mask covers {length} keys but this rank holds {chunk_len}")
        self.local = m

    @property
    def present(self) -> bool:
        return self.full is not None or self.local is not None

    def travelling(self) -> list[torch.Tensor]:
        """What goes into the K/V buffer: this rank's key-mask chunk, or nothing."""
        return [] if self.local is None else [self.local]

    def chunk(self, j: int, travelled: list[torch.Tensor]) -> torch.Tensor | None:
        """Chunk j's mask: the part that arrived with its keys, or the slice of the full mask."""
        if self.full is not None:
            return self.full[..., j * self.chunk_len : (j + 1) * self.chunk_len]
        return travelled[0] if travelled else None

    def skip(self, j: int, mask_j: torch.Tensor | None) -> bool:
        """Every key of chunk j is masked for every row: nothing to compute (the hops still happen)."""
        if j not in self._skip:
            empty = None
            if mask_j is not None:
                allowed = mask_j if mask_j.dtype == torch.bool else mask_j != float("-inf")
                empty = ~allowed.any(-1)  # (B|1, H|1, Sq|1)
            every, some = torch.stack([empty.all(), empty.any()]).tolist() if empty is not None else (False, False)
            self._skip[j] = every
            self._empty_rows[j] = empty if some else None
        return self._skip[j]

    def blank_empty_rows(self, j: int, out_j: torch.Tensor, lse_j: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with no allowed key in chunk j (after `skip(j, ...)`) get out 0 and lse −inf, so the merge
        gives that block no weight (kernels disagree about what they report there; the CPU flash kernel says
        lse 0)."""
        e = self._empty_rows.get(j)
        if e is None:
            return out_j, lse_j
        e = e if seq_dim == 2 else e.transpose(1, 2)
        return out_j.masked_fill(e.unsqueeze(-1), 0.0), lse_j.masked_fill(e, float("-inf"))


def pack_chunk(kernel: block_kernels.BlockKernel, k: torch.Tensor, v: torch.Tensor, masks: ChunkMasks) -> tuple[Packing, torch.Tensor]:
    """This rank's chunk as it travels: K and V in the kernel's layout, then its key mask (if one travels)."""
    parts = [kernel.to_layout(k), kernel.to_layout(v), *masks.travelling()]
    packing = Packing([(t.shape, t.dtype) for t in parts])
    return packing, packing.pack(parts, k.device)


def stream(packing: Packing, buf: torch.Tensor, comm: GroupComm) -> Iterator[tuple[int, list[torch.Tensor]]]:
    """Yield (j, parts of chunk j) for j = r, r+1, ... (mod W): one hop per step, double-buffered. While the
    caller computes on step i's chunk, it is being sent to rank r−1 and chunk j+1 received from rank r+1
    into the buffer step i−1 used; the hop is waited for only when the caller asks for the next chunk. Every
    rank makes all W−1 hops, whatever it computes."""
    spare = None
    for i in range(comm.world):
        hop = comm.shift(buf, -1, into=spare) if i < comm.world - 1 else None
        yield (comm.rank + i) % comm.world, packing.unpack(buf)
        if hop is not None:
            spare, buf = buf, comm.wait(hop)  # both directions done: the sent buffer is free again


# ----------------------------------------------------------------------------------------------------------
# The algorithm
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RingSetup:
    """What one ring attention call runs with besides its tensors: each chunk's mask, the block kernel, the ring's
    group, the softmax scale and the dtype blocks are merged / gradients accumulated in (the forward's and the
    backward's may differ: `dataclasses.replace`)."""

    masks: ChunkMasks
    kernel: block_kernels.BlockKernel
    comm: GroupComm
    scale: float
    acc_dtype: torch.dtype


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


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: RingSetup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries against every rank's keys. q, k, v: this rank's shards, model layout (B, S, H, D).
    Returns out (model layout, q's dtype, merged in `setup.acc_dtype`) and the merged fp32 lse (B, S, H)."""
    masks, kernel, comm, scale, acc_dtype = setup.masks, setup.kernel, setup.comm, setup.scale, setup.acc_dtype
    q = kernel.to_layout(q)  # a view: every kernel takes strided layouts (as SDPA hands them), a copy costs a chunk
    out = lse = None
    for j, (k_j, v_j, *travelled) in stream(*pack_chunk(kernel, k, v, masks), comm):  # own chunk first
        mask_j = masks.chunk(j, travelled)
        if masks.skip(j, mask_j):
            continue
        out_j, lse_j = kernel.forward(q, k_j, v_j, mask_j, scale)
        out_j, lse_j = masks.blank_empty_rows(j, out_j, lse_j.float(), kernel.seq_dim)
        if out is None:
            out, lse = out_j.to(acc_dtype), lse_j
        else:
            out, lse = merge(out, lse, out_j, lse_j, guard=masks.present)
        out_j = lse_j = None  # merged: not held through the next block's kernel
    if out is None:  # every key masked for every row
        out = torch.zeros_like(q, dtype=acc_dtype)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return kernel.to_layout(out.to(q.dtype)), kernel.lse_to_layout(lse)


class DkvRing:
    """dK/dV on their way home. At step i rank r adds its dK/dV of the chunk it holds (r+i) to that chunk's
    fp32 accumulator and sends it to rank r−1, which holds that chunk at step i+1; after W steps one final
    hop brings each chunk's sum to its owner. Two buffers: the one in flight out and the one coming in."""

    toward = -1
    """The direction that follows the keys (diffusers 0.42.1 sends to r+1: right only when W = 2)."""

    def __init__(self, comm: GroupComm, packing: Packing, device: torch.device) -> None:
        self.comm, self.packing, self.device = comm, packing, device
        self.hop: Any = None
        self.sent: torch.Tensor | None = None

    def add(self, grads: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """This step's dK/dV of the chunk held (None: the chunk was skipped), then the hop to `toward`."""
        spare = None
        if self.hop is None:  # step 0: start this rank's chunk's accumulator
            acc = self.packing.empty(self.device)
            if grads is None:
                acc.zero_()
            else:
                for part, g in zip(self.packing.unpack(acc), grads):
                    part.copy_(g)
        else:  # the accumulator of the chunk held now, from rank r+1
            acc, spare = self.comm.wait(self.hop), self.sent  # the last send is done: its buffer is free
            if grads is not None:
                for part, g in zip(self.packing.unpack(acc), grads):
                    part.add_(g)
        self.sent, self.hop = acc, self.comm.shift(acc, self.toward, into=spare)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's chunk's dK, dV (after the last `add`), in the kernel's layout."""
        dk, dv = self.packing.unpack(self.comm.wait(self.hop))
        return dk, dv


def ring_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, setup: RingSetup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of this rank's shards (model layout, `setup.acc_dtype`), from what `ring_forward` took and gave
    (out and lse are the global merged ones)."""
    masks, kernel, comm, scale, acc_dtype = setup.masks, setup.kernel, setup.comm, setup.scale, setup.acc_dtype
    q, dout, out = (kernel.to_layout(x) for x in (q, dout, out))  # views (measured: copies cost 3 chunks at the peak)
    lse = kernel.lse_to_layout(lse)
    k_shape, v_shape = kernel.to_layout(k).shape, kernel.to_layout(v).shape
    dkv = DkvRing(comm, Packing([(k_shape, acc_dtype), (v_shape, acc_dtype)]), q.device)
    dq = None
    for j, (k_j, v_j, *travelled) in stream(*pack_chunk(kernel, k, v, masks), comm):
        mask_j = masks.chunk(j, travelled)
        grads = None if masks.skip(j, mask_j) else kernel.backward(dout, q, k_j, v_j, out, lse, mask_j, scale)
        if grads is not None:
            dq = grads[0].to(acc_dtype) if dq is None else dq.add_(grads[0])
        dkv.add(None if grads is None else grads[1:])
        grads = None  # summed: not held through the next block's kernel (3 chunks of memory)
    dk, dv = dkv.result()
    if dq is None:
        dq = torch.zeros_like(q, dtype=acc_dtype)
    return kernel.to_layout(dq), kernel.to_layout(dk), kernel.to_layout(dv)


# ----------------------------------------------------------------------------------------------------------
# Passes over the heads
# ----------------------------------------------------------------------------------------------------------

MAX_PASSES = 4
PASS_MIN_KV_BYTES = 1 << 20
"""Below this much K and V per pass, a pass's W−1 hops cost more in latency than its memory is worth."""
PASS_MIN_TILES_PER_SLOT = 4
"""A pass keeps at least this many 128-query tiles (B × heads × ⌈S/128⌉) per parallel slot of the device
(streaming multiprocessors on CUDA, torch threads on CPU): fewer, and a fused kernel on fewer heads leaves the
device partly idle, so the passes would cost time."""


def _parallel_slots(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def head_passes(query: torch.Tensor, key: torch.Tensor, masks: ChunkMasks, comm: GroupComm) -> list[slice]:
    """The heads, in the groups the ring runs one after another ("passes"; model layout (B, S, H, D)).

    Heads are independent, so a pass is the whole ring for its heads and the results are bit-identical to one
    pass (tested). What the ring holds beyond its inputs and results (two K/V buffers, two dK/dV accumulators,
    dQ in the accumulation dtype, one block's outputs, the kernel's scratch: about 13 local chunks in fp32 and
    20 in bf16 with one pass) scales with the heads of a pass, so 2 passes halve it and 4 quarter it. A pass
    costs W−1 more hops and runs kernels on fewer heads: split (into up to `MAX_PASSES`, dividing the heads)
    only while every pass still moves ≥ `PASS_MIN_KV_BYTES` of K/V and fills the device
    (`PASS_MIN_TILES_PER_SLOT`). A ring of one has nothing in flight, and a mask with a per-head dimension is
    kept whole: one pass."""
    batch, seq, heads, _ = query.shape
    kv_bytes = 2 * key.numel() * key.element_size()
    slots = _parallel_slots(query.device)
    passes = 1
    if comm.world > 1 and not masks.per_head:
        for n in range(MAX_PASSES, 1, -1):
            tiles = batch * (heads // n) * -(-seq // 128)
            if heads % n == 0 and kv_bytes // n >= PASS_MIN_KV_BYTES and tiles >= PASS_MIN_TILES_PER_SLOT * slots:
                passes = n
                break
    per = heads // passes
    return [slice(i * per, (i + 1) * per) for i in range(passes)]


def forward_in_passes(
    passes: list[slice], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, setup: RingSetup
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ring_forward` once per pass, each pass's out and lse written into the whole (B, S, H, ·) results."""
    if len(passes) == 1:
        return ring_forward(q, k, v, setup)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for h in passes:
        out[:, :, h], lse[:, :, h] = ring_forward(q[:, :, h], k[:, :, h], v[:, :, h], setup)
    return out, lse


# the fused backward's convention (dout, q, k, v, out, lse, ...: aten's and flash-attn's backward ops)
def backward_in_passes(
    passes: list[slice],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    setup: RingSetup,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ring_backward` once per pass; dQ, dK, dV in `grad_dtype`, each pass's written into the whole."""
    if len(passes) == 1:
        grads = ring_backward(dout, q, k, v, out, lse, setup)
        return tuple(g.to(grad_dtype) for g in grads)  # type: ignore[return-value]
    dq, dk, dv = (torch.empty_like(x, dtype=grad_dtype) for x in (q, k, v))
    for h in passes:
        dq[:, :, h], dk[:, :, h], dv[:, :, h] = ring_backward(*(x[:, :, h] for x in (dout, q, k, v, out, lse)), setup)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# diffusers' interface
# ----------------------------------------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    """cpdoctor's fixed ring attention (see the module docstring), with diffusers' ring signature."""

    # diffusers' TemplatedRingAttention.forward signature, which the patch replaces
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
        kernel = block_kernels.select(forward_op, _parallel_config)
        scale = block_kernels.default_scale(query.shape[-1], scale)
        masks = ChunkMasks(attn_mask, key.shape[1], comm, ulysses)
        # Like the original: convert_to_fp32 merges in fp32; without it the merge follows type promotion with
        # the fp32 lse (so it is fp32 too for half inputs), while the backward accumulates in the grad dtype.
        to_fp32 = compat.convert_to_fp32(_parallel_config)
        fwd_dtype = torch.float32 if to_fp32 else torch.promote_types(query.dtype, torch.float32)
        setup = RingSetup(masks, kernel, comm, scale, fwd_dtype)
        ctx.passes = head_passes(query, key, masks, comm)
        out, lse = forward_in_passes(ctx.passes, query, key, value, setup)

        ctx.save_for_backward(query, key, value, out, lse)
        ctx.setup = replace(setup, acc_dtype=torch.float32 if to_fp32 else query.dtype)
        if return_lse:
            ctx.mark_non_differentiable(lse)
            return out, lse
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *args: Any):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = backward_in_passes(ctx.passes, grad_out.to(query.dtype), query, key, value, out, lse, ctx.setup, grad_out.dtype)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None
