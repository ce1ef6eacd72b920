"""`--repro DIR`'s fix.diff: which defects of diffusers' own code an op-level FAIL shows, the minimal diff for
them against the installed file (compat/upstream_fix.py), and its proof.

Nothing is written before it is verified: the installed diffusers package is copied to a temporary folder, the
diff is applied to the copy (never to the user's install), and with the copy first on PYTHONPATH the written
repro.py runs under torchrun and the same examination runs on its cases: the FAIL's own case, ring 2–4 when the
dK/dV direction is fixed, ring 2 and Ulysses 2 as a guard. Cases share one launch per world size (a launch costs
seconds of imports; a case a tenth of one). The fix is verified when the repro no longer reproduces and every
case PASSes; the issue text then carries the diff and a before/after table.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.diffusers import BackendRefusal
from cpdoctor.compat.upstream_fix import (
    FixRefused,
    UpstreamDefect,
    UpstreamFix,
    apply_diff,
    dispatch_source,
    make_fix,
    package_folder,
    present,
)
from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.examinations import runner
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.launch.jobs import Case, CaseOutcome
from cpdoctor.report import TENSOR_LABELS, Finding, Verdict
from cpdoctor.vocabulary import HALF, Device, DType, Kind

TENSORS = ("out", "dq", "dk", "dv")
GUARD = ((2, 1), (1, 2))
"""Ring 2 and Ulysses 2: the layouts every fix must leave exact."""
DIRECTION_RINGS = (2, 3, 4)


@dataclass(frozen=True)
class CaseCheck:
    """One examined case on the patched copy: its layout, verdict, rel err per tensor and, when this run
    measured the same case on the installed code, those errors too."""

    ring: int
    ulysses: int
    mask_pad: int
    verdict: Verdict
    after: dict[str, float]
    before: dict[str, float] = field(default_factory=dict)
    note: str = ""
    backend: str = ""
    """Set for a case run on another backend than the FAIL's (the mask fix's other backends)."""
    emulated: bool = False
    checkpointing: bool = False
    crashed_before: bool = False
    """The FAIL's own case, which crashed on the installed code (no errors before)."""

    @property
    def label(self) -> str:
        parts = [f"ring {self.ring}" if self.ring > 1 else "", f"Ulysses {self.ulysses}" if self.ulysses > 1 else ""]
        label = " × ".join(p for p in parts if p) + (f", last {self.mask_pad} keys masked" if self.mask_pad else "")
        label += ", checkpointing" if self.checkpointing else ""
        if self.backend:
            label += f", `{self.backend}`" + (" (CPU stand-in)" if self.emulated else "")
        return label


@dataclass(frozen=True)
class FixBackends:
    """Where a fix whose contract is per backend (the mask's, the checkpointing's) is verified: the backends whose
    ring runs here and takes what the case hands it (the FAIL's own, the CPU backend, the CUDA backends whose CPU
    stand-in keeps the kernel's contract), and every other CP-registered backend with why it was not."""

    verified: tuple[tuple[str, bool], ...]
    """(backend, emulated) pairs, the FAIL's own first."""
    not_verified: tuple[tuple[str, str], ...]
    """(backend, why) pairs."""
    masked: bool = True
    """Verified for the mask fix (a backend that refuses a mask cannot show it)."""


@dataclass
class Verification:
    """The proof of a fix: whether it holds, and if not why; the repro's errors before (the FAIL) and after."""

    verified: bool
    reason: str
    repro_before: dict[str, float]
    repro_after: dict[str, float] = field(default_factory=dict)
    cases: list[CaseCheck] = field(default_factory=list)
    wall_s: float = 0.0
    backends: FixBackends | None = None
    crashed_before: str = ""
    """"CRASH" when the FAIL's own case crashed on the installed code (no errors before it), "" otherwise."""


@dataclass
class UpstreamOutcome:
    """What `--repro` adds: the diff written (None when refused or not verified), one line for the user, and the
    issue text's section."""

    diff_path: str | None
    message: str
    section: str = ""
    fix: UpstreamFix | None = None
    verification: Verification | None = None


