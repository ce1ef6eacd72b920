"""The Python API: the same examinations as the CLI, returning a `Report` instead of printing. Thin: each function
builds its examination's request (every request names its kind, `request.kind`) and hands it to the runner
(examinations/runner.py), which turns it into launches, outcomes and findings.

    import cpdoctor
    report = cpdoctor.check_attention(ring=4)          # spawns 4 ranks (or joins torchrun's world)
    assert report.verdict == "PASS", report.findings[0].diagnosis
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from cpdoctor.examinations import registry, runner
from cpdoctor.examinations.attention.request import AttentionRequest, build_request
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.examinations.request import Request, validate_timeout
from cpdoctor.examinations.runner import SuiteRun
from cpdoctor.launch import torchrun
from cpdoctor.launch.jobs import Case
from cpdoctor.report import Finding, Report, RunResult, Verdict
from cpdoctor.vocabulary import Device, DType, Kind

if TYPE_CHECKING:
    from cpdoctor.examinations.attention.repro import Repro
    from cpdoctor.suite import Suite, SuiteRequest

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "begin_command",
    "end_command",
    "prints_here",
    "validate_timeout",
    "write_repro",
    "PreflightFailed",
    "AttentionRequest",
    "ModelRequest",
    "PeerRequest",
    "build_request",
    "check_attention",
    "check_model",
    "check_peer",
    "examine",
    "examine_command",
    "examine_suite",
    "examine_environment",
    "examine_step",
    "watch_step",
    "warm_ranks",
    "plan_model",
    "preflight",
    "request_for",
    "run_findings",
    "run_suite",
]

DEFAULT_TIMEOUT_S = 300.0
Tick = Callable[[], None] | None


RANK_IMPORTS = (
    "torch",
    "torch.distributed",
    "diffusers.models.attention_dispatch",
    "cpdoctor.launch.worker",
    "cpdoctor.examinations.attention",
    "cpdoctor.examinations.peer",
)
"""What every rank of an op-level examination imports (3.3-3.8 s of a cold rank's start on 2 cores)."""

MODEL_RANK_IMPORTS = RANK_IMPORTS + (
    "diffusers.models.modeling_utils",
    "diffusers.models.transformers.transformer_flux",  # with it the modules every transformer shares (~1.5 s)
    "cpdoctor.examinations.model",
    "cpdoctor.examinations.step",
)
"""What the ranks of a model or step examination import besides."""


WARM_ENV = "CPDOCTOR_WARM"
"""`CPDOCTOR_WARM=0`: no warm server; every rank is spawned as a fresh interpreter."""


def warm_ranks(models: bool = False) -> None:
    """Start, in the background, the process the ranks of this command fork from, importing torch, diffusers and
    the examinations once while this process plans (launch/warm.py); `models`: the model classes too. The CLI's
    commands call it; a script may too, if its own code runs under `if __name__ == "__main__":` (each rank imports
    the script again, as with any multiprocessing start method but fork). Nothing under torchrun, whose ranks
    exist already, nor with CPDOCTOR_WARM=0 (every rank a fresh interpreter, as before: the baseline of
    benchmarks/bench_commands.py, and a way out should a fork ever misbehave here)."""
    import os

    if torchrun.under_torchrun() or os.environ.get(WARM_ENV) == "0":
        return
    from cpdoctor.launch.warm import WARM

    WARM.start(MODEL_RANK_IMPORTS if models else RANK_IMPORTS)


def request_for(kind: Kind, **fields: object) -> Request:
    """The validated, prepared request of an examination from keyword fields (None = default)."""
    entry = registry.get(kind)
    return entry.prepare(entry.build_request(**fields))


def check_attention(
    request: AttentionRequest | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None, **fields: Any
) -> Report:
    """Op-level CP parity of diffusers' dispatch_attention_fn; with `patch=True`, before and after the fix."""
    req = request if request is not None else registry.get(Kind.ATTENTION).build_request(**fields)
    return examine(req, timeout_s=timeout_s, on_tick=on_tick)


def check_peer(request: PeerRequest | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None, **fields: Any) -> Report:
    """A peer's CP attention (ring-flash-attn, yunchang, torch's context_parallel: `impl=`, `variant=`, `kernel=`,
    `causal=`) examined like diffusers': every rank's out, LSE where exposed, dQ, dK, dV against the fp64 full
    sequence, gathered by token index in the peer's own layout.

        report = cpdoctor.check_peer(impl="ring-flash-attn", variant="zigzag", causal=True, ring=4)
    """
    req = request if request is not None else registry.get(Kind.PEER).build_request(**fields)
    return examine(req, timeout_s=timeout_s, on_tick=on_tick)


def check_model(
    request: ModelRequest | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None, **fields: Any
) -> Report:
    """Model-level CP parity of a diffusers model class through its own `enable_parallelism`: the gathered
    output and every parameter gradient (summed over the CP group) against the same model in one process in
    fp64; with `patch=True`, before and after cpdoctor's fixed CP attention (ring and Ulysses).

        report = cpdoctor.check_model(model="flux", ring=2)          # tiny Flux, 2 ranks
    """
    req = request if request is not None else registry.get(Kind.MODEL).build_request(**fields)
    return examine(req, timeout_s=timeout_s, on_tick=on_tick)


def examine_suite(
    suite: Suite, *, patch: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None
) -> tuple[SuiteRequest, SuiteRun]:
    """Every check of a suite run (examinations/runner.py: checks of the same world size and device share one
    launch), with what the suite asked: what `run_suite` and the doctor build their reports from."""
    from cpdoctor.suite import SuiteRequest, build_requests

    validate_timeout(timeout_s)
    requests = build_requests(suite, patch)
    ran = runner.run_requests(requests, patch=patch, timeout_s=timeout_s, on_tick=on_tick)
    return SuiteRequest(suite.name, suite.source, patch, tuple(requests)), ran


def run_suite(suite: Suite, *, patch: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None) -> Report:
    """Every check of a suite as one Report, in the suite's order (with `patch`, the unpatched runs under
    `before`). Checks of the same world size and device share one launch (examinations/runner.py)."""
    request, ran = examine_suite(suite, patch=patch, timeout_s=timeout_s, on_tick=on_tick)
    before = RunResult.of(ran.before) if ran.before is not None else None
    return Report.of(ran.findings, ran.environment, request, before=before, wall_s=ran.wall_s, suite=suite.name, warnings=ran.warnings)


def examine(request: Request, *, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Tick = None) -> Report:
    """Run the examination `request` is for (its type names it: `AttentionRequest`, `PeerRequest`, ...; unpatched,
    then patched with `request.patch`) as one Report: the exit code and top-level verdict are the last run's; with
    patch the unpatched run is `before` (examinations/runner.py)."""
    return runner.examine(request, timeout_s=timeout_s, on_tick=on_tick)


def run_findings(
    kind: Kind | None, cases: list[Case], world_size: int, device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Finding]:
    """Launch the given cases once (of one kind, or of several with `kind` None) and return one finding per case, in order."""
    return runner.run_findings(kind, cases, world_size, device, timeout_s)


def visible_gpus() -> int:
    """The CUDA devices the ranks would see, without importing torch here (examinations/runner.py)."""
    return runner.visible_gpus()


class PreflightFailed(RuntimeError):
    """Raised by `preflight` when CP attention is wrong here and the fix does not (or may not) repair it, or
    when the first training step it watched does not match one process."""

    def __init__(self, report: Report, what: str = "context-parallel attention is not safe to train with here"):
        finding = next((f for f in report.findings if f.verdict is not Verdict.PASS), report.findings[0] if report.findings else None)
        detail = f"{finding.verdict}: {finding.diagnosis}" if finding else report.verdict
        super().__init__(f"cpdoctor preflight: {what} — {detail}")
        self.report = report


def _degrees_from(parallel_config: Any) -> tuple[int, int]:
    cp = getattr(parallel_config, "context_parallel_config", None) or parallel_config
    return int(getattr(cp, "ring_degree", None) or 1), int(getattr(cp, "ulysses_degree", None) or 1)


def preflight(
    ring: int | None = None,
    ulysses: int | None = None,
    *,
    parallel_config: Any = None,
    model: Any = None,
    watch_first_step: bool = True,
    loss_scale: float | None = None,
    on_step: Callable[[Report], None] | None = None,
    fix: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **fields: Any,
) -> Report:
    """Call once at the top of a training script (on every rank under torchrun) before any CP training step.

    Examines diffusers' CP attention with this job's degrees (from `model`'s enable_parallelism or
    `parallel_config` when given), backend, dtype and head shape (`heads=`, `head_dim=`, `seq=`, `mask_pad=`,
    `backend=`, `dtype=`), forward and backward. If it is exact, nothing changes. If it is wrong and `fix` is
    true, cpdoctor's fixed CP attention (ring and Ulysses) is examined too and, when it is exact, left patched into
    this process (every rank takes the same decision: under torchrun all ranks see rank 0's report). Otherwise
    raises PreflightFailed with the diagnosis, so the job stops before it learns from corrupted gradients.

    With `model` (and `watch_first_step`), the user's first training step is examined too, against one process
    (`watch_step`): armed now, judged before the first optimizer.step(), which a wrong step never reaches
    (PreflightFailed on every rank, and only for a FAIL: a step it could not examine, or one it can read two ways,
    is a warning and the job goes on). `loss_scale` is what the CP step multiplies its loss by that one process
    would not (e.g. cp_size; read from the autograd graph when not given); `on_step(report)` receives the first
    step's report on every rank before its optimizer step. Returns the attention report."""
    from cpdoctor.fix import patch as fix_patch

    if model is not None:
        from cpdoctor.examinations.step import model_degrees

        ring, ulysses = model_degrees(model)
    elif parallel_config is not None:
        ring, ulysses = _degrees_from(parallel_config)
    was_patched = fix_patch.is_patched()
    report = check_attention(timeout_s=timeout_s, ring=ring, ulysses=ulysses, patch=fix, **fields)
    unpatched = report.before if report.before is not None else RunResult(report.verdict, report.findings)
    if unpatched.verdict == Verdict.PASS:
        fix_patch.set_patched(was_patched)
    elif fix and report.verdict == Verdict.PASS:
        fix_patch.apply()
    else:
        fix_patch.set_patched(was_patched)
        raise PreflightFailed(report)
    if model is not None and watch_first_step:
        _arm_first_step(model, loss_scale, on_step)
    return report


def _arm_first_step(model: Any, loss_scale: float | None = None, on_step: Callable[[Report], None] | None = None) -> Any:
    """The step examination on the model's first training step: a wrong step raises PreflightFailed before the
    first optimizer.step(); a step it could not examine, or one whose verdict rests on a reading (WARN), is a warning,
    not a stop. Returns the armed watch (first.FirstStep)."""
    import warnings

    from cpdoctor.examinations.step import arm_first_step

    def judge(step: Report) -> None:
        if on_step is not None:
            on_step(step)
        if step.verdict is Verdict.FAIL:  # only a wrong step stops the job
            raise PreflightFailed(step, what="the first CP training step does not match one process")
        if step.verdict is Verdict.WARN:
            warnings.warn(f"cpdoctor: the first training step: {_first_not_pass(step).diagnosis}", stacklevel=2)
        elif step.verdict is not Verdict.PASS:  # a crash, hang or refusal of the examination: could not examine
            warnings.warn(f"cpdoctor: the first training step could not be examined: {_first_not_pass(step).diagnosis}", stacklevel=2)

    return arm_first_step(model, judge, loss_scale=loss_scale)


def _first_not_pass(report: Report) -> Finding:
    return next((f for f in report.findings if f.verdict is not Verdict.PASS), report.findings[0])


def watch_step(
    model: Any,
    *,
    step: int | None = None,
    reference: str = "fp64",
    loss_scale: float | None = None,
    timeout_s: float = 600.0,
    cp_group: Any = None,
    mesh: Any = None,
    ring: int | None = None,
    ulysses: int | None = None,
    dp: int | None = None,
) -> Any:
    """Watch one CP training step of `model` (a diffusers transformer with enable_parallelism, bare, in DDP, prepared
    by accelerate, compiled, or under FSDP2's fully_shard) against one process:

        with cpdoctor.watch_step(model) as step:
            ...  # the user's noise, forward, loss, backward and gradient sync, on every rank
        step.report  # a Report, the same on every rank: inputs, output gradients, reduction, RNG and gradients

    `step` names the step (every rank must watch the same one; default: this process's count of watched steps);
    `reference` is the precision of the one-process recomputation (fp64 or fp32); `loss_scale` is the factor this
    CP step multiplies its loss by that one process would not (e.g. cp_size, as NeMo Automodel and SimpleTuner do;
    read from the autograd graph when not given); `timeout_s` bounds every wait for a peer. A model whose CP is not
    diffusers' says nothing of the job's layout: pass its CP process group (`cp_group=`), its device mesh (`mesh=`:
    the `cp` dimension, as torchtitan's `parallel_dims.get_mesh("cp")`, or `ring` and `ulysses`), or the degrees
    (`ring=`, `ulysses=`, `dp=`: CP groups of consecutive ranks); one run cannot examine such a model (its reference
    rebuilds a diffusers class) and says which two-run `cpdoctor step` command does. The watcher itself is
    examinations/step/watcher/watch.py's `StepWatch`."""
    from cpdoctor.examinations.step.watcher.watch import StepWatch

    return StepWatch(
        model,
        step=step,
        reference=reference,
        loss_scale=loss_scale,
        timeout_s=timeout_s,
        cp_group=cp_group,
        mesh=mesh,
        ring=ring,
        ulysses=ulysses,
        dp=dp,
    )


# the public API's keywords (README); step_request, which the CLI also calls, takes the same
def examine_step(
    target: str,
    *,
    nproc: int | None = None,
    ring: int | None = None,
    ulysses: int | None = None,
    dp: int | None = None,
    device: Device = Device.AUTO,
    reference: DType = DType.FP64,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Report:
    """`cpdoctor step path/to/train.py:function`: the user's step function on its ranks (spawned, or torchrun's
    world), watched. A function that takes its degrees (`cp`, `ring`, `ulysses`, `dp`, `job`) runs twice, without
    CP and with CP, and its final gradients are compared; otherwise it gets `watch_step` and runs once
    (cpdoctor.examinations.step)."""
    from cpdoctor.examinations.step import step_request

    request = step_request(target, nproc=nproc, ring=ring, ulysses=ulysses, dp=dp, device=device, reference=reference)
    return examine(request, timeout_s=timeout_s)


def examine_command(
    command: list[str] | tuple[str, ...],
    *,
    ring: int | None = None,
    ulysses: int | None = None,
    dp: int | None = None,
    emulate: tuple[str, ...] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cwd: str = "",
) -> Report:
    """`cpdoctor step -- COMMAND`: the user's own launch command run twice, without CP and with CP (placeholders
    {cp} {ring} {ulysses} {dp} {world} {nproc} give each run its degrees), its first optimizer step captured in
    every rank and judged as two runs are (docs/STEP_COMMAND.md)."""
    from cpdoctor.examinations.step.runs.command import CommandRequest
    from cpdoctor.examinations.step.runs.command_run import examine_command as run_twice

    validate_timeout(timeout_s)
    request = CommandRequest.of(command, ring, ulysses, dp, tuple(emulate), cwd)
    return run_twice(request, timeout_s)


def examine_environment(device: str = "auto", dtype: str = "auto", emulate: bool = False) -> Report:
    """`cpdoctor env` in this process: versions, devices, one row per attention backend (found by trying it),
    the known defects of the installed code (see cpdoctor.examinations.env)."""
    from cpdoctor.examinations.env import examination
    from cpdoctor.examinations.env.request import EnvRequest

    return examination.run(EnvRequest(device, dtype, emulate))


def plan_model(
    model: str,
    height: int | None = None,
    width: int | None = None,
    text_len: int | None = None,
    ring: int = 1,
    ulysses: int = 1,
    frames: int | None = None,
) -> Report:
    """`cpdoctor plan`: the measured length of every CP split of `model` at these settings (None: the pipeline's
    default) and the ways out of each problem (see cpdoctor.examinations.plan)."""
    from cpdoctor.examinations.plan import planner
    from cpdoctor.examinations.plan.request import PlanRequest

    return planner.run(PlanRequest(model, height, width, text_len, ring, ulysses, frames))


def list_models() -> list[Any]:
    """Every diffusers model class with a context-parallel plan (`cpdoctor plan --list`)."""
    from cpdoctor.model_zoo import catalog

    return catalog.list_models()


def write_repro(report: Report, directory: str, command: str, fix_timeout_s: float | None = None) -> Repro:
    """For an op-level FAIL (or the ring backward's CRASH under `checkpointing`): DIR/repro.py (torch + diffusers
    only) and DIR/ISSUE.md; with `fix_timeout_s`, also DIR/fix.diff for a known defect of diffusers' code, once
    verified on a patched copy; the paths written and what became of the fix (`Repro`: the check's report with it
    is `dataclasses.replace(report, upstream_fix=repro.upstream_fix)`)."""
    from cpdoctor.examinations.attention import repro

    return repro.write_repro(report, directory, command, fix_timeout_s)


def begin_command() -> None:
    """A command of the CLI starts. Under torchrun every rank then keeps its process group until `end_command`,
    so that all ranks leave at the same moment with the same exit code (launch/torchrun.py); elsewhere nothing."""
    if torchrun.under_torchrun():
        torchrun.hold_group_until_exit()


def end_command(code: int) -> NoReturn:
    """The command ends with `code`: under torchrun every rank waits for the others and all exit at once; elsewhere
    a plain exit."""
    torchrun.leave_together(code)
    raise SystemExit(code)  # leave_together exits; this line states it for the type checker


def prints_here() -> bool:
    """Whether this process prints the report: always when cpdoctor spawned the ranks, rank 0 only under torchrun."""
    return torchrun.is_reporting_rank()
