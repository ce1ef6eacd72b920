"""`cpdoctor step path/to/train.py:function`: what to run, on how many ranks. Validated in the parent without
importing the script (its source is parsed), so a wrong path or name is exit 2 before any rank starts."""

from __future__ import annotations

import ast
import enum
import os
from dataclasses import asdict, dataclass

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import NotEmulated, Unpatched
from cpdoctor.report.environment import Environment, Launch
from cpdoctor.vocabulary import Device, DType, Kind, parse

CONTRACT = (
    "FUNCTION runs on every rank inside the job's process group (cpdoctor starts it, or joins torchrun's; it must "
    "not initialise or destroy the group). It receives by name what it declares among cp, ring, ulysses, dp, "
    "watch_step and job, builds its model (enable_parallelism when cp > 1) and mesh from those degrees, and runs its "
    "training step inside `with watch_step(model):` (forward, loss, backward, gradient sync; optimizer.step() after "
    "the block), seeding its weights and data the same way whatever the degrees. A function that takes its degrees "
    "runs twice: without CP (dp processes), then with CP, and the final gradients are compared. A function with "
    "a single other parameter gets watch_step and runs once, against the step recomputed in one fp64 process."
)


class Role(str, enum.Enum):
    """Which run a launch of `cpdoctor step` is."""

    ONE_RUN = "one_run"  # the function does not take its degrees: watched against the recomputed reference
    WITHOUT_CP = "without_cp"  # first of two runs: the same job without CP, final gradients to disk
    WITH_CP = "with_cp"  # second of two runs: compared with the first


@dataclass(frozen=True)
class StepRequest(Unpatched, NotEmulated):
    """`cpdoctor step`'s request: the user's step function, where its ranks run and their layout."""

    kind = Kind.STEP  # the examination this request is for (registry.of)

    target: str
    """path/to/train.py:function"""
    world_size: int = 2
    device: Device = Device.AUTO
    reference: DType = DType.FP64
    """The precision of the one-process recomputation (fp64, or fp32 where fp64 does not fit)."""
    ring: int | None = None
    """The CP degrees and data-parallel size handed to a function that takes them (None: the legacy contract,
    where the function decides its layout from the world size)."""
    ulysses: int | None = None
    dp: int | None = None
    role: Role = Role.ONE_RUN
    """Which run this launch is: decided in the parent from the function's parameters."""
    workdir: str = ""
    """Where the run without CP leaves its gradients for the run with CP."""

    def __post_init__(self) -> None:
        """The words as their enums (a suite, the API or an old JSON gives strings)."""
        try:
            object.__setattr__(self, "device", parse(Device, self.device, "device"))
            object.__setattr__(self, "reference", parse(DType, self.reference, "reference"))
            object.__setattr__(self, "role", parse(Role, self.role, "role"))
        except ValueError as exc:
            raise BadInput(str(exc)) from None

    @property
    def path(self) -> str:
        return self.target.rsplit(":", 1)[0]

    @property
    def function(self) -> str:
        return self.target.rsplit(":", 1)[1]

    @property
    def cp(self) -> int:
        return (self.ring or 1) * (self.ulysses or 1)

    def asked(self) -> Environment:
        return Environment(launch=Launch(ring=self.ring, ulysses=self.ulysses))

    @classmethod
    def from_dict(cls, fields: dict) -> StepRequest:
        return cls(**fields)

    def validate(self) -> StepRequest:
        if ":" not in self.target or not self.function.isidentifier():
            raise BadInput(f"give the step as path/to/train.py:function, not {self.target!r}")
        if not os.path.isfile(self.path):
            raise BadInput(f"no such file: {self.path}")
        try:
            tree = ast.parse(open(self.path, encoding="utf-8").read(), self.path)
        except (SyntaxError, UnicodeDecodeError) as exc:
            raise BadInput(f"cannot parse {self.path}: {exc}") from exc
        if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == self.function for n in tree.body):
            raise BadInput(f"{self.path} defines no top-level function {self.function}")
        for name in ("ring", "ulysses", "dp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise BadInput(f"--{name} must be a positive integer, not {value!r}")
        if self.role is not Role.WITHOUT_CP and self.world_size < 2:
            raise BadInput(f"--nproc must be at least 2 (a CP step needs peers), not {self.world_size}")
        if self.reference not in DType.references():
            raise BadInput(f"--reference must be fp64 or fp32, not {self.reference!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)