def defects_of(req: AttentionRequest, finding: Finding, has: Callable[[UpstreamDefect], bool] | None = None) -> tuple[UpstreamDefect, ...]:
    """The defects of diffusers' code behind a FAIL: those the diagnosis named, plus the known ones the FAIL's
    own layout runs through where the installed source shows them (`has(defect)`): the dK/dV direction at ring
    ≥ 3 hides behind a wrong forward under a mask, and a stale-K/V backward behind anything the ring does."""
    from cpdoctor.examinations.attention import judge
    from cpdoctor.examinations.judging import diagnose

    if finding.verdict is Verdict.CRASH:
        return _crash_defects(req, finding, has)
    sig = judge.signature(req, getattr(finding.evidence, "facts", None), finding.tensors)
    spoken = diagnose(judge.RULES, sig)[2]
    rule_of = {
        UpstreamDefect.DKV_DIRECTION: judge.DKV_DIRECTION,
        UpstreamDefect.MASK_NOT_ROTATED: judge.MASK_NOT_ROTATED,
        UpstreamDefect.STALE_KV: judge.STALE_KV,
    }  # the double transpose is a CRASH: no rule of this table names it
    found = [d for d, rule in rule_of.items() if any(r is rule for r in spoken)]
    if has is not None:
        if req.ring > 1 and UpstreamDefect.STALE_KV not in found and has(UpstreamDefect.STALE_KV):
            found.append(UpstreamDefect.STALE_KV)
        if req.ring >= 3 and UpstreamDefect.DKV_DIRECTION not in found and has(UpstreamDefect.DKV_DIRECTION):
            found.append(UpstreamDefect.DKV_DIRECTION)
        if req.mask_pad and req.ring > 1 and UpstreamDefect.MASK_NOT_ROTATED not in found and has(UpstreamDefect.MASK_NOT_ROTATED):
            found.append(UpstreamDefect.MASK_NOT_ROTATED)
    return tuple(d for d in UpstreamDefect if d in found)


def checkpointing_crash(finding: Finding) -> bool:
    """Is this CRASH the ring backward's under non-reentrant checkpointing (the judge's signature object, matched
    against the finding's own tracebacks)?"""
    from cpdoctor.examinations.judging import RING_UNDER_CHECKPOINTING

    if finding.verdict is not Verdict.CRASH or finding.failure is None:
        return False
    return RING_UNDER_CHECKPOINTING.matches("\n".join(finding.failure.tracebacks.values()))


def _crash_defects(req: AttentionRequest, finding: Finding, has: Callable[[UpstreamDefect], bool] | None) -> tuple[UpstreamDefect, ...]:
    """The defects behind a CRASH: the ring backward's under checkpointing, and the known ones the verification
    runs through where the installed source shows them: a stale-K/V backward (no fix: the refusal says so), the
    dK/dV direction (the verification checks ring 3 and 4 with checkpointing, so the diffs are combined) and the
    mask under a masked ring."""
    if not (req.checkpointing and req.ring > 1 and checkpointing_crash(finding)):
        return ()
    found = [UpstreamDefect.SAVED_PER_STEP]
    if has is not None:
        found += [d for d in (UpstreamDefect.STALE_KV, UpstreamDefect.DKV_DIRECTION) if has(d)]
        if req.mask_pad and has(UpstreamDefect.MASK_NOT_ROTATED):
            found.append(UpstreamDefect.MASK_NOT_ROTATED)
    return tuple(d for d in UpstreamDefect if d in found)


