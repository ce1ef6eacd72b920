"""What a watched step's gradients must be, from the events it was seen to go through (events.py): what was
observed decides a verdict; what only a number's value tells is a reading, which never decides a FAIL.

The one-run reference R back-propagates the recorded output gradient, so every factor the step put on its loss is
in R, and the step's gradients G (before any clip) are c·R when nothing inside the model is wrong. One process
running the same code computes R / λ, times the step's own scalings of its gradients and 1 / T (T the GradScaler's
scale it unscaled by); λ is the part of the loss's factors that comes from the job's degrees.

Observed:
- the reductions of the gradients (`reductions`): DDP's average over its group, FSDP2's divide factor, each
  all_reduce's op and group, the step's own scaling of its gradients by a power of the degrees seen on the tensors
  between two events (`p.grad /= dp`), each relative to the sum over the CP ranks and the mean over the
  data-parallel replicas a correct step takes; with the step's other scalings and 1 / T they are what the events
  say c is;
- each mean on the loss's path and the elements it averaged, with what the CP peers' output gradients are
  (measure.OutGrad): a loss that is the same on every peer averages the same part of the gathered output in one
  process, whatever part (a condition image sliced off, half of a prior-preservation batch); a per-shard loss whose
  mean covers its own shard averages cp× fewer elements than one process does;
- GradScaler's scale and accelerate's division (their nodes are marked), the unscaling.

Read (a `Literal`): a number whose meaning only its value tells: a constant on the loss equal to a power of the
job's degrees (`loss * 2` at cp 2: cp, or a weight?), to one degree over the micro-batches or the output's count
(`loss * cp / accum` as one number), or to 1 / this rank's shard's count; a scaling of the gradients whose value
fits such a count. Each is read every way its value fits, a weight one process applies too or each degree power it
could carry that one process does not (0.25 at dp 2 × cp 2 is 1/(cp·dp), or cp² over a 16-token count);
`Readings.outcomes` gives a correct step's c under every reading, and the judge compares the measured c with each.
A number that is no such power is the same in one process (said in the report, never read as a degree)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from cpdoctor.examinations.step.judgment.measure import OutGrad
from cpdoctor.examinations.step.watcher.events import (
    AccelerateBackward,
    ClipNorm,
    Collective,
    DDPReduce,
    Event,
    EventLog,
    FSDPReduce,
    GradScale,
    InnerStep,
    LossTerm,
    Op,
    Source,
)
from cpdoctor.examinations.step.watcher.group import StepGroup

SAME = 1e-6
"""Relative difference under which two values are one (a Python float of cp / accum against cp / accum)."""

MAX_READINGS = 4096
"""Readings are every combination of the literals' meanings; past this many the loss is not read at all."""


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


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=SAME)


@dataclass(frozen=True)
class Counts:
    """The counts a number is compared with: the output's full counts (elements, tokens × batch, tokens), this
    rank's shard's (each over cp), and the step's micro-batches (its forwards, or accelerate's accumulation)."""

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
class Literal:
    """A number whose meaning only its value tells: on the loss (`on_loss`) or a scaling of the gradients. Read as a
    weight, one process applies `value` too; read as one of `degrees` (a power of the job's degrees, with its
    meaning), one process does not apply that part: `value / degree` on the gradients, the loss divided by it."""

    value: float
    where: str
    degrees: tuple[tuple[float, str], ...]
    weight: str = "a weight of the step's own"
    on_loss: bool = True
    seen: str = ""
    """Where the watcher saw it, said once (a scaling of the gradients: between which events)."""

    @property
    def text(self) -> str:
        return f"the {self.value:.4g} {self.where}"

    def meaning(self, reading: int) -> str:
        """Reading 0 is the weight, reading i the (i-1)th degree power."""
        return self.weight if reading == 0 else self.degrees[reading - 1][1]

    def degree(self, reading: int) -> float:
        return 1.0 if reading == 0 else self.degrees[reading - 1][0]

    def both_ways(self) -> str:
        seen = f" ({self.seen})" if self.seen else ""
        return f"{self.text}{seen} is {', '.join(m for _, m in self.degrees)} or {self.weight}"


