"""The parent of `cpdoctor step -- <command>`: the command launched twice (launch/command.py), run 1 without CP and
run 2 with CP, each armed through the startup module (capture.py in every process); what each process left in the
run's folder read back; the report. Run 2's ranks judged their step themselves, as the two-run examination does
(a `StepWatch` against run 1 on disk): its report is the answer. Everything else is said as a finding:

- a rank that raised (its traceback, by the startup module's excepthook), or a command that failed without one
  (the end of its output: torchrun's summary names a rank killed by a signal): CRASH, exit 1; in run 1, an error
  that says the job does not fit without CP (out of memory; a length not divisible at cp 1): UNSUPPORTED (exit 3)
  naming the rank and what to change;
- nothing moved for the timeout: the command's process tree killed, HANG naming the rank that stopped (exit 1);
- a command that exits without an optimizer step, or whose optimizer updates no module that ran with gradients:
  UNSUPPORTED (exit 3);
- a run on another number of processes than its degrees say, or a step that cannot be examined as asked (no CP
  enabled in run 2; degrees said two ways): bad input, exit 2."""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.runs.capture import ArmSpec, Captured, Ending
from cpdoctor.examinations.step.runs.command import RUNS, CommandRequest, RunDegrees, describe_run
from cpdoctor.examinations.step.runs.emulation import emulation_note
from cpdoctor.examinations.step.runs.request import Role
from cpdoctor.launch import armed
from cpdoctor.launch.command import CommandRun, run_command
from cpdoctor.launch.progress import Milestone, read_advice, read_raised, show_advice
from cpdoctor.report import FailureEvidence, Finding, Report, Verdict

DOES_NOT_FIT = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|MemoryError|DefaultCPUAllocator", re.IGNORECASE)
INDIVISIBLE = re.compile(r"divisible", re.IGNORECASE)
KILLED = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-\d+)", re.DOTALL)
"""torchrun's failure summary: `rank : 1 (local_rank: 1)` then `exitcode : -9 (pid: ...)` (a signal)."""

WHERE = {
    "joining": "started, before its first training forward",
    "examining": "inside the training step",
    "reporting": "at its first optimizer step, capturing",
    "done": "done, leaving",
}


@dataclass(frozen=True)
class RunRow:
    """One launch of the command (JSON `runs`)."""

    run: int
    role: Role
    command: tuple[str, ...]
    processes: int
    exit_code: int | None
    wall_s: float

    def to_dict(self) -> dict:
        return {"run": self.run, "role": self.role.value, "command": list(self.command), "processes": self.processes,
                "exit_code": self.exit_code, "wall_s": round(self.wall_s, 3)}  # fmt: skip


@dataclass
class Launched:
    """What one launch left: how the command ended, each process's outcome and exception, its advice."""

    role: Role
    degrees: RunDegrees
    argv: list[str]
    ended: CommandRun
    outcomes: dict[str, Captured] = field(default_factory=dict)
    raised: dict[str, tuple[str, str]] = field(default_factory=dict)
    arm_failures: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    armed: int = 0
    """How many Python processes of the command the startup module armed (they imported torch)."""

    @property
    def subject(self) -> str:
        return f"training step, {describe_run(self.role, self.degrees)}: {' '.join(self.argv)}"

    def row(self) -> RunRow:
        ranks = {o.rank for o in self.outcomes.values()} | set(self.ended.steps)
        return RunRow(RUNS.index(self.role) + 1, self.role,
                      tuple(self.argv), len(ranks), self.ended.returncode, self.ended.wall_s)  # fmt: skip


def examine_command(request: CommandRequest, timeout_s: float, on_poll: Callable[[], None] | None = None) -> Report:
    """Run the command without CP, then with CP; the report of run 2's judgment, or of what stopped either run."""
    start = time.monotonic()
    launched: list[Launched] = []
    with tempfile.TemporaryDirectory(prefix="cpdoctor-step-") as work:
        saved = os.path.join(work, "saved")
        for role in RUNS:
            run = launch(request, role, os.path.join(work, role.value), saved, timeout_s, on_poll)
            launched.append(run)
            stopped = stop_findings(run, timeout_s)
            if stopped:
                return report_of(request, stopped, launched, start)
        return report_of(request, judged(request, launched[-1]), launched, start)


def launch(
    request: CommandRequest, role: Role, directory: str, saved: str, timeout_s: float, on_poll: Callable[[], None] | None
) -> Launched:
    degrees = request.degrees(role)
    ArmSpec(role, saved, degrees.ring, degrees.ulysses, degrees.dp, timeout_s, tuple(e.value for e in request.emulate)).write(directory)
    argv = request.argv(role)
    ended = run_command(argv, directory, timeout_s, cwd=request.cwd or None, on_poll=on_poll)
    run = Launched(role, degrees, argv, ended)
    read_folder(run, directory)
    for line in run.advice:
        show_advice(line)
    return run


