"""What a watched step's gradients must be, relative to the one-run reference, computed from the events it was seen
to go through (events.py), never guessed from their values.

The reference R back-propagates the recorded output gradient, which carries every factor the step put on its
loss. One process running the same code computes R / λ, where λ is the part of those factors that comes from the
job's degrees: a constant that is a power of a degree (cp, ring, ulysses, dp: `loss * cp_size`, `loss / cp`,
`loss * (cp / accum)` as one Python factor), or a normaliser that is this rank's shard's count instead of the
full one (`F.mse_loss(shard)`, `shard.sum() / shard.numel()`), compared by value with the output's full and
shard counts. A constant that is not a power of a degree, 1 / the number of micro-batches, 1 / the full count,
GradScaler's scale and accelerate's division are the same in one process. Then, before any clip (its recorded
coefficient divided out, or the gradients captured at its entry), a correct step's final gradients are
R / (λ · T), T the GradScaler scale when it unscaled them.

The reductions the step was seen to make (its collectives' op and group, DDP's averaging, FSDP2's divide factor)
give what the gradients should be if those are all that happened; the judge uses them to name where a factor
comes from. Only the value of a degree is compared, never the size or roundness of a number."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from cpdoctor.examinations.step.events import (
    ClipNorm,
    Collective,
    DDPReduce,
    Event,
    EventLog,
    FSDPReduce,
    GradScale,
    LossFactor,
    LossTerm,
    Op,
    Source,
)
from cpdoctor.examinations.step.group import StepGroup

SAME = 1e-6
"""Relative difference under which two values are one (a Python float of cp / accum against cp / accum)."""


@dataclass(frozen=True)
class Power:
    """A product of the job's degrees' powers (cp, ring, ulysses, dp): what a misplaced reduction or a loss factor
    written with the degrees multiplies by."""

    exponents: tuple[tuple[str, int], ...]
    value: float

    @property
    def text(self) -> str:
        sup = {2: "²", 3: "³"}
        num = [f"{n}{sup.get(e, '')}" for n, e in self.exponents if e > 0]
        den = [f"{n}{sup.get(-e, '')}" for n, e in self.exponents if e < 0]
        return ("·".join(num) or "1") + (f"/{'·'.join(den)}" if den else "")

    @property
    def is_one(self) -> bool:
        return not self.exponents


ONE = Power((), 1.0)


def degree_powers(ring: int, ulysses: int, dp: int) -> tuple[Power, ...]:
    """Every product of the degrees' powers with exponents in -2..2 (at most 3 in all), simplest first, one per
    value (cp before ring and Ulysses, those before dp)."""
    degrees = [("cp", ring * ulysses)]
    if ring > 1 and ulysses > 1:
        degrees += [("ring", ring), ("ulysses", ulysses)]
    if dp > 1:
        degrees.append(("dp", dp))
    degrees = [(n, d) for n, d in degrees if d > 1]
    found: dict[float, Power] = {}
    combos = itertools.product(range(-2, 3), repeat=len(degrees))
    for exps in sorted(combos, key=lambda es: (sum(map(abs, es)), [abs(e) for e in reversed(es)], [-e for e in es])):
        if not any(exps) or sum(map(abs, exps)) > 3:
            continue
        value = math.prod(float(d) ** e for (_, d), e in zip(degrees, exps))
        key = round(math.log(value), 9)
        if value != 1.0 and key not in found:
            found[key] = Power(tuple((n, e) for (n, _), e in zip(degrees, exps) if e), value)
    return tuple(found.values())


def power_of(value: float, powers: tuple[Power, ...]) -> Power | None:
    """The degree power `value` is (None: none is)."""
    if not value > 0:
        return None
    return next((p for p in powers if math.isclose(value, p.value, rel_tol=SAME)), None)


@dataclass(frozen=True)
class Counts:
    """The counts a normaliser is compared with: the output's full counts (elements, tokens × batch, tokens), this
    rank's shard's (each over cp), and the step's micro-batches."""

    full: tuple[int, ...]
    shard: tuple[int, ...]
    micro: tuple[int, ...]
    cp: int = 1

    @classmethod
    def of(cls, shape: tuple[int, ...], gather_dim: int, cp: int, micro: tuple[int, ...]) -> Counts:
        full = set()
        if shape:
            full.add(math.prod(shape))
            if len(shape) > 1:
                full.add(math.prod(shape[:-1]))
            if 0 <= gather_dim < len(shape):
                full.add(shape[gather_dim])
        full.discard(0)
        shard = {k // cp for k in full if cp > 1 and k % cp == 0}
        return cls(tuple(sorted(full)), tuple(sorted(shard)), tuple(sorted({m for m in micro if m > 1})), cp)


@dataclass(frozen=True)
class Reading:
    """What one factor (or a path's normaliser) means: the degree power it carries (ONE: none) and why."""

    power: Power
    why: str


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=SAME)


