"""From a CP group's step numbers and events to a finding: a table of rules over measured relations and observed
events (judging.Rule), each with its remedy. The rules never know which fault was injected; they read what the
numbers say (inputs that differ between CP peers, output gradients that differ and not as a per-shard loss's,
gradients that differ between peers after the sync, RNG states that part) and what the events say a correct step's
gradients are (factors.py) under every reading of the numbers whose meaning only their value tells.

One run FAILs only on what it observed: inputs that differ between CP peers, losses that differ between them,
gradients that differ between them after the sync or between the data-parallel replicas, a uniform factor that is
wrong under every reading and that the reductions it watched make, and a non-uniform error when nothing the watcher
saw but could not read can explain it (then the attention is named). A verdict that rests on a reading (a literal
equal to a power of the degrees, a loss it could not read through) is at most a WARN naming the reading and the
two-run command that decides. Two runs compare with the same code without CP: any uniform factor that is a power
of the degrees FAILs there.

Tolerance. The expected gradients come from one process; a correct fp32 CP step lands ~1e-7–1e-6 from them
on the tiny models (docs/FACTS.md), the defects this examination exists for at 1e-2 and beyond, or at an exact
factor. The tolerance is fixed per dtype the step computed in (`DType.grad_tolerance`; under autocast the
autocast dtype), or BASELINE_SLACK × the same step without CP in its own dtypes for bf16/fp16. A parameter
whose own error is PARAM_SLACK× the tolerance fails the step even when the total is within it. A step the
optimizer skips is not examined. RNG states that part while the gradients are right are a WARN."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import product

from cpdoctor.examinations.judging import RING_UNDER_CHECKPOINTING, Aspect, CrashSignature, Rule, diagnosis_of, spoken_rules
from cpdoctor.examinations.step.judgment.factors import MAX_READINGS, Expectation, Outcome, Power, degree_powers, power_of
from cpdoctor.examinations.step.judgment.input_layouts import Placement
from cpdoctor.examinations.step.judgment.measure import ParamError, RankGrad, StepNumbers
from cpdoctor.report import Finding, JudgedRow, TensorRow, Verdict
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

SEED_REMEDY = (
    "give every rank of a CP group the same inputs: seed noise and timesteps by the data-parallel rank "
    "(e.g. torch.Generator().manual_seed(seed + dp_rank)), never by the global rank"
)
LOSS_REMEDY = "compute the loss on the full (gathered) model output, identically on every CP rank"
SHARD_LOSS_REMEDY = (
    "compute the loss on the full gathered output on every CP rank (diffusers' _cp_plan gathers it), or normalise "
    "each shard's loss by the full token count"
)
CP_SUM_REMEDY = (
    "sum the parameter gradients over the CP group after backward (dist.all_reduce(p.grad, op=SUM, group=cp_group), "
    "the group of the model's CP mesh), then average over the data-parallel ranks only; or multiply the loss by cp "
    "where a reduction averages over the CP ranks (DDP or FSDP over a mesh that includes them)"
)
DP_REMEDY = "average the gradients over the data-parallel ranks (DDP over the data-parallel group, or all_reduce then divide by dp)"
ATTENTION_REMEDY = "cpdoctor.patch() before the first step (cpdoctor.preflight(...) does it when the fix is exact)"
RNG_REMEDY = (
    "make every CP rank draw the same random numbers in the same order (same generator seeded by the data-parallel "
    "rank; no rank-only draws such as dropout or logging samples between seeding and the step); `cpdoctor env` "
    "measures whether the attention op itself consumes RNG"
)
TWO_RUNS_REMEDY = (
    "two runs decide, with the same code without CP and with it (nothing read): `cpdoctor step path/to/train.py:fn{layout}` "
    "with a function that takes its degrees, or `cpdoctor step{layout} -- <your launch command>`"
)
LAYOUT_SCALE_REMEDY = (
    "look for a scaling of the loss or of the gradients that depends on the layout (a division by the world size or by "
    "this rank's token count): the same code without CP does not apply it"
)
LOSS_SCALE_REMEDY = (
    "or tell the watcher the loss's factor of the degrees: watch_step(model, loss_scale=...) or preflight(model=..., loss_scale=...)"
)
SKIP_REMEDY = "nothing to do for this step: the next step the optimizer takes is examined (preflight's armed watch re-arms)"


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


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def _skip_text(s: StepSignature) -> str:
    return f"not examined: {s.skipped}"


def _inputs_text(s: StepSignature) -> str:
    judged = s.n.inputs_judged
    if judged is not None and judged.by_layout:
        wrong = "; ".join(d.detail or f"{d.name}: rank {_ranks(d.different)}" for d in s.n.inputs_differ)
        right = ", ".join(g.describe() for g in judged.right())
        text = (
            f"the model's inputs are not what the run without CP fed it (its rank {judged.against}; each CP rank's input "
            f"must equal that run's, or be this rank's shard of it along a sequence dimension): {wrong}"
        ) + (f"; right: {right}" if right else "")
    else:
        parts = [f"{d.name} on rank {_ranks(d.different)} (rank {_ranks(d.same_as_first)} had another)" for d in s.n.inputs_differ]
        text = "the model's inputs differ between CP peers, which must all feed the same full inputs: " + "; ".join(parts)
        if judged is not None:  # two runs, and no peer fed what a rank of the run without CP did: the peers compared
            text = (
                "no CP rank fed the model what a rank of the run without CP did (its data depend on the layout), and the "
                "inputs every peer feeds whole differ between the CP peers: " + "; ".join(parts)
            )
    if len(s.n.rng_before_groups) > 1:
        text += (
            "; their RNG states differed already before the step (ranks "
            + " | ".join(_ranks(g) for g in s.n.rng_before_groups)
            + "): the random draws were seeded per rank"
        )
    return text


def _shard_text(s: StepSignature) -> str:
    return (
        f"each CP rank's loss covers only its own shard of the gathered output (the output gradient of rank "
        f"{_ranks(s.n.ranks)} is zero outside its own chunk)"
    )


def _out_grad_text(s: StepSignature) -> str:
    return (
        f"the gradient flowing into the model's output differs between CP peers (rank {_ranks(s.n.out_grad_differ)} against "
        f"rank {s.n.ranks[0]}, relative difference up to {s.n.out_grad_spread:.2g}): the loss is computed differently on "
        "each rank (different targets, weights or normalisation)"
    )


def _peers_text(s: StepSignature) -> str:
    text = (
        f"the parameter gradients differ between CP peers after the sync (relative difference up to {s.n.peer_spread:.2g}): "
        f"the reduction over the CP group (ranks {_ranks(s.n.ranks)}) is missing; each rank holds the gradient of its own tokens"
    )
    if s.n.sum_rel_err <= s.tol:
        text += f"; summed over the CP group they are the expected gradients (rel err {s.n.sum_rel_err:.2g})"
    else:
        text += f"; even summed over the CP group they are off (rel err {s.n.sum_rel_err:.2g})"
    return text


def _dp_text(s: StepSignature) -> str:
    return (
        f"each CP group ends with the gradients of its own data only (rank {s.n.ranks[0]}: {s.n.own_rel_err:.2g} from its group's "
        f"reference, {s.worst.rel_err:.2g} from the mean over the {s.n.dp} data-parallel groups): the averaging over the "
        "data-parallel ranks is missing"
    )


def _seen(s: StepSignature) -> str:
    """What the watcher saw that makes the factor: the loss's factors of the degrees and the reductions."""
    parts = []
    if s.n.recomputed:
        r = s.e.readings
        power = r.certain_power
        if power is not None and power != 1.0:
            p = power_of(power, degree_powers(s.n.ring, s.n.ulysses, s.n.dp))
            parts.append(f"the loss carries {p.text + ' = ' if p else ''}{power:g}")
        elif power is not None:
            parts.append("the loss carries no factor of the degrees")
        parts += list(r.notes)
    made = [r.text for r in s.e.reductions]
    parts.append("the gradients went through " + "; ".join(made) if made else "no reduction of the gradients was seen")
    if s.e.unobserved:
        parts.append("not readable: " + "; ".join(s.e.unobserved))
    return "; ".join(parts)