def read_number(value: float, counts: Counts, powers: tuple[Power, ...]) -> tuple[tuple[float, str], ...]:
    """Every degree power a number could carry besides being a weight of the step's own (empty: none, it is the same
    in one process; 1 and 1 / the output's own count included): a degree power, such a power over the micro-batches
    or over the output's count, 1 / this rank's shard's count; one meaning per degree value, simplest first."""
    a = abs(value)
    if _same(a, 1.0) or any(_same(a, 1 / k) for k in counts.full):
        return ()
    found: dict[float, str] = {}
    shard = next((k for k in counts.shard if _same(a, 1 / k)), None)
    if shard is not None:
        found[float(counts.cp)] = f"1/{shard}, this rank's shard's count ({shard * counts.cp} / cp)"
    for p in powers:
        meanings = [f"{p.text} = {p.value:.4g}"] if _same(a, p.value) else []
        if sum(abs(e) for _, e in p.exponents) == 1:  # one degree over a count: `loss * cp / accum`, `sum() * cp / numel`
            meanings += [f"{p.text} / {m} micro-batches" for m in counts.micro if _same(a, p.value / m)]
            meanings += [f"{p.text} / {k}" for k in counts.full if _same(a, p.value / k)]
        if meanings and not any(_same(p.value, d) for d in found):
            found[p.value] = meanings[0]
    return tuple(found.items())


def weight_text(value: float, counts: Counts) -> str:
    m = next((m for m in counts.micro if _same(abs(value), 1 / m)), None)
    return f"the mean over its {m} micro-batches" if m else "a weight of the step's own"


@dataclass(frozen=True)
class Term:
    """One path from a backward root to a model output, as the readings see it: the degree power it certainly
    carries (a per-shard mean over its own shard: cp) and the literals on it."""

    certain: float = 1.0
    literals: tuple[int, ...] = ()


@dataclass(frozen=True)
class Outcome:
    """One reading: which meaning each literal is read as (0: a weight, i: its i-th degree power), and what a
    correct step's G / R is then (None: not a single number, the loss's terms then carry different factors of the
    degrees, or the loss could not be read)."""

    readings: tuple[int, ...]
    factor: float | None
    loss_power: float | None = None


@dataclass(frozen=True)
class Readings:
    """What the events leave open about what one process computes: the literals, the loss's terms, the step's own
    scalings of its gradients that are no degree power (`own`, the same in one process), what was observed and is
    said (`notes`), why the loss's factor cannot be known at all (`unknown`), or what the user said (`said`)."""

    literals: tuple[Literal, ...] = ()
    terms: tuple[Term, ...] = (Term(),)
    own: float = 1.0
    notes: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    said: float | None = None
    folds: tuple[str, ...] = ()
    """The loss's numbers that are no power of the degrees, a micro-batch mean or the output's count (`loss * 0.7`,
    `loss * cp / 3` as one number): read as the step's own weight, the same in one process; but such a number may
    fold a degree in (cp / 3 at cp 2 is 0.667), so a factor of one degree it could absorb is never a FAIL."""

    def outcomes(self) -> tuple[Outcome, ...]:
        """Every reading, the all-weights reading first."""
        choices = [range(len(lit.degrees) + 1) for lit in self.literals]
        if math.prod(len(c) for c in choices) > MAX_READINGS:
            return (Outcome((), None),)
        return tuple(self._outcome(r) for r in itertools.product(*choices))

    def _outcome(self, readings: tuple[int, ...]) -> Outcome:
        lits = self.literals
        on_grads = math.prod(lit.value / lit.degree(r) for lit, r in zip(lits, readings) if not lit.on_loss)
        if self.unknown:
            return Outcome(readings, None)
        if self.said is not None:
            return Outcome(readings, self.own * on_grads / self.said, self.said)
        powers = {t.certain * math.prod(lits[i].degree(readings[i]) for i in t.literals) for t in self.terms}
        if len({round(math.log(p), 9) for p in powers}) != 1:
            return Outcome(readings, None)
        power = powers.pop()
        return Outcome(readings, self.own * on_grads / power, power)

    @property
    def as_degrees(self) -> float:
        """λ with every literal read as its first degree power (two runs name a factor by it), 1 when that is no number."""
        power = self._outcome((1,) * len(self.literals)).loss_power
        return power if power is not None else 1.0

    @property
    def certain_power(self) -> float | None:
        """λ when nothing about it is read (no literal, nothing unknown, one value for every term), else None."""
        outcomes = self.outcomes()
        return outcomes[0].loss_power if len(outcomes) == 1 else None


