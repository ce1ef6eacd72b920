"""Under torchrun (or inside a training script's process group): this process is one rank of an existing
world. Every rank gets rank 0's outcomes, so every rank can act on them alike."""

from __future__ import annotations

import os
import time

from cpdoctor.attempt import Attempt
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


class HeldGroup:
    """The process group the CLI keeps under torchrun until every rank leaves together. Lifetime: one instance,
    `HELD`, created at this module's import; armed by `hold_group_until_exit` (the CLI, before its command runs);
    the first job that creates the group hands it over (`keep`) instead of destroying it; `leave_together` uses it
    and ends the process. `release` (a test, or anything that must go on in this process) destroys the held group
    and disarms: nothing survives it, and the next job creates its group afresh."""

    def __init__(self) -> None:
        self.armed = False
        """Keep the group the next job creates (set by the CLI under torchrun)."""
        self.context: DistContext | None = None
        """The kept group's context, or None."""

    def arm(self) -> None:
        self.armed = True

    def keep(self, ctx: DistContext) -> bool:
        """Take `ctx` instead of its job closing it: only when armed, only a group the job created (a training
        script's own group is never ours to keep), and only the first (later jobs join the kept one)."""
        if not (self.armed and ctx.owns_group and self.context is None):
            return False
        self.context = ctx
        return True

    def release(self) -> None:
        """Destroy the held group (if any) and disarm."""
        ctx, self.context, self.armed = self.context, None, False
        if ctx is not None:
            ctx.close()


HELD = HeldGroup()

EXIT_DELAY_S = 0.5
"""Every rank exits at rank 0's clock time now + this: after the broadcast every rank is awake, and sleeping
until one absolute moment lines the exits up far tighter than returning from a barrier does on a loaded host
(torchrun polls its workers every 0.1 s and kills the rest as soon as one has exited non-zero)."""


def hold_group_until_exit() -> None:
    """The CLI under torchrun: keep the process group this rank created until `leave_together`, so that every
    rank leaves at the same moment with the same exit code (torchrun kills the others as soon as one rank
    exits non-zero, and reports a 40-line ChildFailedError of SIGTERMs)."""
    HELD.arm()


def leave_together(code: int) -> None:
    """Wait for every rank, then exit at once with `code` (no teardown a peer could trip over). Without a
    held group this is a plain exit."""
    import sys

    held = HELD.context
    if held is None:
        sys.exit(code)
    import contextlib
    import time

    sys.stdout.flush()
    sys.stderr.flush()
    deadline = time.time() + EXIT_DELAY_S
    with contextlib.suppress(Exception):  # one moment for all: rank 0's clock (one node shares it)
        deadline = held.broadcast_to_world(deadline)
    time.sleep(max(0.0, min(EXIT_DELAY_S * 4, deadline - time.time())))
    os._exit(code)


def _lost_peer(outcomes: list[CaseOutcome]) -> bool:
    return any(f.kind is FailureKind.HANG for o in outcomes for f in o.failures)


def run_in_this_process(job: Job, group_size: int | None = None) -> LaunchResult:
    """Run the job as this rank (of its CP group of `group_size` ranks, where the world holds several: each group
    examines at once and the first group's outcomes are every rank's). Cases after a failed one that every rank
    reported still run; a case whose collective timed out ends the job (nobody can relaunch under torchrun), and
    the rest are left out."""
    start = time.monotonic()
    ctx = DistContext.join(job.timeout_s, job.device, group_size)
    peer_lost = False
    try:
        outcomes = execute_job(job, ctx, StepLog(None))
        peer_lost = ctx.rank == 0 and _lost_peer(outcomes or [])
        if not peer_lost:  # a lost peer would never join the broadcast
            shared = Attempt.of(lambda: ctx.broadcast_to_world(outcomes))  # rank 0 saw a lost peer and did not share
            if shared.error is not None:
                failure = RankFailure(0, FailureKind.HANG, f"rank 0 did not share the result ({type(shared.error).__name__})")
                peer_lost = True
                return LaunchResult([CaseOutcome(job.cases[0], failures=[failure])], wall_s=time.monotonic() - start, launches=1)
            outcomes = shared.value
    finally:
        if peer_lost or not HELD.keep(ctx):
            ctx.close(sync=not peer_lost)
    result = LaunchResult(list(outcomes or []), wall_s=time.monotonic() - start, launches=1)
    refused = next((o.refusal for o in result.outcomes if o.refusal is not None), None)
    if refused is not None:
        from cpdoctor.launch.jobs import RankStatus

        setattr(result, "bad_input" if refused.status is RankStatus.BAD_INPUT else "cannot_examine", refused.message)
    return result
