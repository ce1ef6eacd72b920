"""Is a CP rank's model input what it should be? Each input a CP rank fed the model is compared with the
same-named input of the run without CP (two runs: the same code, the same data) and is one of:

- replicated: equal to it (diffusers' `_cp_plan` models receive every input whole and split inside; a timestep,
  a pooled text embedding, anything per sample rather than per token);
- this rank's shard of it along one dimension, in a layout a CP implementation uses (a trainer such as
  torchtitan's FLUX shards the image and text tokens itself before calling the model);
- wrong: anything else (a timestep drawn differently on each CP rank, noise drawn per rank, another rank's
  chunk, a tensor of the wrong shape), with what it is instead.

The layouts, each rank's token indices in the order the rank holds them (peer_impls/layouts.py spells them once):
- contiguous: `x.chunk(cp, dim)[rank]`: torch's `_context_parallel_shard` without a load balancer (it
  `distribute_tensor`s with `Shard(seq_dim)`, torch/distributed/tensor/experimental/_context_parallel/
  _attention.py `_context_parallel_buffers`; torchtitan's FLUX `cp_shard(..., load_balancer_type=None)`), and
  diffusers' `_cp_plan` split (`x.chunk(W, dim)[flattened mesh rank]`, also ring × Ulysses);
- head-tail: torch's `_HeadTailLoadBalancer` (_context_parallel/_load_balancer.py): the sequence in 2·cp
  chunks, rank r holding chunks r and 2·cp−1−r (torchtitan's `cp_shard(..., "headtail")`, the default for SDPA;
  ring-flash-attn's zigzag);
- stripe: round robin, token t on rank t mod cp (ring-flash-attn's stripe attention).
torch's per-document head-tail and PTRR balancers depend on document lengths or a block mask that the input
alone does not show: an input in those layouts is not recognised here (wrong, "not this rank's shard in any
layout"), which is why a rank's input is also tried against the other ranks' shards before that is said.

Equality is exact by default (NaN equal to NaN): both runs compute an input with the same code from the same data,
and a shard is an index selection. A tensor computed through the model (its output, the gradient flowing into it:
torchtitan's output stays sharded, so each CP rank's output gradient is its shard of the run without CP's) differs
from the run without CP's by rounding: `rtol` accepts a relative L2 difference up to it. Pure functions; nothing
here talks to other ranks."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cpdoctor.peer_impls.layouts import Layout, token_indices

SHARD_LAYOUTS = (Layout.CONTIGUOUS, Layout.HEAD_TAIL, Layout.STRIPE)
"""The layouts an input shard is tried in, in the order a tie is named (a constant input matches them all)."""


class Placement(str, enum.Enum):
    """What a CP rank's input is, relative to the run without CP's."""

    REPLICATED = "replicated"
    SHARD = "shard"
    WRONG = "wrong"


class Mismatch(str, enum.Enum):
    """Why an input is wrong."""

    SHAPE = "shape"  # neither the full shape nor a part of it along one dimension
    DTYPE = "dtype"
    VALUES = "values"  # the full shape, other values
    OTHER_RANKS_SHARD = "other_ranks_shard"  # a shard, but another rank's
    NOT_A_SHARD = "not_a_shard"  # a part's shape, but no rank's shard in any layout
    VALUE = "value"  # a non-tensor input that differs
    MISSING = "missing"  # the run without CP had no input of that name (or this rank lacks it)
    DISAGREE = "disagree"  # right on its own, but the CP peers do not agree on one placement / layout


@dataclass(frozen=True)
class InputLayout:
    """One input of one CP rank against the run without CP's."""

    name: str
    placement: Placement
    dim: int | None = None
    """The sharded dimension (SHARD; for OTHER_RANKS_SHARD / NOT_A_SHARD, the dimension the part is along)."""
    layouts: tuple[Layout, ...] = ()
    """Every layout in which this is this rank's shard (SHARD), or `other_rank`'s (OTHER_RANKS_SHARD)."""
    mismatch: Mismatch | None = None
    other_rank: int | None = None
    """The CP rank (place in the group) whose shard this is, for OTHER_RANKS_SHARD."""
    detail: str = ""
    """For people: what the input is instead (WRONG)."""

    @property
    def right(self) -> bool:
        return self.placement is not Placement.WRONG


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _same(a: Any, b: Any, rtol: float = 0.0) -> bool:
    """Equal tensors (shape, dtype, values; NaN equal to NaN): exactly, or within a relative L2 difference `rtol`."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    if rtol > 0:
        x, y = a.detach().double(), b.detach().double()
        norm = float(y.norm())
        return norm > 0 and float((x - y).norm()) <= rtol * norm
    return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def shard_of(full: Any, dim: int, layout: Layout, cp: int, rank: int) -> Any:
    """Rank `rank`'s shard of `full` along `dim` in `layout` (None where the layout cannot split that length)."""
    import torch

    seq = full.shape[dim]
    if layout is Layout.CONTIGUOUS:
        chunks = full.chunk(cp, dim)  # torch's Shard(dim): chunk sizes, the last one shorter on an uneven length
        return chunks[rank] if rank < len(chunks) else None
    if seq % (2 * cp if layout is Layout.HEAD_TAIL else cp):
        return None
    index = torch.tensor(token_indices(layout, seq, cp, 1, rank), dtype=torch.long, device=full.device)
    return full.index_select(dim, index)