def read_constant(factor: LossFactor, counts: Counts, powers: tuple[Power, ...], micro_free: bool) -> tuple[Reading, bool]:
    """A constant on the loss: (its reading, whether it used the micro-batch count). The same in one process when it
    is 1, 1/micro-batches, 1/a full count or any number that is no degree power; a degree power otherwise (also
    times 1/micro-batches or 1/a full count: `loss * (cp / accum)`, `sum() * cp / numel`)."""
    a = abs(factor.value)
    v = f"{factor.value:.6g}"
    if factor.source is not Source.CONSTANT and factor.source is not Source.GRADIENT:
        return Reading(ONE, ""), False
    if _same(a, 1.0):
        return Reading(ONE, ""), False
    micro = counts.micro if micro_free else ()
    if any(_same(a, 1 / m) for m in micro):
        return Reading(ONE, f"1/{round(1 / a)}: the mean over the micro-batches"), True
    if any(_same(a, 1 / k) for k in counts.full):
        return Reading(ONE, f"1/{round(1 / a)}: the full output's count"), False
    shard = next((k for k in counts.shard if _same(a, 1 / k)), None)
    if shard is not None:  # a normaliser by this rank's shard's count: one process divides by the full one
        p = power_of(float(counts.cp), powers) or Power((("cp", 1),), float(counts.cp))
        return Reading(p, f"1/{shard}: this rank's shard's count ({shard * counts.cp} / cp)"), False
    for p in powers:
        if _same(a, p.value):
            return Reading(p, f"the constant {v}"), False
        for m in micro:
            if _same(a, p.value / m):
                return Reading(p, f"{v} = {p.text} / {m} micro-batches"), True
        for k in counts.full:
            if _same(a, p.value / k):
                return Reading(p, f"{v} = {p.text} / {k}"), False
    return Reading(ONE, f"{v}: a constant, the same in one process"), False


def read_mean(count: int, counts: Counts, powers: tuple[Power, ...]) -> Reading:
    """A mean over `count` elements: over the full output (the same in one process), over this rank's shard (the
    shards' sum then weighs the loss cp× one process's), or over something else (the same in one process)."""
    if count in counts.full or count not in counts.shard:
        return Reading(ONE, "")
    full = count * counts.cp
    p = power_of(float(counts.cp), powers) or Power((("cp", 1),), float(counts.cp))
    return Reading(p, f"a mean over its own shard ({count} of the output's {full})")


@dataclass(frozen=True)
class TermReading:
    """One term of the loss: the degree power λ its factors carry, and the readings that carry it."""

    power: float
    readings: tuple[Reading, ...]

    @property
    def why(self) -> str:
        return "; ".join(r.why for r in self.readings if not r.power.is_one)


def read_term(term: LossTerm, counts: Counts, powers: tuple[Power, ...]) -> TermReading:
    readings = []
    micro_free = True
    for f in term.factors:
        if f.source is Source.MEAN:
            continue
        reading, used = read_constant(f, counts, powers, micro_free)
        micro_free = micro_free and not used
        readings.append(reading)
    means = [f.count for f in term.factors if f.source is Source.MEAN and f.count]
    if means:
        readings.append(read_mean(math.prod(means), counts, powers))
    return TermReading(math.prod(r.power.value for r in readings), tuple(readings))


@dataclass(frozen=True)
class Reduction:
    """A reduction the step was seen to make, and its factor relative to what a correct step does (a sum over the
    CP ranks and a mean over the data-parallel replicas)."""

    text: str
    factor: float


