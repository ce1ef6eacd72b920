"""The watched model's parameter gradients as the examination compares them: every trainable parameter (by the
bare model's names, the segments wrappers insert dropped), flat in one float32 vector, a DTensor's gathered whole
(FSDP2's shards, torchtitan's FSDP over dp_shard × cp: `full_tensor()`, a collective on every rank). One function,
so a layout whose gradients need another gathering extends it here (full_grads.py shapes it by name)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.judgment.reference import canonical
from cpdoctor.launch import watcher_comm


@dataclass(frozen=True)
class Gradients:
    """The flat gradients of the trainable parameters, in `names` order."""

    names: tuple[tuple[str, int], ...]
    """(canonical name, numel) of each trainable parameter."""
    flat: Any
    missing: tuple[str, ...] = ()
    """Trainable parameters without a gradient (read as zeros)."""

    @property
    def param_names(self) -> list[str]:
        return [n for n, _ in self.names]

    @property
    def numels(self) -> list[int]:
        return [k for _, k in self.names]

    def by_name(self) -> dict[str, Any]:
        """Each parameter's gradient (a flat view of `flat`; a missing one as zeros)."""
        out, offset = {}, 0
        for name, n in self.names:
            out[name] = self.flat[offset : offset + n]
            offset += n
        return out


def trainable(module: Any) -> list[tuple[str, Any]]:
    """(canonical name, parameter) of every parameter that requires a gradient, in the model's order."""
    return [(canonical(n), p) for n, p in module.named_parameters() if p.requires_grad]


def gather_grads(module: Any) -> Gradients:
    """Every trainable parameter's gradient now, flat (FSDP2's gathered whole on every rank)."""
    import torch

    params = trainable(module)
    flat = torch.empty(sum(p.numel() for _, p in params))  # filled in place: no second whole copy
    names, missing, offset = [], [], 0
    for name, p in params:
        n = p.numel()
        if p.grad is None:
            missing.append(name)
            flat[offset : offset + n] = 0
        else:
            flat[offset : offset + n] = watcher_comm.full_tensor(p.grad.detach()).reshape(-1)
        names.append((name, n))
        offset += n
    return Gradients(tuple(names), flat, tuple(missing))


def unclipped(grads: Gradients, coefficients: Mapping[int, float], parts: Mapping[int, Any]) -> Gradients:
    """`grads` as before the step's norm clips: parameter i's slice divided by `coefficients[i]` (what its clips
    multiplied it by), or replaced by `parts[i]` (its gradient as an optimizer step inside backward found it). A new
    flat vector only when something changes; `grads` itself is left as it is."""
    divide = {i: c for i, c in coefficients.items() if c != 1.0 and c > 0}
    if not divide and not parts:
        return grads
    flat, offset = grads.flat.clone(), 0
    for i, (_, n) in enumerate(grads.names):
        if i in parts:
            flat[offset : offset + n] = parts[i]
        elif i in divide:
            flat[offset : offset + n] /= divide[i]
        offset += n
    replaced = {grads.names[i][0] for i in parts}
    return Gradients(grads.names, flat, tuple(m for m in grads.missing if m not in replaced))
