"""Parameter gradients as full tensors under their bare names, whatever holds them: a plain tensor, FSDP2's
sharded DTensor (gathered whole: `full_tensor()`, a collective over its mesh, launch/watcher_comm.py's), or a
module that wrappers renamed (torch's checkpoint_wrapper, torch.compile, FSDP1: reference.canonical strips the
segments they insert). Two runs are compared on these: name by name, full tensor against full tensor.

`full_gradients` runs on every rank (the gathers are collectives); `compare` is pure."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.watcher.grads import gather_grads, trainable


def full_gradients(module: Any) -> dict[str, Any]:
    """Every trainable parameter's gradient, whole, float32 on the CPU, keyed by the bare model's name; a trainable
    parameter without a gradient is zeros (as a sum over ranks reads it). Every rank of the parameters' meshes
    must call it (each DTensor is gathered): the examination's own gathering (grads.gather_grads), shaped."""
    shapes = {name: tuple(p.shape) for name, p in trainable(module)}
    return {name: g.reshape(shapes[name]) for name, g in gather_grads(module).by_name().items()}


@dataclass(frozen=True)
class ParamGap:
    """One parameter's gradient against the expected one."""

    name: str
    rel_err: float
    factor: float
    """The c that brings the expected gradient closest to this one (least squares; nan when the expected is 0)."""


@dataclass(frozen=True)
class GradComparison:
    """Gradients (by bare name) against the expected ones: the total relative L2 error, the best uniform factor
    over all parameters, the worst parameter, and the names only one side has."""

    rel_err: float
    factor: float
    worst: ParamGap | None
    params: tuple[ParamGap, ...]
    only_got: tuple[str, ...]
    only_expected: tuple[str, ...]

    @property
    def same_names(self) -> bool:
        return not self.only_got and not self.only_expected


def _gap(name: str, got: Any, ref: Any) -> tuple[ParamGap, float, float, float]:
    g, r = got.double().reshape(-1), ref.double().reshape(-1)
    d2, r2, gr = float((g - r).pow(2).sum()), float(r.pow(2).sum()), float((g * r).sum())
    rel = math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)
    return ParamGap(name, rel, gr / r2 if r2 > 0 else math.nan), d2, r2, gr


def compare(got: dict[str, Any], expected: dict[str, Any]) -> GradComparison:
    """`got` against `expected`, both {bare name: full tensor}; shapes must agree where names do."""
    shared = [n for n in expected if n in got]
    for n in shared:
        if tuple(got[n].shape) != tuple(expected[n].shape):
            raise ValueError(f"{n}: gradient shape {tuple(got[n].shape)} against {tuple(expected[n].shape)} expected")
    gaps, d2, r2, gr = [], 0.0, 0.0, 0.0
    for n in shared:
        gap, a, b, c = _gap(n, got[n], expected[n])
        gaps.append(gap)
        d2, r2, gr = d2 + a, r2 + b, gr + c
    rel = math.sqrt(d2 / r2) if r2 > 0 else (0.0 if d2 == 0 else math.inf)
    worst = max(gaps, key=lambda p: p.rel_err, default=None)
    return GradComparison(
        rel_err=rel,
        factor=gr / r2 if r2 > 0 else math.nan,
        worst=worst,
        params=tuple(gaps),
        only_got=tuple(n for n in got if n not in expected),
        only_expected=tuple(n for n in expected if n not in got),
    )
