"""A plan's findings: each problem is a FAIL finding whose remedy lists the measured ways out; a plan without a
problem is one PASS finding. The command of a problem re-runs `cpdoctor plan` with its first concrete remedy
applied, to look closer."""

from __future__ import annotations

from typing import Any

from cpdoctor.model_zoo.splits.plan import plan_command, remedy_line
from cpdoctor.model_zoo.splits.result import Plan, Problem
from cpdoctor.report import Finding, Verdict


def problem_finding(problem: Problem, model: str, settings: dict[str, Any]) -> Finding:
    changes = next((c for c in (r.settings() for r in problem.remedies) if c), None)
    return Finding(
        f"plan: {', '.join(problem.tensors)}",
        Verdict.FAIL,
        problem.what,
        remedy_line(problem.remedies),
        evidence=problem,
        command=plan_command(model, settings, changes) if changes else None,
    )


def pass_finding(settings: dict[str, Any]) -> Finding:
    heads = "" if settings["ulysses"] == 1 else f" and the heads over ulysses {settings['ulysses']}"
    return Finding("plan: every split", Verdict.PASS, f"every split divides over {settings['world_size']} ranks{heads}")


def plan_findings(plan: Plan, model: str) -> list[Finding]:
    """`model`: the name or path the plan was asked for (what the commands repeat)."""
    if not plan.problems:
        return [pass_finding(plan.settings)]
    return [problem_finding(p, model, plan.settings) for p in plan.problems]
