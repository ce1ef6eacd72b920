"""The verdict of an op-level case: each tensor against its tolerance, then the diagnosis read from the error
signature through a table of rules (forward vs backward, which of dQ/dK/dV, one rank vs all, ring vs Ulysses,
degree 2 vs ≥ 3). `signature()` turns numbers into the facts the rules read; a unit test can feed it numbers."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.compat.backends import BackendFacts
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.commands import check_command
from cpdoctor.examinations.judging import (
    CP_BACKEND_REMEDY,
    CRASH_SIGNATURES,
    Aspect,
    Rule,
    emulation_note,
    judge_rows,
    subject_marks,
    unsupported_finding,
)
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.op_judge import OpJudge, OpSignature
from cpdoctor.report import TENSOR_LABELS, Finding, JudgedRow, Verdict

PATCH = "cpdoctor.patch()"
REPORT_IT = "cpdoctor.patch() if the ring is involved; otherwise report it with `cpdoctor env --markdown`"


@dataclass(frozen=True)
class Signature(OpSignature):
    """The facts of one measured case that the diagnosis rules read: the shared ones, and the backend's."""

    dtype: str
    mask_pad: int
    backend: str
    routes_cp: bool | None  # False: the backend never calls the CP templates
    cp_registered: bool | None

    @property
    def layout(self) -> str:
        return "ring" if self.ulysses == 1 else ("Ulysses" if self.ring == 1 else "the ring inside unified ring × Ulysses")

    def grads_text(self) -> tuple[str, str]:
        labels = "/".join(TENSOR_LABELS[n] for n in self.grads_bad)
        errs = ", ".join(f"{TENSOR_LABELS[n]} {self.errors[n]:.2g}" for n in self.grads_bad)
        return labels, errs


def _ignores_cp(s: Signature) -> str:
    registered = "" if s.cp_registered else "; it is not registered as CP-capable and dispatch_attention_fn never checks"
    return (
        f"forward wrong {s.where} (out rel err {s.errors['out']:.2g}): {s.backend} ignores the parallel config and attends "
        f"only to each rank's local 1/{s.world} of the keys{registered}"
    )


def _direction(s: Signature) -> str:
    labels, errs = s.grads_text()
    return (
        f"{s.fwd}backward wrong {s.where}: dQ exact and {labels} wrong ({errs}) at ring degree {s.ring} ≥ 3 through {s.layout}: "
        "the dK/dV accumulator travels the wrong way round the ring (to rank r+1 instead of r−1); the two directions agree only at ring 2"
    )


def _stale_kv(s: Signature) -> str:
    labels, errs = s.grads_text()
    return (
        f"{s.fwd}backward wrong {s.where}: {labels} wrong ({errs}) through {s.layout}: the ring backward recomputes every "
        "ring step against stale iteration-0 (local) K/V and partial out/lse instead of the rotated chunk"
    )


def _backward_other(s: Signature) -> str:
    labels, errs = s.grads_text()
    return f"{s.fwd}backward wrong {s.where}: {labels} wrong ({errs}) through {s.layout}"


MASK_NOT_ROTATED: Rule[Signature] = Rule(
    Aspect.FORWARD,
    "mask not rotated",
    lambda s: "out" in s.bad and s.mask_pad > 0 and s.ring > 1,
    lambda s: (
        f"forward wrong {s.where} only with a padding mask (out rel err {s.errors['out']:.2g}): {s.layout} applies each rank's "
        "local key mask to every rotated KV chunk instead of rotating the mask with its keys"
    ),
    (f"{PATCH} (its ring rotates the mask with the keys)", "Ulysses-only CP (it all-gathers the mask)"),
)

DKV_DIRECTION: Rule[Signature] = Rule(
    Aspect.BACKWARD,
    "dK/dV direction",
    lambda s: bool(s.grads_bad) and s.routes_cp is not False and "dq" not in s.grads_bad and s.ring >= 3,
    _direction,
    (PATCH, "keep ring_degree ≤ 2 and scale with Ulysses"),
)

STALE_KV: Rule[Signature] = Rule(
    Aspect.BACKWARD,
    "stale K/V",
    lambda s: bool(s.grads_bad) and s.routes_cp is not False and "dq" in s.grads_bad and s.ring > 1,
    _stale_kv,
    (
        PATCH,
        "upgrade diffusers to a release whose ring backward passes the rotated key/value (then re-check ring ≥ 3)",
        "Ulysses-only CP",
    ),
)
"""The rules that name a defect of diffusers' own code (`--repro` writes its upstream fix: attention/upstream.py)."""

