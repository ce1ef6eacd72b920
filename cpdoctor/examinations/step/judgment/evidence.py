"""What a watched step's report carries besides its rows (JSON `details` and `request`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepEvidence:
    """What a step finding carries besides its rows (JSON `details`)."""

    ranks: tuple[int, ...]
    ring: int
    ulysses: int
    dp: int
    inputs_differ: dict[str, tuple[int, ...]]
    rng_after_groups: tuple[tuple[int, ...], ...]
    out_grad_spread: float
    peer_spread: float
    cp_sum_rel_err: float
    factor: float
    """The worst rank's uniform factor against what one process computes (1 for a correct step)."""
    factor_residual: float
    first_bad_param: str | None
    reference: str
    compute_dtype: str = ""
    forwards: int = 1
    expected_factor: float = 1.0
    """G / R a correct step shows under the reading the rows are judged against (one run; 1 with two runs)."""
    loss_factor: float | None = 1.0
    """The factor of the degrees on the loss (λ) when nothing about it rests on a reading, else None."""
    readings: tuple[str, ...] = ()
    """The numbers whose meaning only their value tells, each with both its readings (one run)."""
    observed: tuple[str, ...] = ()
    """What the one-run watcher observed of the loss and of the step's own gradient scalings, and took as it is."""
    clip_coefficient: float = 1.0
    """The product of the step's norm clips' coefficients (each divided out of the parameters it clipped)."""
    clipped: str = ""
    grad_scaler: float | None = None
    unscaled: bool = False
    reductions: tuple[str, ...] = ()
    not_read: tuple[str, ...] = ()
    """What the watcher saw but could not read (loss nodes it cannot read through, comm hooks, ...)."""
    skipped: str | None = None
    reference_gib: float | None = None
    """The one-process reference's plan on the CP group's first rank (copy + gradients), GiB; None with two runs."""


@dataclass(frozen=True)
class TooLarge:
    """The evidence of a step whose one-process reference was refused by its memory plan (`cpdoctor step` turns
    it into bad input, exit 2; in a training script it is a finding and the job goes on)."""

    plan: str


@dataclass(frozen=True)
class WatchedStep:
    """What a watched step's report says was asked: the layout it ran in and which step it was, against which
    baseline (JSON `request`: `ring`, `ulysses`, `world_size`, `step`, `reference`)."""

    ring: int
    ulysses: int
    world_size: int
    step: int
    reference: str

    def to_dict(self) -> dict[str, Any]:
        return {"ring": self.ring, "ulysses": self.ulysses, "world_size": self.world_size, "step": self.step, "reference": self.reference}
