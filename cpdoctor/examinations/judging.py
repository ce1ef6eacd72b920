"""From numbers to verdicts, shared by every examination: one tolerance, one per-tensor judgement, diagnosis as
a table of rules, and the CRASH / HANG findings of ranks that failed (with the known signatures of diffusers'
CP code recognised in their tracebacks).

The tolerance of a tensor is `2 × e_base + eps(dtype)`, where `e_base` is the relative L2 error the same
backend (or model) makes on the full sequence *without* CP in the same dtype, measured in the same run, and
eps is the dtype's machine epsilon: the criterion flash-attn's own tests use (at most twice the error of a
plain same-dtype implementation). Measured on CPU: fp32 baselines are 3.7e-7–4.6e-7, so fp32 tolerates ~1e-6;
bf16 baselines are 2.2e-3–3.9e-3, so bf16 tolerates ~1.5e-2, while the unrotated-mask bug shows 7.4e-2.
Without a baseline (the backend has no local path) it is `4 × eps`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from cpdoctor.errors import Unsupported, UnsupportedKind
from cpdoctor.launch.jobs import FailureKind, RankFailure
from cpdoctor.report import FailureEvidence, Finding, JudgedRow, TensorRow, Verdict
from cpdoctor.vocabulary import DType

GRADS_FAR_WORSE = 10.0
"""A gradient whose error is this many times the forward's is wrong for a reason of its own."""

LSE_REMEDY = (
    "use a backend with an LSE for ring attention (cpdoctor_cpu on CPU; _native_flash, _native_cudnn or flash on GPU), or Ulysses-only CP"
)
CP_BACKEND_REMEDY = (
    "use a CP-capable backend (`cpdoctor env` lists them; on CPU cpdoctor_cpu, on GPU _native_flash, _native_cudnn or flash)"
)
OTHER_BACKEND_REMEDY = "pick a backend that runs on this device (`cpdoctor env` lists them)"


def tolerance(dtype: str, baseline: float | None) -> float:
    eps = DType(dtype).eps
    return 4 * eps if baseline is None else 2 * baseline + eps


def judge_row(row: TensorRow, dtype: str, slack: float = 1.0) -> JudgedRow:
    """A measured tensor row with its tolerance, the ranks outside it and its verdict. `slack` widens the
    tolerance for a row that is the worst of many (see the model examination's worst parameter)."""
    tol = tolerance(dtype, row.baseline_rel_err)
    bad = tuple(r for r, e in enumerate(row.per_rank_rel_err) if not e <= tol)
    ok = row.rel_err <= slack * tol and row.nonfinite == 0 and not bad
    return JudgedRow.judged(row, tol, bad, Verdict.PASS if ok else Verdict.FAIL)


def judge_rows(rows: dict[str, TensorRow], dtype: str) -> dict[str, JudgedRow]:
    return {name: judge_row(row, dtype) for name, row in rows.items()}


UNSUPPORTED_REMEDIES: dict[UnsupportedKind, str] = {
    UnsupportedKind.MISSING_PACKAGE: "install the missing package, or pick another backend (`cpdoctor env` lists what runs here)",
    UnsupportedKind.NOT_REGISTERED: OTHER_BACKEND_REMEDY,
    UnsupportedKind.NOT_CP_CAPABLE: CP_BACKEND_REMEDY,
    UnsupportedKind.DOES_NOT_RUN: OTHER_BACKEND_REMEDY,
    UnsupportedKind.NO_BACKWARD: OTHER_BACKEND_REMEDY,
    UnsupportedKind.NO_LSE: LSE_REMEDY,
    UnsupportedKind.REFUSED_BY_RELEASE: "use a layout this release supports, or a release that supports this one",
    UnsupportedKind.NOT_EXAMINED: "run this check alone",
    UnsupportedKind.PLAN_DOES_NOT_FIT: (
        "examine a model the plan fits: every block the plan names (no --blocks below them; the tiny config keeps them), "
        "a config of the class's own shape; nothing about the attention was measured"
    ),
}
"""The remedy of each kind of UNSUPPORTED (a unit test checks that every kind has one)."""


