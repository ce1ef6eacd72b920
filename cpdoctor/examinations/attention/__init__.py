"""The op-level examination (`cpdoctor check`): diffusers' real dispatch_attention_fn on sequence shards, forward
and backward, against the full sequence."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from cpdoctor.examinations.attention import judge
from cpdoctor.examinations.attention.request import AttentionRequest, build_request
from cpdoctor.examinations.base import Examination
from cpdoctor.launch.jobs import Case, CaseNumbers, RankFailure, RankResult
from cpdoctor.report import Finding
from cpdoctor.vocabulary import Kind


class AttentionExamination(Examination):
    kind = Kind.ATTENTION
    request_type = AttentionRequest

    def build_request(self, **fields: Any) -> AttentionRequest:
        return build_request(**fields)

    def run_rank(self, case: Case, ctx: Any) -> RankResult:
        from cpdoctor.examinations.attention import probe

        return probe.run_rank(case, ctx)

    def evaluate(self, case: Case, results: list[RankResult], ctx: Any) -> CaseNumbers:
        from cpdoctor.examinations.attention import probe

        return probe.evaluate(case, results, ctx)

    def finding(self, case: Case, evaluated: Any) -> Finding:
        return judge.attention_finding(case.request, evaluated)

    def describe(self, request: AttentionRequest) -> str:
        return judge.describe(request)

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        found = judge.JUDGE.failure_findings(self.describe(case.request), failures, timeout_s)
        if getattr(case.request, "emulate", False):
            return [replace(f, emulated=judge.emulation_note(case.request.backend)) for f in found]
        return found


EXAMINATION = AttentionExamination()