def _factor_text(s: StepSignature) -> str:
    p = s.power
    assert s.off is not None
    f = s.candidate
    cause = f": {f.cause}" if f is not None else ""
    said = (
        "these events make it"
        if s.explained
        else "a scaling of the gradients the watcher did not see makes part of it (a manual division, a comm hook, a reduction inside a compiled region)"
    )
    name = f.text if f is not None else p.text if p is not None else ""  # cp^a · dp^b where one fits
    factor = f"factor {name} = {p.value:g} at {s.layout}" if p is not None else f"at {s.layout}"
    text = f"every rank's gradients are exactly {s.off:.4g}× what one process computes ({factor}; residual {s.worst.residual:.2g})"
    if len(s.readings) > 1:
        others = ", ".join(f"{s.worst.factor / e:.4g}×" for _, e in s.readings[1:] if e is not None)
        read = "; ".join(lit.both_ways() for lit in s.e.readings.literals)
        text += (
            f" if every number read is a weight of the step's own, and {others} under the other readings ({read}): wrong under every one"
        )
    return f"{text}; the watcher saw: {_seen(s)}; {said}{cause}"


def _factor_remedy(s: StepSignature) -> str:
    f = s.candidate
    if f is not None:
        return f.remedy
    return CP_SUM_REMEDY


