"""What the step's rules say: each cause's sentence built from the signature's numbers and the events the watcher
saw (the factor and what makes it, the reading a WARN rests on, the attention's command and the first bad
parameter and block). Words only; which rule speaks is judge.py's."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.examinations.judging import RING_UNDER_CHECKPOINTING, CrashSignature
from cpdoctor.examinations.step.judgment.factors import MAX_READINGS, Outcome, degree_powers, power_of
from cpdoctor.examinations.step.judgment.measure import ParamError
from cpdoctor.examinations.step.judgment.remedies import CP_SUM_REMEDY, LOSS_SCALE_REMEDY, TWO_RUNS_REMEDY
from cpdoctor.examinations.step.judgment.signature import PARAM_SLACK, StepSignature
from cpdoctor.vocabulary import DType


def ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def skip_text(s: StepSignature) -> str:
    return f"not examined: {s.skipped}"


def inputs_text(s: StepSignature) -> str:
    judged = s.n.inputs_judged
    if judged is not None and judged.by_layout:
        wrong = "; ".join(d.detail or f"{d.name}: rank {ranks(d.different)}" for d in s.n.inputs_differ)
        right = ", ".join(g.describe() for g in judged.right())
        text = (
            f"the model's inputs are not what the run without CP fed it (its rank {judged.against}; each CP rank's input "
            f"must equal that run's, or be this rank's shard of it along a sequence dimension): {wrong}"
        ) + (f"; right: {right}" if right else "")
    else:
        parts = [f"{d.name} on rank {ranks(d.different)} (rank {ranks(d.same_as_first)} had another)" for d in s.n.inputs_differ]
        text = "the model's inputs differ between CP peers, which must all feed the same full inputs: " + "; ".join(parts)
        if judged is not None:  # two runs, and no peer fed what a rank of the run without CP did: the peers compared
            text = (
                "no CP rank fed the model what a rank of the run without CP did (its data depend on the layout), and the "
                "inputs every peer feeds whole differ between the CP peers: " + "; ".join(parts)
            )
    if len(s.n.rng_before_groups) > 1:
        text += (
            "; their RNG states differed already before the step (ranks "
            + " | ".join(ranks(g) for g in s.n.rng_before_groups)
            + "): the random draws were seeded per rank"
        )
    return text


def shard_text(s: StepSignature) -> str:
    return (
        f"each CP rank's loss covers only its own shard of the gathered output (the output gradient of rank "
        f"{ranks(s.n.ranks)} is zero outside its own chunk)"
    )


def out_grad_text(s: StepSignature) -> str:
    return (
        f"the gradient flowing into the model's output differs between CP peers (rank {ranks(s.n.out_grad_differ)} against "
        f"rank {s.n.ranks[0]}, relative difference up to {s.n.out_grad_spread:.2g}): the loss is computed differently on "
        "each rank (different targets, weights or normalisation)"
    )


def peers_text(s: StepSignature) -> str:
    text = (
        f"the parameter gradients differ between CP peers after the sync (relative difference up to {s.n.peer_spread:.2g}): "
        f"the reduction over the CP group (ranks {ranks(s.n.ranks)}) is missing; each rank holds the gradient of its own tokens"
    )
    if s.n.sum_rel_err <= s.tol:
        text += f"; summed over the CP group they are the expected gradients (rel err {s.n.sum_rel_err:.2g})"
    else:
        text += f"; even summed over the CP group they are off (rel err {s.n.sum_rel_err:.2g})"
    return text


def dp_text(s: StepSignature) -> str:
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


def factor_text(s: StepSignature) -> str:
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


def factor_remedy(s: StepSignature) -> str:
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


def reading_text(s: StepSignature) -> str:
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


def reading_remedy(s: StepSignature) -> str:
    """The two runs at this job's degrees, and `loss_scale=` where the loss is what is read."""
    r = s.e.readings
    on_loss = any(lit.on_loss for lit in r.literals) or bool(r.unknown) or bool(r.folds)
    return TWO_RUNS_REMEDY.format(layout=s.switches) + (f"; {LOSS_SCALE_REMEDY}" if on_loss and s.n.recomputed else "")


def unseen_text(s: StepSignature) -> str:
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


def attention_text(s: StepSignature) -> str:
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


def unread_text(s: StepSignature) -> str:
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


def where_text(s: StepSignature) -> str:
    first = first_bad_param(s)
    worst = max(s.n.params_scaled or s.n.params, key=lambda p: p.rel_err, default=None)
    if first is None or worst is None:
        return ""
    return f"first bad parameter {first.name} ({first.rel_err:.2g}) in block {block_of(first.name)}; worst parameter {worst.name} ({worst.rel_err:.2g})"


def rng_text(s: StepSignature) -> str:
    return (
        f"the RNG states differ between CP peers after the step although they agreed before it: rank "
        f"{ranks(s.rng_consumers)} consumed random numbers its peers did not; harmless while the gradients are right, but "
        "every later draw from that generator (the next step's noise and timesteps, dropout) will differ between them"
    )