def propose(
    req: AttentionRequest, ran_on: str | None, finding: Finding, directory: str, script: str, timeout_s: float, backend: str = ""
) -> UpstreamOutcome:
    """Make, verify and (only when verified) write DIR/fix.diff for the FAIL of `req` (`ran_on`: the backend its
    report's environment names; `backend`: the one repro.py runs); the outcome says what happened."""
    from cpdoctor.launch import under_torchrun

    made = Attempt.of(lambda: _fix_for(req, finding), catching=(FixRefused,))  # a refusal is the answer, in its own words
    if made.error is not None:
        return UpstreamOutcome(None, f"no fix.diff: {made.error}")
    fix = made.value
    if fix is None:
        return UpstreamOutcome(None, "no fix.diff: the FAIL's cause is not a defect of diffusers' code that cpdoctor knows")
    if under_torchrun():
        return UpstreamOutcome(
            None, "no fix.diff: under torchrun cpdoctor cannot launch the patched copy's ranks to verify it; run without torchrun", fix=fix
        )
    backend = backend or ran_on or req.backend
    verification = verify(fix, req, finding, script, timeout_s, backend)
    section = issue_section(fix, verification, req)
    if not verification.verified:
        return UpstreamOutcome(None, f"fix not verified, no fix.diff written: {verification.reason}", section, fix, verification)
    path = os.path.join(directory, "fix.diff")
    with open(path, "w") as fh:
        fh.write(fix.diff)
    names = ", ".join(d.value for d in fix.defects)
    return UpstreamOutcome(path, f"fix verified ({names}; {verification.wall_s:.0f} s): wrote {path}", section, fix, verification)


def _fix_for(req: AttentionRequest, finding: Finding) -> UpstreamFix | None:
    """The minimal diff for the defects of diffusers' code behind the FAIL (None when it shows none cpdoctor knows);
    FixRefused where the installed source's structure differs from the one the diff is made for."""
    source = dispatch_source()
    defects = defects_of(req, finding, lambda d: present(source, d))
    return make_fix(source, defects) if defects else None


def fix_backends(own: str, emulated: bool, on_cpu: bool, masked: bool = True) -> FixBackends:
    """The backends a fix is verified on, and why each other CP-registered backend is not: on a CPU the FAIL's
    own, cpdoctor's CPU backend and every CUDA backend with a CPU stand-in whose ring runs (a backend that has no
    LSE for the ring, or with `masked` refuses `attn_mask`, says so in its own code: compat reads it); on a GPU
    the FAIL's own only (no stand-ins there)."""
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.cpu_kernels.standins import EMULATED_BACKENDS

    verified: list[tuple[str, bool]] = [(own, emulated)]
    not_verified: list[tuple[str, str]] = []
    for name in (cpu_backend.NAME, *EMULATED_BACKENDS):
        if name == own or not on_cpu:
            continue
        refusal = None if name == cpu_backend.NAME else _refusal(compat.ring_mask_refusal(name), masked)
        if refusal:
            not_verified.append((name, _refused(refusal)))
        else:
            verified.append((name, name in EMULATED_BACKENDS))
    seen = {name for name, _ in verified} | {name for name, _ in not_verified}
    for name in compat.registered_backend_names():
        if name in seen or not compat.is_cp_registered(name):
            continue
        refusal = _refusal(compat.ring_mask_refusal(name), masked)
        why = _refused(refusal) if refusal else "no kernel or CPU stand-in of it here"
        not_verified.append((name, why if on_cpu or refusal else "the verification runs on the FAIL's backend only on a GPU"))
    return FixBackends(tuple(verified), tuple(not_verified), masked)


def _refusal(refusal: BackendRefusal | None, masked: bool) -> BackendRefusal | None:
    """A backend's refusal that matters here: no LSE always, a refused mask only for a masked case."""
    return refusal if refusal is not None and (masked or refusal.no_lse) else None


def _refused(refusal: BackendRefusal) -> str:
    """Why a backend cannot show the fix, in diffusers' own words."""
    what = "it runs no ring (the ring needs an LSE)" if refusal.no_lse else "its CP path takes no mask"
    return f"{what}: diffusers says “{refusal.message.rstrip('.')}”"