def _reading(s: StepSignature, outcome: Outcome) -> str:
    """One reading, in words: what each literal is taken as."""
    said = [f"{lit.text} is {lit.meaning(r)}" for lit, r in zip(s.e.readings.literals, outcome.readings)]
    return (
        " and ".join(said) if len(said) <= 3 else f"{sum(map(bool, outcome.readings))} of its {len(said)} numbers are powers of the degrees"
    )


def _reading_text(s: StepSignature) -> str:
    """One run, a uniform factor that is not wrong on what the watcher observed: what the verdict rests on."""
    r = s.e.readings
    head = f"every rank's gradients are exactly {s.worst.factor:.4g}× the gradients of the loss as computed here (residual {s.worst.residual:.2g})"
    if all(e is None for _, e in s.readings):
        why = "; ".join(r.unknown) or (
            f"more than {MAX_READINGS} readings of its numbers"
            if len(s.readings) == 1 and r.literals
            else "the loss's terms carry different factors of the degrees under every reading"
        )
        body = f"what one process computes cannot be read: {why}"
    elif s.folded and s.wrong_everywhere:
        folds = ", ".join(r.folds)
        body = (
            f"{s.off:.4g}× what one process computes if {folds} is a weight of the step's own, which one process applies "
            f"too; right if it folds that factor in (a number written with the degrees, as `loss * cp / n` is): only its "
            f"value could tell"
        )
    elif s.wrong_everywhere:
        ev = s.e.events_factor
        unread = f"; not read: {'; '.join(s.unread)}" if s.unread else ""
        body = (
            f"under every reading it is wrong ({s.off:.4g}× what one process computes with every number a weight), but "
            f"the reductions the watcher saw make {ev:.4g}×, not that{unread}: what it could not see may be the step's own scaling"
        )
    else:
        right = [o for o, e in s.readings if s.right_under(e)]
        wrong = [(o, e) for o, e in s.readings if e is not None and not s.right_under(e)]
        body = "whether that is right rests on reading " + "; ".join(lit.both_ways() for lit in r.literals)
        if right:
            body += f": right if {_reading(s, right[0])}"
        if wrong:
            o, e = wrong[0]
            body += f"; {s.worst.factor / e:.4g}× what one process computes if {_reading(s, o)}"
        if any(e is None for _, e in s.readings):
            body += "; under the other readings the loss's terms carry different factors of the degrees"
    return f"{head}: {body}; the watcher saw: {_seen(s)}"


def _reading_remedy(s: StepSignature) -> str:
    """The two runs at this job's degrees, and `loss_scale=` where the loss is what is read."""
    r = s.e.readings
    on_loss = any(lit.on_loss for lit in r.literals) or bool(r.unknown) or bool(r.folds)
    return TWO_RUNS_REMEDY.format(layout=s.switches) + (f"; {LOSS_SCALE_REMEDY}" if on_loss and s.n.recomputed else "")


