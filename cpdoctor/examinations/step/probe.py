"""What every rank runs for `cpdoctor step`: the user's function, handed a `watch_step` that keeps the reports
of the steps it watched (numbers and findings only; never prints)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.launch.jobs import Case, CaseNumbers, RankResult
from cpdoctor.report import Report


@dataclass
class StepRankResult(RankResult):
    """The reports of the steps this rank watched (every rank holds the same ones)."""

    reports: list[Report] = field(default_factory=list)


@dataclass
class StepCaseNumbers(CaseNumbers):
    reports: list[Report]
    environment: dict[str, Any]


def load_function(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location("cpdoctor_user_step", path)
    if spec is None or spec.loader is None:
        raise BadInput(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise BadInput(f"{path} has no function {name}")
    return fn


def run_rank(case: Case, ctx: Any) -> StepRankResult:
    from cpdoctor.examinations.step.watch import StepWatch

    req = case.request
    result = StepRankResult()

    class Watch(StepWatch):
        def __exit__(self, *exc: Any) -> bool:
            done = super().__exit__(*exc)
            if self.report is not None:
                result.reports.append(self.report)
            return done

    def watch(model: Any, *, step: int | None = None, reference: str = req.reference) -> StepWatch:
        return Watch(model, step=step, reference=reference)

    load_function(req.path, req.function)(watch)
    return result


def evaluate(case: Case, results: list[RankResult], ctx: Any) -> StepCaseNumbers:
    first = results[0]
    assert isinstance(first, StepRankResult)
    env = dict(first.reports[-1].environment) if first.reports else {"world_size": ctx.world_size}
    return StepCaseNumbers(first.reports, env)
