"""What a backward root's autograd graph says about the loss: every path from the root to a model output (a
term), and the linear factors on each path, read node by node before the backward frees the graph.

The one-run reference back-propagates the recorded output gradient, which already carries every factor the
step put on its loss; one process running the same code puts the same factors there except those that come from
the job's degrees. So the factors themselves are recorded, wherever the code wrote them: a Python number or a
0-dim / 1-element tensor, above the reduction (`loss * cp`), inside it (`(cp * err).mean()`), on each term of a sum
of losses, each mean with the elements it averaged, GradScaler's scale (`Source.SCALER`, known by the node
`GradScaler.scale` made) and accelerate's division by the accumulation steps (`Source.ACCELERATE`). What a number
means (a weight, or a power of the degrees) is factors.py's question, never this walk's. A path's linear part ends
at the first node that is not a linear scalar operation (a square, a weighting by a tensor): what lies below it is
the loss's own math, the same in one process.

A node whose constants cannot be read (a loss inside a compiled graph, a custom autograd Function such as a
differentiable all_reduce) is named in `BackwardRoot.hidden`; a path that reaches the model's parameters without
passing through its output (a regulariser on the weights) is counted in `param_paths`. The walk only reads the
graph; it touches no tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cpdoctor.examinations.step.watcher.events import BackwardRoot, LossFactor, LossTerm, Source

PASS_THROUGH = frozenset(
    {
        "ToCopyBackward0", "CloneBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
        "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "ExpandBackward0",
        "PermuteBackward0", "TransposeBackward0", "TBackward0", "AliasBackward0", "SelectBackward0", "SliceBackward0",
        "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0", "StackBackward0", "CatBackward0",
        "IndexBackward0", "SumBackward0", "SumBackward1", "_DDPSinkBackward",
    }
)  # fmt: skip
"""Nodes that route the loss without scaling it (casts, views, slices, stacking, sums; DDP's output sink)."""

SCALAR_OPS = {"MulBackward0": 1, "MulBackward1": 1, "DivBackward0": -1, "DivBackward1": -1}
"""`x * s` and `x / s`, and how s enters the product."""

LOSS_FUNCTIONS = frozenset({"MseLossBackward0", "L1LossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0"})
"""torch's loss functions whose `reduction` is saved on the node (1 = mean, 2 = sum): the end of the linear part."""

MAX_NODES = 20_000
"""A loss graph is a few dozen nodes above the model's outputs; past this the walk gives up and says so."""


def _scalar(value: Any) -> float | None:
    """The value of a Python number or of a one-element tensor that is not trained (None otherwise)."""
    import torch

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        return float(value.detach().double().reshape(()))
    return None


def _mean_count(node: Any) -> int | None:
    """How many elements a MeanBackward node averaged."""
    sizes = getattr(node, "_saved_self_sym_sizes", None)
    if sizes is None:
        return None
    dims = getattr(node, "_saved_dim", None)
    if not dims:
        return math.prod(int(s) for s in sizes)
    return math.prod(int(sizes[d]) for d in dims)


def _hides_constants(node: Any) -> bool:
    """A node whose backward cannot be read here: a compiled graph, or a custom autograd Function."""
    from torch.autograd.function import BackwardCFunction

    return type(node).__name__ not in PASS_THROUGH and isinstance(node, BackwardCFunction)


def _linear(node: Any, marks: Mapping[int, Source]) -> list[tuple[Any, LossFactor | None]] | None:
    """Where a linear node sends the gradient, each edge with the factor it applies (None: factor 1); None when the
    node is not a linear scalar operation (the end of the path's linear part)."""
    name = type(node).__name__
    nexts = [fn for fn, _ in node.next_functions]
    if name in PASS_THROUGH:
        return [(fn, None) for fn in nexts if fn is not None]
    if name == "NegBackward0":
        return [(fn, LossFactor(-1.0, Source.CONSTANT)) for fn in nexts if fn is not None]
    if name in ("AddBackward0", "SubBackward0"):
        alpha = float(getattr(node, "_saved_alpha", 1) or 1)
        second = -alpha if name == "SubBackward0" else alpha
        edges = []
        for fn, factor in zip(nexts, (1.0, second)):
            if fn is not None:
                edges.append((fn, None if factor == 1.0 else LossFactor(factor, Source.CONSTANT)))
        return edges
    if name.startswith("MeanBackward"):
        count = _mean_count(node)
        if count is None:
            return None
        return [(fn, LossFactor(1.0 / count, Source.MEAN, count)) for fn in nexts if fn is not None]
    if name in SCALAR_OPS:
        source = marks.get(id(node), Source.CONSTANT)
        other = _scalar(getattr(node, "_saved_other", None))
        if name.startswith("Mul") and other is None:  # s * x with the scalar first: its gradient flows to `other`
            mine = _scalar(getattr(node, "_saved_self", None))
            live = [fn for fn in nexts if fn is not None]
            if mine is None or len(live) != 1:
                return None
            return [(live[0], LossFactor(mine, source))]
        if other is None or other == 0:
            return None
        value = other ** SCALAR_OPS[name]
        return [(fn, LossFactor(value, source)) for fn in nexts[:1] if fn is not None]
    return None


def read_root(
    root: Any, outputs: Mapping[int, int], params: frozenset[int], marks: Mapping[int, Source], gradient: Any = None
) -> BackwardRoot:
    """Walk from `root` (the tensor backward() was called on) to the model's outputs (`outputs`: id of a recorded
    output's grad_fn -> which forward), collecting each path's linear factors; `marks` attributes nodes made by
    wrapped entry points (GradScaler.scale, Accelerator.backward); `params` are the ids of the model's
    trainable parameters (a path to one that misses the outputs is a term on the weights)."""
    start = getattr(root, "grad_fn", None)
    first = ()
    value = _scalar(gradient) if gradient is not None else None
    if value is not None and value != 1.0:
        first = (LossFactor(value, Source.GRADIENT),)
    terms: list[LossTerm] = []
    hidden: list[str] = []
    param_paths = 0
    stack: list[tuple[Any, tuple[LossFactor, ...], bool]] = [(start, first, True)] if start is not None else []
    seen_math: set[tuple[int, tuple[LossFactor, ...]]] = set()  # below the linear part: each node once per prefix
    visits = 0
    while stack:
        node, factors, linear = stack.pop()
        visits += 1
        if visits > MAX_NODES:
            hidden.append(f"a loss graph of more than {MAX_NODES} nodes above the model's output")
            break
        forward = outputs.get(id(node))
        if forward is not None:
            terms.append(LossTerm(factors, forward))
            continue
        if type(node).__name__ == "AccumulateGrad":
            if id(getattr(node, "variable", None)) in params:
                param_paths += 1
            continue
        if linear:
            if _hides_constants(node):
                hidden.append(type(node).__name__)
            edges = None if _hides_constants(node) else _linear(node, marks)
            if edges is not None:
                stack.extend((fn, factors + ((replace(f, place=len(factors)),) if f is not None else ()), True) for fn, f in edges)
                continue
            if type(node).__name__ in LOSS_FUNCTIONS and getattr(node, "_saved_reduction", None) == 1:
                saved = getattr(node, "_saved_self", None)
                if saved is not None:
                    factors = factors + (LossFactor(1.0 / saved.numel(), Source.MEAN, int(saved.numel()), len(factors)),)
        key = (id(node), factors)
        if key in seen_math:
            continue
        seen_math.add(key)
        stack.extend((fn, factors, False) for fn, _ in node.next_functions if fn is not None)
    return BackwardRoot(tuple(terms), tuple(dict.fromkeys(hidden)), param_paths)
