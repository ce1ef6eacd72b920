"""Where each rank is, and whether it still moves: every rank records the step it has reached and ticks while it
computes, so a hang is "no rank has moved for T seconds", named by what the ranks did, not by timing margins.

A spawned rank writes `rank<R>.step` (atomically): its case, its step (joining the process group, preparing a
case, inside the examination's collectives, reporting to rank 0, rank 0 evaluating, the other ranks awaiting
rank 0's verdict), a tick counter and what it is doing. The supervising parent (spawn.py) reads the files as it
polls: a file whose text changed is a rank that moved. Ticks come from three places, none a collective:
- `mark` at every step of the worker (worker.py);
- `tick(what)` where an examination computes for long (rank 0's no-CP baseline and reference, the step
  examination's reference), and `ticking(model, what)`: hooks on every module of a model, forward and backward,
  so a long computation moves layer by layer;
- on CPU a heartbeat thread (`start_heartbeat`) that ticks while the process burns CPU time (a single slow
  matmul, importing torch): a rank blocked in a gloo collective or asleep burns none.
Writes are throttled (TICK_WRITE_S), so a tick costs a clock read.

While it examines, a rank also keeps its flight record in `rank<R>.flight` (flight.py): how many collectives
it entered and the one it is blocked in, rewritten in place at every enter, wait and leave.

When no rank has moved for the timeout, the ranks furthest behind are the stuck ones; the others were waiting
for them in a collective. Among ranks at the same step, the ones outside any collective are stuck while those
inside one wait for them (`blame`); ranks that all stopped at the same step with nothing to tell them apart are a
deadlock among themselves, and all of them are named.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

STEPS = ("joining", "preparing", "examining", "reporting", "evaluating", "awaiting", "done")
"""In order. `preparing` -> `examining` is where a rank enters the examination's first collective; after the
gather, rank 0 is `evaluating` and every other rank `awaiting` its verdict (so a rank that waits for rank 0's
evaluation is ahead of it, never behind)."""

TICK_WRITE_S = 0.25
"""At most one tick written per this many seconds (marks are always written)."""

HEARTBEAT_S = 0.5
HEARTBEAT_CPU_SHARE = 0.1
"""The heartbeat ticks when the process used at least this share of one core over the last HEARTBEAT_S: a rank
that computes does (even on a loaded machine), a rank asleep or blocked in a gloo collective does not."""


@dataclass(frozen=True)
class Collectives:
    """A rank's flight record in its case (flight.py): how many collectives it entered, and the one it is in
    now (`op` and its number `seq`; no `op`: outside any collective)."""

    entered: int = 0
    op: str = ""
    seq: int = 0

    @property
    def inside(self) -> bool:
        return bool(self.op)

    def describe(self) -> str:
        """ "in all_gather #3", "outside any collective (2 entered)"."""
        return f"in {self.op} #{self.seq}" if self.inside else f"outside any collective ({self.entered} entered)"

    def token(self) -> str:
        """The flight file's text: `@2` (2 entered, outside), `@3:all_gather#3` (in it); "" when empty."""
        if not self.entered and not self.inside:
            return ""
        return f"@{self.entered}" + (f":{self.op}#{self.seq}" if self.inside else "")

    @classmethod
    def parse(cls, token: str) -> Collectives:
        """The record `token` wrote; an empty one for anything else (no file, nothing entered, a torn read)."""
        found = _TOKEN.fullmatch(token.strip())
        if found is None:
            return cls()
        return cls(int(found["entered"]), found["op"] or "", int(found["seq"] or 0))


_TOKEN = re.compile(r"@(?P<entered>\d+)(?::(?P<op>[^\s#]+)#(?P<seq>\d+))?")


@dataclass(frozen=True, order=True)
class Milestone:
    """Where a rank is (what its step file says): its case, the index of its point in STEPS, the ticks since, and
    what it is doing. A rank's progress point, not the step examination (examinations/step)."""

    case: int
    index: int
    ticks: int = field(default=0, compare=False)
    doing: str = field(default="", compare=False)
    flight: Collectives = field(default=Collectives(), compare=False)

    @property
    def name(self) -> str:
        return STEPS[self.index]

    def describe(self) -> str:
        if self.index == 0:
            return "joining the process group"
        where = f"case {self.case + 1}: {self.name}" + (f" ({self.doing})" if self.doing else "")
        return where + (f", {self.flight.describe()}" if self.flight.token() else "")

    def text(self) -> str:
        """The step file's text (the flight record has a file of its own)."""
        return f"{self.case} {self.name} {self.ticks} {self.doing}".rstrip()

    @classmethod
    def parse(cls, text: str, flight: str = "") -> Milestone | None:
        """The step a step file's `text` says, with the flight file's `flight` record."""
        parts = text.split(maxsplit=3)
        try:
            ticks = int(parts[2]) if len(parts) > 2 else 0
            return cls(int(parts[0]), STEPS.index(parts[1]), ticks, parts[3] if len(parts) > 3 else "", Collectives.parse(flight))
        except (ValueError, IndexError):
            return None


