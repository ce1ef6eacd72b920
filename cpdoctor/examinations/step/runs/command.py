"""`cpdoctor step [--ring R] [--ulysses U] [--dp D] -- <command ...>`: the user's own, unmodified launch command,
run twice (docs/STEP_COMMAND.md). What to run is a `CommandRequest`, validated in the parent before anything
starts: the command with its placeholders, which give each run its degrees:

    run 1, the same job without CP:  {cp} = {ring} = {ulysses} = 1,  {dp} = D,  {world} = {nproc} = D
    run 2, with CP:                  {ring} = R, {ulysses} = U, {cp} = R × U, {dp} = D, {world} = {nproc} = D × R × U

A placeholder is replaced wherever it stands in an argument (`--nproc-per-node={nproc}`, `cp={cp}`); other braces
are left alone. A command whose two runs would be the same command (no placeholder that differs between them)
cannot tell a CP step from one without CP: bad input, as is a program that is not found."""

from __future__ import annotations

import enum
import os
import shutil
from dataclasses import dataclass

from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.runs.request import Role
from cpdoctor.vocabulary import Kind

PLACEHOLDERS = ("cp", "ring", "ulysses", "dp", "world", "nproc")


class Emulation(str, enum.Enum):
    """An environment the startup module fakes in every process of the command, where CPU ranks differ from the GPU
    ranks the trainer is written for (never the user's command or the trainer's logic; the report says it)."""

    TORCHTITAN_CPU = "torchtitan-cpu"
    DIFFUSERS_CPU = "diffusers-cpu"


def describe_run(role: Role, degrees: RunDegrees) -> str:
    """ "run 1 (the same job without CP, 2 processes)", "run 2 (with CP: ...)"."""
    if role is Role.WITHOUT_CP:
        return f"run 1 (the same job without CP, {degrees.world} process{'es' if degrees.world > 1 else ''})"
    return f"run 2 (with CP: ring {degrees.ring} × Ulysses {degrees.ulysses} × dp {degrees.dp}, {degrees.world} processes)"


RUNS = (Role.WITHOUT_CP, Role.WITH_CP)
"""The two launches, in order."""


@dataclass(frozen=True)
class RunDegrees:
    """The degrees one run's command is given."""

    ring: int
    ulysses: int
    dp: int

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def value(self, name: str) -> int:
        return {"cp": self.cp, "ring": self.ring, "ulysses": self.ulysses, "dp": self.dp, "world": self.world, "nproc": self.world}[name]


def substitute(argument: str, degrees: RunDegrees) -> str:
    for name in PLACEHOLDERS:
        argument = argument.replace("{" + name + "}", str(degrees.value(name)))
    return argument


@dataclass(frozen=True)
class CommandRequest:
    """`cpdoctor step -- COMMAND`: the command as typed, the degrees of the run with CP, the emulations asked."""

    kind = Kind.STEP

    command: tuple[str, ...]
    ring: int = 2
    ulysses: int = 1
    dp: int = 1
    emulate: tuple[Emulation, ...] = ()
    cwd: str = ""
    """Where the command runs (the caller's working directory when empty)."""

    @classmethod
    def of(cls, command: list[str] | tuple[str, ...], ring: int | None = None, ulysses: int | None = None, dp: int | None = None,
           emulate: tuple[str, ...] = (), cwd: str = "") -> CommandRequest:  # fmt: skip
        """The request from the CLI's or the API's words: ring 2 when neither CP degree is given (as `cpdoctor step
        path:fn`), 1 for the other; dp 1."""
        if ring is None and ulysses is None:
            ring = 2
        try:
            modes = tuple(Emulation(e) for e in emulate)
        except ValueError:
            raise BadInput(f"--emulate takes {', '.join(e.value for e in Emulation)}, not {', '.join(emulate)}") from None
        one = [1 if d is None else d for d in (ring, ulysses, dp)]
        return cls(tuple(command), *one, emulate=modes, cwd=cwd).validate()

    def degrees(self, run: Role) -> RunDegrees:
        return RunDegrees(1, 1, self.dp) if run is Role.WITHOUT_CP else RunDegrees(self.ring, self.ulysses, self.dp)

    def argv(self, run: Role) -> list[str]:
        return [substitute(a, self.degrees(run)) for a in self.command]

    def validate(self) -> CommandRequest:
        if not self.command:
            raise BadInput("give the command to run after --, e.g. cpdoctor step -- torchrun --nproc-per-node {nproc} train.py --cp {cp}")
        for name in ("ring", "ulysses", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise BadInput(f"--{name} must be a positive integer, not {value!r}")
        if self.ring * self.ulysses < 2:
            raise BadInput("the run with CP needs a CP degree of at least 2 (--ring R and/or --ulysses U)")
        if self.argv(Role.WITHOUT_CP) == self.argv(Role.WITH_CP):
            raise BadInput(
                "the command is the same in both runs: put {cp} (or {ring}, {ulysses}, {world}, {nproc}) where it sets its "
                "CP degree and process count, e.g. torchrun --nproc-per-node {nproc} train.py --cp {cp}"
            )
        program = self.argv(Role.WITHOUT_CP)[0]
        found = _found(program, self.cwd)
        if found is not None:
            raise BadInput(f"{found} (give the step as path/to/train.py:function, or a command after --)")
        return self

    def to_dict(self) -> dict:
        return {
            "command": list(self.command),
            "ring": self.ring,
            "ulysses": self.ulysses,
            "dp": self.dp,
            "runs": {run.value: self.argv(run) for run in RUNS},
            "emulate": [e.value for e in self.emulate],
        }


def _found(program: str, cwd: str) -> str | None:
    """Why `program` cannot run (None: it can): a path (relative to `cwd`) must be an executable file, a name must be
    on PATH."""
    if os.sep not in program:
        return None if shutil.which(program) is not None else f"no program {program!r} found on PATH"
    path = program if os.path.isabs(program) else os.path.join(cwd or os.getcwd(), program)
    if not os.path.isfile(path):
        return f"no program {program!r} found"
    return None if os.access(path, os.X_OK) else f"{program} is not executable (run it with its interpreter, e.g. python {program})"