def _unseen_text(s: StepSignature) -> str:
    return (
        f"every rank's gradients are exactly {s.off:.4g}× what one process computes (residual {s.worst.residual:.2g}), a "
        f"factor that is no power of this job's degrees ({s.layout}): if the step scaled them by it on purpose where the "
        f"watcher cannot see (a manual clip or unscaling), the step is right, otherwise not; the watcher saw: {_seen(s)}"
    )


def attention_command(s: StepSignature) -> str:
    """The op-level `cpdoctor check` command at this job's CP degrees."""
    from cpdoctor.examinations.commands import OpLayout, check_command

    dtype = s.n.dtype if s.n.dtype in DType.examined() else DType.FP32
    return check_command(OpLayout(ring=s.n.ring, ulysses=s.n.ulysses, dtype=dtype))  # the default seq: no --seq


@dataclass(frozen=True)
class AttentionCrash:
    """A crash of diffusers' CP attention that a watched step raises: the attention's defect, not the step's, and
    the `cpdoctor check` switches that show it alone at the job's degrees."""

    signature: CrashSignature
    checkpointing: bool = False


ATTENTION_CRASHES: tuple[AttentionCrash, ...] = (AttentionCrash(RING_UNDER_CHECKPOINTING, checkpointing=True),)
"""The known crashes of diffusers' CP attention a user's training step meets (docs/FACTS.md)."""


def attention_crash(tracebacks: dict[int, str]) -> AttentionCrash | None:
    """The first known crash of diffusers' CP attention the ranks' tracebacks show (None: the step's own error)."""
    text = "\n".join(tracebacks.values())
    return next((c for c in ATTENTION_CRASHES if c.signature.matches(text)), None)


def crash_command(crash: AttentionCrash, ring: int, ulysses: int) -> str:
    """The op-level `cpdoctor check` command that raises the same crash alone, at the job's CP degrees."""
    from cpdoctor.examinations.commands import OpLayout, check_command

    return check_command(OpLayout(ring=ring, ulysses=ulysses, checkpointing=crash.checkpointing))  # the default seq: no --seq


def _attention_text(s: StepSignature) -> str:
    fwd = "forward wrong too" if not s.n.out_rel_err <= s.tol else "forward exact"
    worst = max(s.n.grads, key=s.rank_error)
    text = (
        f"inputs, loss and reduction are right (peers agree, no constant factor) but the gradients are wrong: "
        f"worst rank {worst.rank} rel err {s.rank_error(worst):.2g} (tolerance {s.tol:.2g}, {s.n.dtype}"
    )
    if s.bad_params and not s.bad_ranks:
        p = max(s.bad_params, key=lambda q: q.rel_err)
        text += f"; within it in total, but parameter {p.name} is {p.rel_err:.2g}, over {PARAM_SLACK:g}× its tolerance"
    return (
        text + f"; {fwd}: out {s.n.out_rel_err:.2g}): the model's CP path, most often the attention; the op-level check at "
        f"this job's degrees: `{attention_command(s)}`"
    )


def _unread_text(s: StepSignature) -> str:
    worst = max(s.n.grads, key=s.rank_error)
    return (
        f"the gradients are {s.rank_error(worst):.2g} from the recomputed reference and not by one factor (tolerance "
        f"{s.tol:.2g}), but the watcher saw what it could not read, which can make that: {'; '.join(s.unread)}; the "
        f"attention is named only when nothing else can explain an error (`{attention_command(s)}` examines it alone)"
    )


def first_bad_param(s: StepSignature) -> ParamError | None:
    """The first parameter, in the model's order, whose gradient leaves the tolerance (after the uniform factor)."""
    return next((p for p in s.n.params_scaled or s.n.params if not p.rel_err <= s.tol), None)


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to the first numeric part (`transformer_blocks.0`), or its
    top-level module (`x_embedder`)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _where_text(s: StepSignature) -> str:
    first = first_bad_param(s)
    worst = max(s.n.params_scaled or s.n.params, key=lambda p: p.rel_err, default=None)
    if first is None or worst is None:
        return ""
    return f"first bad parameter {first.name} ({first.rel_err:.2g}) in block {block_of(first.name)}; worst parameter {worst.name} ({worst.rel_err:.2g})"


