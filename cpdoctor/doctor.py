"""The front door: `cpdoctor` with no arguments. The examinations that matter on this machine, as one suite.

A newcomer who runs one `cpdoctor check --ring 2` may see PASS while ring 3, ring 4 and a masked ring are
corrupt. The doctor runs the layouts people actually use, on the best CP-capable backend here ("auto"):

    ring 2 · ring 3 · ring N (N = the accelerators visible, when N ≥ 2 and N is not 2 or 3) · Ulysses 2 ·
    ring 2 × Ulysses 2 · ring 2 with a padded key mask · ring 2 inside non-reentrant activation checkpointing

as one `Suite` through `cpdoctor.api.examine_suite`, which runs the checks of one world size in one launch (on a
CPU host: world 2, 3 and 4, three launches); the doctor builds its own report from what came back (`rows_of`):
every finding carries `command`, the exact `cpdoctor check ...` line that looks closer, and the report carries a
summary under `doctor`. Nothing here prints (cli/doctor.py
renders) and nothing here looks at version numbers: the verdicts come from measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations.request import degrees_label
from cpdoctor.report import Finding, Report, RunResult, Verdict
from cpdoctor.report.sections import DoctorRow, DoctorSummary
from cpdoctor.suite import Suite, SuiteRequest
from cpdoctor.vocabulary import Kind

if TYPE_CHECKING:
    from cpdoctor.examinations.request import Request
    from cpdoctor.examinations.runner import SuiteRun

MASK_PAD = 3
"""Keys masked as padding in the masked-ring check (a padded text prompt)."""

RINGS = ((2, "where most jobs start"), (3, "ring ≥ 3: the dK/dV direction"))
"""The ring degrees every plan checks, diffusers' and each installed peer's, and what each covers."""


@dataclass(frozen=True)
class PlannedCheck:
    """One examination of the doctor: a short label for the table, its request (built once, validated: an
    `AttentionRequest` for diffusers' CP attention, a `PeerRequest` for an installed peer's), the fields the
    doctor gave it (the JSON row's `fields`, as the plan wrote them: `{"ring": 3}`, not the request's 14 keys),
    and why it is there."""

    label: str
    request: Request = field(hash=False)
    fields: dict[str, Any] = field(hash=False)
    why: str = ""

    @classmethod
    def attention(cls, why: str, **given: Any) -> PlannedCheck:
        """A check of diffusers' CP attention with the `given` fields (the rest the request's defaults), labelled by
        its layout ("ring 2 × Ulysses 2", "ring 2, mask_pad 3")."""
        from cpdoctor.examinations.attention.request import AttentionRequest

        request = AttentionRequest.of(**given)
        marks = (f", mask_pad {request.mask_pad}" if request.mask_pad else "") + (", checkpointing" if request.checkpointing else "")
        return cls(degrees_label(request.ring, request.ulysses) + marks, request, given, why)

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
    checks = [check(why, ring=ring) for ring, why in RINGS]
    if n >= 2 and n not in (2, 3):
        checks.append(check(f"all {n} {'ranks' if torchrun_world else 'accelerators'}, one ring", ring=n))
    checks += [
        check("heads split (all-to-all)", ulysses=2),
        check("the ring inside unified CP", ring=2, ulysses=2),
        check("a padded prompt's key mask", ring=2, mask_pad=MASK_PAD),
        check("gradient checkpointing (non-reentrant)", ring=2, checkpointing=True),
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


def plan_in_words() -> str:
    """What the doctor runs, in words, from its plan (`--help` of `cpdoctor` and `cpdoctor doctor`): the checks of a
    CPU host, the ring over every accelerator where there are 4 or more, and the rows of each installed peer."""
    from cpdoctor.vocabulary import Impl

    here = {c.label for c in plan(0)}
    words = [c.label if c.label in here else "ring N (all N ≥ 4 accelerators, one ring)" for c in plan(4)]
    rings = " and ".join(f"ring {ring}" for ring, _ in RINGS)
    peers = ", ".join(impl.value for impl in Impl.peers())
    return f"{' · '.join(words)}; then {rings} of each installed peer ({peers})"


def peer_checks(device: str = "auto") -> tuple[PlannedCheck, ...]:
    """A ring 2 and a ring 3 row for each installed peer (ring-flash-attn, yunchang, torch's context_parallel)."""
    from cpdoctor.examinations.peer.catalog import doctor_checks

    rows = []
    for row in doctor_checks(RINGS, device):
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


@dataclass(frozen=True)
class DoctorRequest:
    """The doctor's request: the suite it ran (every check as its full, validated request), marked as the
    doctor's, with the accelerators it counted and the torchrun world it joined (JSON: the suite's keys plus
    `doctor`, `accelerators`, `torchrun_world`)."""

    suite: SuiteRequest
    accelerators: int
    torchrun_world: int | None

    def to_dict(self) -> dict[str, Any]:
        return {**self.suite.to_dict(), "doctor": True, "accelerators": self.accelerators, "torchrun_world": self.torchrun_world}


@dataclass(frozen=True)
class Rows:
    """The doctor's findings in plan order, each with the command that looks closer at its check (and the
    unpatched ones with `--patch`), and its table's rows."""

    findings: tuple[Finding, ...]
    before: tuple[Finding, ...] | None
    table: tuple[DoctorRow, ...]


def rows_of(checks: list[PlannedCheck], ran: SuiteRun, torchrun_world: int | None) -> Rows:
    """Each check's finding (and unpatched finding) with its closer-look command: a check that did not pass, before
    or after the fix, is looked at closer before and after the fix. A finding that does not know where it ran ran
    on the suite's machine."""
    befores: list[Finding | None] = list(ran.before) if ran.before is not None else [None] * len(ran.findings)
    findings, found_before, table = [], [], []
    for check, finding, before in zip(checks, ran.findings, befores, strict=True):
        failed = any(f is not None and f.verdict != Verdict.PASS for f in (finding, before))
        command = command_for(check, patch=failed, torchrun_world=torchrun_world)
        findings.append(replace(finding.ran_in(ran.environment), command=command))
        if before is not None:
            found_before.append(replace(before.ran_in(ran.environment), command=command))
        table.append(
            DoctorRow(check.label, dict(check.fields), check.why, finding.verdict, command, None if before is None else before.verdict)
        )
    return Rows(tuple(findings), None if ran.before is None else tuple(found_before), tuple(table))


def backends_chosen(checks: list[PlannedCheck], findings: tuple[Finding, ...]) -> str:
    """Every backend the doctor's checks of diffusers chose, joined: the one a finding judged from numbers names
    (its evidence's facts); where the ranks failed before they could say (a CRASH, a layout the release refuses),
    `auto` resolved here as they resolve it (`backend_choice.resolved_backend`, diffusers' installed backends tried
    on this device: the parent imports torch and diffusers only then). "auto" when none is known."""
    from cpdoctor.attempt import Attempt
    from cpdoctor.examinations.backend_choice import resolved_backend

    named = {name for f in findings if (name := _backend_of(f))}
    failed = [c.request for c, f in zip(checks, findings) if c.kind is Kind.ATTENTION and f.failure is not None]
    if not named and failed:  # a backend that cannot even be resolved here leaves the line at "auto"
        named = {name for req in failed if (name := Attempt.of(lambda r=req: resolved_backend(r)).or_else("auto")) != "auto"}
    return ", ".join(sorted(named)) if named else "auto"


def _backend_of(finding: Finding) -> str | None:
    """The backend the ranks chose for a check, as its evidence names it (None when none got far enough to say)."""
    facts = getattr(finding.evidence, "facts", None)  # a check of diffusers' attention: AttentionEvidence's; a peer's: none
    name = getattr(facts, "name", None)
    return name if name and name != "auto" else None


def run_doctor(
    *, patch: bool = False, timeout_s: float | None = None, on_tick: Callable[[], None] | None = None, accelerators: int | None = None
) -> Report:
    """Run the doctor's checks here and return one Report, built from its rows: findings in plan order, each with its
    `command`; its `doctor` section summarises the environment, the checks and what did not pass."""
    from cpdoctor.api import DEFAULT_TIMEOUT_S, examine_suite

    torchrun_world = _torchrun_world()
    n = count_accelerators() if accelerators is None else accelerators
    checks = plan(n, torchrun_world, peer_checks())
    asked, ran = examine_suite(
        suite_for(checks), patch=patch, timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, on_tick=on_tick
    )
    rows = rows_of(checks, ran, torchrun_world)
    backend = backends_chosen(checks, rows.findings)
    environment = ran.environment.replace(
        software=ran.environment.software.replace(accelerators=n), attention=ran.environment.attention.replace(backend=backend)
    )
    summary = DoctorSummary(
        n,
        torchrun_world,
        backend,
        len({c.world_size for c in checks}),  # one launch per world size, diffusers' checks and the peers' together
        rows.table,
        tuple(r.label for r in rows.table if r.verdict != Verdict.PASS),
        None if rows.before is None else tuple(r.label for r in rows.table if r.before != Verdict.PASS),
    )
    before = None if rows.before is None else RunResult.of(rows.before)
    # the doctor's report says its summary only: no `suite` or `warnings` key (its request names the suite)
    return Report.of(rows.findings, environment, DoctorRequest(asked, n, torchrun_world), before=before, wall_s=ran.wall_s, doctor=summary)
