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
from dataclasses import dataclass

from cpdoctor.examinations.judging import Aspect, Rule, diagnosis_of, spoken_rules
from cpdoctor.examinations.step.judgment.diagnosis import (
    attention_command,
    attention_text,
    dp_text,
    factor_remedy,
    factor_text,
    inputs_text,
    out_grad_text,
    peers_text,
    ranks,
    reading_remedy,
    reading_text,
    rng_text,
    shard_text,
    skip_text,
    unread_text,
    unseen_text,
    where_text,
)
from cpdoctor.examinations.step.judgment.factors import Expectation, degree_powers, power_of
from cpdoctor.examinations.step.judgment.input_layouts import Placement
from cpdoctor.examinations.step.judgment.measure import StepNumbers
from cpdoctor.examinations.step.judgment.remedies import (
    ATTENTION_REMEDY,
    CP_SUM_REMEDY,
    DP_REMEDY,
    LAYOUT_SCALE_REMEDY,
    LOSS_REMEDY,
    RNG_REMEDY,
    SEED_REMEDY,
    SHARD_LOSS_REMEDY,
    SKIP_REMEDY,
)
from cpdoctor.examinations.step.judgment.signature import StepSignature
from cpdoctor.report import Finding, JudgedRow, TensorRow, Verdict


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
    StepRule(Aspect.CAUSE, "not examined", lambda s: s.skipped is not None, skip_text, (SKIP_REMEDY,), verdict=Verdict.UNSUPPORTED),
    StepRule(Aspect.CAUSE, "inputs differ between CP peers", lambda s: bool(s.n.inputs_differ), inputs_text, (SEED_REMEDY,)),
    StepRule(Aspect.CAUSE, "loss differs per rank", lambda s: s.loss_differs, out_grad_text, (LOSS_REMEDY,)),
    StepRule(Aspect.CAUSE, "CP reduction missing", lambda s: s.peers_differ, peers_text, (CP_SUM_REMEDY,)),
    StepRule(Aspect.CAUSE, "DP averaging missing", lambda s: s.dp_missing, dp_text, (DP_REMEDY,)),
    StepRule(Aspect.CAUSE, "wrong under every reading", lambda s: s.n.recomputed and s.wrong_everywhere and s.observed and not s.folded, factor_text, remedy_of=factor_remedy),
    StepRule(Aspect.CAUSE, "rests on a reading", lambda s: s.n.recomputed and s.off is not None, reading_text, remedy_of=reading_remedy, verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "factor of the degrees", lambda s: s.power is not None, factor_text, remedy_of=factor_remedy),
    StepRule(Aspect.CAUSE, "unseen scale", lambda s: s.off is not None, unseen_text, (LAYOUT_SCALE_REMEDY,), verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "seen, not read", lambda s: _gradients_wrong(s) and bool(s.unread), unread_text, remedy_of=reading_remedy, verdict=Verdict.WARN),
    StepRule(Aspect.CAUSE, "gradients wrong", _gradients_wrong, attention_text, (ATTENTION_REMEDY,), names_attention=True),
    StepRule(Aspect.SHARD, "per-shard loss", lambda s: s.n.out_grad_own_shard and s.off is not None, shard_text, (SHARD_LOSS_REMEDY,), decides=False),
    StepRule(Aspect.RNG, "RNG consumed unevenly", lambda s: s.rng_parted, rng_text, (RNG_REMEDY,), verdict=Verdict.WARN),
    StepRule(Aspect.WHERE, "first bad parameter", lambda s: s.grads_bad and s.only_gradients_wrong, where_text, decides=False),
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
    return f"training step, CP group ranks {ranks(n.ranks)} (ring {n.ring} × Ulysses {n.ulysses}, dp {n.dp}, {n.dtype})"


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