def _cases(req: AttentionRequest, defects: tuple[UpstreamDefect, ...], backends: FixBackends | None = None) -> list[AttentionRequest]:
    """The layouts to examine on the patched copy, each the FAIL's request with what differs (`dataclasses.replace`;
    validated by the caller, which keeps a layout the shape refuses as UNSUPPORTED): the FAIL's own case first, then
    ring 2–4 for the direction, then the guard, then (mask and checkpointing fixes) the FAIL's own case on each other
    backend the fix is verified on (the CUDA kernels' stand-ins take half precision only: bf16 there when the FAIL's
    dtype is not); duplicates dropped. `seq=None`: the default length of each layout."""
    own = replace(req, patch=False)
    plain = {"ulysses": 1, "mask_pad": 0, "seq": None}
    layouts = [own]
    if UpstreamDefect.DKV_DIRECTION in defects:
        layouts += [replace(own, ring=r, **plain) for r in DIRECTION_RINGS]
    if UpstreamDefect.SAVED_PER_STEP in defects:  # with and without checkpointing, on every ring the diff fixes
        rings = DIRECTION_RINGS if UpstreamDefect.DKV_DIRECTION in defects else (own.ring,)
        layouts += [replace(own, ring=r, checkpointing=c, **plain) for r in rings for c in (True, False)]
        layouts += [replace(own, ring=1, ulysses=2, mask_pad=0, seq=None, checkpointing=True)]
    layouts += [replace(own, ring=r, ulysses=u, mask_pad=0, seq=None, checkpointing=False) for r, u in GUARD]
    if backends is not None:
        for name, emulated in backends.verified[1:]:
            dtype = own.dtype if not emulated or own.dtype in HALF else DType.BF16
            layouts.append(replace(own, backend=name, emulate=emulated, dtype=dtype))
    seen, unique = set(), []
    for case in layouts:
        if _case_key(case) not in seen:
            seen.add(_case_key(case))
            unique.append(case)
    return unique


def _case_key(req: AttentionRequest) -> tuple[object, ...]:
    """What tells two cases apart: the layout, the mask, the backend and whether it is emulated."""
    return (req.ring, req.ulysses, req.mask_pad, req.backend, req.emulate, req.checkpointing)


def verify(fix: UpstreamFix, req: AttentionRequest, finding: Finding, script: str, timeout_s: float, backend: str = "") -> Verification:
    """Apply the diff to a copy of the installed package and run repro.py and the examination's cases there
    (the mask and checkpointing fixes also on the other backends `fix_backends` names)."""
    start = time.monotonic()
    before = {n: t.rel_err for n, t in finding.tensors.items()}
    result = Verification(False, "", before)
    if finding.verdict is Verdict.CRASH:
        result.crashed_before = "CRASH"
    if UpstreamDefect.MASK_NOT_ROTATED in fix.defects or UpstreamDefect.SAVED_PER_STEP in fix.defects:  # per-backend contracts
        masked = UpstreamDefect.MASK_NOT_ROTATED in fix.defects
        result.backends = fix_backends(backend or req.backend, req.emulate, _on_cpu(req), masked)
    with tempfile.TemporaryDirectory(prefix="cpdoctor-upstream-") as root:
        copied = Attempt.of(lambda: _patched_copy(fix, root), catching=(OSError, ValueError))
        if copied.error is not None:
            result.reason = f"cannot apply the diff to a copy of the installed diffusers ({copied.error})"
            return result
        _run_repro(result, script, req.world_size, root, timeout_s)
        _run_cases(result, req, fix.defects, root, timeout_s, backend)
    result.wall_s = time.monotonic() - start
    failed = [c.label for c in result.cases if c.verdict not in (Verdict.PASS, Verdict.UNSUPPORTED)]
    if not result.reason and failed:
        result.reason = f"on the patched copy {', '.join(failed)} still do{'es' if len(failed) == 1 else ''} not PASS"
    result.verified = not result.reason
    if result.verified:
        result.reason = "fix verified"
    return result


def _patched_copy(fix: UpstreamFix, root: str) -> None:
    """Copy the installed diffusers package (bytecode caches too, so the ranks import it as fast) under `root`
    and apply the diff to the copy's file."""
    package = package_folder()
    copy = os.path.join(root, os.path.basename(package))
    shutil.copytree(package, copy, symlinks=True)
    target = os.path.join(root, fix.source.repo_path.split("/", 1)[1])
    with open(target, encoding="utf-8") as fh:
        text = fh.read()
    if text != fix.source.text:
        raise ValueError(f"the copy's {fix.source.repo_path} differs from the file the diff was made from")
    with open(target, "w", encoding="utf-8") as fh:
        fh.write(apply_diff(text, fix.diff))


