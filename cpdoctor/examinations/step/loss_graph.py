"""What happened to the loss between its reduction and `backward()`, read from the backward root's autograd
graph: the scalar factors it was multiplied or divided by (`loss * cp_size`, `loss / accumulation_steps`,
GradScaler's scale) and the reduction that made it a scalar (a mean over how many elements, or a sum).

Why: the one-run watcher back-propagates the recorded output gradient, which already carries every one of those
factors. A correct step that scales its loss by the CP size and then averages over the CP ranks (NeMo Automodel,
SimpleTuner) ends with gradients exactly 1/cp of that reference, the same numbers as a step that averages over
the CP ranks without scaling its loss. Only the factor in the graph tells the two apart; where the graph does
not say, the judge gives both readings (a WARN), never a FAIL that stops a healthy job.

The roots are caught by wrapping `torch.Tensor.backward` (and `torch.autograd.backward`) while a watch is open;
both are restored at its exit, and the wrapper only reads the graph (no tensor is touched)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCALAR_NODES = {"MulBackward0": 1, "DivBackward0": -1}
"""Autograd nodes of `x * s` and `x / s`, and how s enters the product."""

PASS_THROUGH = ("ToCopyBackward0", "CloneBackward0", "ViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0", "UnsqueezeBackward0")
"""Nodes that move the scalar loss without changing its value (`.float()`, `.clone()`, views)."""

MEAN_LOSSES = ("MseLossBackward0", "L1LossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0")
"""torch's loss functions whose `reduction` is saved on the node (1 = mean, 2 = sum)."""


LOSS_SCALE_MIN = 256.0
"""A power of two at least this large on the loss is read as a dynamic loss scale (GradScaler starts at 2**16
and halves or doubles it; a CP size is 2–64). On the CPU GradScaler's scale is a 0-dim tensor, as a Python
number on the loss is, so the value is what tells them apart."""


@dataclass(frozen=True)
class Factor:
    """One scalar the loss was scaled by. `constant` is a Python number (or a wrapped one); a one-element tensor
    such as GradScaler's scale on a GPU is not, nor is a large power of two (`LOSS_SCALE_MIN`)."""

    value: float
    constant: bool


@dataclass(frozen=True)
class LossReading:
    """One backward root: its scalar factors (root first) and its reduction."""

    factors: tuple[Factor, ...] = ()
    reduction: str = "unknown"
    """"mean", "sum" or "unknown" (a node this reader does not know: a sum of losses, a custom Function...)."""
    count: int | None = None
    """How many elements a mean reduction averaged over (None for a sum or unknown)."""

    @property
    def scale(self) -> float:
        return math.prod(f.value for f in self.factors)

    def constants(self) -> tuple[float, ...]:
        return tuple(f.value for f in self.factors if f.constant)

    def tensor_scale(self) -> float:
        """The product of the one-element-tensor factors (GradScaler's scale): 1.0 when there is none."""
        return math.prod(f.value for f in self.factors if not f.constant)


def _scalar(t: Any) -> float | None:
    import torch

    if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.requires_grad:
        return float(t.detach().double().reshape(()))
    return None


def _count(node: Any) -> int | None:
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is None:
        return None
    total = math.prod(int(s) for s in sizes)
    dims = getattr(node, "_saved_dim", None)
    if not dims:
        return total
    return math.prod(int(sizes[d]) for d in dims)


def _nested_count(node: Any) -> int | None:
    """The elements averaged by a mean and the means right below it (`x.reshape(B, -1).mean(1).mean()`, as
    diffusers' training scripts write the flow-matching loss)."""
    total = 1
    while node is not None:
        name = type(node).__name__
        if name.startswith("MeanBackward"):
            count = _count(node)
            if count is None:
                return None
            total *= count
        elif name not in PASS_THROUGH:
            return total
        node = node.next_functions[0][0] if node.next_functions else None
    return total


def read_loss(root: Any) -> LossReading:
    """Walk from `root` (the tensor `backward()` was called on) down through scalar multiplications, divisions
    and value-preserving nodes to the reduction."""
    node = getattr(root, "grad_fn", None)
    factors: list[Factor] = []
    while node is not None:
        name = type(node).__name__
        if name in SCALAR_NODES:
            other, mine = _scalar(getattr(node, "_saved_other", None)), getattr(node, "_saved_self", None)
            if other is None and name == "MulBackward0":  # s * x with the scalar first
                other = _scalar(mine)
            if other is None or other == 0:
                return LossReading(tuple(factors))
            saved = getattr(node, "_saved_other", None)
            power_of_two = other >= LOSS_SCALE_MIN and math.log2(other).is_integer()
            constant = saved is not None and saved.dim() == 0 and not (power_of_two and SCALAR_NODES[name] == 1)
            factors.append(Factor(other ** SCALAR_NODES[name], constant))
            node = next((fn for fn, _ in node.next_functions if fn is not None), None)
            continue
        if name in PASS_THROUGH:
            node = node.next_functions[0][0]
            continue
        if name in MEAN_LOSSES:
            red = getattr(node, "_saved_reduction", None)
            saved = getattr(node, "_saved_self", None)
            if red == 1 and saved is not None:
                return LossReading(tuple(factors), "mean", int(saved.numel()))
            return LossReading(tuple(factors), "sum" if red == 2 else "unknown")
        if name.startswith("MeanBackward"):
            return LossReading(tuple(factors), "mean", _nested_count(node))
        if name.startswith("SumBackward"):
            return LossReading(tuple(factors), "sum")
        return LossReading(tuple(factors))
    return LossReading(tuple(factors))


@dataclass
class BackwardRoots:
    """While installed, records every tensor `backward()` is called on (read through `read_loss` at once: the
    graph is freed by the backward)."""

    readings: list[LossReading] = field(default_factory=list)
    _saved: tuple[Callable[..., Any], Callable[..., Any]] | None = None

    def install(self) -> BackwardRoots:
        import torch

        tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward
        readings, inside = self.readings, [False]  # Tensor.backward calls torch.autograd.backward: read once

        def backward(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            readings.append(read_loss(tensor))
            inside[0] = True
            try:
                return tensor_backward(tensor, *args, **kwargs)
            finally:
                inside[0] = False

        def functional_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                for t in tensors if isinstance(tensors, (list, tuple)) else (tensors,):
                    readings.append(read_loss(t))
            return autograd_backward(tensors, *args, **kwargs)

        self._saved = (tensor_backward, autograd_backward)
        torch.Tensor.backward = backward  # type: ignore[method-assign]
        torch.autograd.backward = functional_backward  # type: ignore[assignment]
        return self

    def remove(self) -> None:
        import torch

        if self._saved is not None:
            torch.Tensor.backward, torch.autograd.backward = self._saved  # type: ignore[method-assign,assignment]
            self._saved = None