def unsupported_finding(subject: str, unsupported: Unsupported, remedy: str | None = None, **more: Any) -> Finding:
    """The UNSUPPORTED finding for `unsupported`, with the remedy of its kind unless one is given."""
    return Finding(subject, Verdict.UNSUPPORTED, unsupported.message, remedy or UNSUPPORTED_REMEDIES[unsupported.kind], **more)


# ----------------------------------------------------------------------------------------------------------
# Diagnosis as a table of rules
# ----------------------------------------------------------------------------------------------------------

S = TypeVar("S")


class Aspect(Enum):
    """What part of a case a rule speaks for: rules of one aspect exclude each other (the first that applies
    speaks), rules of different aspects add up. Op level: nonfinite, forward, LSE, backward; the model adds what
    went wrong, the mask and the op-level cross-check; the step: the cause, a per-shard loss, RNG, where."""

    NONFINITE = "nonfinite"
    FORWARD = "forward"
    LSE = "lse"
    BACKWARD = "backward"
    WHAT = "what"
    MASK = "mask"
    OP_LEVEL = "op level"
    CAUSE = "cause"
    SHARD = "shard"
    RNG = "rng"
    WHERE = "where"


@dataclass(frozen=True)
class Rule(Generic[S]):
    """One line of a diagnosis table: when `applies(signature)`, say `says(signature)` and offer `remedies` (and
    `remedy_of(signature)`, for a remedy that depends on what was seen). Rules of the same `aspect` (nonfinite,
    forward, backward, mask, ...) exclude each other: the first that applies speaks for that aspect. `name` is
    for people (tests, docs); code that needs to know which rule spoke holds the rule itself."""

    aspect: Aspect
    name: str
    applies: Callable[[S], bool]
    says: Callable[[S], str]
    remedies: tuple[str, ...] = ()
    remedy_of: Callable[[S], str] | None = None


R = TypeVar("R", bound=Rule)


def spoken_rules(rules: Iterable[R], signature: Any) -> list[R]:
    """The first applying rule of each aspect, in table order."""
    spoken: dict[Aspect, R] = {}
    for rule in rules:
        if rule.aspect not in spoken and rule.applies(signature):
            spoken[rule.aspect] = rule
    return list(spoken.values())


def diagnosis_of(spoken: Sequence[Rule[S]], signature: S) -> tuple[str, str]:
    """(diagnosis, remedy) the rules that spoke give: their texts in order; their remedies, then those that
    depend on the signature, de-duplicated by their text before any parenthesis, the first wording kept."""
    parts = [r.says(signature) for r in spoken]
    remedies = [*(rem for r in spoken for rem in r.remedies), *(r.remedy_of(signature) for r in spoken if r.remedy_of)]
    return "; ".join(p for p in parts if p), join_remedies(remedies)


def diagnose(rules: Iterable[Rule[S]], signature: S) -> tuple[str, str, list[Rule[S]]]:
    """(diagnosis, remedy, the rules that spoke): see `spoken_rules` and `diagnosis_of`."""
    spoken = spoken_rules(rules, signature)
    return (*diagnosis_of(spoken, signature), spoken)


def join_remedies(remedies: Iterable[str]) -> str:
    unique: dict[str, str] = {}
    for remedy in remedies:
        for piece in remedy.split("; or "):
            if piece:
                unique.setdefault(piece.split(" (")[0], piece)
    return "; or ".join(unique.values())


def emulation_note(backend: str) -> str:
    """What an emulated run examined and what it did not (every report of one says it)."""
    if backend == "cpdoctor_cpu":
        return "stand-ins installed, but cpdoctor_cpu runs torch's own CPU kernel: nothing was emulated"
    return (
        f"CUDA kernels of {backend} emulated on CPU by cpdoctor's stand-ins: examined the installed diffusers' CP code "
        f"for {backend} (its ops, layouts, LSE and saved tensors, around kernels that keep the real contract); "
        "not examined: the CUDA kernel itself"
    )