def _run_repro(result: Verification, script: str, world: int, root: str, timeout_s: float) -> None:
    """repro.py under torchrun against the copy: its errors after the fix, and whether it still reproduces."""
    from cpdoctor.launch.script import run_under_torchrun

    run = run_under_torchrun(script, world, root, cwd=root, timeout_s=timeout_s)
    for line in run.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in TENSORS:
            try:
                result.repro_after[parts[0]] = float(parts[1])
            except ValueError:
                continue
    if run.returncode is None:
        result.reason = f"repro.py on the patched copy ran past {timeout_s:.0f} s"
    elif run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
        result.reason = f"repro.py on the patched copy exited {run.returncode}: {tail}"
    elif "NOT REPRODUCED" not in run.stdout:
        result.reason = "repro.py on the patched copy still reproduces the FAIL"


def _on_cpu(req: AttentionRequest) -> bool:
    """Do the verification's ranks run on the CPU (where the CUDA kernels' stand-ins can stand in)?"""
    import torch

    return req.device is Device.CPU or (req.device is not Device.CUDA and not torch.cuda.is_available())


def _run_cases(
    result: Verification, req: AttentionRequest, defects: tuple[UpstreamDefect, ...], root: str, timeout_s: float, backend: str = ""
) -> None:
    """The examination's cases on the copy, through the runner, one launch per world size (a world's emulated cases
    first: the flash-attn stand-in must be on sys.path before the ranks import diffusers; a plain case after them
    removes the aten stand-ins again, probe.prepare_emulation). A layout the FAIL's shape cannot take (heads that
    Ulysses 2 cannot split) is UNSUPPORTED: that guard does not apply."""
    from cpdoctor.launch.script import ranks_import_first

    by_world: dict[int, list[AttentionRequest]] = {}
    for case in sorted(_cases(req, defects, result.backends), key=lambda c: not c.emulate):
        built = Attempt.of(lambda c=case: c.validate(), catching=(BadInput,))
        if built.value is None:  # a shape the layout cannot take
            result.cases.append(CaseCheck(case.ring, case.ulysses, case.mask_pad, Verdict.UNSUPPORTED, {}, note=built.why(with_type=False) or "", **_other_backend(case, req)))  # fmt: skip
            continue
        by_world.setdefault(built.value.world_size, []).append(built.value)
    with ranks_import_first(root):
        for world, requests in sorted(by_world.items()):
            ran = Attempt.of(lambda: _launch(requests, world, timeout_s), catching=(BadInput, CannotExamine))  # noqa: B023 - called at once
            outcomes = ran.value if ran.value is not None else []
            for n, request in enumerate(requests):
                result.cases.append(
                    _checked(result, req, request, outcomes[n] if n < len(outcomes) else None, ran.why(with_type=False), timeout_s)
                )


def _launch(requests: list[AttentionRequest], world: int, timeout_s: float) -> list[CaseOutcome]:
    """One launch of the cases of a world size through the runner; BadInput / CannotExamine where the ranks refused."""
    return runner.run_cases(Kind.ATTENTION, [Case(r) for r in requests], world, str(requests[0].device), timeout_s).outcomes


def _checked(
    result: Verification, req: AttentionRequest, case: AttentionRequest, outcome: CaseOutcome | None, refused: str | None, timeout_s: float
) -> CaseCheck:
    """One case's line of the verification: its verdict and errors on the copy, and the FAIL's errors before where it
    is the FAIL's own case; CRASH where the ranks refused the launch, HANG where an earlier case stopped it."""
    own = _case_key(case) == _case_key(req)
    before = result.repro_before if own else {}
    other = _other_backend(case, req)
    if own and result.crashed_before:
        other["crashed_before"] = True
    key = (case.ring, case.ulysses, case.mask_pad)
    if outcome is None:
        verdict = Verdict.CRASH if refused else Verdict.HANG
        note = f"the ranks refused: {refused}" if refused else "not examined: the launch stopped earlier"
        return CaseCheck(*key, verdict, {}, before, note, **other)
    f = runner.outcome_findings(outcome, timeout_s)[0]
    errors = {t: row.rel_err for t, row in f.tensors.items()}
    return CaseCheck(*key, f.verdict, errors, before, f.diagnosis if f.verdict is not Verdict.PASS else "", **other)


