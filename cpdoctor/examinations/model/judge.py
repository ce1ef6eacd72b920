"""From the numbers of a model examination to a finding: verdict, diagnosis (a table of rules), remedy.

The same tolerance as the op level (`judging.tolerance`: 2 × the no-CP error of the same model in the same
dtype + eps): for the gathered output, and for all parameter gradients concatenated into one vector. The
worst parameter is the one furthest outside its own tolerance (its own no-CP error); it is reported, and it
decides nothing on its own (see WORST_PARAM_SLACK). The diagnosis names forward vs backward, the op-level
check at the same layout (and the exact `cpdoctor check` command that reproduces it), and the padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cpdoctor.examinations.commands import OpLayout, check_command
from cpdoctor.examinations.judging import (
    GRADS_FAR_WORSE,
    Aspect,
    Rule,
    diagnose,
    emulation_note,
    join_remedies,
    judge_row,
    judge_rows,
    subject_marks,
    tolerance,
    unsupported_finding,
)
from cpdoctor.examinations.model.probe import ModelInfo, ModelMeasurement, op_level
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.launch.jobs import Case
from cpdoctor.report import TENSOR_LABELS, BlockRow, Finding, JudgedRow, ParamRow, TensorRow, Verdict

WORST_PARAM_SLACK = 10.0
"""The worst single parameter fails the examination only when it is this many times outside its own
tolerance: one parameter out of hundreds lands past 2 × its rounding noise by chance, a CP defect puts it
orders of magnitude past (0.39.0 tiny Flux ring 2: 3.27 against ~1e-7)."""

MASK_REMEDIES = ("cpdoctor.patch() (its ring rotates the mask with the keys)", "Ulysses-only CP (it all-gathers the mask)")


def describe_model(req: ModelRequest, backend: str | None = None, model: ModelInfo | None = None) -> str:
    name = model.short_name if model is not None else req.model
    source = None if model is None else model.source
    source = "" if source is None else (" tiny" if source == "tiny config" else f" from {source}")
    frames = f"x{req.frames}f" if req.frames else ""
    stacks = model.stacks if model is not None else {}
    if any(s.examined < s.depth for s in stacks.values()):
        source += " blocks " + "+".join(f"{s.examined}/{s.depth}" for s in stacks.values())
    return (
        f"model {name}{source} ring={req.ring} ulysses={req.ulysses} backend={backend or req.backend} "
        f"{req.dtype} {req.height}x{req.width}{frames} text {req.text_len} B{req.batch}"
        + subject_marks(req.mask_pad, req.emulate, req.checkpointing)
    )


def op_check_command(req: Any, mask: bool = False) -> str:
    """The `cpdoctor check` command of the op-level cross-check at this model's layout."""
    return check_command(
        OpLayout(ring=req.ring, ulysses=req.ulysses, dtype=req.dtype, backend=req.backend, mask_pad=req.mask_pad if mask else 0)
    )


def worst_param(params: dict[str, ParamRow], dtype: str) -> JudgedRow | None:
    """The parameter furthest outside its own tolerance, as a tensor row (None when there are none)."""
    if not params:
        return None

    def ratio(item: tuple[str, ParamRow]) -> float:
        p = item[1]
        return float("inf") if p.nonfinite else p.rel_err / tolerance(dtype, p.baseline_rel_err)

    name, p = max(params.items(), key=ratio)
    row = TensorRow(p.rel_err, p.max_abs, p.nonfinite, baseline_rel_err=p.baseline_rel_err, name=name, numel=p.numel)
    return judge_row(row, dtype, slack=WORST_PARAM_SLACK)


def judge_model_tensors(evaluated: ModelMeasurement, dtype: str) -> dict[str, JudgedRow]:
    tensors = judge_rows(evaluated.tensors, dtype)
    worst = worst_param(evaluated.params, dtype)
    if worst is not None:
        tensors["worst_param"] = worst
    return tensors


