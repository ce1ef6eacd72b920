"""The one place a request becomes launches, outcomes and findings: which cases run in which launch, how a case's
outcome (rank 0's numbers, or the ranks that failed) turns into findings judged by its request's entry, and the
environment each finding ran in. The API (`examine`, `run_suite`), the doctor (through `run_suite`), `--repro`'s
verification and the step watcher's failure findings all come through here; api.py only builds requests and
reports."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, replace

from cpdoctor import launch
from cpdoctor.attempt import Attempt
from cpdoctor.compat.packages import installed_version
from cpdoctor.errors import BadInput, CannotExamine, Unsupported, UnsupportedKind
from cpdoctor.examinations import registry
from cpdoctor.examinations.judging import emulation_note, unsupported_finding
from cpdoctor.examinations.request import Request, validate_timeout
from cpdoctor.launch.jobs import Case, CaseOutcome, Job
from cpdoctor.report import Finding, Report, RunResult, Verdict
from cpdoctor.report.environment import Environment, Software
from cpdoctor.report.sections import Warnings
from cpdoctor.vocabulary import Kind

Tick = Callable[[], None] | None


def fallback_environment(request: Request, world_size: int | None = None, ranks_ran: bool = True) -> Environment:
    """What the parent knows when no rank got far enough to report: the versions installed, where the ranks
    ran (`ranks_ran`: the device and process group they chose by their own rule, `launch.context.
    device_and_group`; it costs importing torch to count the GPUs), and the layout asked for (the backend as
    requested, e.g. "auto"). `world_size`: the launch's, where it is not the request's (the step's run without CP)."""
    from cpdoctor.launch.context import device_and_group

    world_size = registry.of(request).world_size(request) if world_size is None else world_size
    software = installed_software()
    asked = request.asked()
    launch = asked.launch.replace(world_size=world_size)
    if ranks_ran:
        device, group = device_and_group(str(request.device), visible_gpus(), world_size)
        launch = launch.replace(device=device, process_group=group)
    if request.emulate:
        launch = launch.replace(emulated=emulation_note(str(asked.attention.backend or "auto")))
    return Environment(software, launch, asked.attention)


def installed_software() -> Software:
    """The versions installed here, read without importing them: what a report says where no rank reported."""
    return Software(torch=installed_version("torch"), diffusers=installed_version("diffusers"), python=platform.python_version())


def visible_gpus() -> int:
    """The CUDA devices the ranks would see, without importing torch in the parent (a report of ranks that hung
    should not wait for it): torch's own count when this process already imported torch, else
    CUDA_VISIBLE_DEVICES when set, else the NVIDIA device nodes of this host."""
    import glob
    import os
    import re
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return Attempt.of(lambda: int(torch.cuda.device_count())).or_else(0)  # a broken CUDA install: none, as the ranks would find
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)])


def run_cases(
    kind: Kind | None, cases: list[Case], world_size: int, device: str, timeout_s: float, on_tick: Tick = None
) -> launch.LaunchResult:
    """Launch the cases in one job (`kind` None: cases of several kinds, each run and evaluated by its request's
    entry, `registry.ByRequest`); BadInput / CannotExamine for what the ranks refused."""
    validate_timeout(timeout_s)
    program = registry.get(kind) if kind is not None else registry.ByRequest()
    fresh = any(registry.of(case.request).fresh_interpreter(case.request) for case in cases)
    result = launch.run(Job(program, tuple(cases), device, timeout_s, fresh_interpreter=fresh), world_size, on_tick)
    if result.bad_input:
        raise BadInput(result.bad_input)
    if result.cannot_examine:
        raise CannotExamine(result.cannot_examine)
    return result


def outcome_findings(outcome: CaseOutcome, timeout_s: float) -> list[Finding]:
    """A case's findings, judged by its request's entry: the judged numbers, or CRASH / HANG from the ranks that failed."""
    entry = registry.of(outcome.case.request)
    if outcome.completed:
        return entry.findings(outcome.case, outcome.evaluated)
    return entry.failure_findings(outcome.case, outcome.failures, timeout_s)


def reported(outcome: CaseOutcome) -> Environment | None:
    """The environment a case's ranks reported with their numbers (None when they reported none)."""
    return outcome.evaluated.environment if outcome.evaluated is not None else None


def ran_in(outcome: CaseOutcome) -> Environment:
    """The environment a case's ranks reported with their numbers, else what the parent knows of where they ran."""
    return reported(outcome) or fallback_environment(outcome.case.request)


def outcome_findings_in(outcome: CaseOutcome, timeout_s: float) -> list[Finding]:
    """`outcome_findings`, each finding keeping the environment its case ran in (`ran_in`)."""
    env = ran_in(outcome)
    return [replace(f, environment=env) for f in outcome_findings(outcome, timeout_s)]


def case_findings(cases: list[Case], outcomes: list[CaseOutcome], timeout_s: float) -> list[Finding]:
    """One finding per case, in order, each keeping the environment its ranks ran in. A case without an outcome
    (under torchrun a job ends at a collective that timed out: nobody can relaunch the rest) says so instead of
    disappearing."""
    findings = []
    for n, case in enumerate(cases):
        if n < len(outcomes):
            findings.append(outcome_findings_in(outcomes[n], timeout_s)[0])
        else:
            reason = Unsupported(UnsupportedKind.NOT_EXAMINED, "not examined: an earlier case of the same launch timed out in a collective")
            findings.append(unsupported_finding(registry.of(case.request).describe(case.request), reason))
    return findings


