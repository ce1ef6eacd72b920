"""Every block's output and input gradient, recorded with hooks, and their errors against the reference.

`BlockRecorder(model)` hooks every block of every stack (`cpdoctor.model_zoo.slicing.block_stacks`): a forward
pre-hook registers a gradient hook on each sequence tensor the block takes (floating, at least 3-D, requiring
grad: hidden_states, encoder_hidden_states), a forward hook keeps each sequence tensor it returns. Under CP each
rank records its own shard; `assemble` puts the shards back along the dimension the model's `_cp_plan` split
(the one whose reference length is world × the shard's), so rank 0 compares whole sequences. Numbers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cpdoctor.report import BlockRow


@dataclass
class BlockRecord:
    """What the hooks saw, in plain data for a payload: the blocks in call order, each block's sequence outputs
    and the gradients that reached its sequence inputs (CPU tensors; a rank's own shards under CP)."""

    order: list[str] = field(default_factory=list)
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    grads: dict[str, list[Any]] = field(default_factory=dict)


def _seq_tensors(values: Any) -> list[Any]:
    import torch

    out = []
    stack = list(values) if isinstance(values, (tuple, list)) else [values]
    for v in stack:
        if isinstance(v, (tuple, list)):
            out.extend(_seq_tensors(v))
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and v.ndim >= 3:
            out.append(v)
    return out


class BlockRecorder:
    """Hooks on every block of `model`; `outputs[name]` and `grads[name]` are lists of CPU tensors."""

    def __init__(self, model: Any) -> None:
        from cpdoctor.model_zoo.slicing import block_stacks

        self.order: list[str] = []
        self.outputs: dict[str, list[Any]] = {}
        self.grads: dict[str, list[Any]] = {}
        self.handles: list[Any] = []
        for stack, blocks in block_stacks(model):
            for i, block in enumerate(blocks):
                name = f"{stack}.{i}"
                self.handles.append(block.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                self.handles.append(block.register_forward_hook(self._post(name)))

    def _pre(self, name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if name not in self.order:
                self.order.append(name)
            inputs = [t for t in _seq_tensors(list(args) + list(kwargs.values())) if t.requires_grad]
            slots: list[Any] = [None] * len(inputs)
            self.grads[name] = slots
            for i, t in enumerate(inputs):
                t.register_hook(self._grad(slots, i))

        return hook

    @staticmethod
    def _grad(slots: list[Any], i: int) -> Any:
        def hook(g: Any) -> None:
            slots[i] = g.detach().cpu().clone()

        return hook

    def _post(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.outputs[name] = [t.detach().cpu().clone() for t in _seq_tensors(output)]

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def record(self) -> BlockRecord:
        return BlockRecord(list(self.order), dict(self.outputs), {k: list(v) for k, v in self.grads.items()})


def _split_dim(first: Any, ref: Any, w: int) -> int | None:
    """The dimension the shards were split along: where the reference is `w` times longer and every other matches."""
    for d in range(ref.ndim):
        if ref.shape[d] == w * first.shape[d] and all(ref.shape[e] == first.shape[e] for e in range(ref.ndim) if e != d):
            return d
    return None


def assemble(shards: list[Any], ref: Any, summed: bool = False, segments: frozenset[int] = frozenset()) -> Any:
    """The whole tensor from the ranks' shards: concatenated along the dimension where the reference is
    len(shards) times longer; when the tensor was not split, the rank-0 copy (an output: every rank holds it) or,
    with `summed`, the sum over the ranks (the gradient of an input every rank holds whole, such as LTX's 3-D
    timestep embedding: each rank's holds its own tokens' part, as a parameter's does).

    A block whose sequence the model concatenated from two streams the plan split separately (Flux2 joins text and
    image before its single-stream blocks: each rank holds [its text shard, its image shard]) is not one contiguous
    split: with `segments` (the shard lengths the split streams have, see `stream_lengths`) each way of cutting the
    shards into two such streams is put back stream by stream as well, and the candidate nearest the reference is
    returned. Only the block table reads this; the verdict compares the model's own output and gradients."""
    import torch

    first = shards[0]
    if first is None:
        return None
    if tuple(first.shape) == tuple(ref.shape):
        return torch.stack(list(shards)).sum(dim=0) if summed and all(s is not None for s in shards) else first
    d = _split_dim(first, ref, len(shards))
    if d is None or any(s is None for s in shards):
        return None
    candidates = [torch.cat(list(shards), dim=d)]
    n = first.shape[d]
    for a in sorted(x for x in segments if 0 < x < n and n - x in segments):
        streams = [s.narrow(d, 0, a) for s in shards] + [s.narrow(d, a, n - a) for s in shards]
        candidates.append(torch.cat(streams, dim=d))
    if len(candidates) == 1:
        return candidates[0]
    from cpdoctor.examinations.measurement import compare

    return min(candidates, key=lambda c: compare(c.double().reshape(-1), ref.double().reshape(-1)).rel_err)


def stream_lengths(shard_record: BlockRecord, ref: BlockRecord, w: int) -> frozenset[int]:
    """The shard lengths of the split sequences one rank's blocks saw (each output's length along its split
    dimension): the streams a joined sequence may be made of."""
    lengths = set()
    for name, outs in shard_record.outputs.items():
        for shard, whole in zip(outs, ref.outputs.get(name, [])):
            d = None if shard is None or whole is None else _split_dim(shard, whole, w)
            if d is not None:
                lengths.add(int(shard.shape[d]))
    return frozenset(lengths)


def _flat(tensors: list[Any]) -> Any:
    import torch

    return torch.cat([t.double().reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=torch.float64)


def _error(parts: list[Any], refs: list[Any]) -> Any:
    from cpdoctor.examinations.measurement import compare

    pairs = [(p, r) for p, r in zip(parts, refs) if p is not None and r is not None]
    if not pairs or len(parts) != len(refs):
        return None
    return compare(_flat([p for p, _ in pairs]), _flat([r for _, r in pairs]))


def block_errors(cp: list[BlockRecord], base: BlockRecord | None, ref: BlockRecord) -> list[BlockRow]:
    """Per block in the reference's call order: the CP run's output and input-gradient errors (shards of every
    rank assembled) and the no-CP baseline's, against the reference."""
    rows = []
    segments = stream_lengths(cp[0], ref, len(cp)) if cp else frozenset()
    for name in ref.order:
        ref_out, ref_grad = ref.outputs.get(name, []), ref.grads.get(name, [])
        out_parts = [
            assemble([p.outputs.get(name, [None] * len(ref_out))[i] for p in cp], r, segments=segments) for i, r in enumerate(ref_out)
        ]
        grad_parts = [
            None
            if r is None
            else assemble([(p.grads.get(name) or [None] * len(ref_grad))[i] for p in cp], r, summed=True, segments=segments)
            for i, r in enumerate(ref_grad)
        ]
        out_c, grad_c = _error(out_parts, ref_out), _error(grad_parts, ref_grad)
        base_out = base_grad = None
        if base is not None:
            bo, bg = _error(base.outputs.get(name, []), ref_out), _error(base.grads.get(name, []), ref_grad)
            base_out, base_grad = (None if bo is None else bo.rel_err), (None if bg is None else bg.rel_err)
        rows.append(
            BlockRow(
                name,
                None if out_c is None else out_c.rel_err,
                None if grad_c is None else grad_c.rel_err,
                (0 if out_c is None else out_c.nonfinite) + (0 if grad_c is None else grad_c.nonfinite),
                base_out,
                base_grad,
            )
        )
    return rows