BLOCK_SLACK = WORST_PARAM_SLACK
"""A block is bad when its output or input-gradient error is this many times outside its own tolerance (2 × its
no-CP error + eps): one of many, like the worst parameter."""


def _beyond(err: float | None, tol: float) -> bool:
    return err is not None and not err <= BLOCK_SLACK * tol


def judge_blocks(rows: list[BlockRow], dtype: str) -> list[BlockRow]:
    """Each block's row with its tolerances and verdict (FAIL when its output or its input gradient leaves the
    no-CP baseline, or is non-finite)."""
    judged = []
    for row in rows:
        out_tol = tolerance(dtype, row.baseline_out_rel_err)
        grad_tol = tolerance(dtype, row.baseline_grad_rel_err)
        bad = bool(row.nonfinite) or _beyond(row.out_rel_err, out_tol) or _beyond(row.grad_rel_err, grad_tol)
        judged.append(replace(row, out_tolerance=out_tol, grad_tolerance=grad_tol, verdict=Verdict.FAIL if bad else Verdict.PASS))
    return judged


def first_bad_block(blocks: list[BlockRow]) -> BlockRow | None:
    """The block where the error enters. A wrong output spreads forward (every later block's output) and into
    every gradient, so when some output is off it is the first block, in the order the forward runs them, whose
    output is. A wrong gradient alone spreads backward (every earlier block's input gradient, never an output),
    so when every output is right it is the first block the backward runs, the last of the forward order, whose
    input gradient is off: a backward defect of one block is named there, not at block 0."""
    bad = [b for b in blocks if b.verdict is Verdict.FAIL]
    forward = [b for b in bad if b.nonfinite or _beyond(b.out_rel_err, b.out_tolerance or 0.0)]
    if forward:
        return forward[0]
    return bad[-1] if bad else None


def _block_text(b: BlockRow) -> str:
    backward = not (b.nonfinite or _beyond(b.out_rel_err, b.out_tolerance or 0.0))
    where = ", where the error enters the backward (every block's output is right)" if backward else ""
    return (
        f"first bad block: {b.name}{where} (output {fmt_or_dash(b.out_rel_err)}, no-CP {fmt_or_dash(b.baseline_out_rel_err)}; "
        f"input grad {fmt_or_dash(b.grad_rel_err)}, no-CP {fmt_or_dash(b.baseline_grad_rel_err)})"
    )


@dataclass(frozen=True)
class OpCheck:
    """One op-level cross-check at the model's layout: its finding, or why it did not run."""

    request: Any
    finding: Finding | None
    error: str | None

    @property
    def bad_out(self) -> bool:
        out = None if self.finding is None else self.finding.tensors.get("out")
        return out is not None and out.failed

    def bad_tensors(self) -> str:
        assert self.finding is not None
        return ", ".join(f"{TENSOR_LABELS.get(n, n)} {t.rel_err:.2g}" for n, t in self.finding.tensors.items() if t.failed)


def fmt_or_dash(x: float | None) -> str:
    return "–" if x is None else f"{x:.2g}"


def op_checks(evaluated: ModelMeasurement) -> list[OpCheck]:
    return [
        OpCheck(op.request, op_level().finding(Case(op.request), op.evaluated), None)
        if op.evaluated is not None
        else OpCheck(op.request, None, op.error or "not run")
        for op in evaluated.op_level
    ]


