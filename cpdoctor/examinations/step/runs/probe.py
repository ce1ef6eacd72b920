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
from cpdoctor.report.environment import Environment, Launch


@dataclass
class StepRankResult(RankResult):
    """The reports of the steps this rank watched (every rank holds the same ones)."""

    reports: list[Report] = field(default_factory=list)


@dataclass
class StepCaseNumbers(CaseNumbers):
    reports: list[Report]
    environment: Environment


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


def watcher_for(req: Any, result: StepRankResult) -> Any:
    """The `watch_step` this run hands the user's function: the one watcher, with the reference of this run
    (recomputed, or the run without CP on disk), keeping every report it makes in `result`."""
    from cpdoctor.examinations.step.judgment.baseline import OneProcessReference, RecordedRun
    from cpdoctor.examinations.step.runs.request import Role
    from cpdoctor.examinations.step.runs.two_runs import RecordingWatch
    from cpdoctor.examinations.step.watcher.watch import StepWatch

    role = req.role
    if role is Role.WITHOUT_CP:
        return lambda model, **options: RecordingWatch(model, req.workdir)

    def watch(model: Any, **options: Any) -> StepWatch:
        options.setdefault("reference", req.reference)
        options.setdefault("target", req.target)  # a refusal of one run names the two-run command for it
        # the degrees the function was handed (a model whose CP is not diffusers')
        for name, value in (("ring", req.ring), ("ulysses", req.ulysses), ("dp", req.dp)):
            options.setdefault(name, value)
        baseline = RecordedRun(req.workdir) if role is Role.WITH_CP else OneProcessReference(options["reference"])
        return StepWatch(model, baseline=baseline, on_report=result.reports.append, **options)

    return watch


def run_rank(case: Case, ctx: Any) -> StepRankResult:
    from cpdoctor.examinations.step.runs.request import Role
    from cpdoctor.examinations.step.runs.two_runs import StepJob, call_arguments, parameters_of

    req = case.request
    result = StepRankResult()
    without_cp = req.role is Role.WITHOUT_CP
    ring, ulysses = (1, 1) if without_cp else (req.ring or 1, req.ulysses or 1)
    job = StepJob(ring, ulysses, req.dp or max(1, ctx.world_size // (ring * ulysses)), watcher_for(req, result), not without_cp)
    args, kwargs = call_arguments(parameters_of(req.path, req.function), job)
    load_function(req.path, req.function)(*args, **kwargs)
    return result


def evaluate(case: Case, results: list[RankResult], ctx: Any) -> StepCaseNumbers:
    first = results[0]
    assert isinstance(first, StepRankResult)
    env = first.reports[-1].environment if first.reports else Environment(launch=Launch(world_size=ctx.world_size))
    return StepCaseNumbers(first.reports, env)