def _rng_text(s: StepSignature) -> str:
    return (
        f"the RNG states differ between CP peers after the step although they agreed before it: rank "
        f"{_ranks(s.rng_consumers)} consumed random numbers its peers did not; harmless while the gradients are right, but "
        "every later draw from that generator (the next step's noise and timesteps, dropout) will differ between them"
    )


def _gradients_wrong(s: StepSignature) -> bool:
    return (s.grads_bad and s.off is None) or bool(s.bad_params)


@dataclass(frozen=True)
class StepRule(Rule[StepSignature]):
    """One line of the step's diagnosis (a judging.Rule: when `applies`, say `says`, offer `remedies` and
    `remedy_of`'s; the first that applies of each aspect speaks), with the `verdict` it gives; `names_attention`
    makes the finding carry the op-level `cpdoctor check` command."""

    verdict: Verdict = Verdict.FAIL
    names_attention: bool = False
    decides: bool = True
    """False for a line that only adds where or why (the first bad block, the per-shard loss): it never sets the
    verdict alone."""


# fmt: skip on this table: one rule a line reads as a table (condition, text, remedy, verdict); the formatter
# would spread each rule over five lines and the table over sixty.
RULES: tuple[StepRule, ...] = (
    StepRule(Aspect.CAUSE, "not examined", lambda s: s.skipped is not None, _skip_text, (SKIP_REMEDY,), verdict=Verdict.UNSUPPORTED),
    StepRule(Aspect.CAUSE, "inputs differ between CP peers", lambda s: bool(s.n.inputs_differ), _inputs_text, (SEED_REMEDY,)),
    StepRule(Aspect.CAUSE, "loss differs per rank", lambda s: s.loss_differs, _out_grad_text, (LOSS_REMEDY,)),
    StepRule(Aspect.CAUSE, "CP reduction missing", lambda s: s.peers_differ, _peers_text, (CP_SUM_REMEDY,)),
    StepRule(Aspect.CAUSE, "DP averaging missing", lambda s: s.dp_missing, _dp_text, (DP_REMEDY,)),
    StepRule(Aspect.CAUSE, "wrong under every reading", lambda s: s.n.recomputed and s.wrong_everywhere and s.observed and not s.folded, _factor_text, remedy_of=_factor_remedy),
    StepRule(Aspect.CAUSE, "rests on a reading", lambda s: s.n.recomputed and s.off is not None, _reading_text, remedy_of=_reading_remedy, verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "factor of the degrees", lambda s: s.power is not None, _factor_text, remedy_of=_factor_remedy),
    StepRule(Aspect.CAUSE, "unseen scale", lambda s: s.off is not None, _unseen_text, (LAYOUT_SCALE_REMEDY,), verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "seen, not read", lambda s: _gradients_wrong(s) and bool(s.unread), _unread_text, remedy_of=_reading_remedy, verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "gradients wrong", _gradients_wrong, _attention_text, (ATTENTION_REMEDY,), names_attention=True),
    StepRule(Aspect.SHARD, "per-shard loss", lambda s: s.n.out_grad_own_shard and s.off is not None, _shard_text, (SHARD_LOSS_REMEDY,), decides=False),
    StepRule(Aspect.RNG, "RNG consumed unevenly", lambda s: s.rng_parted, _rng_text, (RNG_REMEDY,), verdict=Verdict.WARN),
    StepRule(Aspect.WHERE, "first bad parameter", lambda s: s.grads_bad and s.only_gradients_wrong, _where_text, decides=False),
)  # fmt: skip


def spoken(s: StepSignature) -> list[StepRule]:
    """The first applying rule of each aspect, in table order; a step that is not examined says nothing else."""
    rules = spoken_rules(RULES, s)
    return rules[:1] if rules and rules[0].verdict is Verdict.UNSUPPORTED else rules


def verdict_of(rules: list[StepRule]) -> Verdict:
    """UNSUPPORTED when the step is not examined, FAIL when a rule that fails spoke, WARN when only warnings did
    (lines that do not decide aside)."""
    verdicts = {r.verdict for r in rules if r.decides}
    for verdict in (Verdict.UNSUPPORTED, Verdict.FAIL, Verdict.WARN):
        if verdict in verdicts:
            return verdict
    return Verdict.PASS