@dataclass(frozen=True)
class ModelSignature:
    """The facts of one measured model case that the diagnosis rules read."""

    req: Any
    tensors: dict[str, JudgedRow]
    plain: OpCheck | None  # the op-level check without a mask
    masked: OpCheck | None  # with the model's padding mask
    inner_gathers: tuple[str, ...] = ()  # the plan's gathers inside the block stacks

    @property
    def layout(self) -> str:
        r, u = self.req.ring, self.req.ulysses
        return "ring" if u == 1 else ("Ulysses" if r == 1 else "ring × Ulysses")

    @property
    def out(self) -> JudgedRow:
        return self.tensors["out"]

    @property
    def grads(self) -> JudgedRow:
        return self.tensors["grads"]

    @property
    def grads_bad(self) -> bool:
        worst = self.tensors.get("worst_param")
        return self.grads.failed or (worst is not None and worst.failed)

    @property
    def worst_text(self) -> str:
        w = self.tensors.get("worst_param")
        if not w:
            return ""
        return f"; worst parameter {w.name} {w.rel_err:.2g} (no-CP {fmt_or_dash(w.baseline_rel_err)})"

    @property
    def masked_op_fails_forward_only_with_mask(self) -> bool:
        return (
            self.masked is not None
            and self.masked.finding is not None
            and self.plain is not None
            and self.plain.finding is not None
            and self.masked.bad_out
            and not self.plain.bad_out
        )


def _forward_wrong(s: ModelSignature) -> str:
    what = f"forward wrong: out rel err {s.out.rel_err:.2g} (tolerance {s.out.tolerance:.2g})"
    if s.grads_bad:
        follows = s.grads.rel_err <= GRADS_FAR_WORSE * max(s.out.rel_err, 1e-30)
        cause = "and the gradients with it" if follows else "and the gradients far worse, a backward defect of their own"
        what += f", {cause} (all grads {s.grads.rel_err:.2g}{s.worst_text})"
    return what


def _op_fails(s: ModelSignature) -> str:
    assert s.plain is not None and s.plain.finding is not None
    return (
        f"the attention op alone fails at this layout: `{op_check_command(s.req)}` → {s.plain.bad_tensors()} ({s.plain.finding.diagnosis})"
    )


def _op_remedies(s: ModelSignature) -> tuple[str, ...]:
    return (s.plain.finding.remedy,) if s.plain is not None and s.plain.finding is not None and s.plain.finding.remedy else ()


def _plain_verdict(s: ModelSignature) -> Verdict | None:
    return s.plain.finding.verdict if s.plain is not None and s.plain.finding is not None else None


