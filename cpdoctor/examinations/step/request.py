"""`cpdoctor step path/to/train.py:function`: what to run, on how many ranks. Validated in the parent without
importing the script (its source is parsed), so a wrong path or name is exit 2 before any rank starts."""

from __future__ import annotations

import ast
import os
from dataclasses import asdict, dataclass

from cpdoctor.errors import BadInput

CONTRACT = (
    "FUNCTION(watch_step) runs on every rank inside the job's process group (cpdoctor starts it, or joins "
    "torchrun's): it builds its model (with enable_parallelism) and data, and runs one training step inside "
    "`with watch_step(model):` (forward, loss, backward, gradient sync; optimizer.step() after the block). It "
    "must not initialise or destroy the process group."
)


@dataclass(frozen=True)
class StepRequest:
    target: str
    """path/to/train.py:function"""
    world_size: int = 2
    device: str = "auto"
    reference: str = "fp64"

    @property
    def path(self) -> str:
        return self.target.rsplit(":", 1)[0]

    @property
    def function(self) -> str:
        return self.target.rsplit(":", 1)[1]

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
        if self.world_size < 2:
            raise BadInput(f"--nproc must be at least 2 (a CP step needs peers), not {self.world_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise BadInput(f"--device must be auto, cpu or cuda, not {self.device!r}")
        if self.reference not in ("fp64", "fp32"):
            raise BadInput(f"--reference must be fp64 or fp32, not {self.reference!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)
