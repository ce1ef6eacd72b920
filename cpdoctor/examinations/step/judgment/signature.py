"""A CP group's step numbers read as relations the rules test (StepSignature): the tolerance, the uniform factor and
the candidate causes that make it (Factor, CAUSES), the readings that decide it. Numbers only; the words are
diagnosis.py's and the verdicts judge.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

from cpdoctor.examinations.step.judgment.factors import Expectation, Outcome, Power, degree_powers
from cpdoctor.examinations.step.judgment.measure import ParamError, RankGrad, StepNumbers
from cpdoctor.examinations.step.judgment.remedies import CP_SUM_REMEDY, SHARD_LOSS_REMEDY
from cpdoctor.vocabulary import DType

PARAM_SLACK = 4.0
"""A single parameter fails the step when its own relative error is this many tolerances (its own baseline's
when one was measured): the ring ≥ 3 dK/dV defect shows 0.8 on the worst parameter of tiny Flux while the total
is 2.1e-2, under a bf16 tolerance."""

BASELINE_SLACK = 4.0
"""The tolerance of a bf16/fp16 step is this many times the error of the same step without CP in the same dtypes
(plus eps). flash-attn's rule is 2× for one kernel; across a whole model the chunked attention rounds otherwise
than the whole: a correct LoRA step on a bf16 base measured 0.069 against 0.020 without CP (3.5×), bf16 weights
0.040 against ≤ 0.011, autocast 0.022 against 0.044 (tiny Flux, CP 2, docs/STEP.md)."""


@dataclass(frozen=True)
class Factor:
    """A candidate constant factor: its value, how it is written, and what produces it."""

    value: float
    text: str
    cause: str
    remedy: str


CAUSES = {
    (-1, 0): (
        "the gradients were averaged over the CP ranks instead of summed: a data-parallel wrapper (DDP, FSDP) or an "
        "all_reduce(AVG) over a group that includes the CP ranks, with no factor cp on the loss to make up for it",
        CP_SUM_REMEDY,
    ),
    (1, 0): (
        "the CP ranks' contributions were summed on top of a loss that already weighs each shard at full weight (a "
        "loss normalised by the local shard, or multiplied by cp, then summed over the CP group), or the CP reduction ran twice",
        SHARD_LOSS_REMEDY + "; or reduce over the CP group once, and multiply the loss by cp only where the reduction averages",
    ),
    (0, 1): ("the gradients were summed over the data-parallel replicas instead of averaged", "average over the data-parallel ranks"),
    (0, -1): ("the gradients were averaged over the data-parallel ranks twice", "average over the data-parallel ranks once"),
    (-1, -1): (
        "the gradients were averaged over every rank of the world: over the CP ranks as well as the data-parallel ones",
        CP_SUM_REMEDY,
    ),
    (1, 1): ("the gradients were summed over every rank of the world on top of per-shard losses", SHARD_LOSS_REMEDY),
    (1, -1): ("the gradients were averaged over the data-parallel ranks and scaled by the CP size", CP_SUM_REMEDY),
    (-1, 1): ("the gradients were averaged over the CP ranks and summed over the data-parallel ones", CP_SUM_REMEDY),
}
"""What a misplaced reduction over the CP (a) and data-parallel (b) dimensions multiplies the gradients by: cp^a × dp^b."""


def factor_candidates(cp: int, dp: int) -> tuple[Factor, ...]:
    """cp^a × dp^b for a, b in {-1, 0, 1}, CP first: what a misplaced mean or sum over one of the job's dimensions
    multiplies the gradients by."""
    out = []
    for a, b in sorted(product((-1, 0, 1), repeat=2), key=lambda ab: (abs(ab[1]), abs(ab[0]), -ab[0])):
        if (a, b) == (0, 0) or (b and dp == 1) or (a and cp == 1):
            continue
        value = float(cp) ** a * float(dp) ** b
        if value == 1.0:
            continue
        num = [n for n, e in (("cp", a), ("dp", b)) if e == 1]
        den = [n for n, e in (("cp", a), ("dp", b)) if e == -1]
        text = ("·".join(num) or "1") + (f"/{'·'.join(den)}" if den else "")
        out.append(Factor(value, text, *CAUSES[(a, b)]))
    return tuple(out)


@dataclass(frozen=True)
class StepSignature:
    """The facts of one CP group's step that the rules read: its numbers, and what its events say."""

    n: StepNumbers
    e: Expectation = field(default_factory=Expectation)

    @property
    def tol(self) -> float:
        """The fixed tolerance of the step's dtype, or BASELINE_SLACK × the same-dtype baseline's error (+ eps) when
        one was measured and is larger: what one process makes of the step in bf16/fp16."""
        dtype = DType(self.n.dtype) if self.n.dtype in DType.names() else None
        fixed = dtype.grad_tolerance if dtype is not None else DType.FP32.grad_tolerance
        e = self.n.baseline_rel_err
        return fixed if e is None else max(fixed, BASELINE_SLACK * e + (dtype.eps if dtype is not None else 0.0))

    def param_tol(self, index: int) -> float:
        base = self.n.param_baselines[index] if index < len(self.n.param_baselines) else 0.0
        return PARAM_SLACK * max(self.tol, BASELINE_SLACK * base)

    @property
    def readings(self) -> tuple[tuple[Outcome, float | None], ...]:
        """Every reading of the step, with G / R a correct step shows under it (None: no single number): one run's
        from the events (factors.py); two runs have one, 1 (the reference is the same code without CP)."""
        if not self.n.recomputed:
            return ((Outcome((), 1.0, 1.0), 1.0),)
        return self.e.factors()

    @property
    def nonfinite(self) -> int:
        return sum(g.nonfinite for g in self.n.grads)

    @property
    def skipped(self) -> str | None:
        """Why this step is not examined: the optimizer skips it (GradScaler overflow), or its gradients are not finite."""
        if self.e.skipped:
            return self.e.skipped
        if self.nonfinite:
            return f"{self.nonfinite} gradient values are not finite (NaN/Inf) after the sync: an optimizer step on them is skipped or ruins the weights"
        return None

    @property
    def peers_differ(self) -> bool:
        return not self.n.peer_spread <= self.tol

    @property
    def worst(self) -> RankGrad:
        return max(self.n.grads, key=lambda g: g.rel_err)

    @property
    def factor_tol(self) -> float:
        """How close (relative) a factor must sit to 1 or to a candidate: 10 tolerances, at most 5 % (the factor
        itself is far more precise than the residual around it)."""
        return min(10 * self.tol, 0.05)

    def right_under(self, expected: float | None) -> bool:
        """The worst rank's factor is what a correct step shows under a reading whose G / R is `expected`."""
        return expected is not None and expected > 0 and abs(self.worst.factor / expected - 1) <= self.factor_tol

    @property
    def expected(self) -> float:
        """G / R of a correct step under the reading the numbers are shown against: the first under which the step
        is right, else the first that is a number (every literal a weight), else 1 (against R itself)."""
        known = [e for _, e in self.readings if e is not None]
        return next((e for e in known if self.right_under(e)), known[0] if known else 1.0)

    def ratio(self, g: RankGrad) -> float:
        """A rank's uniform factor against what one process computes."""
        return g.factor / self.expected

    @property
    def uniform(self) -> bool:
        """Every rank's gradients are one constant multiple of the reference's (peers agree, nothing left)."""
        return not self.peers_differ and self.worst.residual <= self.tol and self.worst.factor > 0

    @property
    def right_everywhere(self) -> bool:
        return self.uniform and all(self.right_under(e) for _, e in self.readings)

    @property
    def wrong_everywhere(self) -> bool:
        return self.uniform and all(e is not None and not self.right_under(e) for _, e in self.readings)

    @property
    def off(self) -> float | None:
        """The uniform factor between the step and one process (under the reading shown), when the step is not right
        under every reading."""
        if not self.uniform or self.right_everywhere:
            return None
        return self.ratio(self.worst)

    @property
    def power(self) -> Power | None:
        """The degree power the uniform factor is (a misplaced reduction's signature), None when it is none."""
        r = self.off
        if r is None:
            return None
        for p in degree_powers(self.n.ring, self.n.ulysses, self.n.dp):
            if abs(r - p.value) <= self.factor_tol * p.value:
                return p
        return None

    @property
    def candidate(self) -> Factor | None:
        p = self.power
        if p is None:
            return None
        return next((f for f in factor_candidates(self.n.cp, self.n.dp) if math.isclose(f.value, p.value, rel_tol=1e-9)), None)

    @property
    def explained(self) -> bool:
        """The seen reductions, scalings and unscaling give the measured factor: nothing the watcher missed acted. With
        two runs the factor is against the same code at cp 1, so the reductions alone, or with the loss's literals
        read as degrees (a mean over the shard), may make it: the loss is read against this rank's output, which is
        a shard where the trainer shards it (torchtitan's global token count reads as 1/cp of it), so either counts."""
        c = self.worst.factor
        ev = self.e.events_factor
        made = (ev,) if self.n.recomputed else (ev, ev * self.e.readings.as_degrees)
        return any(x > 0 and abs(c - x) <= self.factor_tol * x for x in made)

    @property
    def unread(self) -> tuple[str, ...]:
        """What the watcher saw but could not read (one run): a comm hook, an unobserved reduction, a loss node it
        cannot read through, a term on the weights; any of them can make a factor or an error the rest does not."""
        return (*self.e.readings.unknown, *self.e.unobserved) if self.n.recomputed else ()

    @property
    def folded(self) -> bool:
        """One run: the uniform factor is one degree (or its inverse) that a number on the loss read as the step's own
        weight could have folded in (`loss * cp / 3` is 0.667 at cp 2): only its value tells, so never a FAIL."""
        if not (self.n.recomputed and self.e.readings.folds and self.off is not None):
            return False
        singles = [p for p in degree_powers(self.n.ring, self.n.ulysses, self.n.dp) if sum(abs(e) for _, e in p.exponents) == 1]
        return any(abs(self.off / p.value - 1) <= self.factor_tol for p in singles)

    @property
    def observed(self) -> bool:
        """One run's uniform factor is wrong on what the watcher observed: the reductions it watched make it and it
        saw nothing it could not read."""
        return self.explained and not self.unread

    def rank_error(self, g: RankGrad) -> float:
        """A rank's error against what one process computes: the factor's distance from the expected one and the
        residual after it."""
        c1 = self.ratio(g)
        return math.sqrt((c1 - 1) ** 2 + (c1 * g.residual) ** 2) if math.isfinite(g.residual) else g.rel_err

    @property
    def bad_ranks(self) -> tuple[int, ...]:
        return tuple(g.rank for g in self.n.grads if not self.rank_error(g) <= self.tol or g.nonfinite)

    @property
    def bad_params(self) -> tuple[ParamError, ...]:
        """Parameters far outside the tolerance on their own (after the uniform factor)."""
        return tuple(p for i, p in enumerate(self.n.params_scaled) if not p.rel_err <= self.param_tol(i))

    @property
    def grads_bad(self) -> bool:
        return bool(self.bad_ranks) or bool(self.bad_params)

    @property
    def dp_missing(self) -> bool:
        """Each data-parallel replica ends with a multiple of its own data's gradient, not of the mean over them."""
        return self.grads_bad and not self.uniform and self.n.own_residual is not None and self.n.own_residual <= self.tol

    @property
    def only_gradients_wrong(self) -> bool:
        """Inputs, loss and reduction right: the peers agree on everything and no constant factor explains the error
        (where naming the first bad parameter and block says something)."""
        return not (self.n.inputs_differ or self.loss_differs or self.peers_differ or self.off is not None or self.dp_missing)

    @property
    def loss_differs(self) -> bool:
        """The peers' output gradients differ and not as the disjoint pieces of a per-shard loss."""
        return self.n.losses_differ

    @property
    def rng_consumers(self) -> tuple[int, ...]:
        """The ranks whose RNG state after the step differs from the largest group of peers (ties: the first
        rank's group is the norm)."""
        groups = self.n.rng_after_groups
        if len(groups) < 2:
            return ()
        norm = max(groups, key=len)
        return tuple(r for g in groups if g is not norm for r in g)

    @property
    def rng_parted(self) -> bool:
        return bool(self.rng_consumers) and len(self.n.rng_before_groups) == 1

    @property
    def layout(self) -> str:
        return f"CP {self.n.cp} (ring {self.n.ring} × Ulysses {self.n.ulysses}) × data-parallel {self.n.dp}"

    @property
    def switches(self) -> str:
        """This job's degrees as `cpdoctor step` switches."""
        out = f" --ring {self.n.ring}" if self.n.ring > 1 else ""
        out += f" --ulysses {self.n.ulysses}" if self.n.ulysses > 1 else ""
        return out + (f" --dp {self.n.dp}" if self.n.dp > 1 else "")