FLIGHT_WIDTH = 64
"""The flight file's one record, padded to this many bytes: each record overwrites the last in place."""


class StepLog:
    """Records this rank's steps and ticks in `path` and its flight record (flight.py) in `flight_path` (no-op
    without them: under torchrun nobody supervises).

    The step file is replaced atomically at each write (a temporary file renamed over it: 2.5 ms on this
    project's 2-core machine under load). The flight record changes at every collective entered, waited in and
    left, so it is written in place instead, one `pwrite` of FLIGHT_WIDTH bytes into a file kept open (1 µs
    there): a reader may catch a record half written, but only while the rank moves, and the parent reads the
    record that decides anything after nobody moved for the timeout."""

    def __init__(self, path: str | None, case_offset: int = 0, flight_path: str | None = None):
        self.path = path
        self.flight_path = flight_path
        self.case_offset = case_offset
        self._step = Milestone(case_offset, 0)
        self._written = 0.0
        self._lock = threading.Lock()
        self._flight_fd: int | None = None

    def mark(self, case: int, step: str) -> None:
        with self._lock:
            self._step = Milestone(case + self.case_offset, STEPS.index(step), self._step.ticks + 1)
            self._write()

    def tick(self, doing: str | None = None) -> None:
        """This rank moved (`doing`: what it does now; None keeps the last). Written at most every TICK_WRITE_S."""
        if self.path is None:
            return
        with self._lock:
            s = self._step
            self._step = Milestone(s.case, s.index, s.ticks + 1, s.doing if doing is None else doing)
            if time.monotonic() - self._written >= TICK_WRITE_S:
                self._write()

    def collectives(self, record: Collectives) -> None:
        """The rank entered, waits in or left a collective (flight.py): its record, written at once, in place
        (the parent counts a change of it as a move, like one of the step file)."""
        if self.flight_path is None:
            return
        if self._flight_fd is None:
            self._flight_fd = os.open(self.flight_path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._flight_fd, record.token().ljust(FLIGHT_WIDTH).encode(), 0)

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(self._step.text())
        os.replace(tmp, self.path)
        self._written = time.monotonic()


def read_step(path: str, flight_path: str | None = None) -> Milestone | None:
    """The step a rank's step file says (None: no file yet), with its flight record when `flight_path` is given."""
    text = read_text(path)
    flight = (read_text(flight_path) or "") if flight_path is not None else ""
    return None if text is None else Milestone.parse(text, flight)