def subject_marks(mask_pad: int, emulate: bool, checkpointing: bool) -> str:
    """The end of an op-level or a model check's subject: the keys masked as padding, emulated, checkpointing."""
    return (f" mask_pad={mask_pad}" if mask_pad else "") + (" emulated" if emulate else "") + (" checkpointing" if checkpointing else "")


# ----------------------------------------------------------------------------------------------------------
# Ranks that failed: CRASH / HANG, and the known crash signatures of diffusers' CP code
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CrashSignature:
    """A traceback pattern of a known defect, with what it means and what to do."""

    name: str
    patterns: tuple[str, ...]  # all must be found (each within one line)
    diagnosis: str
    remedy: str

    def matches(self, text: str) -> bool:
        return all(re.search(p, text) is not None for p in self.patterns)


RING_UNDER_CHECKPOINTING = CrashSignature(
    "ring backward under checkpointing",
    # torch's refusal, raised from a backward of diffusers' own code (the ring template's, wherever it lives)
    (r"Unpack is being triggered for a tensor that was already unpacked once", r"diffusers[\\/][^\"]*\.py\", line \d+, in backward\b"),
    "diffusers' ring backward unpacks ctx.saved_tensors and then calls the backend's backward op once per ring step, and "
    "every op unpacks ctx.saved_tensors again; torch's non-reentrant activation checkpointing (diffusers' "
    "enable_gradient_checkpointing(), torch's checkpoint_wrapper) refuses a second unpack, so no training step with "
    "ring CP and checkpointing completes: every release with ring CP up to the installed one (measured on diffusers "
    "0.39.0 and 0.42.1)",
    "cpdoctor.patch() (its fixed ring saves the tensors once and unpacks them once: "
    "`cpdoctor check --ring 2 --checkpointing --patch` passes); or Ulysses-only CP (its backward calls the op once: "
    "`cpdoctor check --ulysses 2 --checkpointing` passes); or reentrant checkpointing (use_reentrant=True recomputes "
    "the forward inside the backward with ordinary saved tensors: diffusers' ring then runs, and is as right as "
    "`cpdoctor check` without --checkpointing finds it)",
)
"""The crash of every ring-CP trainer that checkpoints activations (docs/FACTS.md): named alike by `check
--checkpointing`, `model --checkpointing` and the step examination."""

