"""What every rank does at the end of a watched block, in order: agree through the store that all are here and well
(agree.py); take the gradients as the comparison needs them, before any clip (grads.py; a norm clip's recorded
coefficient divided out, or the gradients captured at the clip's entry); with two runs, judge its own inputs and
output gradients against the run without CP's (baseline.input_layouts); send what it saw (inputs, output
gradients, gradients, events, those layouts) to its CP group's first rank; there the baseline gives the expected gradients
(baseline.py), the events what the step must show (factors.py), the numbers are measured (measure.py) and judged
(judge.py); every CP group's finding is shared with every rank. The collectives are launch/watcher_comm.py's."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat import parallel_config as compat
from cpdoctor.examinations.step.judgment.baseline import Baseline
from cpdoctor.examinations.step.judgment.diagnosis import first_bad_param
from cpdoctor.examinations.step.judgment.evidence import StepEvidence, WatchedStep
from cpdoctor.examinations.step.judgment.factors import Expectation, expectation, logs_of
from cpdoctor.examinations.step.judgment.judge import step_finding
from cpdoctor.examinations.step.judgment.measure import Against, measure
from cpdoctor.examinations.step.judgment.reference import ReferenceTooLarge
from cpdoctor.examinations.step.judgment.signature import StepSignature
from cpdoctor.examinations.step.watcher import agree
from cpdoctor.examinations.step.watcher.grads import Gradients
from cpdoctor.examinations.step.watcher.group import StepGroup
from cpdoctor.examinations.step.watcher.messages import Arrival, PeerRecord, ReferenceOutcome
from cpdoctor.examinations.step.watcher.observe import Recorder
from cpdoctor.examinations.step.watcher.record import Recorded, rng_digest
from cpdoctor.launch import watcher_comm
from cpdoctor.report import Environment, Finding, Report, Verdict
from cpdoctor.report.environment import Launch, Software


@dataclass(frozen=True)
class Closing:
    """What one rank's watch holds at the block's exit."""

    group: StepGroup
    recorded: Recorded
    recorder: Recorder
    baseline: Baseline
    rng_before: str
    loss_scale: float | None
    error: str | None
    started: float


def report_of(c: Closing, findings: list[Finding]) -> Report:
    import torch

    from cpdoctor.compat.diffusers import diffusers_version

    g = c.group
    env = Environment(
        Software(torch=str(torch.__version__), diffusers=diffusers_version()), Launch(str(c.recorded.device), world_size=g.world)
    )
    request = WatchedStep(g.ring, g.ulysses, g.world, g.index, c.baseline.name)
    return Report.of(findings, env, request, wall_s=time.perf_counter() - c.started)


def close(c: Closing) -> Report:
    hooks = c.recorded.hooks
    stopped = agree.arrive(c.group, Arrival(c.group.rank, c.group.index, hooks.forwards, hooks.backwards, c.error))
    if stopped is not None:
        return report_of(c, stopped)
    c.recorder.fsdp()
    rng_after = rng_digest()
    grads = c.recorder.as_compared()
    out_grads = tuple(f.out_grad for f in hooks.calls)
    try:
        layouts = c.baseline.input_layouts(c.group, c.recorded)
    except Exception:  # noqa: BLE001 - unreadable saved inputs: this rank sends none and its group is matched by fingerprints
        layouts = ()
    mine = PeerRecord(
        c.group.rank,
        hooks.forwards,
        hooks.backwards,
        hooks.prints,
        c.rng_before,
        rng_after,
        out_grads,
        None,
        grads.missing,
        tuple(c.recorder.log.events),
        layouts,
    )
    records = watcher_comm.gather_to_first(mine, c.group.process_group)
    all_grads = watcher_comm.gather_tensor_to_first(grads.flat, c.group.process_group)  # a tensor collective: no pickling
    if records is not None and all_grads is not None:
        for rec, g in zip(records, all_grads):
            rec.grads = g
    grads = Gradients(grads.names, None, grads.missing)  # the first rank holds its own among the gathered ones
    group = c.group.with_groups(tuple(watcher_comm.all_gather(c.group.ranks)))
    expected_mine, outcome = None, ReferenceOutcome()
    if group.leader:
        assert records is not None
        # the reference's failure is reported on every rank, no rank left waiting; too large: not examined, and said
        # before anything was allocated
        computed = Attempt.of(lambda: c.baseline.expected(group, c.recorded, records, grads.param_names), trace=True)
        expected_mine = computed.value
        if isinstance(computed.error, ReferenceTooLarge):
            outcome = ReferenceOutcome(refused=str(computed.error))
        elif computed.error is not None:
            outcome = ReferenceOutcome(failed=computed.trace or "")
    stop = agree.reference_outcome(group, outcome, c.baseline.name)
    if stop is not None:
        return report_of(c, [stop])
    finding = judged(c, group, records, grads, expected_mine)
    return report_of(c, [f for f in watcher_comm.all_gather(finding) if f is not None])


def judged(c: Closing, group: StepGroup, records: list[PeerRecord] | None, grads: Gradients, expected_mine: Any) -> Finding | None:
    """On every rank, the data-parallel combination of the references (a collective where needed); on a CP group's
    first rank, its finding."""
    import torch

    own = expected_mine if expected_mine is not None else torch.zeros(sum(grads.numels), dtype=torch.float32)
    expected = c.baseline.combine(own, group.dp)
    if not group.leader:
        return None
    assert records is not None
    try:
        return _finding(c, group, records, grads, expected, own)
    except Exception:  # noqa: BLE001 - reported on every rank through the gather that follows
        return agree.own_crash(group, "cpdoctor's measurement raised")


def _finding(c: Closing, group: StepGroup, records: list[PeerRecord], grads: Gradients, expected: Any, own: Any) -> Finding:
    module, hooks = c.recorded.module, c.recorded.hooks
    gather_dim = compat.output_gather_dim(module)
    against = Against(
        ref_out=c.baseline.ref_output,
        expected=expected,
        own=own,
        param_names=grads.param_names,
        param_numels=grads.numels,
        reference=c.baseline.name,
        recomputed=c.baseline.needs_inputs,
        native=c.baseline.native,
        judged=c.baseline.judged,
    )
    numbers = measure(
        records,
        group,
        against,
        dtype=c.recorded.dtype,
        gather_dim=gather_dim,
        out=c.baseline.output(hooks),
        out_numel=hooks.calls[0].out_numel,
    )
    seen = expectation(
        logs_of([r.events for r in records]),
        group,
        hooks.calls[0].out_shape,
        gather_dim,
        hooks.forwards,
        c.loss_scale,
        shapes=numbers.out_grads,
    )
    finding = step_finding(numbers, seen)
    finding = replace(
        finding,
        subject=f"training step {group.index}, {finding.subject.removeprefix('training step, ')}",
        evidence=evidence(numbers, seen, c.baseline.name, c.baseline.plan),
    )
    why = c.baseline.unmatched()
    if why is not None and not numbers.inputs_differ:
        return unmatched(finding, why)
    return finding


def unmatched(finding: Finding, why: str = "") -> Finding:
    """The run without CP fed the model other inputs than this CP group: its gradients answer another question, so
    nothing is judged (the step's data depends on the layout, not a CP defect). `why`: what differs, where known."""
    return Finding(
        finding.subject,
        Verdict.UNSUPPORTED,
        "no rank of the run without CP started from the weights and fed the model the inputs this CP group did (their "
        f"fingerprints differ{': ' + why if why else ''}): the step's data or weights depend on the CP layout, so its "
        "gradients cannot be compared with one process's",
        "seed weights, noise and timesteps by the data-parallel rank (never the global rank or the world size), the "
        "same way whatever the degrees",
        finding.tensors,
        evidence=finding.evidence,
    )


def evidence(numbers: Any, seen: Expectation, reference: str, plan: Any = None) -> StepEvidence:
    s = StepSignature(numbers, seen)
    first = first_bad_param(s)
    return StepEvidence(
        ranks=numbers.ranks,
        ring=numbers.ring,
        ulysses=numbers.ulysses,
        dp=numbers.dp,
        inputs_differ={d.name: d.different for d in numbers.inputs_differ},
        rng_after_groups=numbers.rng_after_groups,
        out_grad_spread=numbers.out_grad_spread,
        peer_spread=numbers.peer_spread,
        cp_sum_rel_err=numbers.sum_rel_err,
        factor=s.ratio(s.worst),
        factor_residual=s.worst.residual,
        first_bad_param=None if first is None else first.name,
        reference=reference,
        compute_dtype=numbers.dtype,
        forwards=max(numbers.forwards, default=1),
        expected_factor=s.expected,
        loss_factor=seen.readings.certain_power,
        readings=tuple(lit.both_ways() for lit in seen.readings.literals),
        observed=seen.readings.notes,
        clip_coefficient=_prod(c.coefficient for c in seen.clips),
        clipped=seen.clip_text,
        grad_scaler=seen.scale,
        unscaled=seen.unscaled is not None,
        reductions=tuple(r.text for r in seen.reductions),
        not_read=s.unread,
        skipped=s.skipped,
        reference_gib=None if plan is None else round(plan.total / 2**30, 3),
    )


def _prod(values: Any) -> float:
    out = 1.0
    for v in values:
        out *= v
    return out
