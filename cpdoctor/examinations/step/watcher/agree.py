"""How the ranks of a watched step agree, through the process group's store and never a collective, that they may
go on: every rank is at the block's end and none raised (`arrive`), none stops (`decide`), every CP group's
reference is done (`reference_outcome`). A rank that raised, is stuck in a collective of the step, or whose
reference failed cannot leave its peers waiting: each round ends within the timeout, and every rank takes the
same decision from what the store holds."""

from __future__ import annotations

import traceback

from cpdoctor.examinations.step.judgment.diagnosis import attention_crash, crash_command
from cpdoctor.examinations.step.watcher.group import StepGroup
from cpdoctor.examinations.step.watcher.messages import Arrival, Decision, ReferenceOutcome
from cpdoctor.launch import watcher_comm
from cpdoctor.report import FailureEvidence, Finding, Verdict


def crash(group: StepGroup, tracebacks: dict[int, str], what: str) -> Finding:
    """A CRASH finding naming the ranks that raised, with the last line of each traceback; a known crash of
    diffusers' CP attention is named as the attention's defect, with the `cpdoctor check` that shows it alone."""
    lines = _last_lines(tracebacks)
    ranks = ", ".join(map(str, sorted(tracebacks)))
    known = attention_crash(tracebacks)
    if known is None:
        return Finding(
            group.subject(),
            Verdict.CRASH,
            f"{what} on rank {ranks} ({lines})",
            "read the traceback of that rank (in the JSON details)",
            failure=FailureEvidence(tracebacks=dict(tracebacks)),
        )
    command = crash_command(known, group.ring, group.ulysses)
    return Finding(
        group.subject(),
        Verdict.CRASH,
        f"{what} inside diffusers' CP attention on rank {ranks}, the attention's defect and not the step's own error "
        f"({lines}) — {known.signature.name}: {known.signature.diagnosis}; `{command}` shows it alone",
        known.signature.remedy,
        failure=FailureEvidence(tracebacks=dict(tracebacks), signature=known.signature.name),
        command=command,
    )


def own_crash(group: StepGroup, what: str) -> Finding:
    """cpdoctor's own exception on this rank, as a finding (called inside the `except`)."""
    return crash(group, {group.rank: traceback.format_exc()}, what)


def _last_lines(tracebacks: dict[int, str]) -> str:
    """Each distinct last line of the tracebacks once, after the ranks that raised it ("rank 0, 1: ...")."""
    said: dict[str, list[int]] = {}
    for rank, text in sorted(tracebacks.items()):
        said.setdefault(_last_line(text), []).append(rank)
    return "; ".join(f"rank {', '.join(map(str, ranks))}: {line}" for line, ranks in said.items())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no traceback)"


def arrive(group: StepGroup, mine: Arrival) -> list[Finding] | None:
    """Every rank agrees that all ranks reached the block's end and none raised; the findings when not (the same
    on every rank), None when the collectives may start."""
    seen = watcher_comm.exchange(f"cpdoctor/watch/{group.seq}/arrive", mine, tuple(range(group.world)), group.timeout_s)
    absent = [r for r, a in enumerate(seen) if a is None]
    raised = {a.rank: a.error for a in seen if a is not None and a.error}
    findings = []
    if raised:
        findings.append(crash(group, raised, "the step raised"))
    if absent:
        findings.append(
            Finding(
                group.subject(),
                Verdict.HANG,
                f"rank {', '.join(map(str, absent))} did not reach the end of the watched step within {group.timeout_s:g} s "
                f"(rank {', '.join(str(a.rank) for a in seen if a is not None)} did): it is still inside the step, e.g. in a "
                "collective of it that a rank which raised never joins",
                "read the traceback of the rank that raised; otherwise make every rank run the same step",
            )
        )
    if not findings:
        problem = count_problem(group, [a for a in seen if a is not None])
        findings = [problem] if problem is not None else []
    return decide(group, findings)