CRASH_SIGNATURES: tuple[CrashSignature, ...] = (
    RING_UNDER_CHECKPOINTING,
    CrashSignature(
        "double transpose",
        (r"[Nn]umber of heads in key/value must divide|GQA|[Nn]um(ber of)? ?heads.*must (match|divide)",),
        "the backend's backward op transposes K/V again although its forward saved them in the kernel's layout, so "
        "the kernel sees sequence and heads swapped (a heads/shape error)",
        "cpdoctor.patch() (its ring and Ulysses call the kernels with explicit layouts); or upgrade diffusers to a release whose "
        "_native_flash / _native_cudnn backward ops do not transpose twice; or another backend",
    ),
    CrashSignature(
        "wrong number of gradients",
        (r"returned an incorrect number of gradients",),
        "an autograd Function of diffusers' CP templates returns another number of gradients than its forward has "
        "inputs (its signature changed and its backward did not follow)",
        "cpdoctor.patch() (it replaces the ring and the Ulysses templates and implements their backwards itself); otherwise "
        "use a release whose templates match (report it with `cpdoctor env --markdown`)",
    ),
    CrashSignature(
        "LSE rank",
        (
            r"must match the size of tensor|[Dd]imension out of range|number of dimensions",
            r"\b(\w*_)?(lse|logsumexp)\b\s*[-+*/)\]]|[-+*/(\[]\s*(\w*_)?(lse|logsumexp)\b",
        ),
        "the ring merge got an LSE of another rank (number of dimensions) than it expects: older releases choose "
        "the LSE layout by the torch version, not by the tensor the kernel returned",
        "cpdoctor.patch() (its merge takes the kernel's LSE as returned); or a diffusers release that checks the LSE's shape",
    ),
    CrashSignature(
        "Ulysses leaves a per-head mask whole",
        (r"is invalid for input of size|must match the size of tensor b", r"[Uu]lysses"),
        "the model passes a mask with one row per attention head (B, H, 1, S_k: LTX-Video and LTX-2 build their text "
        "mask so); Ulysses all-gathers a mask along the keys but leaves its heads whole, so after the all-to-all each "
        "rank's H/U query heads meet a mask of H heads and the kernel refuses the shapes (diffusers 0.39.0 and 0.42.1; "
        "cpdoctor's patched Ulysses too): a crash, never a silent error",
        "ring CP for this model (with `cpdoctor.patch()`, whose ring rotates the mask with its keys: `cpdoctor model "
        "MODEL --ring 2 --mask-pad 3 --patch`); or a mask without the heads dimension (B, 1, 1, S_k)",
    ),
    CrashSignature(
        "rotary table not split",
        (r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)", r"rotary"),
        "a rotary table of the whole sequence met a query that the model's _cp_plan split (or the other way round): the "
        "model builds a rotary table in its forward that its plan does not split with the tokens (LTX-2's audio-video "
        "cross-attention rope in diffusers 0.42.1), so every rank's shard and the table disagree in length before any "
        "attention runs; not the attention",
        "nothing to fix in the attention: the class's _cp_plan misses a split (`cpdoctor plan MODEL` lists what it "
        "splits); report it upstream with this traceback, and run this model without CP until its plan splits that table",
    ),
    CrashSignature(
        "no LSE",
        (r"does not support return_lse",),
        "the backend has no LSE, and ring attention needs one to merge the chunks",
        LSE_REMEDY,
    ),
    CrashSignature(
        "uneven shard",
        (r"must be divisible by mesh size",),
        "a sequence length that the CP world size does not divide: diffusers shards evenly and asserts otherwise",
        "make every split length divisible (`cpdoctor plan MODEL ...` measures the lengths and the ways out)",
    ),
    CrashSignature(
        "warning_once",
        (r"has no attribute 'warning_once'|warning_once",),
        "diffusers' CP hook calls logger.warning_once, which only exists once transformers is imported (it patches "
        "logging.Logger); the warning it wanted to give: an input of the _cp_plan has another rank than expected and "
        "is not split",
        "pip install transformers and import it before enable_parallelism (every pipeline imports it)",
    ),
)


@dataclass(frozen=True)
class ReleaseRefusal:
    """A layout the installed diffusers refuses with its own clear message (raised in its own code): nothing is
    silently wrong, the release just does not do it. UNSUPPORTED with that message, not a CRASH."""

    name: str
    pattern: str
    remedy: str

    def matches(self, failure: RankFailure) -> bool:
        return re.search(self.pattern, failure.message) is not None and "diffusers" in failure.traceback


RELEASE_REFUSALS: tuple[ReleaseRefusal, ...] = (
    ReleaseRefusal(
        "unified ring × Ulysses",
        r"Unified Ulysses-Ring attention is not yet supported",
        "ring × Ulysses in one job arrived with diffusers 0.37.0 (_templated_unified_attention): upgrade diffusers, or use "
        "ring-only or Ulysses-only CP here (cpdoctor.patch() cannot add it: this release's ContextParallelConfig refuses the layout)",
    ),
    ReleaseRefusal(
        "attention mask",
        r"Attention mask is not yet supported for templated attention",
        "masks under CP attention arrived with diffusers 0.37.0 (whose ring then needs cpdoctor.patch() to rotate them with the "
        "keys): upgrade diffusers, or call the model without a text mask (unpadded text of a length that divides: `cpdoctor "
        "plan` finds one; a pipeline that passes an all-ones mask on every call, as LTX's does, must leave it out)",
    ),
    ReleaseRefusal(
        "not supported by this release",
        r"is not yet supported|not supported yet",
        "use a layout this diffusers supports, or a release that supports this one (its message above names what it refuses)",
    ),
)
"""In table order: the first whose pattern every crashed rank's message matches names the refusal."""


