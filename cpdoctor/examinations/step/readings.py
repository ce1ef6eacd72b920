"""What uniform factor between a watched step's final gradients F and the one-run reference R a healthy step
shows, decided from what the step itself says (docs/STEP.md has the decision and its reasons).

The reference back-propagates the recorded output gradient, which carries every scalar the user's code put on
the loss; the final gradients went through the user's sync, clipping and unscaling. So F = c·R with

- c = 1/s_cp where s_cp is what the CP step scales its loss by that one process would not: `loss * cp_size`
  (NeMo Automodel, SimpleTuner: read from the autograd graph as a constant equal to cp), the user's explicit
  `loss_scale=`, or a per-shard loss that is a mean over its own shard (the shards' sum weighs the loss cp×);
- times 1/T when a GradScaler's scale T (a one-element tensor factor in the graph) was unscaled before the
  gradients were read;
- times max_norm/‖F_unclipped‖ when the gradients were clipped (their total norm is then the max_norm).

Where two readings fit the same numbers (a factor equal to cp that may be a convention or not; a per-shard loss
whose normaliser the graph does not show; a clip that may hide a 1/cp), the judge says both in a WARN. With two
runs (`cpdoctor step`) the reference is the same code without CP: c must be 1, nothing is read."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cpdoctor.examinations.step.measure import StepNumbers


@dataclass(frozen=True)
class LossScale:
    """What the CP step scales its loss by relative to one process (s_cp), and why; `other` is the second
    reading when the step does not say which applies."""

    value: float
    why: str
    other: LossScale | None = None
    confident: bool = False
    """The reading stands when it finds the step right (a constant equal to cp on the loss is the convention's
    signature); otherwise a second reading that finds it right makes the verdict a WARN."""


def loss_scale(n: StepNumbers) -> LossScale:
    """s_cp for this step (1 with two runs: the reference is the same code without CP)."""
    cp = float(n.cp)
    if not n.recomputed:
        return LossScale(1.0, "")
    if n.loss_scale is not None:
        return LossScale(float(n.loss_scale), f"you said the CP step scales its loss by {n.loss_scale:g} (loss_scale=)")
    readings = n.loss
    if n.out_grad_own_shard:
        shard = n.out_numel // n.cp if n.cp else 0
        if readings and all(r.reduction == "mean" and r.count == shard for r in readings):
            return LossScale(
                cp,
                f"each rank's loss is a mean over its own shard ({shard} of the output's {n.out_numel} elements): the sum over the CP ranks weighs the loss cp× what one process computes",
            )
        if readings and all(r.reduction == "sum" or (r.reduction == "mean" and r.count == n.out_numel) for r in readings):
            return LossScale(1.0, "each rank's loss covers its own shard with a normaliser that does not depend on the shard")
        return LossScale(
            1.0,
            "each rank's loss covers its own shard, normalised as one process would (if by the full token count)",
            LossScale(cp, "normalised by the local shard's size (then the sum over the CP ranks weighs the loss cp×)"),
        )
    if cp > 1 and readings and all(any(math.isclose(f, cp) for f in r.constants()) for r in readings):
        return LossScale(
            cp,
            f"the loss was multiplied by {cp:g} = cp before backward (read from the autograd graph: the convention of NeMo Automodel and SimpleTuner, which the mean over the CP ranks cancels)",
            LossScale(1.0, f"a factor {cp:g} on the loss that has nothing to do with CP"),
            confident=True,
        )
    return LossScale(1.0, "")


def grad_scaler_scale(n: StepNumbers) -> float:
    """GradScaler's scale when every backward root was multiplied by the same one-element tensor (1.0 otherwise)."""
    scales = {r.tensor_scale() for r in n.loss}
    return scales.pop() if len(scales) == 1 else 1.0


def round_norm(x: float) -> float | None:
    """The max_norm a clipped gradient's total norm shows: x when it is within 1e-4 of a number with at most two
    significant digits (1.0, 0.5, 0.01, 2.5, ...), else None."""
    if not x > 0 or not math.isfinite(x):
        return None
    exp = math.floor(math.log10(x)) - 1
    candidate = round(x / 10**exp) * 10**exp
    return candidate if abs(x - candidate) <= 1e-4 * candidate else None


@dataclass(frozen=True)
class Harmless:
    """A uniform factor a healthy step shows, and what produces it."""

    factor: float
    why: str


def harmless_factors(n: StepNumbers, s_cp: float) -> tuple[Harmless, ...]:
    """F/R factors that are right for this step under the loss scale s_cp: 1/s_cp, and 1/(s_cp·T) once a
    GradScaler's scale T was unscaled."""
    out = [Harmless(1.0 / s_cp, "")]
    t = grad_scaler_scale(n)
    if t != 1.0:
        out.append(Harmless(1.0 / (s_cp * t), f"unscaled by the GradScaler's scale {t:g} before the gradients were read"))
    return tuple(out)