RULES: tuple[Rule[ModelSignature], ...] = (
    Rule(
        Aspect.NONFINITE,
        "non-finite values",
        lambda s: bool(s.out.nonfinite or s.grads.nonfinite),
        lambda s: f"{s.out.nonfinite + s.grads.nonfinite} non-finite values (NaN/Inf)",
        ("try --dtype fp32 to separate overflow from a CP defect",),
    ),
    Rule(Aspect.WHAT, "forward wrong", lambda s: s.out.failed, _forward_wrong),
    Rule(
        Aspect.WHAT,
        "backward wrong",
        lambda s: True,
        lambda s: (
            f"forward exact (out {s.out.rel_err:.2g}), backward wrong: all parameter grads {s.grads.rel_err:.2g} (tolerance {s.grads.tolerance:.2g}){s.worst_text}"
        ),
    ),
    Rule(
        Aspect.MASK,
        "mask not rotated",
        lambda s: bool(s.req.mask_pad) and s.masked_op_fails_forward_only_with_mask,
        lambda s: (
            "the text padding mask is involved: at op level the same layout is exact in forward without a mask and "
            f"wrong with one (`{op_check_command(s.req, mask=True)}`: {s.masked.bad_tensors()}): {s.layout} applies each rank's "  # type: ignore[union-attr]
            "local key mask to every rotated KV chunk instead of rotating the mask with its keys"
        ),
        MASK_REMEDIES,
    ),
    Rule(
        Aspect.MASK,
        "mask handled",
        lambda s: bool(s.req.mask_pad) and s.masked is not None and s.masked.finding is not None and not s.masked.bad_out,
        lambda s: f"the padding mask is handled at op level (`{op_check_command(s.req, mask=True)}` passes the forward)",
    ),
    Rule(
        Aspect.MASK,
        "mask unexamined",
        lambda s: bool(s.req.mask_pad) and s.req.ring > 1 and (s.masked is None or s.masked.finding is None),
        lambda s: "the text padding mask is split under ring attention: rerun without --mask-pad to see whether it is involved",
    ),
    Rule(
        Aspect.OP_LEVEL,
        "op check did not run",
        lambda s: s.plain is not None and s.plain.finding is None,
        lambda s: f"the op-level cross-check did not run ({s.plain.error}); run `{op_check_command(s.req)}`",  # type: ignore[union-attr]
    ),
    Rule(Aspect.OP_LEVEL, "op fails too", lambda s: _plain_verdict(s) == Verdict.FAIL, _op_fails, ()),
    Rule(
        Aspect.OP_LEVEL,
        "op passes: the plan gathers inside the blocks",
        lambda s: _plain_verdict(s) == Verdict.PASS and not s.out.failed and bool(s.inner_gathers),
        lambda s: (
            f"the attention op alone passes at this layout (`{op_check_command(s.req)}`) and the forward is exact: the model's "
            f"_cp_plan gathers the sequence inside its blocks ({', '.join(s.inner_gathers[:3])}), so from each such gather to the "
            "next split every rank holds the whole sequence and back-propagates the whole of its gradient, which the CP "
            "step's sum over the CP group (right for a plan that splits once and gathers once) counts on every rank; "
            "inference through this plan is exact, training through it is not, whatever the attention"
        ),
        (
            "train this model without CP, or through a _cp_plan that splits once before the blocks and gathers once after "
            "them (as Wan's: `cpdoctor plan wan`); inference through this plan is exact",
        ),
    ),
    Rule(
        Aspect.OP_LEVEL,
        "op passes: model path",
        lambda s: (
            _plain_verdict(s) == Verdict.PASS
            and not (s.req.mask_pad and s.masked is not None and s.masked.finding is not None and s.masked.finding.verdict == Verdict.FAIL)
        ),
        lambda s: (
            f"the attention op alone passes at this layout (`{op_check_command(s.req)}`): the defect lies in the model's CP path around "
            "attention (its _cp_plan splits and gathers, rotary embeddings, masks), not in the attention op"
        ),
        ("compare the model's _cp_plan with its forward (`cpdoctor plan` lists what it splits); report it with `cpdoctor env --markdown`",),
    ),
    Rule(
        Aspect.OP_LEVEL,
        "op says otherwise",
        lambda s: _plain_verdict(s) not in (None, Verdict.PASS, Verdict.FAIL),
        lambda s: f"the op-level cross-check `{op_check_command(s.req)}` says {s.plain.finding.verdict}: {s.plain.finding.diagnosis}",  # type: ignore[union-attr]
    ),
)


def diagnose_model(req: Any, evaluated: ModelMeasurement, tensors: dict[str, JudgedRow]) -> tuple[str, str]:
    """(diagnosis, remedy): forward vs backward, the op level at the same layout, the mask."""
    ops = op_checks(evaluated)
    gathers = () if evaluated.model is None else evaluated.model.inner_gathers
    sig = ModelSignature(
        req, tensors, next((o for o in ops if not o.request.mask_pad), None), next((o for o in ops if o.request.mask_pad), None), gathers
    )
    failing_ops = [o for o in ops if o.finding is not None and o.finding.verdict == Verdict.FAIL]
    if not sig.out.failed and not sig.grads_bad and failing_ops:
        return _hidden_by_noise(req, sig, failing_ops[0])
    if not sig.out.failed and not sig.grads_bad:
        n_params = None if evaluated.model is None else evaluated.model.parameter_tensors
        params = f"all {n_params} parameter gradients" if n_params else "the parameter gradients"
        return (
            f"output and {params} match the single-process fp64 model within the {req.dtype} tolerance through "
            f"enable_parallelism ({sig.layout}, {req.world_size} ranks) (out {sig.out.rel_err:.2g}, all grads {sig.grads.rel_err:.2g}{sig.worst_text})",
            "",
        )
    diagnosis, remedy, _ = diagnose(RULES, sig)
    extra = _op_remedies(sig) if _plain_verdict(sig) == Verdict.FAIL else ()  # the op-level remedy joins the rest
    return diagnosis, join_remedies([remedy, *extra])


