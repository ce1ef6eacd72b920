"""The user's whole CP training step, examined against one process: `cpdoctor.watch_step` in a training script,
`cpdoctor step path/to/train.py:function` for a script that exposes its step.

watch.py (the context manager) → record.py (hooks: inputs, output gradient, weights, RNG) → reference.py (the
same step in one fp64 process on each CP group's first rank) → measure.py (relations, numbers only) → judge.py
(the rules table). request.py and probe.py are the command's; the collectives are launch/step_comm.py's."""

from __future__ import annotations

from typing import Any

from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.step.request import CONTRACT, StepRequest
from cpdoctor.launch.jobs import Case, RankFailure
from cpdoctor.report import Finding, Report, Verdict

__all__ = [
    "CONTRACT",
    "EXAMINATION",
    "StepExamination",
    "StepRequest",
    "arm_first_step",
    "examine_script",
    "examine_step",
    "model_degrees",
    "watch_step",
]


def watch_step(model: Any, **options: Any) -> Any:
    """`with watch_step(model) as step: <one training step>`; then `step.report` (watch.py, where the options are)."""
    from cpdoctor.examinations.step.watch import watch_step as _watch

    return _watch(model, **options)


def model_degrees(model: Any) -> tuple[int, int]:
    """(ring, ulysses) of a diffusers transformer with enable_parallelism (bare, in DDP or under FSDP2); BadInput
    when CP is not enabled on it (what `preflight(model=...)` reads the job's degrees from)."""
    from cpdoctor.compat import step as compat
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.step.watch import unwrap

    inner = unwrap(model)
    config = compat.parallel_config_of(inner)
    if config is None:
        raise BadInput(f"{type(inner).__name__} has no context parallelism enabled: call model.enable_parallelism(config=...) first")
    return compat.cp_degrees(config)


def arm_first_step(model: Any, on_report: Any = None, *, reference: str = "fp64") -> Any:
    """Arm the step examination on `model`'s next training step, closed by the first optimizer.step() of any
    optimizer; `on_report(report)` runs on every rank before that step (first.py)."""
    from cpdoctor.examinations.step.first import watch_first_step

    return watch_first_step(model, on_report, reference=reference)


class StepExamination(Examination):
    """`cpdoctor step`: the user's function on every rank; rank 0's watched reports become the report."""

    kind = "step"
    request_type = StepRequest
    in_suites = False

    def unsupported_here(self, request: Any) -> None:
        return None

    def run_rank(self, case: Case, ctx: Any) -> Any:
        from cpdoctor.examinations.step import probe

        return probe.run_rank(case, ctx)

    def evaluate(self, case: Case, results: list, ctx: Any) -> Any:
        from cpdoctor.examinations.step import probe

        return probe.evaluate(case, results, ctx)

    def findings(self, case: Case, evaluated: Any) -> list[Finding]:
        """Every CP group's finding of every watched step (one finding per CP group and step)."""
        found = [f for report in evaluated.reports for f in report.findings]
        if found:
            return found
        return [
            Finding(
                self.describe(case.request),
                Verdict.UNSUPPORTED,
                f"{case.request.target} never watched a step: nothing was examined",
                f"run one training step inside `with watch_step(model):` in {case.request.function}(watch_step)",
            )
        ]

    def finding(self, case: Case, evaluated: Any) -> Finding:
        return self.findings(case, evaluated)[0]

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        from cpdoctor.examinations.judging import failure_findings

        return failure_findings(self.describe(case.request), failures, timeout_s)

    def describe(self, request: StepRequest) -> str:
        return f"training step {request.target} on {request.world_size} ranks"


EXAMINATION = StepExamination()


def examine_script(request: StepRequest, timeout_s: float) -> Report:
    """Run `request.target` on its ranks (spawned, or joining torchrun's) and return the Report of the steps it
    watched; a rank that raised or hung is a CRASH / HANG finding; a request the ranks refused is BadInput."""
    import time

    from cpdoctor import launch
    from cpdoctor.errors import BadInput, CannotExamine
    from cpdoctor.launch.jobs import Job

    request = request.validate()
    t0 = time.perf_counter()
    case = Case(request)
    result = launch.run(Job(EXAMINATION, (case,), request.device, timeout_s), request.world_size)
    if result.bad_input:
        raise BadInput(result.bad_input)
    if result.cannot_examine:
        raise CannotExamine(result.cannot_examine)
    outcome = result.outcomes[0] if result.outcomes else None
    env: dict[str, Any] = {"world_size": request.world_size}
    if outcome is None:
        findings = [Finding(EXAMINATION.describe(request), Verdict.HANG, "no rank reported", "rerun with a longer --timeout")]
    elif outcome.completed:
        findings = EXAMINATION.findings(case, outcome.evaluated)
        env = outcome.evaluated.environment
    else:
        findings = EXAMINATION.failure_findings(case, outcome.failures, timeout_s)
    return Report.of(findings, env, request.to_dict(), wall_s=time.perf_counter() - t0)


def examine_step(target: str, *, nproc: int = 2, device: str = "auto", reference: str = "fp64", timeout_s: float = 300.0) -> Report:
    """`cpdoctor step`: run `path/to/train.py:function` (FUNCTION(watch_step), see request.CONTRACT) on `nproc`
    spawned ranks, or on torchrun's world when there is one, and return the Report of the steps it watched.
    BadInput (exit 2) for a wrong target or a model without CP."""
    from cpdoctor.launch import under_torchrun
    from cpdoctor.launch.torchrun import torchrun_world_size

    world = torchrun_world_size() if under_torchrun() else nproc
    return examine_script(StepRequest(target=target, world_size=world, device=device, reference=reference), timeout_s)