@dataclass
class _Read:
    """What reading the loss's roots collects: its literals (one per number and place, shared by every term and
    micro-batch that has it), the terms, what was observed and said, and why the loss's factor is unknown."""

    literals: list[Literal] = field(default_factory=list)
    keys: dict[tuple, int] = field(default_factory=dict)
    terms: list[Term] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    folds: list[str] = field(default_factory=list)

    def literal(self, key: tuple, literal: Literal) -> int:
        if key not in self.keys:
            self.keys[key] = len(self.literals)
            self.literals.append(literal)
        return self.keys[key]


def _loss_readings(log: EventLog, counts: Counts, powers: tuple[Power, ...], shapes: tuple[OutGrad, ...], out_numel: int) -> _Read:
    """The literals, terms, notes and unknowns of the loss, read from the first rank's backward roots."""
    read = _Read()
    for root in log.roots:
        read.unknown += [f"the loss's constants inside {h}" for h in root.hidden]
        for term in root.terms:
            shape = shapes[term.output] if term.output < len(shapes) else OutGrad.REPLICATED
            read.terms.append(_term(term, counts, powers, shape, out_numel, read))
    if not read.terms:
        read.unknown.append(
            "no backward reaching the model's output was observed (torch.autograd.backward or grad bound before the watch?)"
        )
    read.notes, read.unknown = list(dict.fromkeys(read.notes)), list(dict.fromkeys(read.unknown))
    read.folds = list(dict.fromkeys(read.folds))
    return read


def _term(term: LossTerm, counts: Counts, powers: tuple[Power, ...], shape: OutGrad, out_numel: int, read: _Read) -> Term:
    """One term: its means (observed, with what the peers' output gradients are) and its literals."""
    certain, mine = 1.0, []
    count = math.prod(f.count for f in term.factors if f.source is Source.MEAN and f.count)
    if count > 1 and count not in counts.full:
        if shape is OutGrad.PER_SHARD and count in counts.shard:
            certain = float(counts.cp)
            read.notes.append(
                f"a per-shard loss averaging its own shard ({count} of the output's {count * counts.cp} elements; one process averages cp× as many)"
            )
        elif shape is OutGrad.PER_SHARD:
            part = ((float(counts.cp), "over its shard's part (cp)"),)
            where = f"(a mean over {count} elements of a per-shard loss)"
            mine.append(read.literal(("mean", count), Literal(1 / count, where, part, "the same part in one process")))
        else:
            read.notes.append(
                f"a mean over {count} of the output's {out_numel} elements, the same part on every CP peer (the same in one process)"
            )
    for f in term.factors:
        if f.source not in (Source.CONSTANT, Source.GRADIENT):
            continue
        degrees = read_number(f.value, counts, powers)
        if degrees:
            literal = Literal(f.value, "on the loss", degrees, weight_text(f.value, counts))
            mine.append(read.literal((f.source, round(f.value, 12), f.place), literal))
        elif not _same(abs(f.value), 1.0):
            read.notes.append(f"the {f.value:.4g} on the loss (no power of the degrees: the same in one process)")
            if not any(_same(abs(f.value), 1 / k) for k in (*counts.micro, *counts.full)):
                read.folds.append(f"the {f.value:.4g} on the loss")
    return Term(certain, tuple(dict.fromkeys(mine)))


