"""The verdict of a peer case: each tensor against the shared tolerance (judging.tolerance: 2 × the same
kernel's no-CP error + eps), then the diagnosis from a table of rules of its own. Where a rule names the
peer's code, the file and line come from the installed source (peer_impls/source.py), read when judging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.errors import Unsupported, UnsupportedKind
from cpdoctor.examinations.judging import Aspect, CrashSignature, Rule, judge_row, unsupported_finding
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.op_judge import OpJudge, OpSignature
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.peer_impls.source import Located, SourceLine
from cpdoctor.report import TENSOR_LABELS, Finding, JudgedRow, Verdict
from cpdoctor.vocabulary import DType

BF16_DQ = r"(return dq\.to\(torch\.bfloat16\)[^\n]*)"
"""A backward that returns dQ cast to bf16 whatever the input dtype (found in the variant's installed source)."""


@dataclass(frozen=True)
class PeerSignature(OpSignature):
    """The facts of one measured peer case that the rules read: the shared ones, and the peer's own code."""

    impl: str
    variant: str
    dtype: DType
    causal: bool
    tolerances: dict[str, float]
    forward_at: Located | None = None  # the variant's forward function in the installed source
    backward_at: Located | None = None  # its backward function
    dq_cast: Located | None = None  # a `return dq.to(torch.bfloat16)` in its source
    others_without_cast: tuple[str, ...] = ()  # variants of the same peer that take this request and have no such cast

    def errs(self, names: list[str]) -> str:
        return ", ".join(f"{TENSOR_LABELS[n]} {self.errors[n]:.2g} (tolerance {self.tolerances[n]:.2g})" for n in names)


def _at(found: Located | None) -> str:
    return f" ({found.text} at {found.location})" if found is not None else ""


def _report_it(s: PeerSignature) -> str:
    return f"report it to {s.impl} with this report (--json) and the command below; meanwhile use a variant or degree that passes"


def _dq_cast(s: PeerSignature) -> str:
    assert s.dq_cast is not None
    return (
        f"dQ wrong {s.where}: {s.errs(['dq'])}, while out, dK and dV are within tolerance: {s.impl} {s.variant}'s backward returns "
        f"dQ cast to bf16 whatever the input dtype ({s.dq_cast.text!r} at {s.dq_cast.location}), so a {s.dtype} run gets its dQ "
        "rounded to bf16"
    )


def _dq_cast_remedy(s: PeerSignature) -> str:
    others = f"; or a variant whose backward keeps the dtype ({', '.join(s.others_without_cast)})" if s.others_without_cast else ""
    return f"run {s.impl} {s.variant} in bf16{others}"


def _forward(s: PeerSignature) -> str:
    return f"forward wrong {s.where}: {s.errs(['out'])} in {s.impl} {s.variant}'s forward{_at(s.forward_at)}"


def _lse(s: PeerSignature) -> str:
    return f"the LSE it returns is wrong {s.where}: {s.errs(['lse'])}, while out is right: a caller merging it (another ring, a sink) gets wrong results"


def _backward(s: PeerSignature) -> str:
    return f"{s.fwd}backward wrong {s.where}: {s.errs(s.grads_bad)} in {s.impl} {s.variant}'s backward{_at(s.backward_at)}"


RULES: tuple[Rule[PeerSignature], ...] = (
    Rule(
        Aspect.NONFINITE,
        "non-finite",
        lambda s: s.nonfinite > 0,
        lambda s: f"{s.nonfinite} NaN/Inf values in {', '.join(TENSOR_LABELS[n] for n in sorted(s.bad))}",
        (),
    ),
    Rule(Aspect.FORWARD, "forward wrong", lambda s: "out" in s.bad, _forward, ()),
    Rule(Aspect.LSE, "LSE wrong", lambda s: "lse" in s.bad and "out" not in s.bad, _lse, ()),
    Rule(
        Aspect.BACKWARD,
        "dQ cast to bf16",
        lambda s: s.grads_bad == ["dq"] and s.dq_cast is not None and s.dtype is not DType.BF16,
        _dq_cast,
        remedy_of=_dq_cast_remedy,
    ),
    Rule(Aspect.BACKWARD, "backward wrong", lambda s: bool(s.grads_bad), _backward, ()),
)
"""Peers' diagnosis table. A remedy that depends on the signature is the rule's `remedy_of`; where no rule
offers one, the peer is told (`_report_it`)."""

PEER_CRASHES: tuple[CrashSignature, ...] = (
    CrashSignature(
        "LSE padded to 32",
        (r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", r"_merge|update_out_and_lse|lse"),
        "the block kernel returned an LSE longer than its output and the peer merged it unsliced: the CUDA memory-efficient "
        "kernel pads logsumexp to a multiple of 32 (torch/_meta_registrations.py meta__scaled_dot_product_efficient_attention: "
        "ceil(M / 32) * 32 off ROCm), so every ring block whose length is not a multiple of 32 breaks the merge",
        "make every block a multiple of 32 tokens (with head-tail load balancing a block is S / (2 × ranks)); or the flash or cuDNN kernel",
    ),
)
"""Crash signatures of peers' code (diffusers' own, in judging.CRASH_SIGNATURES, do not apply to peers)."""

JUDGE = OpJudge(RULES, PEER_CRASHES)
"""A peer's judge: the table above, and the peers' crash signatures (never diffusers': they describe its code)."""


def signature(req: PeerRequest, tensors: dict[str, JudgedRow]) -> PeerSignature:
    spec = req.adapter.spec
    variant = req.the_variant
    module, source = spec.module, variant.source

    def look(pattern: str, path: str = source) -> Located | None:
        return SourceLine(module, path, pattern).read() if path else None

    bad = frozenset(n for n, row in tensors.items() if row.failed)
    others = tuple(
        v.name
        for v in spec.variants
        if v.name != variant.name and v.source and req.causal in v.causal and v.no_backward is None and look(BF16_DQ, v.source) is None
    )
    return PeerSignature(
        impl=req.impl,
        variant=req.variant,
        dtype=req.dtype,
        ring=req.ring,
        ulysses=req.ulysses,
        causal=req.causal,
        bad=bad,
        errors={n: row.rel_err for n, row in tensors.items()},
        tolerances={n: row.tolerance for n, row in tensors.items()},
        bad_ranks=tuple(sorted({r for n in bad for r in tensors[n].bad_ranks})),
        nonfinite=sum(row.nonfinite for row in tensors.values()),
        forward_at=look(r"^def (\w*_forward)\(") if "out" in bad else None,
        backward_at=look(r"^def (\w*_backward)\(") if bad - {"out", "lse"} else None,
        dq_cast=look(BF16_DQ) if "dq" in bad else None,
        others_without_cast=others if "dq" in bad else (),
    )


def diagnosis(sig: PeerSignature) -> tuple[str, str]:
    text, remedy = JUDGE.diagnose(sig)
    return text, remedy or _report_it(sig)


def describe(req: PeerRequest) -> str:
    degrees = f"ring {req.ring}" + (f" × Ulysses {req.ulysses}" if req.ulysses > 1 else "")
    return f"{req.impl} {req.variant} ({req.kernel}) {degrees}, {'causal' if req.causal else 'not causal'}, {req.dtype}"


def _options(req: PeerRequest) -> list[tuple[str, object, str]]:
    """(field, its value, its `cpdoctor check` option) for each field the command line carries, in the command's
    order."""
    return [
        ("impl", req.impl, f"--impl {req.impl}"),
        ("variant", req.variant, f"--variant {req.variant}"),
        ("kernel", req.kernel, f"--kernel {req.kernel}"),
        ("ring", req.ring, f"--ring {req.ring}"),
        ("ulysses", req.ulysses, f"--ulysses {req.ulysses}"),
        ("causal", req.causal, "--causal" if req.causal else "--no-causal"),
        ("dtype", req.dtype, f"--dtype {req.dtype}"),
        ("seq", req.seq, f"--seq {req.seq}"),
        ("heads", req.heads, f"--heads {req.heads}"),
        ("head_dim", req.head_dim, f"--head-dim {req.head_dim}"),
        ("batch", req.batch, f"--batch {req.batch}"),
        ("seed", req.seed, f"--seed {req.seed}"),
    ]


QUIET = ("ulysses", "batch", "seed")
"""The options a finding's command says only where they differ from the defaults, as the command always wrote them."""


def check_command(req: PeerRequest, *, brief: bool = False) -> str:
    """The command that examines this case alone (the CLI options of `cpdoctor check` for peers): every option
    spelled out but `QUIET`'s at their defaults (a finding's `command`: the case stays the same whatever the other
    defaults become), or with `brief` the implementation, the ring and only the options that differ from the defaults
    `cpdoctor check --impl` gives it (the doctor's table: `cpdoctor check --impl torch --ring 2 --causal`)."""
    default = {name: value for name, value, _ in _options(PeerRequest(impl=req.impl))}
    said = ("impl", "ring") if brief else tuple(name for name in default if name not in QUIET)
    shown = [option for name, value, option in _options(req) if name in said or value != default[name]]
    return " ".join(["cpdoctor check", *shown])


def emulation_note(req: PeerRequest, facts: Any) -> str | None:
    """What an emulated peer run examined and did not, and every shim that acted."""
    if facts is None or not facts.emulated:
        return None
    kernel = req.the_kernel
    note = (
        f"CUDA kernels emulated on CPU: {req.impl}'s own code ran unchanged (its ring, layout, LSE merge, communication) over "
        f"{kernel.standin}; not examined: the CUDA kernel itself"
    )
    shims = "; ".join(f"{s.name}: {s.what} (why: {s.why}; acted {s.acted}×)" for s in facts.shims)
    return note + (f". Shimmed: {shims}" if shims else ". Nothing shimmed")


LSE_DTYPE = "fp32"
"""The LSE is float32 in every kernel's contract (flash-attn's softmax_lse, aten's logsumexp) whatever the input
dtype, so its row is judged at fp32's eps: an LSE rounded to the input dtype (a known class of ring bug) is
about 1e-3 off in bf16, far above its fp32 tolerance but inside a bf16 one."""


def judged(rows: dict[str, Any], dtype: str) -> dict[str, JudgedRow]:
    """Every row against the shared tolerance: the LSE at fp32, the rest at the request's dtype."""
    return {name: judge_row(row, LSE_DTYPE if name == "lse" else dtype) for name, row in rows.items()}


def peer_finding(req: PeerRequest, measured: Measurement) -> Finding:
    subject = describe(req)
    if measured.unsupported is not None:
        return unsupported_finding(subject, measured.unsupported)
    tensors = judged(measured.tensors, req.dtype)
    note = emulation_note(req, measured.facts)
    if not any(row.failed for row in tensors.values()):
        worst = max(tensors, key=lambda n: tensors[n].rel_err / max(tensors[n].tolerance, 1e-30))
        row = tensors[worst]
        text = f"every rank within tolerance (closest: {TENSOR_LABELS[worst]} {row.rel_err:.2g} of {row.tolerance:.2g})"
        if measured.baseline_error:
            text += f"; no baseline ({measured.baseline_error}): dtype-only tolerance"
        return Finding(subject, Verdict.PASS, text, "", tensors=tensors, evidence=measured.facts, emulated=note)
    text, remedy = diagnosis(signature(req, tensors))
    return Finding(subject, Verdict.FAIL, text, remedy, tensors=tensors, evidence=measured.facts, command=check_command(req), emulated=note)


def unsupported(req: PeerRequest, why: Unsupported) -> Finding:
    """The UNSUPPORTED finding of a request the parent knows cannot run here, with the peer's own way out."""
    spec = req.adapter.spec
    if why.kind is UnsupportedKind.MISSING_PACKAGE:
        remedy = f"install it: {spec.install}"
    else:
        usable = [k.name for k in spec.kernels if k.no_backward is None]
        variants = [v.name for v in spec.variants if v.no_backward is None]
        remedy = f"examine {spec.impl.value} with a kernel and variant that have a backward (kernels: {', '.join(usable)}; variants: {', '.join(variants)})"
    return unsupported_finding(describe(req), why, remedy=remedy)
