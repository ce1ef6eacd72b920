"""Under torchrun (or inside a training script's process group): this process is one rank of an existing
world. Every rank gets rank 0's outcomes, so every rank can act on them alike."""

from __future__ import annotations

import os
import time

from cpdoctor.launch.context import DistContext
from cpdoctor.launch.jobs import CaseOutcome, FailureKind, Job, LaunchResult, RankFailure
from cpdoctor.launch.progress import StepLog
from cpdoctor.launch.worker import execute_job


def under_torchrun() -> bool:
    """True when torchrun (or any launcher with its conventions) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "CPDOCTOR_SPAWNED" not in os.environ


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_reporting_rank() -> bool:
    """Only rank 0 of a torchrun world prints; a spawning parent always does."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


def _lost_peer(outcomes: list[CaseOutcome]) -> bool:
    return any(f.kind is FailureKind.HANG for o in outcomes for f in o.failures)


def run_in_this_process(job: Job) -> LaunchResult:
    """Run the job as this rank. Cases after a failed one that every rank reported still run; a case whose
    collective timed out ends the job (nobody can relaunch under torchrun), and the rest are left out."""
    start = time.monotonic()
    ctx = DistContext.join(job.timeout_s, job.device)
    peer_lost = False
    try:
        outcomes = execute_job(job, ctx, StepLog(None))
        peer_lost = ctx.rank == 0 and _lost_peer(outcomes or [])
        if not peer_lost:  # a lost peer would never join the broadcast
            try:
                outcomes = ctx.broadcast_from_root(outcomes)
            except Exception as exc:  # noqa: BLE001 - rank 0 saw a lost peer and did not share
                failure = RankFailure(0, FailureKind.HANG, f"rank 0 did not share the result ({type(exc).__name__})")
                peer_lost = True
                return LaunchResult([CaseOutcome(job.cases[0], failures=[failure])], wall_s=time.monotonic() - start, launches=1)
    finally:
        ctx.close(sync=not peer_lost)
    result = LaunchResult(list(outcomes or []), wall_s=time.monotonic() - start, launches=1)
    refused = next((o.refusal for o in result.outcomes if o.refusal is not None), None)
    if refused is not None:
        from cpdoctor.launch.jobs import RankStatus

        setattr(result, "bad_input" if refused.status is RankStatus.BAD_INPUT else "cannot_examine", refused.message)
    return result