def run_findings(kind: Kind | None, cases: list[Case], world_size: int, device: str, timeout_s: float) -> list[Finding]:
    """Launch the given cases once (of one kind, or of several with `kind` None) and return one finding per case, in order."""
    result = run_cases(kind, cases, world_size, device, timeout_s)
    return case_findings(cases, result.outcomes, timeout_s)


def warnings_seen(outcomes: list[CaseOutcome]) -> Warnings | None:
    """The warnings the examination raised on the ranks (kept off the terminal), counted for the JSON."""
    return Warnings.counted([outcome.warnings for outcome in outcomes])


def first_environment(outcomes: list[CaseOutcome], fallback: Callable[[], Environment]) -> Environment:
    """The environment the first evaluated case reported, else what the parent knows (`fallback()`)."""
    return next((env for outcome in outcomes if (env := reported(outcome)) is not None), None) or fallback()


def examine(request: Request, *, timeout_s: float, on_tick: Tick = None) -> Report:
    """Run the examination `request` is for (its type names it: `AttentionRequest`, `PeerRequest`, ...; unpatched,
    then patched with `request.patch`) and assemble its Report: the exit code and top-level verdict are the last
    run's; with patch the unpatched run is `before`. Under torchrun every rank returns the same report (rank 0's)."""
    entry = registry.of(request)
    kind = entry.kind
    missing = entry.unsupported_here(request)
    if missing is not None:  # answered from the parent, before any rank starts
        finding = entry.unsupported_finding(request, missing)
        environment = fallback_environment(request, ranks_ran=False)
        return Report.of([finding], environment, request)
    req = entry.prepare(request)
    advice: list[str] = []
    try:
        for cases, world in entry.stages(req):  # every stage but the last prepares the last (the step's run without CP)
            result = run_cases(kind, cases, world, entry.device(req), timeout_s, on_tick)
            advice += [line for line in result.advice if line not in advice]
            failed = [f for o in result.outcomes if not o.completed for f in outcome_findings(o, timeout_s)]
            if failed or not result.outcomes:
                break
    finally:
        entry.finish(req)
    runs = [RunResult.of(outcome_findings_in(o, timeout_s)) for o in result.outcomes]
    if not runs:
        return Report.of([Finding(entry.describe(req), Verdict.HANG, "no rank reported", "rerun with a longer timeout")],
                         fallback_environment(req, world), req, wall_s=result.wall_s, advice=tuple(advice))  # fmt: skip
    final = runs[-1]
    before = runs[0] if req.patch and len(runs) > 1 else None
    env = first_environment(result.outcomes, lambda: fallback_environment(req))
    warnings = warnings_seen(result.outcomes)
    return Report.of(final.findings, env, req, before=before, wall_s=result.wall_s, warnings=warnings, advice=tuple(advice))


@dataclass
class SuiteRun:
    """What the runner made of a suite's requests: one finding per request in order (the patched run's where there
    is one), the unpatched findings when any request ran patched, the machine's environment (each finding keeps its
    own), the time in ranks, the launches and the warnings the ranks raised."""

    findings: list[Finding]
    before: list[Finding] | None
    environment: Environment
    wall_s: float
    launches: int
    warnings: Warnings | None = None


def run_requests(requests: list[Request], *, patch: bool, timeout_s: float, on_tick: Tick = None) -> SuiteRun:
    """Every request's cases, in the requests' order of findings. Requests of one world size, device and interpreter
    need share one launch whatever their kind (the ranks import torch and diffusers once); with `patch` (or a request
    that asks for it) the unpatched findings come back under `before`."""
    validate_timeout(timeout_s)
    groups: dict[tuple, list[int]] = {}
    for i, req in enumerate(requests):
        entry = registry.of(req)
        # Stand-ins are per process (an emulating rank imports diffusers after them): never mixed with the rest.
        groups.setdefault((entry.world_size(req), entry.device(req), entry.fresh_interpreter(req)), []).append(i)
    final: list[Finding | None] = [None] * len(requests)
    before: list[Finding | None] = [None] * len(requests)
    outcomes_seen: list[CaseOutcome] = []
    wall = 0.0
    launches = 0
    for (world, device, _fresh), members in groups.items():
        # diffusers' own examinations before the peers': a peer's rank puts the flash-attn stand-in on sys.path
        ordered = sorted(members, key=lambda i: registry.of(requests[i]).kind is Kind.PEER)
        owned = [(i, case) for i in ordered for case in registry.of(requests[i]).cases(requests[i])]
        result = run_cases(None, [case for _, case in owned], world, device, timeout_s, on_tick)
        wall += result.wall_s
        launches += result.launches
        outcomes_seen += result.outcomes
        judged = case_findings([c for _, c in owned], result.outcomes, timeout_s)
        for (i, case), finding in zip(owned, judged):
            if case.patched:
                final[i] = finding
            else:
                before[i] = finding
                final[i] = final[i] or finding
    widest = max(requests, key=lambda r: registry.of(r).world_size(r))
    ran = first_environment(outcomes_seen, lambda: fallback_environment(widest))
    environment = ran.machine_only()  # each finding keeps its own (Finding.environment); the suite's is the machine's
    if environment.software.diffusers is None:  # a peer's ranks do not report it
        environment = environment.replace(software=environment.software.replace(diffusers=installed_version("diffusers")))
    before_run = None
    if patch or any(r.patch for r in requests):
        before_run = [b for b in before if b is not None]
    findings = [f for f in final if f is not None]
    return SuiteRun(findings, before_run, environment, wall, launches, warnings_seen(outcomes_seen))
