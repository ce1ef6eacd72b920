"""A plan's findings: each problem is a FAIL finding whose remedy lists the measured ways out; a plan without a
problem is one PASS finding. The command of a problem re-runs `cpdoctor plan` with its first concrete remedy
applied, to look closer."""

from __future__ import annotations

import shlex
from typing import Any

from cpdoctor.examinations.plan.result import Plan, Problem, Remedy
from cpdoctor.report import Finding, Verdict

SETTING_OPTIONS = (
    ("height", "--height"),
    ("width", "--width"),
    ("text_len", "--text-len"),
    ("frames", "--frames"),
    ("ring", "--ring"),
    ("ulysses", "--ulysses"),
)


def remedy_line(remedies: list[Remedy]) -> str:
    """'resolution: 1328x1344: 6972 -> 3486 per rank; degrees: ...', predicted ones marked."""
    return "; ".join(f"{r.kind}: {r.text}" + ("" if r.measured else " (predicted)") for r in remedies)


def remedy_settings(remedy: Remedy) -> dict[str, int] | None:
    """The settings a remedy changes, or None when it names none (no option found, an "anything" mode)."""
    v = remedy.values
    if remedy.kind == "resolution" and "height" in v:
        return {"height": v["height"], "width": v["width"]}
    if remedy.kind == "text_padding" and "text_len" in v:
        return {"text_len": v["text_len"]}
    if remedy.kind == "frames" and "frames" in v:
        return {"frames": v["frames"]}
    if remedy.kind == "degrees" and v.get("options"):
        return {"ring": v["options"][0]["ring"], "ulysses": v["options"][0]["ulysses"]}
    return None


def plan_command(model: str, settings: dict[str, Any], changes: dict[str, int] | None = None) -> str:
    """`cpdoctor plan MODEL --height H ...` at `settings` with `changes` applied."""
    values = {**settings, **(changes or {})}
    parts = ["cpdoctor", "plan", shlex.quote(model)]
    parts += [f"{opt} {values[key]}" for key, opt in SETTING_OPTIONS if values.get(key) is not None]
    return " ".join(parts)


def problem_finding(problem: Problem, model: str, settings: dict[str, Any]) -> Finding:
    changes = next((c for c in map(remedy_settings, problem.remedies) if c), None)
    return Finding(
        f"plan: {', '.join(problem.tensors)}",
        Verdict.FAIL,
        problem.what,
        remedy_line(problem.remedies),
        details={"tensors": list(problem.tensors), "remedies": [r.to_dict() for r in problem.remedies]},
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
