"""The front door: `cpdoctor` with no arguments. The examinations that matter on this machine, as one suite.

A newcomer who runs one `cpdoctor check --ring 2` may see PASS while ring 3, ring 4 and a masked ring are
corrupt. The doctor runs the layouts people actually use, on the best CP-capable backend here ("auto"):

    ring 2 · ring 3 · ring N (N = the accelerators visible, when N ≥ 2 and N is not 2 or 3) · Ulysses 2 ·
    ring 2 × Ulysses 2 · ring 2 with a padded key mask · ring 2 inside non-reentrant activation checkpointing

as one `Suite` through `cpdoctor.api.run_suite`, which runs the checks of one world size in one launch (on a
CPU host: world 2, 3 and 4, three launches). Every finding carries `command`, the exact `cpdoctor check ...`
line that looks closer, and the report carries a summary under `doctor`. Nothing here prints (cli/doctor.py
renders) and nothing here looks at version numbers: the verdicts come from measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.report import Report, Verdict
from cpdoctor.report.sections import DoctorRow, DoctorSummary
from cpdoctor.suite import Suite
from cpdoctor.vocabulary import Kind

MASK_PAD = 3
"""Keys masked as padding in the masked-ring check (a padded text prompt)."""


@dataclass(frozen=True)
class PlannedCheck:
    """One examination of the doctor: a short label for the table, its request (built once, validated: an
    `AttentionRequest` for diffusers' CP attention, a `PeerRequest` for an installed peer's), the fields the
    doctor gave it (the JSON row's `fields`, as the plan wrote them: `{"ring": 3}`, not the request's 14 keys),
    and why it is there."""

    label: str
    request: Any = field(hash=False)
    fields: dict[str, Any] = field(hash=False)
    why: str = ""

    @classmethod
    def attention(cls, label: str, why: str, **given: Any) -> PlannedCheck:
        """A check of diffusers' CP attention with the `given` fields (the rest the request's defaults)."""
        from cpdoctor.examinations.attention.request import AttentionRequest

        return cls(label, AttentionRequest.of(**given), given, why)

    @property
    def kind(self) -> Kind:
        return self.request.kind

    @property
    def world_size(self) -> int:
        return self.request.world_size


def plan(accelerators: int, torchrun_world: int | None = None, peers: tuple[PlannedCheck, ...] = ()) -> list[PlannedCheck]:
    """The checks for a host with `accelerators` visible (0 on a CPU-only host), in table order, then the rows
    of the installed peers (`peer_checks`).

    Under torchrun the world is given: only the checks of that world size can run in it, and the "all the
    accelerators in one ring" check uses the world size instead of the local device count."""
    n = torchrun_world if torchrun_world is not None else accelerators
    check = PlannedCheck.attention
    checks = [check("ring 2", "where most jobs start", ring=2), check("ring 3", "ring ≥ 3: the dK/dV direction", ring=3)]
    if n >= 2 and n not in (2, 3):
        checks.append(check(f"ring {n}", f"all {n} {'ranks' if torchrun_world else 'accelerators'}, one ring", ring=n))
    checks += [
        check("Ulysses 2", "heads split (all-to-all)", ulysses=2),
        check("ring 2 × Ulysses 2", "the ring inside unified CP", ring=2, ulysses=2),
        check(f"ring 2, mask_pad {MASK_PAD}", "a padded prompt's key mask", ring=2, mask_pad=MASK_PAD),
        check("ring 2, checkpointing", "gradient checkpointing (non-reentrant)", ring=2, checkpointing=True),
        *peers,
    ]
    if torchrun_world is not None:
        checks = [c for c in checks if c.world_size == torchrun_world]
        if not checks:
            raise BadInput(
                f"torchrun started {torchrun_world} process{'es' if torchrun_world != 1 else ''}: the doctor needs at least 2; "
                "run `cpdoctor` without torchrun (it starts its own ranks), or `cpdoctor check` with the degrees you use"
            )
    return checks


def peer_checks(device: str = "auto") -> tuple[PlannedCheck, ...]:
    """A ring 2 and a ring 3 row for each installed peer (ring-flash-attn, yunchang, torch's context_parallel)."""
    from cpdoctor.examinations.peer.catalog import doctor_checks

    rows = []
    for row in doctor_checks(device):
        fields: dict[str, Any] = {"impl": row.request.impl, "ring": row.request.ring}
        if row.request.causal:
            fields["causal"] = True
        rows.append(PlannedCheck(row.label, row.request, fields, row.covers))
    return tuple(rows)


