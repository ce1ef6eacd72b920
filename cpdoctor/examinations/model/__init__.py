"""The model-level examination (`cpdoctor model`): a real diffusers model class through its own
`enable_parallelism`, output and every parameter gradient, against the same model in one process."""

from __future__ import annotations

from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.attention.request import build_request as build_attention_request
from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.model import judge
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.request import default_degrees
from cpdoctor.launch.jobs import Case
from cpdoctor.report import Finding


def memory_plan(req: ModelRequest) -> Any:
    """The memory plan `prepare` printed for this request (a cpdoctor.models.memory.MemoryPlan), None when this
    process did not prepare it."""
    import sys

    probe = sys.modules.get("cpdoctor.examinations.model.probe")
    return None if probe is None else probe.printed_plan(req)


def op_level_requests(req: ModelRequest) -> tuple[Any, ...]:
    """The op-level cross-checks run at the same layout: exactly what `cpdoctor check --ring R --ulysses U
    [--dtype D] [--backend B]` runs, and again with `--mask-pad N` when the model's text is padded."""
    common = dict(ring=req.ring, ulysses=req.ulysses, backend=req.backend, dtype=req.dtype, device=req.device, emulate=req.emulate)
    ops = [build_attention_request(**common)]
    if req.mask_pad:
        ops.append(build_attention_request(**common, mask_pad=req.mask_pad))
    return tuple(ops)


class ModelExamination(Examination):
    kind = "model"
    probe = "cpdoctor.examinations.model.probe"
    request_type = ModelRequest

    def build_request(self, **fields: Any) -> ModelRequest:
        fields = default_degrees({k: v for k, v in fields.items() if v is not None})
        return ModelRequest.from_dict(fields).validate()

    def prepare(self, request: ModelRequest) -> ModelRequest:
        """Resolve the model and fill the default shapes (imports diffusers: unknown names, a missing tiny config
        or checkpoint, a text mask the model does not take and uneven top-level shards are bad input here,
        before any process starts)."""
        from cpdoctor.examinations.model import probe

        try:
            prepared, _ = probe.prepare(request.validate())
        except ImportError as exc:  # torch or diffusers missing
            raise BadInput(f"missing package: {exc}") from exc
        return prepared

    def cases(self, request: ModelRequest) -> list[Case]:
        options = {"op_requests": op_level_requests(request)}
        cases = [Case(request, patched=False, options=options)]
        if request.patch:
            cases.append(Case(request, patched=True, options=options))
        return cases

    def finding(self, case: Case, evaluated: Any) -> Finding:
        found = judge.model_finding(case.request, evaluated)
        plan = memory_plan(case.request)
        if plan is not None:
            found.details["memory_plan"] = plan.to_dict()
        return found

    def describe(self, request: ModelRequest) -> str:
        return judge.describe_model(request)


EXAMINATION = ModelExamination()