def read_folder(run: Launched, directory: str) -> None:
    """Each process's outcome, exception and advice, from the run's folder."""
    run.armed = armed.armed_count(directory)
    for name in _listed(directory, "outcome", ".pkl"):
        with open(os.path.join(directory, "outcome", name + ".pkl"), "rb") as fh:
            outcome = pickle.load(fh)
        run.outcomes[outcome.who] = outcome
    for name in _listed(directory, "raised", ".txt"):
        if name.endswith(".arm"):
            with open(os.path.join(directory, "raised", name + ".txt")) as fh:
                run.arm_failures.append(fh.read().splitlines()[0])
            continue
        noted = read_raised(armed.raised_path(directory, name))
        if noted is not None:
            run.raised[name] = noted
    for name in _listed(directory, "advice", ".txt"):
        run.advice += [line for line in read_advice(armed.advice_path(directory, name)) if line not in run.advice]


def _listed(directory: str, folder: str, suffix: str) -> list[str]:
    path = os.path.join(directory, folder)
    return sorted(n.removesuffix(suffix) for n in os.listdir(path) if n.endswith(suffix)) if os.path.isdir(path) else []


def stop_findings(run: Launched, timeout_s: float) -> list[Finding]:
    """Why this launch cannot go on to a judgment (empty: it can); BadInput for a run that was asked wrongly."""
    refused = [o for o in run.outcomes.values() if o.ending is Ending.REFUSED]
    if refused:
        raise BadInput(f"{describe_run(run.role, run.degrees)}: {refused[0].message}")
    if run.raised:
        return [crash_finding(run)]
    if run.ended.killed:
        return [hang_finding(run, timeout_s)]
    failed = [o for o in run.outcomes.values() if o.ending is Ending.FAILED]
    if failed:
        return [_crash(run, {o.rank: o.traceback for o in failed}, f"cpdoctor's capture raised: {failed[0].message}")]
    lost = [o for o in run.outcomes.values() if o.ending is Ending.NO_MODEL]
    if lost:
        return [Finding(run.subject, Verdict.UNSUPPORTED, f"rank {lost[0].rank}: {lost[0].message}",
                        "train one model with one optimizer: its forward runs with gradients enabled, outside torch.no_grad()")]  # fmt: skip
    if not run.outcomes:
        return [never_stepped(run)]
    return _world_checked(run)


def _world_checked(run: Launched) -> list[Finding]:
    """The run must have as many processes as its degrees say, each of which reached the optimizer step."""
    worlds = {o.world for o in run.outcomes.values()}
    world = max(worlds)
    if world != run.degrees.world:
        raise BadInput(
            f"{describe_run(run.role, run.degrees)} ran {world} process(es) but its degrees make {run.degrees.world}: give the "
            "process count as {nproc} (or {world}) and the CP degree as {cp} (or {ring}, {ulysses}) in the command"
        )
    ranks = {o.rank for o in run.outcomes.values()}
    missing = sorted(set(range(world)) - ranks)
    if missing and run.role is Role.WITHOUT_CP:
        return [Finding(run.subject, Verdict.UNSUPPORTED, f"rank {', '.join(map(str, missing))} ended without an optimizer step "
                        f"while rank {min(ranks)} reached one", "run the same training step on every rank")]  # fmt: skip
    return []


def never_stepped(run: Launched) -> Finding:
    code = run.ended.returncode
    if run.arm_failures:
        return Finding(run.subject, Verdict.UNSUPPORTED, run.arm_failures[0], "install cpdoctor in the Python the command runs")
    armed_any = run.armed > 0
    if code:
        return _crash(run, _killed_ranks(run.ended.output_tail), f"the command exited with code {code} before any optimizer step")
    why = (
        f"no process of it reached an optimizer step ({run.armed} Python process{'es' if run.armed > 1 else ''} armed)"
        if armed_any
        else "no Python process of it imported torch with cpdoctor's startup module (python -I, -E or -S ignore PYTHONPATH and sitecustomize)"
    )
    return Finding(
        run.subject,
        Verdict.UNSUPPORTED,
        f"the command exited (code {code}) without a training step to examine: {why}",
        "give the command that trains: its first optimizer.step() is the step examined (the job ends there)",
        failure=FailureEvidence(logs={0: run.ended.output_tail}),
    )