RULES: tuple[Rule[Signature], ...] = (
    Rule(
        Aspect.NONFINITE,
        "non-finite values",
        lambda s: s.nonfinite > 0,
        lambda s: f"{s.nonfinite} non-finite values (NaN/Inf) {s.where}",
        ("check the backend's dtype support; try --dtype fp32 to separate overflow from a CP defect",),
    ),
    Rule(Aspect.FORWARD, "backend ignores CP", lambda s: "out" in s.bad and s.routes_cp is False, _ignores_cp, (CP_BACKEND_REMEDY,)),
    MASK_NOT_ROTATED,
    Rule(
        Aspect.FORWARD,
        "forward wrong",
        lambda s: "out" in s.bad,
        lambda s: f"forward wrong {s.where} through {s.layout} (out rel err {s.errors['out']:.2g})",
        (REPORT_IT,),
    ),
    DKV_DIRECTION,
    STALE_KV,
    Rule(Aspect.BACKWARD, "backward wrong", lambda s: bool(s.grads_bad) and s.routes_cp is not False, _backward_other, (REPORT_IT,)),
)

JUDGE = OpJudge(RULES, CRASH_SIGNATURES)
"""diffusers' CP attention: the table above, and the known crash signatures of diffusers' CP code."""


@dataclass(frozen=True)
class RoutingFacts:
    """What the diagnosis needs to know about the backend: its name, whether it routes into diffusers' CP
    templates at all (False: it ignores the parallel config), whether it is registered for CP."""

    name: str | None = None
    routes_cp: bool | None = True
    cp_registered: bool | None = True


Routing = RoutingFacts | BackendFacts
"""What the diagnosis reads of a backend (`name`, `routes_cp`, `cp_registered`)."""


def signature(req: AttentionRequest, facts: Routing | None, tensors: dict[str, JudgedRow]) -> Signature:
    """The facts the rules read, from the request, the backend's facts (a probe's `BackendFacts`, or a test's
    `RoutingFacts`) and the judged rows."""
    bad = frozenset(n for n, t in tensors.items() if t.failed)
    return Signature(
        ring=req.ring,
        ulysses=req.ulysses,
        dtype=req.dtype,
        mask_pad=req.mask_pad,
        backend=(facts.name if facts is not None else None) or req.backend,
        routes_cp=facts.routes_cp if facts is not None else None,
        cp_registered=facts.cp_registered if facts is not None else None,
        bad=bad,
        errors={n: t.rel_err for n, t in tensors.items()},
        bad_ranks=tuple(sorted({r for n in bad for r in tensors[n].bad_ranks})),
        nonfinite=sum(t.nonfinite for t in tensors.values()),
    )


def diagnose_attention(req: AttentionRequest, facts: Routing | None, tensors: dict[str, JudgedRow]) -> tuple[str, str]:
    """(diagnosis, remedy) naming the signature seen."""
    sig = signature(req, facts, tensors)
    if not sig.bad:
        return (f"out, dQ, dK and dV match the full-sequence reference on every rank within the {req.dtype} tolerance", "")
    diagnosis, remedy = JUDGE.diagnose(sig)
    return diagnosis or f"{', '.join(sorted(sig.bad))} outside tolerance {sig.where}", remedy


def describe(req: AttentionRequest, backend: str | None = None) -> str:
    return (
        f"attention ring={req.ring} ulysses={req.ulysses} backend={backend or req.backend} {req.dtype} "
        f"B{req.batch} S{req.seq} H{req.heads} D{req.head_dim}" + subject_marks(req.mask_pad, req.emulate, req.checkpointing)
    )


RNG_NOTE = (
    "the CP forward and backward advanced the device's random generator although dropout is 0 (the backend's op "
    "gives its kernel a dropout > 0, e.g. flash-attn ops forcing dropout_p=1e-30 to get an LSE): runs are not "
    "bitwise reproducible and any later dropout in the model draws other masks"
)


@dataclass
class AttentionEvidence:
    """What an op-level finding carries besides its rows (JSON `details`): the backend's facts, the RNG note
    when the CP run moved the device's generator, why the no-CP baseline could not run."""

    facts: BackendFacts | None = None
    rng_advanced: str | None = None
    baseline_error: str | None = None


def attention_finding(req: AttentionRequest, evaluated: Measurement) -> Finding:
    """The finding for one evaluated attention case."""
    subject = describe(req, evaluated.backend)
    emulated = emulation_note(evaluated.backend) if req.emulate else None
    evidence = AttentionEvidence(evaluated.facts, baseline_error=evaluated.baseline_error)
    if evaluated.unsupported is not None:
        return unsupported_finding(subject, evaluated.unsupported, evidence=evidence, emulated=emulated)
    tensors = judge_rows(evaluated.tensors, req.dtype)
    diagnosis, remedy = diagnose_attention(req, evaluated.facts, tensors)
    verdict = Verdict.PASS if all(not t.failed for t in tensors.values()) else Verdict.FAIL
    if evaluated.rng_advanced:
        evidence.rng_advanced = RNG_NOTE
        diagnosis = f"{diagnosis}; and {RNG_NOTE}"
        remedy = remedy or "cpdoctor.patch() (its ring calls the kernels with dropout 0); or a release whose op does not force dropout"
    command = None if verdict == Verdict.PASS else check_command(req, patch=not req.patch)
    return Finding(subject, verdict, diagnosis, remedy, tensors, evidence, command=command, emulated=emulated)
