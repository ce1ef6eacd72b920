"""The body every rank runs, spawned or under torchrun: each case of the job, payloads gathered to rank 0,
rank 0 evaluates. A case that fails on some rank becomes that case's outcome, and the job goes on to the next
case whenever every rank got to report (a crash never hides what comes after it); a rank that cannot report
leaves the rest to the supervising parent (spawn.py), which relaunches them."""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
import signal
import warnings
from collections.abc import Callable
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.launch.context import DistContext
from cpdoctor.launch.faults import inject_fault
from cpdoctor.launch.flight import recording
from cpdoctor.launch.jobs import Case, CaseOutcome, FailureKind, Job, RankFailure, RankPayload, RankProgram, RankResult, RankStatus
from cpdoctor.launch.progress import Heartbeat, StepLog, activate

OutcomeSink = Callable[[int, CaseOutcome], None]


def _error(failed: Attempt[Any]) -> RankPayload:
    """A failed attempt (taken with its traceback) as a rank's error payload."""
    return RankPayload(RankStatus.ERROR, message=f"{type(failed.error).__name__}: {failed.error}", traceback=failed.trace)


def run_case(program: RankProgram, case: Case, ctx: DistContext, log: StepLog, index: int) -> RankPayload:
    """This rank's payload for one case, with the warnings raised meanwhile (diffusers' deprecation notices on
    every rank would bury the verdict under torchrun: they are counted in the report instead)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        payload = _run_case(program, case, ctx, log, index)
    payload.warnings = [f"{w.category.__name__}: {w.message}" for w in caught]
    return payload


def _run_case(program: RankProgram, case: Case, ctx: DistContext, log: StepLog, index: int) -> RankPayload:
    """Every exception becomes a payload, never an escape: a rank's exception is a finding, not our crash."""

    def examine() -> RankResult:
        log.mark(index, "preparing")
        inject_fault(ctx.rank, case.label)
        log.mark(index, "examining")
        with recording():
            return program.run_rank(case, ctx)

    run = Attempt.of(examine, trace=True)
    if run.ok:
        return RankPayload(RankStatus.OK, run.value)
    if isinstance(run.error, BadInput):
        return RankPayload(RankStatus.BAD_INPUT, message=str(run.error))
    if isinstance(run.error, CannotExamine):
        return RankPayload(RankStatus.CANNOT_EXAMINE, message=str(run.error))
    return _error(run)


def failures_from_payloads(payloads: list[RankPayload]) -> list[RankFailure]:
    """The gathered payloads of a case that did not complete, as rank failures: the ranks that raised on
    their own are CRASH; ranks whose collective timed out were waiting for a peer; lost ones are HANG."""
    failures = []
    for rank, p in enumerate(payloads):
        if p.status is RankStatus.LOST:
            failures.append(RankFailure(rank, FailureKind.HANG, p.message))
        elif p.status is RankStatus.ERROR:
            failures.append(RankFailure(rank, FailureKind.CRASH, p.message, p.traceback, waiting=p.timed_out))
    return failures


def refusal(payloads: list[RankPayload]) -> RankPayload | None:
    """The first bad-input / cannot-examine payload: the request itself is refused, not a rank."""
    return next((p for p in payloads if p.status in (RankStatus.BAD_INPUT, RankStatus.CANNOT_EXAMINE)), None)


def _evaluate(program: RankProgram, case: Case, payloads: list[RankPayload], ctx: DistContext) -> CaseOutcome:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome = _outcome(program, case, payloads, ctx)
    for message in [w for p in payloads for w in p.warnings] + [f"{w.category.__name__}: {w.message}" for w in caught]:
        outcome.warnings[message] = outcome.warnings.get(message, 0) + 1
    return outcome


def _outcome(program: RankProgram, case: Case, payloads: list[RankPayload], ctx: DistContext) -> CaseOutcome:
    refused = refusal(payloads)
    if refused is not None:
        return CaseOutcome(case, refusal=refused)
    if not all(p.ok for p in payloads):
        return CaseOutcome(case, failures=failures_from_payloads(payloads))
    results = [p.value for p in payloads if p.value is not None]
    evaluated = Attempt.of(lambda: program.evaluate(case, results, ctx), trace=True)
    if evaluated.ok:
        return CaseOutcome(case, evaluated=evaluated.value)
    p = _error(evaluated)  # rank 0's evaluation failing is a finding too
    return CaseOutcome(case, failures=[RankFailure(0, FailureKind.CRASH, p.message, p.traceback)])


