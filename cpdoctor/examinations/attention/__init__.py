"""The op-level examination (`cpdoctor check`): diffusers' real dispatch_attention_fn on sequence shards, forward
and backward, against the full sequence."""

from __future__ import annotations

from dataclasses import replace

from cpdoctor.examinations.attention import judge
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.launch.jobs import Case, RankFailure
from cpdoctor.report import Finding
from cpdoctor.vocabulary import Kind


class AttentionExamination(Examination[AttentionRequest]):
    kind = Kind.ATTENTION
    probe = "cpdoctor.examinations.attention.probe"
    request_type = AttentionRequest

    def finding(self, case: Case, evaluated: Measurement) -> Finding:
        return judge.attention_finding(case.request, evaluated)

    def describe(self, request: AttentionRequest) -> str:
        return judge.describe(request)

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        req: AttentionRequest = case.request
        found = judge.JUDGE.failure_findings(self.describe(req), failures, timeout_s)
        if req.emulate:
            return [replace(f, emulated=judge.emulation_note(req.backend)) for f in found]
        return found


EXAMINATION = AttentionExamination()
