"""Inside one process of a command `cpdoctor step -- <command>` launched (launch/command.py), armed by the startup
module (launch/startup/sitecustomize.py): what the process does for the parent that supervises it, and how the
job ends once the capture is done.

- Its progress: a rank (RANK set by its launcher, or a process that ran a training forward) keeps a step file in
  the run's folder (`progress/<who>.step`, launch/progress.py's StepLog: the parent counts a change as a move), ticks
  at every module call and on CPU time (progress.Heartbeat), and says where it is (`mark`).
- Its advice for the user (progress.advise) goes to `advice/<who>.txt`, which the parent prints.
- The end: `leave_together` agrees with every rank through the process group's store (never a collective: a peer
  may be dead) that all are done, flushes, and ends the process with exit code 0 by `os._exit`, which no
  `try/except` of the user's script can swallow and which runs no teardown a peer could trip over; the first rank
  (whose process hosts the store when the script started the group itself) leaves last."""

from __future__ import annotations

import os
import sys
import time
from typing import NoReturn

from cpdoctor.launch import progress

RANK_VARIABLE = "RANK"

LAST_LEAVES_WITHIN_S = 10.0
"""How long the first rank waits for the others to say they are leaving before it leaves too."""


def who(rank: int | None = None) -> str:
    """This process's name in the run's folder (the startup module's rule): `rank<R>`, else `pid<PID>`."""
    if rank is None:
        text = os.environ.get(RANK_VARIABLE, "")
        rank = int(text) if text.isdigit() else None
    return f"rank{rank}" if rank is not None else f"pid{os.getpid()}"


def progress_path(directory: str, name: str) -> str:
    return os.path.join(directory, "progress", f"{name}.step")


def advice_path(directory: str, name: str) -> str:
    return os.path.join(directory, "advice", f"{name}.txt")


def raised_path(directory: str, name: str) -> str:
    return os.path.join(directory, "raised", f"{name}.txt")


def outcome_path(directory: str, name: str) -> str:
    return os.path.join(directory, "outcome", f"{name}.pkl")


def note_armed(directory: str) -> None:
    """Leave a mark that this process was armed (the parent tells "no Python process armed" from "none stepped")."""
    folder = os.path.join(directory, "armed")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"pid{os.getpid()}"), "w") as fh:
        fh.write(sys.executable)


def armed_count(directory: str) -> int:
    folder = os.path.join(directory, "armed")
    return len(os.listdir(folder)) if os.path.isdir(folder) else 0


def keep_progress(directory: str, name: str) -> None:
    """Start this process's step file and its heartbeat (once per process: the startup module arms once)."""
    for folder in ("progress", "advice", "raised", "outcome"):
        os.makedirs(os.path.join(directory, folder), exist_ok=True)
    log = progress.StepLog(progress_path(directory, name))
    progress.activate(log, raised_path(directory, name), advice_path(directory, name))
    log.mark(0, "joining")
    progress.Heartbeat()


def mark(step: str) -> None:
    """Where this process is now (progress.STEPS: joining, examining, reporting, done)."""
    log = progress.ACTIVE.log
    if log is not None:
        log.mark(0, step)


def write_outcome(directory: str, name: str, outcome: object) -> None:
    """What this process found, pickled for the parent (written whole, then renamed: never read half written)."""
    import pickle

    path = outcome_path(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(outcome, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def leave_together(timeout_s: float) -> NoReturn:
    """Every rank of the default process group says it is done and waits (at most `timeout_s`) for all to say so;
    then each leaves with exit code 0, the first rank last. Without a process group, the process just leaves."""
    mark("done")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to flush
            pass
    try:
        _agree_to_leave(timeout_s)
    except Exception:  # noqa: BLE001 - a peer that died or a store that went away: this rank leaves all the same
        pass
    os._exit(0)


def _agree_to_leave(timeout_s: float) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        return
    store = distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"cpdoctor/leave/{rank}", b"1")
    store.wait([f"cpdoctor/leave/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    if rank != 0:
        store.set(f"cpdoctor/left/{rank}", b"1")
        return
    deadline = time.monotonic() + LAST_LEAVES_WITHIN_S
    for r in range(1, world):
        left = max(deadline - time.monotonic(), 0.01)
        store.wait([f"cpdoctor/left/{r}"], timedelta(seconds=left))