def reductions(log: EventLog, group: StepGroup, powers: tuple[Power, ...]) -> tuple[tuple[Reduction, ...], float, tuple[str, ...]]:
    """The reductions of the gradients in `log` (DDP's, FSDP2's, the collectives on the first reduced parameter's
    gradient, and the step's own scaling by a power of the degrees: `p.grad /= dp`), the product of the step's own
    scalings that are no power of the degrees (the same in one process: a manual unscaling), and what could not
    be read."""
    found: list[Reduction] = []
    unread: list[str] = []
    own = 1.0
    on_grads = [e for e in log.of(Collective) if e.on_gradients]
    first = on_grads[0].param if on_grads else None
    for e in log.events:
        if isinstance(e, DDPReduce) and e.synced and e.comm_hook is None:
            n = group.replicas_in(e.ranks)
            found.append(Reduction(f"DDP averages over its {len(e.ranks)} ranks ({_span(e.ranks, group)})", n / len(e.ranks)))
        elif isinstance(e, FSDPReduce):
            n = group.replicas_in(e.ranks)
            text = f"FSDP2 sums over its {len(e.ranks)} ranks ({_span(e.ranks, group)}) and divides by {e.divide_factor:g}"
            found.append(Reduction(text, n / e.divide_factor))
        elif isinstance(e, GradScale):
            p = power_of(abs(e.factor), powers)
            if p is None:
                own *= e.factor
            else:
                found.append(
                    Reduction(f"the step's own code scaled the gradients by {e.factor:.4g} = {p.text} (between {e.between})", e.factor)
                )
        elif isinstance(e, Collective) and e.on_gradients and e.param == first:
            n = group.replicas_in(e.ranks)
            span = _span(e.ranks, group)
            if e.op is Op.SUM:
                found.append(Reduction(f"{e.call}(SUM) over ranks {_ranks(e.ranks)} ({span})", float(n)))
            elif e.op is Op.AVG:
                found.append(Reduction(f"{e.call}(AVG) over ranks {_ranks(e.ranks)} ({span})", n / len(e.ranks)))
            else:
                unread.append(f"a {e.op.value} reduction of the gradients over ranks {_ranks(e.ranks)} (its factor is not readable)")
    return tuple(found), own, tuple(unread)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks))


def _span(ranks: tuple[int, ...], group: StepGroup) -> str:
    """What a reduction group is in the job's layout: the CP group, the data-parallel replicas, both, or part."""
    members = set(ranks)
    replicas = group.replicas_in(ranks)
    per = {len(members & set(g)) for g in group.cp_groups if members & set(g)} or {len(members)}
    whole_cp = per == {group.cp}
    if whole_cp and replicas == group.dp and group.dp > 1:
        return "dp × cp: every rank"
    if whole_cp:
        return "the CP group" if replicas == 1 else f"the CP groups of {replicas} replicas"
    if per == {1}:
        return "the data-parallel replicas"
    return f"{max(per)} of the {group.cp} CP ranks" + (f" in {replicas} replicas" if replicas > 1 else "")