def _other_backend(case: AttentionRequest, req: AttentionRequest) -> dict[str, Any]:
    """CaseCheck's backend fields for a case on another backend than the FAIL's (none for the FAIL's own), and
    whether it ran under checkpointing."""
    checkpointing = {"checkpointing": case.checkpointing}
    if case.backend == req.backend and case.emulate == req.emulate:
        return checkpointing
    return {"backend": case.backend, "emulated": case.emulate, **checkpointing}


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def issue_section(fix: UpstreamFix, v: Verification, req: AttentionRequest) -> str:
    """The issue text's "Proposed fix": the diff, the repro before and after, every case examined on the copy."""
    names = " and ".join(f"the {d.value}" for d in fix.defects)
    lines = [
        "### Proposed fix",
        "",
        f"A minimal change to `{fix.source.repo_path}` for {names} (attached as `fix.diff`; `patch -p1 < fix.diff` in a",
        "diffusers checkout of the release named under System Info):",
        "",
        "```diff",
        fix.diff.rstrip("\n"),
        "```",
        "",
        f"{'Verified' if v.verified else 'NOT verified'} by cpdoctor on a copy of the installed diffusers with this diff applied: "
        f"`repro.py` and the same examination (rel L2 error against the fp64 reference; tolerance as above).",
        "",
        "| tensor | before (installed) | after (patched copy) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {TENSOR_LABELS.get(n, n)} | {v.crashed_before or _fmt(v.repro_before.get(n))} | {_fmt(v.repro_after.get(n))} |" for n in TENSORS
    ]
    lines += ["", "| case on the patched copy | verdict | out / dQ / dK / dV after | before |", "|---|---|---|---|"]
    for c in v.cases:
        after = " / ".join(_fmt(c.after.get(n)) for n in TENSORS) if c.after else c.note or "–"
        before = " / ".join(_fmt(c.before.get(n)) for n in TENSORS) if c.before else ("CRASH" if c.crashed_before else "not run")
        lines.append(f"| {c.label} | {c.verdict.value} | {after} | {before} |")
    lines += _backend_lines(v.backends)
    if not v.verified:
        lines += ["", f"Not verified: {v.reason}."]
    return "\n".join(lines) + "\n"


def _backend_lines(backends: FixBackends | None) -> list[str]:
    """Which backends the fix was verified on and which not, and why (the issue's reader asks first)."""
    if backends is None:
        return []
    kept = "mask contract" if backends.masked else "op contract (what its forward saves, what its backward reads)"
    names = ", ".join(f"`{name}`" for name, _ in backends.verified)
    emulated = [f"`{name}`" for name, em in backends.verified if em]
    stand_in = (
        f" ({', '.join(emulated)}: the CUDA kernel replaced by cpdoctor's CPU stand-in, which keeps the kernel's {kept})"
        if emulated
        else ""
    )
    lines = ["", f"{'The mask part' if backends.masked else 'The fix'} was verified on: {names}{stand_in}.", ""]
    if backends.not_verified:
        lines += ["Not verified on:", ""] + [f"- `{name}`: {why}" for name, why in backends.not_verified]
    return lines


def with_section(issue: str, section: str) -> str:
    """The issue text with the fix section before its System Info (after the logs it fixes)."""
    marker = "### System Info"
    if not section:
        return issue
    return issue.replace(marker, section + "\n" + marker, 1) if marker in issue else issue + "\n" + section


__all__ = ["CaseCheck", "UpstreamOutcome", "Verification", "defects_of", "issue_section", "propose", "with_section"]