def rows(s: StepSignature) -> dict[str, JudgedRow]:
    """The finding's rows: the output (forward; only where the reference recomputed it), the parameter gradients
    (worst rank, every rank, against what one process computes; the no-CP column is the same-dtype baseline where
    one was measured) and the worst parameter (after the uniform factor, against its own tolerance)."""
    tol = s.tol
    table = {}
    if math.isfinite(s.n.out_rel_err):
        out = TensorRow(s.n.out_rel_err, s.n.out_max_abs, 0, worst_rank=s.n.ranks[0])
        table["out"] = JudgedRow.judged(out, tol, (), Verdict.PASS if s.n.out_rel_err <= tol else Verdict.FAIL)
    worst = max(s.n.grads, key=s.rank_error)
    grads = TensorRow(
        s.rank_error(worst),
        worst.max_abs,
        s.nonfinite,
        worst_rank=worst.rank,
        per_rank_rel_err=tuple(s.rank_error(g) for g in s.n.grads),
        baseline_rel_err=s.n.baseline_rel_err,
    )
    table["grads"] = JudgedRow.judged(grads, tol, s.bad_ranks, Verdict.FAIL if s.grads_bad else Verdict.PASS)
    params = s.n.params_scaled or s.n.params
    if params:
        i, worst_param = max(enumerate(params), key=lambda ip: ip[1].rel_err / s.param_tol(ip[0]))
        row = TensorRow(worst_param.rel_err, worst_param.max_abs, 0, name=worst_param.name, numel=worst_param.numel)
        ok = worst_param.rel_err <= s.param_tol(i)
        table["worst_param"] = JudgedRow.judged(row, s.param_tol(i), (), Verdict.PASS if ok else Verdict.FAIL)
    return table


def describe(n: StepNumbers) -> str:
    return f"training step, CP group ranks {_ranks(n.ranks)} (ring {n.ring} × Ulysses {n.ulysses}, dp {n.dp}, {n.dtype})"


def _pass_text(s: StepSignature) -> str:
    worst = max(s.n.grads, key=s.rank_error)
    notes = []
    if s.n.recomputed:
        power = s.e.readings.certain_power
        read = "; ".join(s.e.readings.notes)
        if power is not None and power != 1.0:
            p = power_of(power, degree_powers(s.n.ring, s.n.ulysses, s.n.dp))
            notes.append(f"the loss carries {power:g} = {p.text if p else power} ({read}), which the step's reductions make up for")
        elif read:
            notes.append(read)
    notes += [x for x in (s.e.scaler_text, s.e.clip_text, s.e.inner_text) if x]
    if s.unread:
        notes.append(f"not read, the gradients match regardless: {'; '.join(s.unread)}")
    said = f" ({'; '.join(notes)})" if notes else ""
    out = f"; out {s.n.out_rel_err:.2g}" if math.isfinite(s.n.out_rel_err) else ""
    inputs = "same inputs and loss on every CP peer"
    judged = s.n.inputs_judged
    if judged is not None and judged.by_layout and any(g.placement is Placement.SHARD for g in judged.inputs):
        shards = ", ".join(g.name for g in judged.inputs if g.placement is Placement.SHARD)
        inputs = f"inputs the run without CP's ({shards} as each rank's shard, the rest replicated), the loss the same"
    return (
        f"the step matches {s.n.reference}: {inputs}, gradients reduced right{said} "
        f"(worst rank rel err {s.rank_error(worst):.2g}, tolerance {s.tol:.2g} for {s.n.dtype}{out}), RNG states in step"
    )


def step_finding(n: StepNumbers, expectation: Expectation | None = None, evidence: object = None) -> Finding:
    """The finding of one CP group's step."""
    s = StepSignature(n, expectation or Expectation())
    rules = spoken(s)
    verdict = verdict_of(rules)
    if verdict is Verdict.PASS:
        return Finding(describe(n), verdict, _pass_text(s), "", rows(s), evidence=evidence)
    diagnosis, remedy = diagnosis_of(rules, s)
    command = attention_command(s) if verdict is Verdict.FAIL and any(r.names_attention for r in rules) else None
    return Finding(describe(n), verdict, diagnosis, remedy, rows(s), evidence=evidence, command=command)