def _part_dims(local: Any, full: Any) -> list[int]:
    """The dimensions along which `local` could be a part of `full` (every other dimension equal)."""
    if local.ndim != full.ndim:
        return []
    return [
        d
        for d in range(full.ndim)
        if 0 < local.shape[d] < full.shape[d] and all(local.shape[e] == full.shape[e] for e in range(full.ndim) if e != d)
    ]


def _shape(x: Any) -> str:
    return "(" + ", ".join(str(n) for n in x.shape) + ")"


def classify(name: str, local: Any, full: Any, cp: int, rank: int, rtol: float = 0.0) -> InputLayout:
    """What input `name` of CP rank `rank` (its place in a CP group of `cp`) is, against `full`, the same-named
    input of the run without CP (equal within `rtol`, relative L2; exactly by default)."""
    if not _is_tensor(local) or not _is_tensor(full):
        if _is_tensor(local) != _is_tensor(full):
            kinds = f"{type(local).__name__} where the run without CP had {type(full).__name__}"
            return InputLayout(name, Placement.WRONG, mismatch=Mismatch.VALUE, detail=kinds)
        if local == full:
            return InputLayout(name, Placement.REPLICATED)
        return InputLayout(name, Placement.WRONG, mismatch=Mismatch.VALUE, detail=f"{local!r} where the run without CP had {full!r}")
    if local.dtype != full.dtype:
        return InputLayout(
            name, Placement.WRONG, mismatch=Mismatch.DTYPE, detail=f"{local.dtype} where the run without CP had {full.dtype}"
        )
    if local.shape == full.shape:
        if _same(local, full, rtol):
            return InputLayout(name, Placement.REPLICATED)
        return InputLayout(name, Placement.WRONG, mismatch=Mismatch.VALUES, detail=_difference(local, full))
    for dim in _part_dims(local, full):
        mine = tuple(lay for lay in SHARD_LAYOUTS if _matches(local, full, dim, lay, cp, rank, rtol))
        if mine:
            return InputLayout(name, Placement.SHARD, dim=dim, layouts=mine)
        for other in range(cp):
            theirs = tuple(lay for lay in SHARD_LAYOUTS if other != rank and _matches(local, full, dim, lay, cp, other, rtol))
            if theirs:
                return InputLayout(
                    name,
                    Placement.WRONG,
                    dim=dim,
                    layouts=theirs,
                    mismatch=Mismatch.OTHER_RANKS_SHARD,
                    other_rank=other,
                    detail=f"CP rank {other}'s {theirs[0].value} shard along dim {dim}, not CP rank {rank}'s",
                )
        return InputLayout(
            name,
            Placement.WRONG,
            dim=dim,
            mismatch=Mismatch.NOT_A_SHARD,
            detail=f"shape {_shape(local)} is a part of {_shape(full)} along dim {dim}, but no CP rank's shard of it in any layout "
            f"({', '.join(lay.value for lay in SHARD_LAYOUTS)}): its values differ",
        )
    return InputLayout(
        name,
        Placement.WRONG,
        mismatch=Mismatch.SHAPE,
        detail=f"shape {_shape(local)}: neither the run without CP's {_shape(full)} nor a part of it along one dimension",
    )


def _matches(local: Any, full: Any, dim: int, layout: Layout, cp: int, rank: int, rtol: float = 0.0) -> bool:
    part = shard_of(full, dim, layout, cp, rank)
    return part is not None and _same(local, part, rtol)


def _difference(local: Any, full: Any) -> str:
    a, b = local.detach().double(), full.detach().double()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    norm = float(b.norm())
    rel = float((a - b).norm()) / norm if norm > 0 else float("inf")
    return f"differs from the run without CP's (max |Δ| {diff:.3g}, relative {rel:.3g})"


