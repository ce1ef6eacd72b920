"""`run_suite`: every check of a YAML suite, with as few launches as possible, as one `Report`.

Checks of the same kind and world size run as the cases of one launch (the worker processes start once and
import torch and diffusers once), in the suite's order within each launch. With `patch`, every check runs
unpatched and then patched, side by side, as `cpdoctor check --patch` does.
"""

from __future__ import annotations

from typing import Any, Callable

from cpdoctor.api import DEFAULT_TIMEOUT_S, _fallback_environment, attention_case_findings, run_cases
from cpdoctor.report import Report, RunResult
from cpdoctor.examinations.attention.request import validate_timeout
from cpdoctor.suite import Suite, build_requests
from cpdoctor.examinations.attention.judge import UNSUPPORTED, Finding, describe_attention, failure_findings, overall


def _describe(kind: str, req: Any) -> str:
    if kind == "attention":
        return describe_attention(req.to_dict(), req.backend)
    from cpdoctor.examinations.model.judge import describe_model

    return describe_model(req.to_dict())


def _cases(kind: str, req: Any) -> list[dict]:
    extra: dict[str, Any] = {}
    if kind == "model":
        from cpdoctor.api_model import op_level_cases

        extra["op_cases"] = op_level_cases(req)
    cases = [{"request": req.to_dict(), "patched": False, **extra}]
    if req.patch:
        cases.append({"request": req.to_dict(), "patched": True, **extra})
    return cases


def _item_findings(kind: str, item: dict, timeout_s: float) -> list[Finding]:
    if kind == "attention":
        return attention_case_findings(item, timeout_s)
    from cpdoctor.examinations.model.judge import model_case_findings

    return model_case_findings(item, timeout_s)


def run_suite(suite: Suite, *, patch: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S, on_tick: Callable[[], None] | None = None) -> Report:
    """Run every check; findings in the suite's order (with `patch`, the unpatched ones under `before`)."""
    validate_timeout(timeout_s)
    requests = build_requests(suite, patch)
    groups: dict[tuple, list[int]] = {}
    for i, (kind, req) in enumerate(requests):
        groups.setdefault((kind, req.world_size, req.device), []).append(i)
    final: list[Finding | None] = [None] * len(requests)
    before: list[Finding | None] = [None] * len(requests)
    environment: dict[str, Any] = _fallback_environment(max(r.world_size for _, r in requests))
    wall = 0.0
    for (kind, world, device), members in groups.items():
        cases = [case for i in members for case in _cases(kind, requests[i][1])]
        owners = [i for i in members for _ in _cases(kind, requests[i][1])]
        result = run_cases(kind, cases, world, timeout_s, device, on_tick)
        wall += result.wall_s
        if result.failures:
            for i in members:
                crash = failure_findings(_describe(kind, requests[i][1]), result.failures, timeout_s)
                final[i] = before[i] = crash[0]
            continue
        items = result.results or []
        for n, item in enumerate(items):
            i = owners[n]
            environment = item.get("evaluated", {}).get("environment", environment)
            finding = _item_findings(kind, item, timeout_s)[0]
            if item["case"].get("patched"):
                final[i] = finding
            else:
                before[i] = finding
                final[i] = finding if final[i] is None else final[i]
        stopped_at = len(items)
        for n in range(stopped_at, len(cases)):  # a case that stopped the launch leaves the rest unexamined
            i = owners[n]
            if final[i] is None or cases[n].get("patched"):
                final[i] = Finding(_describe(kind, requests[i][1]), UNSUPPORTED, "not examined: an earlier check in the same launch stopped it", "run this check alone")
    for varying in ("world_size", "ring", "ulysses", "backend", "dtype", "model"):  # per check, not per suite
        environment.pop(varying, None)
    findings = [f for f in final if f is not None]
    verdict, code = overall(findings)
    before_run = None
    if patch or any(r.patch for _, r in requests):
        olds = [b for b in before if b is not None]
        before_run = RunResult(overall(olds)[0], olds)
    request = {"suite": suite.name, "source": suite.source, "patch": patch, "checks": [{k: r.to_dict()} for k, r in requests]}
    return Report(verdict, code, environment, request, findings, before=before_run, wall_s=wall, extra={"suite": suite.name})

