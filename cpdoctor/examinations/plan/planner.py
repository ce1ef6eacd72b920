"""Static divisibility planner: will this model's context-parallel split work at this resolution and prompt length?

diffusers splits every tensor named in a model's `_cp_plan` with `tensor.chunk(world, dim)` after asserting
`size % world == 0` (world = ring x ulysses), and Ulysses scatters attention heads over the Ulysses group. This
examination measures, without weights and without compute, the real length of every split input and gathered
output (`measure`: the model's own forward on the meta device, hooked where diffusers hooks it), so the lengths
come from diffusers' code; the only thing cpdoctor supplies is how a pipeline shapes the inputs
(`cpdoctor.model_zoo.catalog` builders). For every problem it then measures the ways out (`remedies`), and `judge`
turns the problems into findings.

It never prints: `run(request)` returns the `cpdoctor.report.Report` every examination returns, the measured
plan under its own keys (`model`, `settings`, `tensors`, `skipped`, `heads`, `problems`, `notes`, `seconds`).
"""

from __future__ import annotations

import time

from cpdoctor.compat.packages import installed_version
from cpdoctor.examinations.plan.judge import plan_findings
from cpdoctor.examinations.plan.request import PlanRequest
from cpdoctor.model_zoo.splits.plan import measure_plan
from cpdoctor.report import Report
from cpdoctor.report.environment import Environment, Launch, Software

__all__ = ["PlanRequest", "run"]


def run(request: PlanRequest) -> Report:
    """Measure every CP split of `request.model` (short name, class name or checkpoint directory) at its settings.

    height / width / text_len / frames left None take the family's pipeline defaults. Raises BadInput for unknown
    models and impossible settings, CannotExamine when the model's inputs cannot be built or its meta forward
    fails. Problems found are FAIL findings of the report, not raised.
    """
    started = time.perf_counter()
    plan = measure_plan(request.setup())
    plan.seconds = time.perf_counter() - started
    findings = plan_findings(plan, request.model)
    return Report.of(findings, _environment(), request, wall_s=plan.seconds, plan=plan)


def _environment() -> Environment:
    """What the measurement ran on: no weights, no compute, the meta device."""
    import torch

    return Environment(Software(torch=str(torch.__version__), diffusers=installed_version("diffusers")), Launch(device="meta"))
