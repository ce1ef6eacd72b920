"""The user's own command, launched and supervised for `cpdoctor step -- <command>`: started in a session of its own
with cpdoctor's startup module first on PYTHONPATH (launch/startup/: it arms every Python process of the job) and
the run's folder in CPDOCTOR_STEP_DIR; watched until it exits; killed, with every process it started, when
nothing moved for the timeout.

What counts as a move: a rank's step file changing (launch/armed.py: module calls, CPU time, where it is), the
command writing output, or its processes burning CPU time (at least CPU_SHARE of one core since the last look:
importing torch, loading data; a rank blocked in a gloo collective or asleep burns none, and torchrun's agent
polling its workers burns far less). When nothing moved for `timeout_s` (or the wall bound, jobs.wall_bound_s, passed),
the ranks furthest behind are the stopped ones (progress.blame). Processes are killed by SIGKILL: the command's
process group and every descendant seen while it ran (torchrun starts each worker in a session of its own, so
the group alone would miss them), each checked by its start time so a reused pid is never killed. After a
normal exit the descendants still alive (a data loader worker the rank left behind) are killed the same way.
Linux: descendants are read from /proc; elsewhere only the process group is killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cpdoctor.launch import armed
from cpdoctor.launch.jobs import wall_bound_s
from cpdoctor.launch.progress import Blame, Milestone, blame, read_step, read_text

VARIABLE = "CPDOCTOR_STEP_DIR"
"""The variable the startup module reads (launch/startup/sitecustomize.py)."""
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")
"""The folder put first on PYTHONPATH: it holds only the startup module."""
POLL_S = 0.1
TREE_EVERY_S = 0.5
"""How often the process tree is read (/proc): cheap, but not at every poll."""
LOG_NAME = "command.log"
CPU_SHARE = 0.1
"""The process tree moved when it used at least this share of one core since the last look (progress.py's rule)."""
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CommandRun:
    """How one launch of the command ended: its exit code (None: cpdoctor killed it), the wall time, whether it
    was stopped because nothing moved (`stalled`) or at the wall bound, the step each rank reached (by rank; None:
    its file was unreadable), who blame names, the end of its output, and how many processes it left behind."""

    returncode: int | None
    wall_s: float
    stalled: bool = False
    wall_bound: bool = False
    steps: dict[int, Milestone | None] = field(default_factory=dict)
    blamed: Blame | None = None
    output_tail: str = ""
    left_behind: int = 0

    @property
    def killed(self) -> bool:
        return self.returncode is None


def environment(directory: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The command's environment: this one, the startup folder first on PYTHONPATH (then the user's entries, then
    the folder cpdoctor itself is imported from when that is a source checkout rather than site-packages, so the
    armed processes can import it), and the run's folder in CPDOCTOR_STEP_DIR."""
    env = dict(os.environ if base is None else base)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extra = [] if os.path.basename(package_parent) in ("site-packages", "dist-packages") else [package_parent]
    entries = [STARTUP, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *extra]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    env[VARIABLE] = directory
    return env


def run_command(
    argv: Sequence[str],
    directory: str,
    timeout_s: float,
    *,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    on_poll: Callable[[], None] | None = None,
) -> CommandRun:
    """Run `argv` armed (see `environment`), its output in DIRECTORY/command.log, until it exits or stops moving."""
    os.makedirs(directory, exist_ok=True)
    log_path = os.path.join(directory, LOG_NAME)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=environment(directory, env),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    tree = ProcessTree(proc.pid)
    try:
        stopped = _supervise(proc, tree, directory, log_path, timeout_s, on_poll)
    finally:
        left = tree.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    steps = read_steps(directory)
    return CommandRun(
        returncode=None if stopped else proc.returncode,
        wall_s=time.monotonic() - start,
        stalled=stopped == "stalled",
        wall_bound=stopped == "wall",
        steps=steps,
        blamed=blame(steps) if stopped else None,
        output_tail=tail(log_path),
        left_behind=0 if stopped else left,
    )


def _supervise(
    proc: subprocess.Popen, tree: ProcessTree, directory: str, log_path: str, timeout_s: float, on_poll: Callable[[], None] | None
) -> str:
    """Wait for the command; "" when it exited, "stalled" or "wall" when it was stopped (then its tree is killed)."""
    moved = last_tree = time.monotonic()
    seen = _movement(directory, log_path)
    deadline = moved + wall_bound_s(timeout_s)
    while proc.poll() is None:
        now = time.monotonic()
        if now - last_tree >= TREE_EVERY_S:
            tree.read()
            if tree.burned() >= CPU_SHARE * (now - last_tree):
                moved = now
            last_tree = now
        state = _movement(directory, log_path)
        if state != seen:
            seen, moved = state, now
        if now - moved > timeout_s or now > deadline:
            tree.read()
            tree.kill()
            return "stalled" if now - moved > timeout_s else "wall"
        if on_poll is not None:
            on_poll()
        time.sleep(POLL_S)
    return ""


def _movement(directory: str, log_path: str) -> tuple:
    """What changes when anything in the command moves: every step file's text and the output's size."""
    folder = os.path.join(directory, "progress")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    size = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    return (size, tuple((n, read_text(os.path.join(folder, n))) for n in names))


def read_steps(directory: str) -> dict[int, Milestone | None]:
    """The step each rank's file says, by rank (processes known only by their pid are left out)."""
    folder = os.path.join(directory, "progress")
    out: dict[int, Milestone | None] = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        stem = name.removesuffix(".step")
        if name.endswith(".step") and stem.startswith("rank") and stem[4:].isdigit():
            out[int(stem[4:])] = read_step(armed.progress_path(directory, stem))
    return out


def tail(path: str, n: int = 6000) -> str:
    with contextlib.suppress(OSError):
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - n))
            return fh.read().decode(errors="replace")
    return ""