def decide(group: StepGroup, findings: list[Finding]) -> list[Finding] | None:
    """A second round: every rank says whether it stops (with its findings) or goes on. A rank that arrived late
    saw everyone and would go on while its peers gave up on it: this round makes it stop with them, so no rank
    enters a collective alone."""
    everyone = tuple(range(group.world))
    said = watcher_comm.exchange(f"cpdoctor/watch/{group.seq}/decide", Decision(tuple(findings)), everyone, group.timeout_s)
    stopped = next((d.stop for d in said if d is not None and not d.goes_on), None)
    if stopped is not None:
        return list(stopped)
    silent = [r for r, d in zip(everyone, said) if d is None]
    if silent:
        return [
            Finding(
                group.subject(),
                Verdict.HANG,
                f"rank {', '.join(map(str, silent))} did not say within {group.timeout_s:g} s whether it goes on",
                "make every rank run the same step",
            )
        ]
    return None


def count_problem(group: StepGroup, arrivals: list[Arrival]) -> Finding | None:
    """The ranks disagree on the step, or some ran no forward or no backward: what stops the examination."""
    steps = {a.index for a in arrivals}
    if len(steps) > 1:
        text = ", ".join(f"rank {a.rank} at step {a.index}" for a in arrivals)
        return Finding(
            group.subject(),
            Verdict.FAIL,
            f"the ranks disagree on the step count: {text}",
            "run the same number of steps on every rank (the same data length per rank; no rank-only steps)",
        )
    no_fwd = [a.rank for a in arrivals if a.forwards == 0]
    if no_fwd:
        return Finding(
            group.subject(),
            Verdict.UNSUPPORTED,
            f"the model was not called inside the watched step on rank {', '.join(map(str, no_fwd))}",
            "run the step's forward inside the `with cpdoctor.watch_step(model)` block",
        )
    if len({a.forwards for a in arrivals}) > 1:
        text = ", ".join(f"rank {a.rank}: {a.forwards}" for a in arrivals)
        return Finding(
            group.subject(),
            Verdict.FAIL,
            f"the ranks ran different numbers of forwards inside the watched step ({text})",
            "run the same micro-batches on every rank of a CP group",
        )
    no_bwd = [a.rank for a in arrivals if a.backwards == 0]
    if no_bwd:
        return Finding(
            group.subject(),
            Verdict.UNSUPPORTED,
            f"the step never called backward through the model's output on rank {', '.join(map(str, no_bwd))}: no gradient to examine",
            "call loss.backward() (and the gradient sync) inside the `with cpdoctor.watch_step(model)` block",
        )
    return None


def reference_outcome(group: StepGroup, mine: ReferenceOutcome, reference: str) -> Finding | None:
    """Every CP group's leader says how its reference ended; every rank reads all of them: the finding that stops
    the examination (a refusal by the memory plan, a crash, a leader that never said), None when all are done."""
    from cpdoctor.examinations.step.judgment.evidence import TooLarge

    leaders = group.leaders
    posted = watcher_comm.exchange(f"cpdoctor/watch/{group.seq}/reference", mine, leaders, group.timeout_s)
    refusals = [p.refused for p in posted if p is not None and p.refused]
    if refusals:
        return Finding(
            group.subject(),
            Verdict.UNSUPPORTED,
            f"not examined: {refusals[0]}",
            "use one of the ways that fit, named in the diagnosis",
            evidence=TooLarge(refusals[0]),
        )
    crashed = {r: p.failed for r, p in zip(leaders, posted) if p is not None and p.failed}
    if crashed:
        return crash(group, crashed, f"cpdoctor's reference ({reference}) raised")
    late = [r for r, p in zip(leaders, posted) if p is None]
    if late:
        return Finding(
            group.subject(),
            Verdict.HANG,
            f"cpdoctor's reference on rank {', '.join(map(str, late))} did not finish within {group.timeout_s:g} s",
            "give watch_step a longer timeout_s, or examine fewer blocks (`cpdoctor model --blocks N`)",
        )
    return None