def read_text(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------------------
# Ticks from inside an examination: the rank's active log (set by the worker), no-op when there is none
# ----------------------------------------------------------------------------------------------------------


class ActiveLog:
    """The step log `tick` writes to in this process, and the files `raised` and `advise` write to. Lifetime: set
    once per rank by the worker (`activate`) before its first case, or by launch/armed.py in a process of a command
    `cpdoctor step -- cmd` launched, kept for the process's life; None in every other process (the parent, a
    training script), where `tick` and `raised` are no-ops and `advise` prints. `advised`
    holds the advice given so far in this process (each said once)."""

    def __init__(self) -> None:
        self.log: StepLog | None = None
        self.raised_path: str | None = None
        self.advice_path: str | None = None
        self.advised: list[str] = []


ACTIVE = ActiveLog()


def activate(log: StepLog | None, raised_path: str | None = None, advice_path: str | None = None) -> None:
    """Make `log` the one `tick` writes to, `raised_path` where `raised` notes an exception and `advice_path`
    where `advise` writes (the worker does, once per rank)."""
    ACTIVE.log = log
    ACTIVE.raised_path = raised_path
    ACTIVE.advice_path = advice_path
    ACTIVE.advised = []


def advise(text: str) -> None:
    """Advice for the user that a rank learns while it runs (one line, e.g. "bf16 is 240× slower than fp32 on
    this CPU"), said once per process. Under a supervising parent it goes to this rank's advice file, which the
    parent prints as soon as it reads it and keeps for the report (spawn.py); in any other process (a training
    script under torchrun) it is printed to stderr here. Cheap; never a collective."""
    line = text.replace("\n", " ")
    if line in ACTIVE.advised:
        return
    ACTIVE.advised.append(line)
    if ACTIVE.advice_path is None:
        show_advice(line)
        return
    tmp = ACTIVE.advice_path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write("\n".join(ACTIVE.advised) + "\n")
    os.replace(tmp, ACTIVE.advice_path)


def show_advice(line: str) -> None:
    """Print one line of advice for the user, on stderr (above a spinner, which redirects it)."""
    print(f"cpdoctor: warning: {line}", file=sys.stderr, flush=True)


def read_advice(path: str) -> list[str]:
    """The lines a rank gave with `advise` (none when it gave none)."""
    return [line for line in (read_text(path) or "").splitlines() if line]


def raised(message: str, traceback: str) -> None:
    """Note, for the supervising parent, that code this rank examines raised (`message`: one line) and was
    caught by the examination, which goes on to agree with its peers. When a peer never arrives (it is stuck in
    a collective the raising rank left), the parent's report of the stall names this rank's exception as the
    CRASH instead of a HANG of everyone (spawn.py). Cheap; never a collective."""
    path = ACTIVE.raised_path
    if path is None:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(message.replace("\n", " ") + "\n" + traceback)
    os.replace(tmp, path)


def read_raised(path: str) -> tuple[str, str] | None:
    """(message, traceback) a rank noted with `raised`, None when it noted nothing."""
    text = read_text(path)
    if not text:
        return None
    message, _, traceback = text.partition("\n")
    return message, traceback


def tick(doing: str | None = None) -> None:
    """This rank is still computing (`doing`: what, for the report of a hang). Cheap; never a collective."""
    if ACTIVE.log is not None:
        ACTIVE.log.tick(doing)


@contextlib.contextmanager
def ticking(model: Any, what: str) -> Iterator[None]:
    """Tick at every module call of `model`, forward and backward, as `what: <block>` (the module's first two
    name segments, e.g. `transformer_blocks.3`): a long forward/backward moves layer by layer."""
    if ACTIVE.log is None:
        yield
        return
    handles = []
    for name, module in model.named_modules():
        doing = f"{what}: {'.'.join(name.split('.')[:2])}" if name else what
        handles.append(module.register_forward_hook(_forward_tick(doing)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _forward_tick(doing: str) -> Any:
    def on_grad(grad: Any) -> None:
        tick(doing + " (backward)")

    def hook(module: Any, args: Any, output: Any) -> None:
        tick(doing)
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if getattr(first, "requires_grad", False) and hasattr(first, "register_hook"):
            first.register_hook(on_grad)

    return hook


class Heartbeat:
    """A daemon thread that ticks while this process burns CPU time (see HEARTBEAT_CPU_SHARE)."""

    def __init__(self) -> None:
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="cpdoctor-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.process_time()
        while True:
            time.sleep(HEARTBEAT_S)
            now = time.process_time()
            if self.enabled and now - last >= HEARTBEAT_CPU_SHARE * HEARTBEAT_S:
                tick()
            last = now


@dataclass(frozen=True)
class Blame:
    """Who stopped a launch that nobody moved in for the timeout: the `stuck` ranks, the ones `waiting` for them,
    and, when their flight records told them apart, what the stuck ones did ("stopped outside any collective while
    rank 0 waits in all_gather #1"; "" when the steps alone named them)."""

    stuck: list[int]
    waiting: list[int]
    why: str = ""


def blame(steps: dict[int, Milestone | None]) -> Blame:
    """Who is stuck among the ranks that did not finish, from the step each one reached (None: not even started).

    The ranks behind all others are stuck; the rest were waiting for them. Among ranks at the same step, their
    flight records (flight.py) decide: when some are in a collective and others are outside any, and an outside
    one never went past the collective the others wait in (it entered no more than that collective's number), the
    ranks outside are stuck and those inside wait for them. Otherwise (nobody in a collective: all compute-bound
    or asleep; everyone in one: a deadlock or mismatched collectives among them; the ranks outside all went past
    what the others wait in) nobody is ahead to wait for anyone, and all of them are named."""
    if not steps:
        return Blame([], [])
    floor = Milestone(-1, -1)
    progress = {rank: step or floor for rank, step in steps.items()}
    lowest = min(progress.values())
    hung = sorted(r for r, s in progress.items() if s == lowest)
    waiting = sorted(r for r in progress if r not in hung)
    flights = {r: progress[r].flight for r in hung}
    inside = [r for r in hung if flights[r].inside]
    outside = [r for r in hung if not flights[r].inside]
    if inside and outside and any(flights[r].entered <= min(flights[w].seq for w in inside) for r in outside):
        return Blame(outside, sorted(waiting + inside), _stopped_outside(flights, inside))
    return Blame(hung, waiting)


def _stopped_outside(flights: dict[int, Collectives], inside: list[int]) -> str:
    """ "stopped outside any collective while rank 0 waits in all_gather #3" (ranks in the same one together)."""
    where: dict[str, list[int]] = {}
    for r in inside:
        where.setdefault(f"{flights[r].op} #{flights[r].seq}", []).append(r)
    waits = ", ".join(f"rank {', '.join(map(str, ranks))} {'waits' if len(ranks) == 1 else 'wait'} in {c}" for c, ranks in where.items())
    return f"stopped outside any collective while {waits}"