def _gradient_readings(
    log: EventLog, counts: Counts, powers: tuple[Power, ...]
) -> tuple[list[Literal], float, list[str], list[tuple[str, float]]]:
    """The step's own scalings of its gradients, seen on the tensors between events: one by a power of the degrees
    and nothing else its value fits is part of a reduction (`p.grad /= dp` after a sum over the replicas: observed,
    returned as (text, factor)); one whose value also fits a count (1 / this rank's shard's tokens, 1 / the
    micro-batches: `p.grad /= accum` at accum = cp) is a literal read every way; any other is the step's own, the
    same in one process (said)."""
    literals, own, notes, observed = [], 1.0, [], []
    for e in log.of(GradScale):
        read = read_number(e.factor, counts, powers)
        pure = power_of(abs(e.factor), powers)
        own_count = any(_same(abs(e.factor), 1 / m) for m in counts.micro)  # `p.grad /= accum` after accumulating
        if pure is not None and [d for d, _ in read] == [pure.value] and not own_count:
            observed.append((f"the step's own code scaled the gradients by {e.factor:.4g} = {pure.text} (between {e.between})", e.factor))
        elif read:
            seen = f"the step's own code scaled them between {e.between}"
            literals.append(Literal(e.factor, "on the gradients", read, weight_text(e.factor, counts), False, seen))
        else:
            own *= e.factor
            notes.append(
                f"the step's own code scaled the gradients by {e.factor:.4g} between {e.between} (no power of the degrees: the same in one process)"
            )
    return literals, own, notes, observed


@dataclass(frozen=True)
class Reduction:
    """A reduction the step was seen to make, and its factor relative to what a correct step does (a sum over the
    CP ranks and a mean over the data-parallel replicas)."""

    text: str
    factor: float


def reductions(log: EventLog, group: StepGroup, scaled: list[tuple[str, float]]) -> tuple[tuple[Reduction, ...], tuple[str, ...]]:
    """The reductions of the gradients in `log` (DDP's, FSDP2's, the collectives on the first reduced parameter's
    gradient, the step's own scalings by a power of the degrees: `scaled`) and what could not be read of them."""
    found: list[Reduction] = [Reduction(text, factor) for text, factor in scaled]
    unread: list[str] = []
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
        elif isinstance(e, Collective) and e.on_gradients and e.param == first:
            n = group.replicas_in(e.ranks)
            span = _span(e.ranks, group)
            if e.op is Op.SUM:
                found.append(Reduction(f"{e.call}(SUM) over ranks {_ranks(e.ranks)} ({span})", float(n)))
            elif e.op is Op.AVG:
                found.append(Reduction(f"{e.call}(AVG) over ranks {_ranks(e.ranks)} ({span})", n / len(e.ranks)))
            else:
                unread.append(f"a {e.op.value} reduction of the gradients over ranks {_ranks(e.ranks)} (its factor is not readable)")
    return tuple(found), tuple(unread)


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
    """What the step's events say its gradients must be, relative to the recomputed reference (one run), what in
    that rests on a reading, and what the watcher saw but could not read."""

    readings: Readings = field(default_factory=Readings)
    scale: float | None = None
    unscaled: float | None = None
    clips: tuple[ClipNorm, ...] = ()
    value_clipped: bool = False
    inner_steps: int = 0
    """Trainable parameters an optimizer stepped inside backward (each compared as its step found it)."""
    reductions: tuple[Reduction, ...] = ()
    unobserved: tuple[str, ...] = ()
    """Reductions or scales the watcher saw but could not read (a comm hook, a PREMUL_SUM, a failed read)."""
    skipped: str | None = None
    """Why the optimizer skips this step (not examined), None when it does not."""

    def factors(self) -> tuple[tuple[Outcome, float | None], ...]:
        """Every reading, with G / R a correct step shows under it (None: unknown)."""
        t = self.unscaled or 1.0
        return tuple((o, None if o.factor is None else o.factor / t) for o in self.readings.outcomes())

    @property
    def events_factor(self) -> float:
        """G / R if the seen reductions, the step's own scalings and the unscaling are all that happened to the
        gradients."""
        on_grads = math.prod(lit.value for lit in self.readings.literals if not lit.on_loss)
        return math.prod(r.factor for r in self.reductions) * self.readings.own * on_grads / (self.unscaled or 1.0)

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
        if len(self.clips) > 1:
            each = ", ".join(f"{c.coefficient:.4g} on {c.params}" for c in self.clips)
            return f"the step clipped {len(self.clips)} groups of parameters by their norm ({each}); each divided out of the parameters it clipped"
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

    @property
    def inner_text(self) -> str:
        if not self.inner_steps:
            return ""
        return f"an optimizer stepped inside backward on {self.inner_steps} parameters: each compared as its step found it"


