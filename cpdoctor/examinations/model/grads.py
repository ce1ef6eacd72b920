"""Parameter gradients as one flat fp32 vector (a large model never holds them twice), and their errors against
the reference, per parameter and all together, accumulated a chunk at a time in fp64."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cpdoctor.report import Comparison, ParamRow


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in the flat gradient vector: its name, size, and whether it got a gradient."""

    name: str
    numel: int
    has_grad: bool


ParamLayout = list[ParamSlot]


def flat_grads(model: Any) -> Any:
    """All parameter gradients in named_parameters order, flattened into one fp32 CPU vector (zeros where a
    parameter got none). Each parameter's gradient is dropped once copied, so a large model never holds its
    gradients twice."""
    import torch

    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)  # pages touched only as filled
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is not None:
            flat[offset : offset + n].copy_(p.grad.detach().reshape(-1))
            p.grad = None
        else:
            flat[offset : offset + n].zero_()
        offset += n
    return flat


class ErrorSum:
    """Relative L2 error, max abs error and non-finite count of one vector against a reference, accumulated a
    chunk at a time in fp64 (`measurement.compare`, for vectors too long to copy into fp64 at once)."""

    def __init__(self) -> None:
        self.sq = self.ref_sq = self.max_abs = 0.0
        self.nonfinite = 0

    def add(self, x: Any, rd: Any, ref_sq: float) -> None:
        """Add the chunk `x` against the fp64 reference chunk `rd` (whose squared norm is `ref_sq`)."""
        import torch

        finite = torch.isfinite(x)
        if bool(finite.all()):
            diff = x.double() - rd
        else:
            self.nonfinite += int((~finite).sum())
            diff = torch.where(finite, x.double() - rd, torch.zeros_like(rd))
        self.sq += float(torch.dot(diff, diff))
        self.ref_sq += ref_sq
        if diff.numel():
            self.max_abs = max(self.max_abs, float(diff.abs().max()))

    def absorb(self, part: ErrorSum, sq: float, nonfinite: int, ref_sq: float) -> None:
        """Add what `part` gained in its last `add` (its squared error `sq` and `nonfinite` since then)."""
        self.sq += sq
        self.nonfinite += nonfinite
        self.ref_sq += ref_sq
        self.max_abs = max(self.max_abs, part.max_abs)

    def result(self) -> Comparison:
        denom = math.sqrt(self.ref_sq) or 1.0
        return Comparison(math.sqrt(self.sq) / denom if not self.nonfinite else float("inf"), self.max_abs, self.nonfinite)


CHUNK = 1 << 22


@dataclass(frozen=True)
class GradErrors:
    """The CP gradients against the reference: per parameter, all of them together, and the no-CP baseline's
    all together (None without a baseline)."""

    params: dict[str, ParamRow]
    total: Comparison
    baseline_total: Comparison | None


def grad_errors(cp: Any, base: Any | None, ref: Any, layout: ParamLayout, ref_layout: ParamLayout) -> GradErrors:
    """One pass over the flat vectors: each reference chunk is converted to fp64 once and serves both the CP
    gradients and the no-CP baseline's."""
    import torch

    params: dict[str, ParamRow] = {}
    total_cp, total_base = ErrorSum(), None if base is None else ErrorSum()
    offset = 0
    for slot, ref_slot in zip(layout, ref_layout):
        mine, theirs = ErrorSum(), None if base is None else ErrorSum()
        for i in range(offset, offset + slot.numel, CHUNK):
            j = min(i + CHUNK, offset + slot.numel)
            rd = ref[i:j].double()
            rsq = float(torch.dot(rd, rd))
            for acc, whole, vec in ((mine, total_cp, cp), (theirs, total_base, base)):
                if acc is None or whole is None:
                    continue
                sq, nonfinite = acc.sq, acc.nonfinite
                acc.add(vec[i:j], rd, rsq)
                whole.absorb(acc, acc.sq - sq, acc.nonfinite - nonfinite, rsq)
        offset += slot.numel
        if ref_slot.has_grad:
            c = mine.result()
            baseline = None if theirs is None else theirs.result().rel_err
            params[slot.name] = ParamRow(c.rel_err, c.max_abs, c.nonfinite, slot.numel, math.sqrt(mine.ref_sq), baseline)
    return GradErrors(params, total_cp.result(), None if total_base is None else total_base.result())


def param_layout(model: Any) -> ParamLayout:
    """(name, numel, got a gradient) per parameter, in the order of flat_grads (taken after the backward and
    before flat_grads drops the gradients)."""
    return [ParamSlot(n, p.numel(), p.grad is not None) for n, p in model.named_parameters()]
