"""One training step of a tiny attention model under CP (patched or not) against one process: the fix's own
end-to-end check (tests and benchmarks use it; suites do not name it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.request import NotEmulated, Unpatched, layout_asked
from cpdoctor.launch.jobs import Case
from cpdoctor.report import Finding, Verdict
from cpdoctor.report.environment import Environment
from cpdoctor.vocabulary import Device, Kind


@dataclass(frozen=True)
class FixTrainingRequest(Unpatched, NotEmulated):
    """See probe.py for the fields' meaning (mask: None, "bool4d", "bool2d" or "additive"). One case: `compare_original`
    says which attention it runs, never a second, patched one."""

    kind = Kind.FIX_TRAINING  # the examination this request is for (registry.of)

    ring: int = 2
    ulysses: int = 1
    mask: str | None = None
    mask_pad: int = 3
    seq: int = 64
    batch: int = 2
    heads: int = 2
    head_dim: int = 16
    dim: int = 32
    layers: int = 2
    dtype: str = "fp32"
    seed: int = 0
    backend: str = "cpdoctor_cpu"
    compare_original: bool = False
    device: Device = Device.AUTO

    @property
    def world_size(self) -> int:
        return self.ring * self.ulysses

    def asked(self) -> Environment:
        return layout_asked(self.ring, self.ulysses, self.dtype, self.backend)

    def validate(self) -> FixTrainingRequest:
        return self

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


class FixTrainingExamination(Examination[FixTrainingRequest]):
    kind = Kind.FIX_TRAINING
    probe = "cpdoctor.examinations.fix_training.probe"
    request_type = FixTrainingRequest
    in_suites = False

    def finding(self, case: Case, evaluated: Any) -> Finding:
        worst = max(evaluated.out_rel_err, evaluated.x_grad_rel_err, evaluated.worst_param_rel_err)
        verdict = Verdict.PASS if worst < 1e-5 else Verdict.FAIL
        return Finding(self.describe(case.request), verdict, f"worst relative error {worst:.2g} against one process", evidence=evaluated)

    def describe(self, request: FixTrainingRequest) -> str:
        return f"train step ring={request.ring} ulysses={request.ulysses} mask={request.mask}"


EXAMINATION = FixTrainingExamination()