def crash_finding(run: Launched) -> Finding:
    """A rank raised: its traceback; in run 1, an error that says the job does not fit without CP is not a crash
    of the CP step but a run that cannot be compared with (UNSUPPORTED, what to change)."""
    named = [n for n in run.raised if _rank_of(n) >= 0] or list(run.raised)  # a rank's own, before its launcher's
    ranks = {_rank_of(name): run.raised[name][1] for name in named}
    first_name = min(named, key=_rank_of)
    message = run.raised[first_name][0]
    if run.role is Role.WITHOUT_CP and (DOES_NOT_FIT.search(message) or INDIVISIBLE.search(message)):
        memory = DOES_NOT_FIT.search(message) is not None
        what = (
            "without CP each rank holds the whole sequence: examine a shorter sequence, a smaller batch or fewer layers "
            "(a CP defect shows at any size), or more dp ranks' memory"
            if memory
            else "a length the command divides by its degrees must divide at cp 1 as well: pick one divisible by every degree"
        )
        return Finding(run.subject, Verdict.UNSUPPORTED, f"run 1 does not fit on {first_name.replace('rank', 'rank ')}: {message}", what,
                       failure=FailureEvidence(tracebacks=ranks))  # fmt: skip
    return _crash(run, ranks, f"{first_name.replace('rank', 'rank ')} raised: {message}")


def _crash(run: Launched, tracebacks: dict[int, str], what: str) -> Finding:
    logs = {} if tracebacks else {0: run.ended.output_tail}
    return Finding(run.subject, Verdict.CRASH, what, "read the traceback of that rank (JSON details) or the command's output",
                   failure=FailureEvidence(tracebacks=tracebacks or {-1: run.ended.output_tail}, logs=logs))  # fmt: skip


def _rank_of(name: str) -> int:
    return int(name[4:]) if name.startswith("rank") and name[4:].isdigit() else -1


def _killed_ranks(output: str) -> dict[int, str]:
    """torchrun's summary of ranks ended by a signal (`exitcode : -9`): the out-of-memory killer's SIGKILL, ..."""
    return {int(r): f"rank {r} was ended by signal {-int(code)} (torchrun's summary)\n{output}" for r, code in KILLED.findall(output)}


def where(step: Milestone | None) -> str:
    if step is None:
        return "not started"
    return WHERE.get(step.name, step.name) + (f" ({step.doing})" if step.doing else "")


def hang_finding(run: Launched, timeout_s: float) -> Finding:
    ended = run.ended
    blamed = ended.blamed
    places = {r: where(s) for r, s in ended.steps.items()}
    if blamed is None or not blamed.stuck:
        what = f"the command stopped moving for {timeout_s:g} s before any rank reached a training forward"
    else:
        stuck = ", ".join(f"rank {r} ({places[r]})" for r in blamed.stuck)
        waits = "; ".join(f"rank {r} was {places[r]}" for r in blamed.waiting)
        what = f"{stuck} stopped: nothing moved for {timeout_s:g} s" + (f" while {waits}" if waits else "")
    if ended.wall_bound:
        what += " (the wall bound passed)"
    return Finding(
        run.subject,
        Verdict.HANG,
        f"{describe_run(run.role, run.degrees)}: {what}; its process tree was killed",
        "a rank is stuck where its peers wait for it (its output below); raise --timeout only if the job can spend longer "
        "without a module call or CPU time (loading, downloading)",
        failure=FailureEvidence(logs={-1: ended.output_tail}, where={r: places[r] for r in ended.steps}),
    )


def judged(request: CommandRequest, run: Launched) -> list[Finding]:
    """Run 2's judgment: the report its ranks made (the same on every rank; the lowest rank's is read)."""
    reports = sorted((o for o in run.outcomes.values() if o.ending is Ending.REPORT), key=lambda o: o.rank)
    findings = list(reports[0].report.findings) if reports and reports[0].report is not None else []
    if not findings:
        return [Finding(run.subject, Verdict.UNSUPPORTED, "run 2 reached its optimizer step but judged nothing", "")]
    note = emulation_note(request.emulate)
    return [replace(f, emulated=note) for f in findings] if note else findings


def report_of(request: CommandRequest, findings: list[Finding], launched: list[Launched], start: float) -> Report:
    from cpdoctor.examinations.runner import installed_software
    from cpdoctor.report.environment import Environment, Launch

    reports = [o.report for run in launched for o in run.outcomes.values() if o.report is not None]
    last = launched[-1].degrees
    asked = Environment(installed_software(), Launch(world_size=last.world, ring=last.ring, ulysses=last.ulysses))
    environment = reports[0].environment if reports else asked
    advice = tuple(dict.fromkeys(line for run in launched for line in run.advice))
    return Report.of(findings, environment, request, wall_s=time.monotonic() - start, advice=advice,
                     runs=tuple(run.row() for run in launched))  # fmt: skip
