"""The model-level examination (`cpdoctor model`): a real diffusers model class through its own
`enable_parallelism`, output and every parameter gradient, against the same model in one process.

The parts: request.py (what is asked), spec.py (which class, config and weights), prepare.py (the parent's
checks, shapes, blocks that fit and memory plan), build.py (model, inputs, one step), grads.py (flat gradients
and their errors), blocks.py (per-block records), probe.py (every rank, then rank 0's evaluation), judge.py
(the rules table and the finding)."""

from __future__ import annotations

from typing import Any

from cpdoctor.errors import BadInput, Unsupported, UnsupportedKind
from cpdoctor.examinations import judging
from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.model import judge
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.launch.jobs import Case, CaseNumbers, RankResult
from cpdoctor.report import Finding
from cpdoctor.vocabulary import Kind


class ModelExamination(Examination[ModelRequest]):
    kind = Kind.MODEL
    request_type = ModelRequest

    def build_request(self, **fields: Any) -> ModelRequest:
        return ModelRequest.of(**fields)  # None: the default (ring's: default_degrees, in the dataclass)

    def prepare(self, request: ModelRequest) -> ModelRequest:
        """Resolve the model and fill the default shapes and the memory plan (imports diffusers: unknown names,
        a missing tiny config or checkpoint, a text mask the model does not take and uneven shards are bad input
        here, before any process starts)."""
        from cpdoctor.examinations.model.prepare import prepare

        try:
            return prepare(request.validate())
        except ImportError as exc:  # torch or diffusers missing
            raise BadInput(f"missing package: {exc}") from exc

    def unsupported_here(self, request: ModelRequest) -> Unsupported | None:
        """A backend whose package is missing (as every examination), or a `_cp_plan` that does not fit the model
        at the request's blocks (Helios with fewer blocks than its plan names): diffusers would raise in
        `enable_parallelism`, which is not the attention's doing, so no rank starts. Unlike the others this asks
        diffusers (a meta-device build, which `prepare` makes anyway: a prepared request is not prepared again)."""
        missing = super().unsupported_here(request)
        if missing is not None:
            return missing
        misfit = self._prepared(request).misfit
        return None if misfit is None else Unsupported(UnsupportedKind.PLAN_DOES_NOT_FIT, misfit.line())

    def unsupported_finding(self, request: ModelRequest, why: Unsupported) -> Finding:
        """The UNSUPPORTED finding, with the plan's entry and the model's as evidence when the plan does not fit."""
        misfit = self._prepared(request).misfit if why.kind is UnsupportedKind.PLAN_DOES_NOT_FIT else None
        return judging.unsupported_finding(self.describe(request), why, evidence=misfit)

    def _prepared(self, request: ModelRequest) -> ModelRequest:
        return request if request.memory is not None or request.misfit is not None else self.prepare(request)

    def run_rank(self, case: Case, ctx: Any) -> RankResult:
        from cpdoctor.examinations.model import probe

        return probe.run_rank(case, ctx)

    def evaluate(self, case: Case, results: list[RankResult], ctx: Any) -> CaseNumbers:
        from cpdoctor.examinations.model import probe

        return probe.evaluate(case, results, ctx)

    def finding(self, case: Case, evaluated: Any) -> Finding:
        return judge.model_finding(case.request, evaluated)

    def describe(self, request: ModelRequest) -> str:
        return judge.describe_model(request)


EXAMINATION = ModelExamination()