class ProcessTree:
    """The command and every process it started, as seen while it ran: pid -> its start time (field 22 of
    /proc/PID/stat), so a pid reused after one of them exited is never taken for it."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        """Each process's CPU seconds at the last look (`burned` counts what was added since)."""
        self.read()

    def read(self) -> None:
        """Add every process whose parent is one already seen (the root included)."""
        if not os.path.isdir("/proc"):
            return
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(int(entry))
                if stat is not None:
                    stats[int(entry)] = stat
        known = {self.root} | set(self.seen)
        grew = True
        while grew:
            grew = False
            for pid, (ppid, _started) in stats.items():
                if ppid in known and pid not in known:
                    known.add(pid)
                    grew = True
        for pid in known:
            if pid in stats and pid not in self.seen:
                self.seen[pid] = stats[pid][1]

    def burned(self) -> float:
        """CPU seconds the processes seen used since the last call (a process that ended adds nothing more)."""
        total = 0.0
        for pid, started in self.seen.items():
            stat = _stat(pid)
            if stat is None or stat[1] != started:
                continue
            now = _cpu_seconds(pid)
            total += max(0.0, now - self.cpu.get(pid, 0.0))  # a process new since the last look: all its time
            self.cpu[pid] = now
        return total

    def alive(self) -> list[int]:
        """The processes seen that still run (their start time unchanged), the root aside."""
        out = []
        for pid, started in self.seen.items():
            stat = _stat(pid)
            if pid != self.root and stat is not None and stat[1] == started and not _zombie(pid):
                out.append(pid)
        return out

    def kill(self) -> int:
        """SIGKILL the command's process group and every descendant still alive; how many descendants there were."""
        self.read()
        left = self.alive()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.root, signal.SIGKILL)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return len(left)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, None when it is gone."""
    text = read_text(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[1]), fields[19]) if len(fields) > 19 else None


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process (fields 14 and 15 of /proc/PID/stat), 0 when it is gone."""
    text = read_text(f"/proc/{pid}/stat") or ""
    fields = text.rsplit(")", 1)[1].split() if ")" in text else []
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS if len(fields) > 12 else 0.0


def _zombie(pid: int) -> bool:
    text = read_text(f"/proc/{pid}/stat") or ""
    fields = text.rsplit(")", 1)[1].split() if ")" in text else []
    return bool(fields) and fields[0] == "Z"
