"""The Python API: the same examinations as the CLI, returning a `Report` instead of printing.

    import cpdoctor
    report = cpdoctor.check_attention(ring=4)          # spawns 4 ranks (or joins torchrun's world)
    assert report.verdict == "PASS", report.findings[0].diagnosis
"""

from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Callable

from cpdoctor import launch
from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.report import Report, RunResult
from cpdoctor.examinations.attention.request import AttentionRequest, validate_timeout
from cpdoctor.examinations.attention.judge import Finding, attention_finding, describe_attention, failure_findings, overall

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_SEQ = 512


def default_seq(world_size: int) -> int:
    """512 rounded up to a multiple of the CP world size, so `--ring 3` works without choosing a length."""
    return -(-DEFAULT_SEQ // world_size) * world_size


def _installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _fallback_environment(world_size: int, req: Any = None) -> dict[str, Any]:
    """What the parent knows without importing torch (used when no rank got far enough to report): the
    versions installed, and the layout asked for (device and backend as requested, e.g. "auto")."""
    env: dict[str, Any] = {
        "torch": _installed_version("torch"),
        "diffusers": _installed_version("diffusers"),
        "python": platform.python_version(),
        "world_size": world_size,
    }
    for key in ("device", "backend", "ring", "ulysses", "dtype"):
        if req is not None and hasattr(req, key):
            env[key] = getattr(req, key)
    return env


def default_degrees(fields: dict[str, Any]) -> dict[str, Any]:
    """Fill ring/ulysses left unset: ring 2, or ring 1 when only a Ulysses degree is given; Ulysses 1."""
    ring, ulysses = fields.get("ring"), fields.get("ulysses")
    if ring is None:
        fields["ring"] = 1 if ulysses not in (None, 1) else 2
    if ulysses is None:
        fields["ulysses"] = 1
    return fields


def build_request(**fields: Any) -> AttentionRequest:
    """An AttentionRequest from keyword fields; seq defaults to 512 rounded up to divide the world size."""
    default_degrees(fields)
    if fields.get("seq") is None:
        fields["seq"] = default_seq(max(1, fields["ring"] * fields["ulysses"]))
    return AttentionRequest.from_dict({k: v for k, v in fields.items() if v is not None}).validate()


def run_cases(kind: str, cases: list[dict], world_size: int, timeout_s: float, device: str, on_tick: Callable[[], None] | None = None) -> Any:
    """Launch one job; raise BadInput / CannotExamine for what the ranks refused."""
    result = launch.run({"kind": kind, "cases": cases, "device": device}, world_size, timeout_s, on_tick)
    if result.bad_input:
        raise BadInput(result.bad_input)
    if result.cannot_examine:
        raise CannotExamine(result.cannot_examine)
    for item in result.results or []:
        if "rank_payloads" in item:
            stopped = launch.failures_from_payloads(item["rank_payloads"])
            if stopped.bad_input:
                raise BadInput(stopped.bad_input)
            if stopped.cannot_examine:
                raise CannotExamine(stopped.cannot_examine)
    return result


def attention_case_findings(item: dict, timeout_s: float) -> list[Finding]:
    """Findings of one launched attention case: the evaluated finding, or CRASH / HANG from the ranks that stopped."""
    req = item["case"]["request"]
    if "evaluated" in item:
        return [attention_finding(req, item["evaluated"])]
    stopped = launch.failures_from_payloads(item["rank_payloads"])
    return failure_findings(describe_attention(req, req["backend"]), stopped.failures, timeout_s)


def check_attention(
    request: AttentionRequest | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_tick: Callable[[], None] | None = None,
    **fields: Any,
) -> Report:
    """Op-level CP parity of diffusers' dispatch_attention_fn; with `patch=True`, before and after the fix.

    Under torchrun every rank returns the same report (rank 0's)."""
    req = request.validate() if request is not None else build_request(**fields)
    cases = [{"request": req.to_dict(), "patched": False}]
    if req.patch:
        cases.append({"request": req.to_dict(), "patched": True})

    def launch_failures(failures: list) -> list[Finding]:
        return failure_findings(describe_attention(req.to_dict(), req.backend), failures, timeout_s)

    return examine("attention", req, cases, timeout_s, launch_failures, lambda item: attention_case_findings(item, timeout_s), on_tick)


def examine(
    kind: str,
    req: Any,
    cases: list[dict],
    timeout_s: float,
    launch_failures: Callable[[list], list[Finding]],
    case_findings: Callable[[dict], list[Finding]],
    on_tick: Callable[[], None] | None = None,
) -> Report:
    """Run the cases of one examination (unpatched, then patched with `req.patch`) and assemble the Report:
    the exit code and top-level verdict are the last run's; with --patch the unpatched run is `before`."""
    validate_timeout(timeout_s)
    result = run_cases(kind, cases, req.world_size, timeout_s, req.device, on_tick)
    runs: list[RunResult] = []
    environment = _fallback_environment(req.world_size, req)
    if result.failures:
        findings = launch_failures(result.failures)
        runs.append(RunResult(overall(findings)[0], findings))
    for item in result.results or []:
        environment = item.get("evaluated", {}).get("environment", environment)
        findings = case_findings(item)
        runs.append(RunResult(overall(findings)[0], findings))
    final = runs[-1]
    verdict, code = overall(final.findings)
    before = runs[0] if req.patch and len(runs) > 1 else None
    return Report(verdict, code, environment, req.to_dict(), final.findings, before=before, wall_s=result.wall_s)


class PreflightFailed(RuntimeError):
    """Raised by `preflight` when CP attention is wrong here and the fix does not (or may not) repair it."""

    def __init__(self, report: Report):
        finding = report.findings[0] if report.findings else None
        detail = f"{finding.verdict}: {finding.diagnosis}" if finding else report.verdict
        super().__init__(f"cpdoctor preflight: context-parallel attention is not safe to train with here — {detail}")
        self.report = report


def _degrees_from(parallel_config: Any) -> tuple[int, int]:
    cp = getattr(parallel_config, "context_parallel_config", None) or parallel_config
    return int(getattr(cp, "ring_degree", None) or 1), int(getattr(cp, "ulysses_degree", None) or 1)


def preflight(
    ring: int | None = None,
    ulysses: int | None = None,
    *,
    parallel_config: Any = None,
    fix: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **fields: Any,
) -> Report:
    """Call once at the top of a training script (on every rank under torchrun) before any CP training step.

    Examines diffusers' CP attention with this job's degrees (from `parallel_config` when given), backend,
    dtype and head shape (`heads=`, `head_dim=`, `seq=`, `mask_pad=`, `backend=`, `dtype=`), forward and
    backward. If it is exact, nothing changes. If it is wrong and `fix` is true, cpdoctor's fixed ring
    attention is examined too and, when it is exact, left patched into this process (every rank takes the
    same decision: under torchrun all ranks see rank 0's report). Otherwise raises PreflightFailed with the
    diagnosis, so the job stops before it learns from corrupted gradients. Returns the report."""
    from cpdoctor.fix import patch as fix_patch

    if parallel_config is not None:
        ring, ulysses = _degrees_from(parallel_config)
    was_patched = fix_patch.is_patched()
    report = check_attention(timeout_s=timeout_s, ring=ring, ulysses=ulysses, patch=fix, **fields)
    unpatched = report.before if report.before is not None else RunResult(report.verdict, report.findings)
    if unpatched.verdict == "PASS":
        fix_patch.set_patched(was_patched)
        return report
    if fix and report.verdict == "PASS":
        fix_patch.apply()
        return report
    fix_patch.set_patched(was_patched)
    raise PreflightFailed(report)


def run_suite(*args: Any, **kwargs: Any) -> Report:
    """Every check of a YAML suite as one Report (see cpdoctor.suite)."""
    from cpdoctor.api_suite import run_suite as _run_suite

    return _run_suite(*args, **kwargs)