def classify_all(local: dict[str, Any], full: dict[str, Any], cp: int, rank: int, rtol: float = 0.0) -> tuple[InputLayout, ...]:
    """Every input of one rank (its names first, then those only the run without CP had), equal within `rtol`."""
    out = []
    for name, value in local.items():
        if name not in full:
            out.append(InputLayout(name, Placement.WRONG, mismatch=Mismatch.MISSING, detail="the run without CP fed no input of that name"))
        else:
            out.append(classify(name, value, full[name], cp, rank, rtol))
    for name in full:
        if name not in local:
            out.append(InputLayout(name, Placement.WRONG, mismatch=Mismatch.MISSING, detail="this rank fed no input of that name"))
    return tuple(out)


@dataclass(frozen=True)
class GroupInput:
    """One input across a CP group: what it is on every rank, or which ranks have it wrong."""

    name: str
    placement: Placement
    dim: int | None = None
    layout: Layout | None = None
    """The one layout every rank's shard is in (SHARD)."""
    wrong: tuple[tuple[int, str], ...] = ()
    """(global rank, what its input is instead) for every rank that has it wrong (WRONG)."""

    @property
    def wrong_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.wrong)

    def describe(self) -> str:
        """One line for a diagnosis."""
        if self.placement is Placement.REPLICATED:
            return f"{self.name}: replicated"
        if self.placement is Placement.SHARD:
            assert self.layout is not None
            return f"{self.name}: each rank's {self.layout.value} shard along dim {self.dim}"
        return f"{self.name}: " + "; ".join(f"rank {r}: {why}" for r, why in self.wrong)


def judge_group(per_rank: Sequence[InputLayout], ranks: Sequence[int]) -> GroupInput:
    """One input across a CP group (`per_rank[i]` from the rank at place i, global rank `ranks[i]`): right when
    every rank's is replicated, or every rank's is its own shard along the same dimension in one common layout
    (then the shards cover the input exactly once); otherwise wrong, naming the ranks that are."""
    name = per_rank[0].name
    wrong = [(r, x.detail) for r, x in zip(ranks, per_rank) if not x.right]
    if wrong:
        return GroupInput(name, Placement.WRONG, wrong=tuple(wrong))
    if all(x.placement is Placement.REPLICATED for x in per_rank):
        return GroupInput(name, Placement.REPLICATED)
    shards = [(r, x) for r, x in zip(ranks, per_rank) if x.placement is Placement.SHARD]
    if len(shards) == len(per_rank) and len({x.dim for _, x in shards}) == 1:
        common = [lay for lay in SHARD_LAYOUTS if all(lay in x.layouts for _, x in shards)]
        if common:
            return GroupInput(name, Placement.SHARD, dim=shards[0][1].dim, layout=common[0])
    return GroupInput(name, Placement.WRONG, wrong=tuple(_disagreement(per_rank, ranks)))


def _disagreement(per_rank: Sequence[InputLayout], ranks: Sequence[int]) -> list[tuple[int, str]]:
    """Every rank right on its own but the group not: the ranks outside the largest agreeing set are named."""

    def said(x: InputLayout) -> str:
        return (
            "replicated"
            if x.placement is Placement.REPLICATED
            else f"its shard along dim {x.dim} ({'/'.join(lay.value for lay in x.layouts)})"
        )

    best: tuple[Placement, int | None, Layout | None] = (Placement.REPLICATED, None, None)
    best_n = -1
    for placement, dim, layout in [(Placement.REPLICATED, None, None)] + [
        (Placement.SHARD, x.dim, lay) for x in per_rank for lay in x.layouts
    ]:
        n = sum(1 for x in per_rank if x.placement is placement and x.dim == dim and (layout is None or layout in x.layouts))
        if n > best_n:
            best, best_n = (placement, dim, layout), n
    placement, dim, layout = best
    agreed = "replicated" if placement is Placement.REPLICATED else f"{layout.value if layout else '?'} shards along dim {dim}"
    return [
        (r, f"{said(x)}, where its CP peers hold {agreed}")
        for r, x in zip(ranks, per_rank)
        if not (x.placement is placement and x.dim == dim and (layout is None or layout in x.layouts))
    ]


def judge_inputs(per_rank: Sequence[Sequence[InputLayout]], ranks: Sequence[int]) -> tuple[GroupInput, ...]:
    """Every input across a CP group: `per_rank[i]` is `classify_all` of the rank at place i."""
    names: list[str] = []
    for inputs in per_rank:
        names += [x.name for x in inputs if x.name not in names]
    out = []
    for name in names:
        column = [next((x for x in inputs if x.name == name), None) for inputs in per_rank]
        filled = [
            x
            if x is not None
            else InputLayout(name, Placement.WRONG, mismatch=Mismatch.MISSING, detail="this rank fed no input of that name")
            for x in column
        ]
        out.append(judge_group(filled, ranks))
    return tuple(out)
