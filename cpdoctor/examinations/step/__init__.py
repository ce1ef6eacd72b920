"""The user's whole CP training step, examined against one process or against the same job without CP:
`cpdoctor.watch_step` and `preflight(model=)` in a training script (one run), `cpdoctor step train.py:function`
(two runs of a function), `cpdoctor step -- <launch command>` (two runs of the user's own command).

Three rooms, each one job (docs/ARCHITECTURE.md):
- runs/ — the command: how a step is run (one run, two runs of a function, two runs of the launched command);
- watcher/ — what is recorded and observed while it runs (watch.py's lifetime, record.py's hooks, observe.py's
  wrapped entry points as events.py's typed events) and the block's exit (examine.py), which hands the recorded
  group (group.py) to
- judgment/ — a function of that group: the baseline (reference.py or the run without CP), factors.py, measure.py,
  judge.py's rules.
The collectives are launch/watcher_comm.py's."""

from __future__ import annotations

from typing import Any

from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.step.runs.request import CONTRACT, Role, StepRequest
from cpdoctor.launch.jobs import Case, RankFailure
from cpdoctor.report import Finding, Verdict
from cpdoctor.vocabulary import Kind

__all__ = [
    "CONTRACT",
    "EXAMINATION",
    "StepExamination",
    "StepRequest",
    "arm_first_step",
    "step_request",
    "model_degrees",
]


def model_degrees(model: Any) -> tuple[int, int]:
    """(ring, ulysses) of a diffusers transformer with enable_parallelism (bare, in DDP or under FSDP2); BadInput
    when CP is not enabled on it (what `preflight(model=...)` reads the job's degrees from), or, for a model that is
    not diffusers' (examined in one run, which it cannot be), the reason and the two-run command."""
    from cpdoctor.compat import parallel_config as compat
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.step.watcher.degrees import one_run_refusal, rebuildable
    from cpdoctor.examinations.step.watcher.record import unwrap

    inner = unwrap(model)
    config = compat.parallel_config_of(inner)
    if config is None and not rebuildable(inner):
        raise BadInput(one_run_refusal(inner))
    if config is None:
        raise BadInput(f"{type(inner).__name__} has no context parallelism enabled: call model.enable_parallelism(config=...) first")
    return compat.cp_degrees(config)


def arm_first_step(model: Any, on_report: Any = None, *, reference: str = "fp64", loss_scale: float | None = None) -> Any:
    """Arm the step examination on `model`'s next training step, closed by the first optimizer.step() of any
    optimizer; `on_report(report)` runs on every rank before that step (first.py)."""
    from cpdoctor.examinations.step.runs.first import watch_first_step

    return watch_first_step(model, on_report, reference=reference, loss_scale=loss_scale)


class StepExamination(Examination[StepRequest]):
    """`cpdoctor step`: the user's function on every rank; rank 0's watched reports become the report. With a
    function that takes its degrees, two launches (two_runs.py): the same job without CP, then with CP."""

    kind = Kind.STEP
    request_type = StepRequest
    in_suites = False

    def unsupported_here(self, request: Any) -> None:
        return None

    def prepare(self, request: Any) -> Any:
        """The role of the launch, from the function's parameters (read from its source): two runs when it takes
        its degrees and cpdoctor starts the ranks (under torchrun nobody can start the run without CP), with a
        fresh folder for the first run's gradients."""
        import dataclasses
        import tempfile

        from cpdoctor.examinations.step.runs.two_runs import parameters_of, takes_degrees
        from cpdoctor.launch import under_torchrun

        request = request.validate()
        if takes_degrees(parameters_of(request.path, request.function)) and not under_torchrun():
            return dataclasses.replace(request, role=Role.WITH_CP, workdir=tempfile.mkdtemp(prefix="cpdoctor-step-"))
        return dataclasses.replace(request, role=Role.ONE_RUN)

    def stages(self, request: Any) -> list[tuple[list[Case], int]]:
        import dataclasses

        if request.role is not Role.WITH_CP:
            return [([Case(request)], request.world_size)]
        without = dataclasses.replace(request, role=Role.WITHOUT_CP)
        return [([Case(without)], request.dp or 1), ([Case(request)], request.world_size)]

    def finish(self, request: Any) -> None:
        import shutil

        if request.workdir:
            shutil.rmtree(request.workdir, ignore_errors=True)

    def run_rank(self, case: Case, ctx: Any) -> Any:
        from cpdoctor.examinations.step.runs import probe

        return probe.run_rank(case, ctx)

    def evaluate(self, case: Case, results: list, ctx: Any) -> Any:
        from cpdoctor.examinations.step.runs import probe

        return probe.evaluate(case, results, ctx)

    def findings(self, case: Case, evaluated: Any) -> list[Finding]:
        """Every CP group's finding of every watched step (one finding per CP group and step). A reference that
        its memory plan refused everywhere is bad input for the command (exit 2, the plan and what fits)."""
        from cpdoctor.errors import BadInput
        from cpdoctor.examinations.step.judgment.evidence import TooLarge

        found = [f for report in evaluated.reports for f in report.findings]
        if found and all(isinstance(f.evidence, TooLarge) for f in found):
            raise BadInput(f"{case.request.target}: {found[0].evidence.plan}")
        if found:
            return found
        if case.request.role is Role.WITHOUT_CP:
            return []
        return [
            Finding(
                self.describe(case.request),
                Verdict.UNSUPPORTED,
                f"{case.request.target} never watched a step: nothing was examined",
                f"run one training step inside `with watch_step(model):` in {case.request.function}",
            )
        ]

    def finding(self, case: Case, evaluated: Any) -> Finding:
        return self.findings(case, evaluated)[0]

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        from cpdoctor.examinations.judging import failure_findings

        return failure_findings(self.describe(case.request), failures, timeout_s)

    def describe(self, request: StepRequest) -> str:
        if request.role is Role.WITHOUT_CP:
            return f"training step {request.target}, the run without CP on {request.dp or 1} rank(s)"
        return f"training step {request.target} on {request.world_size} ranks"


EXAMINATION = StepExamination()


def step_request(
    target: str,
    *,
    nproc: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    dp: int | None = None,
    device: str = "auto",
    reference: str = "fp64",
) -> StepRequest:
    """The request of `cpdoctor step`: the world is torchrun's when there is one, else dp × ring × ulysses when
    degrees are given (dp from `nproc` when only it is), else `nproc` (2 by default)."""
    from cpdoctor.errors import BadInput
    from cpdoctor.launch import under_torchrun
    from cpdoctor.launch.torchrun import torchrun_world_size

    cp = (ring or 1) * (ulysses or 1)
    if under_torchrun():
        world = torchrun_world_size()
    elif ring is not None or ulysses is not None or dp is not None:
        if dp is None:
            dp = max(1, (nproc or cp) // cp)
        world = dp * cp
        if nproc is not None and nproc != world:
            raise BadInput(f"--nproc {nproc} but dp {dp} × ring {ring or 1} × ulysses {ulysses or 1} = {world}")
    else:
        world = nproc or 2
    if ring is None and ulysses is None:
        ring, dp = 2, dp or max(1, world // 2)  # a function that takes its degrees gets CP 2 by default
    return StepRequest(target=target, world_size=world, device=device, reference=reference, ring=ring, ulysses=ulysses, dp=dp)