def _hidden_by_noise(req: Any, sig: ModelSignature, op: OpCheck) -> tuple[str, str]:
    """The model's numbers pass, the attention op at the same layout fails: one step's noise hides it."""
    assert op.finding is not None
    return (
        f"the model's output and gradients stay within its own {req.dtype} no-CP error here (out {sig.out.rel_err:.2g}, all "
        f"grads {sig.grads.rel_err:.2g} against no-CP {fmt_or_dash(sig.grads.baseline_rel_err)}{sig.worst_text}), but the "
        f"attention op at this layout is wrong (`{op_check_command(req, mask=bool(op.request.mask_pad))}` → {op.bad_tensors()}: "
        f"{op.finding.diagnosis}): a systematic error that this one step's {req.dtype} noise hides and that training accumulates",
        join_remedies([op.finding.remedy, "rerun in fp32 (--dtype fp32) to see it at model level"]),
    )


@dataclass
class OpLevelSummary:
    """An op-level cross-check as the finding reports it: its command and verdict, or why it did not run."""

    command: str
    verdict: Verdict | None = None
    diagnosis: str | None = None
    rel_err: dict[str, float] = field(default_factory=dict)
    error: str | None = None


@dataclass
class ModelEvidence:
    """What a model finding carries besides its rows (JSON `details`)."""

    facts: Any = None
    model: ModelInfo | None = None
    blocks: list[BlockRow] = field(default_factory=list)
    first_bad_block: str | None = None
    worst_params: dict[str, dict[str, float | None]] = field(default_factory=dict)
    op_level: list[OpLevelSummary] = field(default_factory=list)
    baseline_error: str | None = None
    memory_plan: Any = None


def _op_summaries(req: Any, evaluated: ModelMeasurement) -> list[OpLevelSummary]:
    out = []
    for op in op_checks(evaluated):
        summary = OpLevelSummary(op_check_command(req, mask=bool(op.request.mask_pad)))
        if op.finding is not None:
            summary.verdict, summary.diagnosis = op.finding.verdict, op.finding.diagnosis
            summary.rel_err = {n: t.rel_err for n, t in op.finding.tensors.items()}
        else:
            summary.error = op.error
        out.append(summary)
    return out


def model_finding(req: ModelRequest, evaluated: ModelMeasurement) -> Finding:
    """The finding for one evaluated model case."""
    subject = describe_model(req, evaluated.backend, evaluated.model)
    emulated = emulation_note(evaluated.backend) if req.emulate else None
    evidence = ModelEvidence(evaluated.facts, evaluated.model, baseline_error=evaluated.baseline_error, memory_plan=req.memory)
    if evaluated.unsupported is not None:
        return unsupported_finding(subject, evaluated.unsupported, evidence=evidence, emulated=emulated)
    tensors = judge_model_tensors(evaluated, req.dtype)
    diagnosis, remedy = diagnose_model(req, evaluated, tensors)
    op_fails = any(op.finding is not None and op.finding.verdict == Verdict.FAIL for op in op_checks(evaluated))
    # the attention op failing at the same layout is corruption even where this step's noise hides it
    verdict = Verdict.PASS if all(not t.failed for t in tensors.values()) and not op_fails else Verdict.FAIL
    evidence.blocks = judge_blocks(evaluated.blocks, req.dtype)
    first = first_bad_block(evidence.blocks)
    evidence.first_bad_block = None if first is None else first.name
    if first is not None:
        diagnosis = f"{diagnosis}; {_block_text(first)}"
    ranked = sorted(evaluated.params.items(), key=lambda kv: kv[1].rel_err, reverse=True)
    evidence.worst_params = {n: {"rel_err": p.rel_err, "baseline_rel_err": p.baseline_rel_err} for n, p in ranked[:5]}
    evidence.op_level = _op_summaries(req, evaluated)
    return Finding(subject, verdict, diagnosis, remedy, tensors, evidence, emulated=emulated)