def expectation(
    logs: list[EventLog],
    group: StepGroup,
    out_shape: tuple[int, ...],
    gather_dim: int,
    forwards: int,
    loss_scale: float | None = None,
    shapes: tuple[OutGrad, ...] = (),
) -> Expectation:
    """The expectation of one CP group's step from its ranks' event logs (the first rank's first): the loss's
    readings from the first rank's backward roots and the output gradients' shapes, the scaler, clips and
    reductions from its events, a skip from any rank's. The micro-batches are the forwards of the model in the
    step (a backward root is not one: a step may call backward once per loss term), or accelerate's accumulation."""
    mine = logs[0]
    powers = degree_powers(group.ring, group.ulysses, group.dp)
    micro = (forwards, *(e.accumulation_steps for e in mine.of(AccelerateBackward)))
    counts = Counts.of(out_shape, gather_dim, group.cp, micro)
    loss = _loss_readings(mine, counts, powers, shapes, math.prod(out_shape) if out_shape else 0)
    loss_literals, terms, notes, unknown = loss.literals, loss.terms, loss.notes, loss.unknown
    grad_literals, own, grad_notes, scaled = _gradient_readings(mine, counts, powers)
    said = float(loss_scale) if loss_scale is not None else None
    if said is not None:  # the user said λ: the loss is not read
        loss_literals, terms, unknown, notes = [], [Term()], [], [f"you said the CP step scales its loss by {said:g} (loss_scale=)"]
        loss.folds = []
    readings = Readings(
        literals=tuple(loss_literals + grad_literals),
        terms=tuple(terms) or (Term(),),
        own=own,
        notes=tuple(notes + grad_notes),
        folds=tuple(loss.folds),
        unknown=tuple(unknown),
        said=said,
    )
    reduced, unread = reductions(mine, group, scaled)
    return Expectation(
        readings=readings,
        scale=mine.scale,
        unscaled=mine.unscaled_by,
        clips=tuple(mine.clips),
        value_clipped=mine.value_clipped,
        inner_steps=sum(e.params for e in mine.of(InnerStep)),
        reductions=reduced,
        unobserved=tuple(dict.fromkeys((*unread, *mine.unobserved, *_weight_terms(mine)))),
        skipped=_skipped(logs),
    )


def _weight_terms(log: EventLog) -> tuple[str, ...]:
    if any(r.param_paths for r in log.roots):
        return ("a term of the loss on the weights themselves (not in the recomputed output gradient)",)
    return ()


def _skipped(logs: list[EventLog]) -> str | None:
    for log in logs:
        if log.found_inf:
            scale = log.scale
            said = f" (scale {scale:g})" if scale else ""
            return f"the GradScaler found inf/NaN in the gradients{said}: it skips this optimizer step"
    return None


def logs_of(events: list[tuple[Event, ...]]) -> list[EventLog]:
    return [EventLog(list(e)) for e in events]
