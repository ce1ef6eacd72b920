"""Processes, process groups, meshes, timeouts and the gather to rank 0: the only place that does them.

Two ways in, one worker body (worker.py):
- started plainly, `spawn.run_spawned` starts ring × ulysses copies of `python -m cpdoctor.launch` with
  torchrun's environment variables, supervises them, and turns a rank that raised, died or stopped moving into
  a RankFailure (a HANG when no rank has moved for the timeout, the stuck rank named by the step each rank
  reached, progress.py; each launch's wall time bounded apart, jobs.wall_bound_s), killing every process it
  started; the cases after a failed one run in a fresh launch;
- under torchrun (RANK and WORLD_SIZE set), `torchrun.run_in_this_process` joins the existing world.

This package must not import torch at module level: the CLI imports it to spawn workers and stays light.
"""

from __future__ import annotations

from collections.abc import Callable

from cpdoctor.errors import BadInput
from cpdoctor.launch.jobs import Case, CaseOutcome, FailureKind, Job, LaunchResult, RankFailure, RankPayload, RankStatus
from cpdoctor.launch.torchrun import is_reporting_rank, torchrun_world_size, under_torchrun

__all__ = [
    "Case",
    "CaseOutcome",
    "FailureKind",
    "Job",
    "LaunchResult",
    "RankFailure",
    "RankPayload",
    "RankStatus",
    "is_reporting_rank",
    "run",
    "under_torchrun",
]


def run(job: Job, world_size: int, on_tick: Callable[[], None] | None = None) -> LaunchResult:
    """Join torchrun's world when there is one, else spawn the ranks. A torchrun world of k × `world_size`
    processes (a dp × cp training job calling `preflight`) examines its k CP groups at once, rank 0's result
    every rank's; a world that is no multiple is bad input."""
    if under_torchrun():
        world = torchrun_world_size()
        if world % world_size:
            raise BadInput(f"torchrun started {world} processes but ring × ulysses = {world_size}, which does not divide it")
        from cpdoctor.launch.torchrun import run_in_this_process

        return run_in_this_process(job, group_size=world_size)
    from cpdoctor.launch.spawn import run_spawned

    return run_spawned(job, world_size, on_tick)