@dataclass(frozen=True)
class Expectation:
    """What the step's events say its gradients must be, relative to the recomputed reference (one run), and
    what in them the watcher could not read."""

    loss_power: float = 1.0
    """λ: the degree power on the loss (1: none), read from its terms or said by `loss_scale=`."""
    loss_why: str = ""
    said: bool = False
    """λ was given by the user (`loss_scale=`), not read."""
    scale: float | None = None
    unscaled: float | None = None
    clips: tuple[ClipNorm, ...] = ()
    value_clipped: bool = False
    reductions: tuple[Reduction, ...] = ()
    scaled: float = 1.0
    """What the step's own code scaled the gradients by besides the degrees (a manual unscaling or clip), seen
    between the events: one process does the same."""
    hidden: tuple[str, ...] = ()
    """Why λ may be incomplete: loss nodes whose constants are unreadable, terms whose λ differ."""
    param_paths: bool = False
    """A term of the loss reaches the weights without the output: its gradient is not recomputed."""
    unobserved: tuple[str, ...] = ()
    """Reductions or scales the watcher saw but could not read (a comm hook, a PREMUL_SUM, a failed read)."""
    skipped: str | None = None
    """Why the optimizer skips this step (not examined), None when it does not."""
    per_shard_loss: bool = False

    @property
    def factor(self) -> float:
        """F / R for a correct step: 1 / (λ · the scale it unscaled by), times the step's own scaling that is no
        power of the degrees."""
        return self.scaled / (self.loss_power * (self.unscaled or 1.0))

    @property
    def events_factor(self) -> float:
        """F / R if the seen reductions, scalings and the unscaling are all that happened to the gradients."""
        return math.prod(r.factor for r in self.reductions) * self.scaled / (self.unscaled or 1.0)

    @property
    def clip_text(self) -> str:
        active = [c for c in self.clips if c.active]
        if self.value_clipped:
            return "the step clipped its gradients by value (clip_grad_value_): compared as the clip found them"
        if not active:
            if self.clips:
                c = self.clips[0]
                return f"clip_grad_norm_(max_norm={c.max_norm:g}) did not act (total norm {c.total_norm:.4g})"
            return ""
        c = active[0]
        return (
            f"the step clipped: clip_grad_norm_(max_norm={c.max_norm:g}) multiplied the gradients by {c.coefficient:.4g} "
            f"(their total norm was {c.total_norm:.4g}); compared before the clip"
        )

    @property
    def scaler_text(self) -> str:
        if self.unscaled:
            return f"unscaled by the GradScaler's scale {self.unscaled:g} before the gradients were read"
        if self.scale:
            return f"still scaled by the GradScaler's scale {self.scale:g} when the gradients were read (as in one process)"
        return ""


def expectation(
    logs: list[EventLog],
    group: StepGroup,
    out_shape: tuple[int, ...],
    gather_dim: int,
    forwards: int,
    loss_scale: float | None = None,
    per_shard_loss: bool = False,
) -> Expectation:
    """The expectation of one CP group's step from its ranks' event logs (the first rank's first): λ from the
    first rank's backward roots, the scaler and clips from its events, a skip from any rank's."""
    mine = logs[0]
    powers = degree_powers(group.ring, group.ulysses, group.dp)
    roots = [r for r in mine.roots if r.reaches_output]
    counts = Counts.of(out_shape, gather_dim, group.cp, (len(roots), forwards))
    readings = [read_term(t, counts, powers) for r in roots for t in r.terms]
    hidden = [h for r in mine.roots for h in r.hidden]
    lambdas = {round(math.log(t.power), 9) for t in readings} if readings else set()
    if len(lambdas) > 1:
        hidden.append(
            "the loss's terms carry different factors of the degrees (" + ", ".join(f"{math.exp(x):.4g}" for x in sorted(lambdas)) + ")"
        )
    power, why = (readings[0].power, readings[0].why) if len(lambdas) == 1 else (1.0, "")
    said = loss_scale is not None
    if said:
        power, why = float(loss_scale), f"you said the CP step scales its loss by {loss_scale:g} (loss_scale=)"
    reduced, scaled, unread = reductions(mine, group, powers)
    skipped = _skipped(logs)
    return Expectation(
        loss_power=power,
        loss_why=why,
        said=said,
        scale=mine.scale,
        unscaled=mine.unscaled_by,
        clips=tuple(mine.clips),
        value_clipped=mine.value_clipped,
        reductions=reduced,
        scaled=scaled,
        hidden=tuple(dict.fromkeys(hidden)),
        param_paths=any(r.param_paths for r in mine.roots),
        unobserved=tuple(dict.fromkeys((*unread, *mine.unobserved))),
        skipped=skipped,
        per_shard_loss=per_shard_loss,
    )


def _skipped(logs: list[EventLog]) -> str | None:
    for log in logs:
        if log.found_inf:
            scale = log.scale
            said = f" (scale {scale:g})" if scale else ""
            return f"the GradScaler found inf/NaN in the gradients{said}: it skips this optimizer step"
    return None


def logs_of(events: list[tuple[Event, ...]]) -> list[EventLog]:
    return [EventLog(list(e)) for e in events]