def execute_job(
    job: Job,
    ctx: DistContext,
    log: StepLog,
    on_local_error: Callable[[int, RankPayload], None] | None = None,
    on_outcome: OutcomeSink | None = None,
) -> list[CaseOutcome] | None:
    """Run every case on this rank; rank 0 returns the outcomes (None elsewhere).

    A rank that fails reports through `on_local_error` at once (the spawning parent reacts without waiting
    for the gather), then still joins the gather so a torchrun user gets the traceback on rank 0 too. After
    each case rank 0 tells every rank whether the job goes on: it stops at a refused request and after a
    collective that timed out (the process group may not be usable any more)."""
    outcomes: list[CaseOutcome] = []
    for index, case in enumerate(job.cases):
        payload = run_case(job.program, case, ctx, log, index)
        if payload.status is RankStatus.ERROR and on_local_error is not None:
            on_local_error(index, payload)
        log.mark(index, "reporting")
        reported = Attempt.of(lambda p=payload: ctx.gather_to_root(p))  # a peer never reported (under torchrun nobody else says so)
        if reported.error is not None:
            if ctx.rank != 0:
                return None
            lost = RankPayload(RankStatus.LOST, message=f"did not report ({type(reported.error).__name__})")
            outcomes.append(CaseOutcome(case, failures=failures_from_payloads([payload] + [lost] * (ctx.world_size - 1))))
            return outcomes
        gathered = reported.value
        go_on = True
        log.mark(index, "evaluating" if ctx.rank == 0 else "awaiting")
        if ctx.rank == 0:
            assert gathered is not None
            outcome = _evaluate(job.program, case, gathered, ctx)
            outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(index, outcome)
            go_on = outcome.refusal is None and not any(p.timed_out for p in gathered)
        if not ctx.broadcast_from_root(go_on):
            break
    log.mark(len(job.cases) - 1, "done")
    return outcomes if ctx.rank == 0 else None


# ----------------------------------------------------------------------------------------------------------
# A spawned rank: `python -m cpdoctor.launch JOB OUTDIR`
# ----------------------------------------------------------------------------------------------------------


def _set_parent_death_signal() -> None:
    """Linux: die with the parent, so no worker outlives a killed `cpdoctor`."""
    with contextlib.suppress(OSError, AttributeError):  # no libc.so.6 (not Linux), or no prctl in it
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def write_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(obj, fh)
    os.replace(tmp, path)


class RankFile(str, enum.Enum):
    """The files a spawned rank writes for its supervising parent, one of each per rank (`rank<R>.<kind>`): its
    latest error, its step log, its flight record, the exception its code noted, its advice."""

    STATUS = "status"
    STEP = "step"
    FLIGHT = "flight"
    RAISED = "raised"
    ADVICE = "advice"


def rank_file(out_dir: str, rank: int, kind: RankFile) -> str:
    return os.path.join(out_dir, f"rank{rank}.{kind.value}")


def outcome_path(out_dir: str, index: int) -> str:
    return os.path.join(out_dir, f"case{index}.outcome")


def worker_main(job_path: str, out_dir: str) -> int:
    """Entry of a spawned rank: outcomes and errors go to files the supervising parent reads."""
    _set_parent_death_signal()
    with open(job_path, "rb") as fh:
        job: Job = pickle.load(fh)
    rank = int(os.environ["RANK"])
    log = StepLog(rank_file(out_dir, rank, RankFile.STEP), flight_path=rank_file(out_dir, rank, RankFile.FLIGHT))
    log.mark(0, "joining")
    activate(log, rank_file(out_dir, rank, RankFile.RAISED), rank_file(out_dir, rank, RankFile.ADVICE))
    heartbeat = Heartbeat()  # importing torch and joining move too

    def report_error(index: int, payload: RankPayload) -> None:
        write_atomic(rank_file(out_dir, rank, RankFile.STATUS), (index, payload))

    joined = Attempt.of(lambda: DistContext.join(job.timeout_s, job.device), catching=(BadInput, CannotExamine))
    if joined.value is None:  # the device or group asked for cannot be had here: the ranks' refusal, exit 2 or 3
        status = RankStatus.BAD_INPUT if isinstance(joined.error, BadInput) else RankStatus.CANNOT_EXAMINE
        report_error(0, RankPayload(status, message=str(joined.error)))
        return 0
    ctx = joined.value
    heartbeat.enabled = ctx.device.type == "cpu"  # a CUDA rank's host thread may spin while it waits: no proof of work
    try:
        ran = Attempt.of(
            lambda: execute_job(
                job, ctx, log, on_local_error=report_error, on_outcome=lambda i, o: write_atomic(outcome_path(out_dir, i), o)
            ),
            trace=True,
        )
        if not ran.ok:  # cpdoctor's own failure on a rank is reported, not left as a silent exit
            report_error(-1, _error(ran))
            return 1
    finally:
        ctx.close()
    return 0
