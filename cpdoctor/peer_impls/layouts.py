"""Which tokens of the full sequence each rank holds, per layout: used to shard the inputs the way the peer
expects and to put every rank's results back by token index before comparing them with the reference.

Each function returns rank `rank`'s global token indices in the order the rank holds them (pure Python, no
torch). `rank` is the rank's place in the CP group, ring-major: rank = ring_rank · ulysses + ulysses_rank
(yunchang's `set_seq_parallel_pg(..., use_ulysses_low=True)` groups: Ulysses ranks adjacent, ring ranks strided).
Sources:
- contiguous: `x.chunk(world, dim=1)[rank]` (ring-flash-attn's basic ring, yunchang's `basic_extract_local`).
- zigzag: the sequence in 2·ring chunks, ring rank r holding chunks r and 2·ring−1−r (ring-flash-attn's
  test/test_zigzag_ring_flash_attn_func.py `extract_local`; yunchang's `zigzag_extract_local`, which then splits
  that pair among the Ulysses ranks).
- stripe: round robin, token t on ring rank t mod ring (ring-flash-attn's test/test_stripe_flash_attn_func.py;
  yunchang's `stripe_extract_local`: reshape (S/ring, ring), transpose, then chunk among all ranks).
- head-tail: PyTorch's `_HeadTailLoadBalancer` (torch/distributed/tensor/experimental/_context_parallel/
  _load_balancer.py): chunks r and 2W−1−r of 2W, like zigzag with Ulysses 1.
- varlen: packed sequences (total tokens, H, D) split contiguously over the ranks (ring-flash-attn's
  llama3_flash_attn_varlen: `total_length % world_size == 0`, each rank the next total/world tokens, sequences
  described by one global `cu_seqlens`).
"""

from __future__ import annotations

import enum


class Layout(enum.Enum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    STRIPE = "stripe"
    HEAD_TAIL = "head-tail"
    VARLEN = "varlen"


def contiguous(seq: int, world: int, rank: int) -> list[int]:
    n = seq // world
    return list(range(rank * n, (rank + 1) * n))


def zigzag(seq: int, ring: int, ulysses: int, rank: int) -> list[int]:
    chunk = seq // (2 * ring)
    r, u = divmod(rank, ulysses)
    pair = list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * ring - 1 - r) * chunk, (2 * ring - r) * chunk))
    n = len(pair) // ulysses
    return pair[u * n : (u + 1) * n]


def stripe(seq: int, ring: int, ulysses: int, rank: int) -> list[int]:
    per_ring = seq // ring
    order = [i * ring + j for j in range(ring) for i in range(per_ring)]
    n = seq // (ring * ulysses)
    return order[rank * n : (rank + 1) * n]


def token_indices(layout: Layout, seq: int, ring: int, ulysses: int, rank: int) -> list[int]:
    """Rank `rank`'s token indices (in the order it holds them) of a sequence of `seq` tokens (the packed
    total for varlen)."""
    world = ring * ulysses
    if layout in (Layout.CONTIGUOUS, Layout.VARLEN):
        return contiguous(seq, world, rank)
    if layout in (Layout.ZIGZAG, Layout.HEAD_TAIL):
        return zigzag(seq, ring, ulysses, rank)
    if layout is Layout.STRIPE:
        return stripe(seq, ring, ulysses, rank)
    raise ValueError(f"unknown layout {layout}")


def varlen_lengths(total: int, sequences: int) -> list[int]:
    """Lengths of `sequences` packed sequences summing to `total`, deliberately uneven (so sequence boundaries
    fall inside ranks' shards): a ramp 1, 2, ..., n scaled to the total, the rest on the last one."""
    if sequences <= 1:
        return [total]
    weights = list(range(1, sequences + 1))
    lengths = [max(1, total * w // sum(weights)) for w in weights]
    lengths[-1] = total - sum(lengths[:-1])
    return lengths


def cu_seqlens(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
