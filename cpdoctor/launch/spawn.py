"""The supervising parent: start the ranks, watch them, and turn a rank that raised, died or stopped moving into
a RankFailure, killing every process it started. A launch is a HANG when no rank has moved (progress.py) for
the job's timeout, or when it is still going at the wall bound (jobs.wall_bound_s); a slow rank that keeps
moving is never one. When a case stops the launch, the cases after it run in a fresh launch, so a crash never
hides what comes after it."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cpdoctor.launch.jobs import (
    WALL_BOUND_FACTOR,
    WALL_BOUND_FLOOR_S,
    CaseOutcome,
    FailureKind,
    Job,
    LaunchResult,
    RankFailure,
    RankPayload,
    RankStatus,
    wall_bound_s,
)
from cpdoctor.launch.progress import Milestone, blame, read_advice, read_raised, read_step, read_text, show_advice
from cpdoctor.launch.warm import WARM, WarmRank
from cpdoctor.launch.worker import RankFile, outcome_path, rank_file

RankProcess = subprocess.Popen | WarmRank
"""A rank the parent supervises: spawned (Popen) or forked from the warm server; both have pid, poll and wait."""

GRACE_AFTER_FAILURE_S = 3.0
"""How long the survivors of a failed rank get to report before they are killed."""

POLL_S = 0.05

PORT_TRIES = 3
"""How many ports a launch tries. `free_port` frees the port it found before rank 0 binds it, and another
process (an outgoing gloo connection takes an ephemeral port from the same range) can take it meanwhile;
torch then raises DistNetworkError "... EADDRINUSE ..." in rank 0's TCPStore before any case ran. That is our
race, not the user's crash, so the launch is started again on a fresh port (torchrun's elastic agent retries
its rendezvous the same way)."""

PORT_TAKEN = "EADDRINUSE"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def rank_environment(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """The environment of one single-node rank, torchrun's variables included, with the cores shared out
    (OMP_NUM_THREADS as the user set it, else cores / ranks)."""
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(_threads_per_rank(world_size))),
    )
    env.update(extra)
    return env


def _tail(path: str, n: int = 4000) -> str:
    with contextlib.suppress(OSError):
        with open(path, "rb") as fh:
            data = fh.read()
        return data[-n:].decode(errors="replace")
    return ""


def _load(path: str) -> object | None:
    with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
        with open(path, "rb") as fh:
            return pickle.load(fh)
    return None


def _kill_all(procs: list[RankProcess]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):  # a fork killed before its setsid
                os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


@dataclass
class _Watch:
    """What the parent has seen of one launch so far."""

    out_dir: str
    procs: list[RankProcess]
    outcomes: dict[int, CaseOutcome] = field(default_factory=dict)
    errors: dict[int, tuple[int, RankPayload]] = field(default_factory=dict)  # rank -> (case index, payload)
    failed_at: float | None = None
    killed: bool = False  # after we killed the ranks, their exit codes say nothing about them
    started: float = field(default_factory=time.monotonic)
    seen: dict[int, str | None] = field(default_factory=dict)  # rank -> the text of its step and flight files last read
    moved: dict[int, float] = field(default_factory=dict)  # rank -> when its step file last changed
    why: str = "stalled"  # why the launch was stopped: "stalled" (nobody moved) or "wall" (the wall bound)
    advice: list[str] = field(default_factory=list)  # what the ranks advised (progress.advise), in the order first read

    def read_advice(self) -> None:
        """Print each line of advice a rank gave, the first time it is read (on stderr, above a spinner)."""
        for rank in range(len(self.procs)):
            for line in read_advice(rank_file(self.out_dir, rank, RankFile.ADVICE)):
                if line not in self.advice:
                    self.advice.append(line)
                    show_advice(line)

    def watch_progress(self, now: float) -> None:
        """Note every rank whose step file or flight record changed since the last poll: it moved."""
        for rank in range(len(self.procs)):
            text = read_text(rank_file(self.out_dir, rank, RankFile.STEP))
            if text is not None:
                text += "\n" + (read_text(rank_file(self.out_dir, rank, RankFile.FLIGHT)) or "")
            if text is not None and text != self.seen.get(rank):
                self.seen[rank] = text
                self.moved[rank] = now

    def last_move(self) -> float:
        """When any rank last moved (the launch's start counts as a move)."""
        return max([self.started, *self.moved.values()])

    def moving(self, now: float, within_s: float) -> list[int]:
        """The ranks that moved in the last `within_s` seconds."""
        return sorted(r for r, t in self.moved.items() if now - t <= within_s)

    def poll(self, now: float) -> None:
        for i in range(len(self.outcomes), 10**6):
            outcome = _load(outcome_path(self.out_dir, i)) if os.path.exists(outcome_path(self.out_dir, i)) else None
            if outcome is None:
                break
            self.outcomes[i] = outcome  # type: ignore[assignment]
        for rank, p in enumerate(self.procs):
            if os.path.exists(rank_file(self.out_dir, rank, RankFile.STATUS)):  # the latest error of this rank
                got = _load(rank_file(self.out_dir, rank, RankFile.STATUS))
                if got is not None:
                    self.errors[rank] = got  # type: ignore[assignment]
            code = p.poll()
            if rank not in self.errors and code not in (None, 0) and not self.killed:
                log = _tail(os.path.join(self.out_dir, f"rank{rank}.log"))
                self.errors[rank] = (-1, RankPayload(RankStatus.ERROR, message=f"rank {rank} died with exit code {code}", traceback=log))
        pending = [
            (i, p)
            for i, p in self.errors.values()
            if p.status is RankStatus.ERROR and not p.timed_out and (i < 0 or i not in self.outcomes)
        ]
        if pending and self.failed_at is None:
            self.failed_at = now
        if not pending:
            self.failed_at = None  # every failure so far was reported through the gather: the job goes on

    def all_exited(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def refusal(self) -> RankPayload | None:
        refused = [p for _, p in self.errors.values() if p.status in (RankStatus.BAD_INPUT, RankStatus.CANNOT_EXAMINE)]
        if refused and (self.all_exited() or len(refused) == len(self.procs)):
            return refused[0]
        return None


def _failures(watch: _Watch, index: int, timeout_s: float) -> list[RankFailure]:
    """Why case `index` did not complete: ranks that raised or died are CRASH. Otherwise, when no rank moved for
    the timeout, the ranks named by the step they reached and, at the same step, by the collective they are in
    (progress.blame) are HANG and the rest were waiting; at the wall bound, the ranks still moving are the ones the others were waiting for."""
    crashed = {r: p for r, (i, p) in watch.errors.items() if p.status is RankStatus.ERROR and not p.timed_out and i in (index, -1)}
    steps: dict[int, Milestone | None] = {
        r: read_step(rank_file(watch.out_dir, r, RankFile.STEP), rank_file(watch.out_dir, r, RankFile.FLIGHT))
        for r in range(len(watch.procs))
    }
    failures = [RankFailure(r, FailureKind.CRASH, p.message, p.traceback, where=_where(steps[r])) for r, p in crashed.items()]
    for r in sorted(set(steps) - set(crashed)):  # an exception the examination caught, then a peer never arrived
        noted = read_raised(rank_file(watch.out_dir, r, RankFile.RAISED))
        if noted is not None:
            crashed[r] = RankPayload(RankStatus.ERROR, message=noted[0], traceback=noted[1])
            failures.append(RankFailure(r, FailureKind.CRASH, noted[0], noted[1], where=_where(steps[r])))
    others = {r: s for r, s in steps.items() if r not in crashed}
    if crashed:
        return failures + [
            RankFailure(r, FailureKind.CRASH, "stopped while waiting for the failed rank in a collective", waiting=True, where=_where(s))
            for r, s in others.items()
        ]
    blamed = blame(others)
    hung, waiting = blamed.stuck, blamed.waiting
    message = f"{blamed.why or 'stopped moving'}: no rank moved for {timeout_s:g} s"
    still_moving = watch.why == "wall"
    if still_moving:
        still = [r for r in watch.moving(time.monotonic(), timeout_s) if r in others]
        if still:
            hung, waiting = still, sorted(r for r in others if r not in still)
        message = f"was still moving at the wall bound ({wall_bound_s(timeout_s):g} s, the larger of {WALL_BOUND_FACTOR} × the timeout and {WALL_BOUND_FLOOR_S:g} s)"
    for r in hung:
        failures.append(
            RankFailure(
                r,
                FailureKind.HANG,
                message,
                _tail(os.path.join(watch.out_dir, f"rank{r}.log")),
                where=_where(others[r]),
                still_moving=still_moving,
            )
        )
    for r in waiting:
        failures.append(
            RankFailure(r, FailureKind.HANG, "was waiting for the hung rank in a collective", waiting=True, where=_where(others[r]))
        )
    return failures


def _where(step: Milestone | None) -> str:
    return step.describe() if step is not None else "not started"


def start_rank(job: Job, job_path: str, out_dir: str, env: dict[str, str], log_path: str) -> RankProcess:
    """One rank of `job`: forked from the warm server where it serves this environment and the job needs no fresh
    interpreter (warm.py), else a fresh `python -m cpdoctor.launch` in a session of its own. Either dies with
    this process (worker_main's parent-death signal) and writes its output to `log_path`."""
    if not job.fresh_interpreter and WARM.serves(env):
        with contextlib.suppress(OSError):  # the server could not fork: spawn this one
            return WARM.fork_rank(job_path, out_dir, env, log_path)
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "cpdoctor.launch", job_path, out_dir],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _launch_once(
    job: Job, world_size: int, on_tick: Callable[[], None] | None, advice: list[str]
) -> tuple[list[CaseOutcome], RankPayload | None]:
    """One launch: the outcomes of a prefix of the job's cases (the last one possibly a failure), or a refusal;
    the ranks' advice is added to `advice`."""
    with tempfile.TemporaryDirectory(prefix="cpdoctor-") as out_dir:
        job_path = os.path.join(out_dir, "job.pkl")
        with open(job_path, "wb") as fh:
            pickle.dump(job, fh)
        port = free_port()
        procs: list[RankProcess] = []
        try:
            for rank in range(world_size):
                env = rank_environment(rank, world_size, port, CPDOCTOR_SPAWNED="1", PYTHONUNBUFFERED="1")
                procs.append(start_rank(job, job_path, out_dir, env, os.path.join(out_dir, f"rank{rank}.log")))
            watch = _Watch(out_dir, procs, advice=advice)
            try:
                return _supervise(watch, job, on_tick)
            finally:
                watch.read_advice()  # what a rank advised just before it finished
        finally:
            _kill_all(procs)


def _lost_port_race(outcomes: list[CaseOutcome], refused: RankPayload | None) -> bool:
    """A launch whose first case failed because the rendezvous port was taken before rank 0 bound it."""
    if refused is not None or len(outcomes) != 1 or outcomes[0].completed:
        return False
    return any(PORT_TAKEN in f.message or PORT_TAKEN in f.traceback for f in outcomes[0].failures)


def _supervise(watch: _Watch, job: Job, on_tick: Callable[[], None] | None) -> tuple[list[CaseOutcome], RankPayload | None]:
    n = len(job.cases)
    wall_deadline = watch.started + wall_bound_s(job.timeout_s)
    while True:
        now = time.monotonic()
        watch.watch_progress(now)
        watch.read_advice()
        watch.poll(now)
        refused = watch.refusal()
        if refused is not None:
            return [], refused
        done = [watch.outcomes[i] for i in range(len(watch.outcomes))]
        if len(done) == n or (done and not done[-1].completed and watch.all_exited()):
            return done, None
        stopped = done and done[-1].refusal is not None
        if stopped:
            return done, None
        grace_over = watch.failed_at is not None and now - watch.failed_at > GRACE_AFTER_FAILURE_S
        stalled = now - watch.last_move() > job.timeout_s
        if now > wall_deadline and not stalled:
            watch.why = "wall"
        if grace_over or stalled or now > wall_deadline or watch.all_exited():
            break
        if on_tick is not None:
            on_tick()
        time.sleep(POLL_S)
    _kill_all(watch.procs)
    watch.killed = True
    watch.poll(time.monotonic())
    done = [watch.outcomes[i] for i in range(len(watch.outcomes))]
    if len(done) < n:
        done.append(CaseOutcome(job.cases[len(done)], failures=_failures(watch, len(done), job.timeout_s)))
    return done, None


def run_spawned(job: Job, world_size: int, on_tick: Callable[[], None] | None = None) -> LaunchResult:
    """Start `world_size` ranks, supervise them, and return every case's outcome.

    Never leaves a process behind: on success the workers have exited; on a failure or a timeout every one
    still alive is killed (each runs in its own session, so its whole process group goes). The cases after a
    failed one run in a fresh launch, each with the full timeout and wall bound."""
    start = time.monotonic()
    result = LaunchResult()
    remaining = list(job.cases)
    port_tries = PORT_TRIES
    while remaining:
        outcomes, refused = _launch_once(replace(job, cases=tuple(remaining)), world_size, on_tick, result.advice)
        result.launches += 1
        port_tries -= 1
        if port_tries > 0 and _lost_port_race(outcomes, refused):
            continue
        port_tries = PORT_TRIES
        if refused is not None:
            setattr(result, "bad_input" if refused.status is RankStatus.BAD_INPUT else "cannot_examine", refused.message)
            break
        result.outcomes += outcomes
        if outcomes and outcomes[-1].refusal is not None:
            refused = outcomes[-1].refusal
            setattr(result, "bad_input" if refused.status is RankStatus.BAD_INPUT else "cannot_examine", refused.message)
            break
        remaining = remaining[len(outcomes) :] if outcomes else remaining[1:]
    result.wall_s = time.monotonic() - start
    return result