def release_refusal(failures: Iterable[RankFailure]) -> ReleaseRefusal | None:
    """The refusal every rank that raised on its own shows (None when they raised anything else)."""
    crashed = [f for f in failures if f.kind is FailureKind.CRASH and not f.waiting]
    if not crashed:
        return None
    return next((r for r in RELEASE_REFUSALS if all(r.matches(f) for f in crashed)), None)


def crash_signature(failures: Iterable[RankFailure], crashes: Sequence[CrashSignature] = CRASH_SIGNATURES) -> CrashSignature | None:
    """The first of `crashes` (by default diffusers' CP code's) found in the messages and tracebacks of the ranks
    that crashed."""
    text = "\n".join(f"{f.message}\n{f.traceback}" for f in failures if not f.waiting)
    return next((s for s in crashes if s.matches(text)), None)


def _ranks(failures: list[RankFailure]) -> str:
    return ", ".join(str(f.rank) for f in failures)


def failure_findings(
    subject: str,
    failures: list[RankFailure],
    timeout_s: float,
    crashes: Sequence[CrashSignature] = CRASH_SIGNATURES,
    raised_in: str = "",
) -> list[Finding]:
    """CRASH / HANG findings from the ranks that failed, each with that rank's traceback; a CRASH names the
    first of `crashes` (the known signatures of the code examined: diffusers' CP code unless told otherwise)
    that its traceback shows. `raised_in` (" — raised in ...", where the examined code raised) follows each
    finding's first words. Ranks that all raised the installed diffusers' own refusal of the layout ("... is not
    yet supported") are one UNSUPPORTED finding instead."""
    crashed = [f for f in failures if f.kind is FailureKind.CRASH and not f.waiting]
    hung = [f for f in failures if f.kind is FailureKind.HANG and not f.waiting]
    waiting = [f for f in failures if f.waiting]
    findings = []
    refusal = release_refusal(failures)
    if refusal is not None:
        first = crashed[0]
        message = f"this diffusers refuses the layout ({refusal.name}): {first.message}{raised_in}"
        evidence = FailureEvidence(tracebacks={f.rank: f.traceback for f in crashed}, where={f.rank: f.where for f in failures if f.where})
        return [Finding(subject, Verdict.UNSUPPORTED, message, refusal.remedy, failure=evidence)]
    if crashed:
        first, later = crashed[0], crashed[1:]
        tail = f"; then rank {_ranks(later)} failed too" if later else ""
        tail += f"; rank {_ranks(waiting)} was waiting in a collective and was stopped" if waiting else ""
        known = crash_signature(crashed, crashes)
        diagnosis = f"rank {first.rank} raised: {first.message}{tail}{raised_in}"
        remedy = "read the traceback below"
        if known is not None:
            diagnosis += f" — {known.name}: {known.diagnosis}"
            remedy = known.remedy
        evidence = FailureEvidence(
            tracebacks={f.rank: f.traceback for f in crashed},
            where={f.rank: f.where for f in failures if f.where},
            signature=None if known is None else known.name,
        )
        findings.append(Finding(subject, Verdict.CRASH, diagnosis, remedy, failure=evidence))
    if hung and not crashed:
        where = "; ".join(f"rank {f.rank} at {f.where}" for f in hung if f.where)
        waits = f"; rank {_ranks([f for f in waiting if f.kind is FailureKind.HANG])} was waiting for it in a collective" if waiting else ""
        what = hung[0].message or f"did not finish within {timeout_s:g} s"
        remedy = (
            "it kept moving: raise --timeout (the wall bound is a multiple of it) or examine less (--blocks, smaller "
            "shapes, --dtype fp32 where the half dtype is slow on this CPU)"
            if hung[0].still_moving
            else "a rank is stuck where its peers wait for it; raise --timeout only if one step of its work takes longer"
        )
        findings.append(
            Finding(
                subject,
                Verdict.HANG,
                f"rank {_ranks(hung)} {what}" + (f" ({where})" if where else "") + waits + raised_in,
                remedy,
                failure=FailureEvidence(logs={f.rank: f.traceback for f in hung}, where={f.rank: f.where for f in failures if f.where}),
            )
        )
    return findings