def command_for(check: PlannedCheck, *, patch: bool = False, torchrun_world: int | None = None) -> str:
    """The exact `cpdoctor check` line of one check (with `--patch`: before and after cpdoctor's fix, which
    concerns diffusers' code only), as the examination writes it; under torchrun, the torchrun line of the same
    world."""
    from cpdoctor.examinations.commands import check_command
    from cpdoctor.examinations.peer.judge import check_command as peer_command

    if check.kind is Kind.PEER:
        command = peer_command(check.request, brief=True)
    else:
        command = check_command(check.request, patch=patch)
    return f"torchrun --nproc-per-node {torchrun_world} -m {command}" if torchrun_world else command


def suite_for(checks: list[PlannedCheck]) -> Suite:
    """The checks as a suite of their built requests (backend auto, the default shape)."""
    return Suite(
        "doctor",
        "the CP examinations that matter on this machine and this diffusers",
        "cpdoctor (doctor)",
        [c.request for c in checks],
    )


def count_accelerators() -> int:
    """The CUDA devices the ranks would use (`api.visible_gpus`: without importing torch in this process)."""
    from cpdoctor.api import visible_gpus

    return visible_gpus()


def _torchrun_world() -> int | None:
    from cpdoctor import launch

    return launch.torchrun_world_size() if launch.under_torchrun() else None


def _backend_of(finding: Any) -> str | None:
    """The backend the ranks chose for a check (None when none got far enough to say)."""
    name = getattr(getattr(finding.evidence, "facts", None), "name", None)
    return name if name and name != "auto" else None


@dataclass(frozen=True)
class DoctorRequest:
    """The doctor's request: the suite it ran (every check as its full, validated request), marked as the
    doctor's, with the accelerators it counted and the torchrun world it joined (JSON: the suite's keys plus
    `doctor`, `accelerators`, `torchrun_world`)."""

    suite: Any
    accelerators: int
    torchrun_world: int | None

    def to_dict(self) -> dict[str, Any]:
        return {**self.suite.to_dict(), "doctor": True, "accelerators": self.accelerators, "torchrun_world": self.torchrun_world}


def run_doctor(
    *, patch: bool = False, timeout_s: float | None = None, on_tick: Callable[[], None] | None = None, accelerators: int | None = None
) -> Report:
    """Run the doctor's checks here and return one Report: findings in plan order, each with its `command`;
    its `doctor` section summarises the environment, the checks and what did not pass."""
    from cpdoctor.api import DEFAULT_TIMEOUT_S, run_suite

    torchrun_world = _torchrun_world()
    n = count_accelerators() if accelerators is None else accelerators
    checks = plan(n, torchrun_world, peer_checks())
    report = run_suite(suite_for(checks), patch=patch, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, on_tick=on_tick)

    befores = report.before.findings if report.before is not None else [None] * len(report.findings)
    rows, findings, found_before = [], [], []
    for check, finding, before in zip(checks, report.findings, befores, strict=True):
        # A check that did not pass (before or after the fix) is looked at closer before and after the fix.
        failed = any(f is not None and f.verdict != Verdict.PASS for f in (finding, before))
        command = command_for(check, patch=failed, torchrun_world=torchrun_world)
        findings.append(replace(finding, command=command))
        found_before.append(None if before is None else replace(before, command=command))
        rows.append(
            DoctorRow(check.label, dict(check.fields), check.why, finding.verdict, command, None if before is None else before.verdict)
        )
    report.findings = findings
    if report.before is not None:
        report.before.findings = found_before  # type: ignore[assignment]
    backends = sorted({b for f in report.findings if (b := _backend_of(f))})
    report.environment = report.environment.replace(accelerators=n, backend=", ".join(backends) if backends else "auto")
    # run_suite's request (every check as its full, validated request), marked as the doctor's.
    report.request = DoctorRequest(report.request, n, torchrun_world)
    report.doctor = DoctorSummary(
        n,
        torchrun_world,
        report.environment.backend,
        len({c.world_size for c in checks}),  # one launch per world size, diffusers' checks and the peers' together
        tuple(rows),
        tuple(r.label for r in rows if r.verdict != Verdict.PASS),
        None if report.before is None else tuple(r.label for r in rows if r.before != Verdict.PASS),
    )
    report.suite, report.warnings = None, None  # the doctor's report says its summary only (its request names the suite)
    return report
