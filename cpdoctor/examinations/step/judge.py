"""From a CP group's step numbers to a finding: a table of rules over measured relations (judging.Rule), each
with its remedy. The rules never know which fault was injected; they read what the numbers say: inputs that
differ between CP peers, output gradients that differ (and whether each is confined to its own shard),
gradients that differ between peers after the sync, gradients a constant factor off the expected ones, RNG
states that part, and what is left when all of that is right (the attention, or the model's CP path).

Tolerance. The expected gradients come from one fp64 process; a correct fp32 CP step lands ~1e-7–1e-6 from them
on the tiny models (docs/FACTS.md), the defects this examination exists for at 1e-2 and beyond, or at an exact
factor. A no-CP baseline in the step's own dtype (what `judging.tolerance` builds on) would cost a second
forward+backward, and the budget is one, so the tolerance is fixed per dtype (GRAD_TOLERANCE): far above
rounding, far below every defect measured."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from cpdoctor.examinations.judging import Rule, diagnose, join_remedies
from cpdoctor.examinations.step.measure import ParamError, RankGrad, StepNumbers
from cpdoctor.report import Finding, JudgedRow, TensorRow, Verdict

GRAD_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2, "fp64": 1e-10}
"""Relative L2 error of a rank's parameter gradients (and of the output) against the fp64 reference."""

SEED_REMEDY = (
    "give every rank of a CP group the same inputs: seed noise and timesteps by the data-parallel rank "
    "(e.g. torch.Generator().manual_seed(seed + dp_rank)), never by the global rank"
)
LOSS_REMEDY = "compute the loss on the full (gathered) model output, identically on every CP rank"
SHARD_LOSS_REMEDY = (
    "compute the loss on the full gathered output on every CP rank (diffusers' _cp_plan gathers it), or normalise "
    "each shard's loss by the full token count"
)
CP_SUM_REMEDY = (
    "sum the parameter gradients over the CP group after backward (dist.all_reduce(p.grad, op=SUM, group=cp_group), "
    "the group of the model's CP mesh), then average over the data-parallel ranks only"
)
DP_REMEDY = "average the gradients over the data-parallel ranks (DDP over the data-parallel group, or all_reduce then divide by dp)"
ATTENTION_REMEDY = "cpdoctor.patch() before the first step (cpdoctor.preflight(...) does it when the fix is exact)"
RNG_REMEDY = (
    "make every CP rank draw the same random numbers in the same order (same generator seeded by the data-parallel "
    "rank; no rank-only draws such as dropout or logging samples between seeding and the step); `cpdoctor env` "
    "measures whether the attention op itself consumes RNG"
)


@dataclass(frozen=True)
class Factor:
    """A candidate constant factor: its value, how it is written, and the reduction that produces it."""

    value: float
    text: str
    cause: str
    remedy: str


def factor_candidates(cp: int, dp: int) -> tuple[Factor, ...]:
    """cp^a × dp^b for a, b in {-1, 0, 1}, CP first: what a misplaced mean or sum over one of the job's dimensions
    multiplies the gradients by."""
    causes = {
        (-1, 0): (
            "the gradients were averaged over the CP ranks instead of summed: a data-parallel wrapper (DDP, "
            "FSDP) or an all_reduce(AVG) over a group that includes the CP ranks",
            CP_SUM_REMEDY,
        ),
        (1, 0): (
            "the CP ranks' contributions were summed on top of a loss already covering each shard at full weight "
            "(a loss normalised by the local shard and then summed over the CP group), or the CP reduction ran twice",
            SHARD_LOSS_REMEDY + "; or reduce over the CP group once",
        ),
        (0, 1): ("the gradients were summed over the data-parallel replicas instead of averaged", "average over the data-parallel ranks"),
        (0, -1): ("the gradients were averaged over the data-parallel ranks twice", "average over the data-parallel ranks once"),
        (-1, -1): (
            "the gradients were averaged over every rank of the world: over the CP ranks as well as the data-parallel ones",
            CP_SUM_REMEDY,
        ),
        (1, 1): ("the gradients were summed over every rank of the world on top of per-shard losses", SHARD_LOSS_REMEDY),
        (1, -1): ("the gradients were averaged over the data-parallel ranks and scaled by the CP size", CP_SUM_REMEDY),
        (-1, 1): ("the gradients were averaged over the CP ranks and summed over the data-parallel ones", CP_SUM_REMEDY),
    }
    out = []
    for a, b in sorted(product((-1, 0, 1), repeat=2), key=lambda ab: (abs(ab[1]), abs(ab[0]), -ab[0])):
        if (a, b) == (0, 0) or (b and dp == 1) or (a and cp == 1):
            continue
        value = float(cp) ** a * float(dp) ** b
        if value == 1.0:
            continue
        num = [n for n, e in (("cp", a), ("dp", b)) if e == 1]
        den = [n for n, e in (("cp", a), ("dp", b)) if e == -1]
        text = ("·".join(num) or "1") + (f"/{'·'.join(den)}" if den else "")
        out.append(Factor(value, text, *causes[(a, b)]))
    return tuple(out)


@dataclass(frozen=True)
class StepSignature:
    """The facts of one CP group's step that the rules read."""

    n: StepNumbers

    @property
    def tol(self) -> float:
        return GRAD_TOLERANCE.get(self.n.dtype, 1e-4)

    @property
    def bad_ranks(self) -> tuple[int, ...]:
        return tuple(g.rank for g in self.n.grads if not g.rel_err <= self.tol or g.nonfinite)

    @property
    def grads_bad(self) -> bool:
        return bool(self.bad_ranks)

    @property
    def nonfinite(self) -> int:
        return sum(g.nonfinite for g in self.n.grads)

    @property
    def peers_differ(self) -> bool:
        return not self.n.peer_spread <= self.tol

    @property
    def worst(self) -> RankGrad:
        return max(self.n.grads, key=lambda g: g.rel_err)

    @property
    def factor(self) -> Factor | None:
        """The candidate factor the gradients sit at, when every rank's are that exact multiple of the expected."""
        g = self.worst
        if self.peers_differ or not g.residual <= self.tol:
            return None
        for f in factor_candidates(self.n.cp, self.n.dp):
            if abs(g.factor - f.value) <= 10 * self.tol * f.value:
                return f
        return None

    @property
    def only_gradients_wrong(self) -> bool:
        """Inputs, loss and reduction right: the peers agree on everything and no constant factor explains the error
        (where naming the first bad parameter and block says something)."""
        dp_missing = self.n.own_rel_err is not None and self.n.own_rel_err <= self.tol
        return not (self.n.inputs_differ or self.n.out_grad_differ or self.peers_differ or self.factor is not None or dp_missing)

    @property
    def rng_consumers(self) -> tuple[int, ...]:
        """The ranks whose RNG state after the step differs from the largest group of peers (ties: the first
        rank's group is the norm)."""
        groups = self.n.rng_after_groups
        if len(groups) < 2:
            return ()
        norm = max(groups, key=len)
        return tuple(r for g in groups if g is not norm for r in g)

    @property
    def layout(self) -> str:
        return f"CP {self.n.cp} (ring {self.n.ring} × Ulysses {self.n.ulysses}) × data-parallel {self.n.dp}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


def _inputs_text(s: StepSignature) -> str:
    parts = [f"{d.name} on rank {_ranks(d.different)} (rank {_ranks(d.same_as_first)} had another)" for d in s.n.inputs_differ]
    text = "the model's inputs differ between CP peers, which must all feed the same full inputs: " + "; ".join(parts)
    if len(s.n.rng_before_groups) > 1:
        text += (
            "; their RNG states differed already before the step (ranks "
            + " | ".join(_ranks(g) for g in s.n.rng_before_groups)
            + "): the random draws were seeded per rank"
        )
    return text


def _out_grad_text(s: StepSignature) -> str:
    if s.n.out_grad_own_shard:
        text = (
            f"each CP rank's loss covers only its own shard of the gathered output (the output gradient of rank "
            f"{_ranks(s.n.ranks)} is zero outside its own chunk)"
        )
        g = s.worst
        if not s.peers_differ and g.residual <= s.tol:
            text += f"; the summed gradients are {g.factor:.4g}× the gradients of the mean of those losses"
            f = s.factor
            if f is not None and f.value == s.n.cp:
                text += f" (= cp = {s.n.cp}: a loss normalised by the local shard, then summed over the CP group)"
        return text
    return (
        f"the gradient flowing into the model's output differs between CP peers (rank {_ranks(s.n.out_grad_differ)} against "
        f"rank {s.n.ranks[0]}, relative difference up to {s.n.out_grad_spread:.2g}): the loss is computed differently on "
        "each rank (different targets, weights or normalisation)"
    )


def _peers_text(s: StepSignature) -> str:
    text = (
        f"the parameter gradients differ between CP peers after the sync (relative difference up to {s.n.peer_spread:.2g}): "
        f"the reduction over the CP group (ranks {_ranks(s.n.ranks)}) is missing; each rank holds the gradient of its own tokens"
    )
    if s.n.sum_rel_err <= s.tol:
        text += f"; summed over the CP group they are the expected gradients (rel err {s.n.sum_rel_err:.2g})"
    else:
        text += f"; even summed over the CP group they are off (rel err {s.n.sum_rel_err:.2g})"
    return text


def _dp_text(s: StepSignature) -> str:
    return (
        f"each CP group ends with the gradients of its own data only (rank {s.n.ranks[0]}: {s.n.own_rel_err:.2g} from its group's "
        f"reference, {s.worst.rel_err:.2g} from the mean over the {s.n.dp} data-parallel groups): the averaging over the "
        "data-parallel ranks is missing"
    )


def _factor_text(s: StepSignature) -> str:
    f = s.factor
    assert f is not None
    return (
        f"every rank's gradients are exactly {s.worst.factor:.4g}× the expected ones (factor {f.text} = {f.value:g} at "
        f"{s.layout}; residual {s.worst.residual:.2g}): {f.cause}"
    )


def _factor_remedy(s: StepSignature) -> str:
    return s.factor.remedy if s.factor is not None else ""


def attention_command(s: StepSignature) -> str:
    """The op-level `cpdoctor check` command at this job's CP degrees."""
    from cpdoctor.examinations.attention.judge import check_command
    from cpdoctor.examinations.attention.request import AttentionRequest, default_seq

    dtype = s.n.dtype if s.n.dtype in ("fp32", "bf16", "fp16") else "fp32"
    return check_command(AttentionRequest(ring=s.n.ring, ulysses=s.n.ulysses, dtype=dtype, seq=default_seq(s.n.cp)))


def _attention_text(s: StepSignature) -> str:
    fwd = "forward wrong too" if not s.n.out_rel_err <= s.tol else "forward exact"
    return (
        f"inputs, loss and reduction are right (peers agree, no constant factor) but the gradients are wrong: "
        f"worst rank {s.worst.rank} rel err {s.worst.rel_err:.2g} (tolerance {s.tol:.2g}; {fwd}: out {s.n.out_rel_err:.2g}): "
        f"the model's CP path, most often the attention; the op-level check at this job's degrees: `{attention_command(s)}`"
    )


def first_bad_param(s: StepSignature) -> ParamError | None:
    """The first parameter, in the model's order, whose gradient leaves the tolerance."""
    return next((p for p in s.n.params if not p.rel_err <= s.tol), None)


def block_of(name: str) -> str:
    """The block a parameter belongs to: its name up to the first numeric part (`transformer_blocks.0`), or its
    top-level module (`x_embedder`)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _where_text(s: StepSignature) -> str:
    first = first_bad_param(s)
    worst = max(s.n.params, key=lambda p: p.rel_err, default=None)
    if first is None or worst is None:
        return ""
    return f"first bad parameter {first.name} ({first.rel_err:.2g}) in block {block_of(first.name)}; worst parameter {worst.name} ({worst.rel_err:.2g})"


def _rng_text(s: StepSignature) -> str:
    return (
        f"the RNG states differ between CP peers after the step although they agreed before it: rank "
        f"{_ranks(s.rng_consumers)} consumed random numbers its peers did not, so every later draw (the next step's noise "
        "and timesteps) differs between them"
    )


RULES: tuple[Rule[StepSignature], ...] = (
    Rule("cause", "non-finite gradients", lambda s: s.nonfinite > 0,
         lambda s: f"{s.nonfinite} non-finite gradient values (NaN/Inf) after the sync", ("check the loss scale and the dtype",)),
    Rule("cause", "inputs differ between CP peers", lambda s: bool(s.n.inputs_differ), _inputs_text, (SEED_REMEDY,)),
    Rule("cause", "per-shard loss", lambda s: bool(s.n.out_grad_differ) and s.n.out_grad_own_shard, _out_grad_text, (SHARD_LOSS_REMEDY,)),
    Rule("cause", "loss differs per rank", lambda s: bool(s.n.out_grad_differ), _out_grad_text, (LOSS_REMEDY,)),
    Rule("cause", "CP reduction missing", lambda s: s.peers_differ, _peers_text, (CP_SUM_REMEDY,)),
    Rule("cause", "DP averaging missing", lambda s: s.grads_bad and s.n.own_rel_err is not None and s.n.own_rel_err <= s.tol, _dp_text, (DP_REMEDY,)),
    Rule("cause", "constant factor", lambda s: s.factor is not None, _factor_text),
    Rule("cause", "gradients wrong", lambda s: s.grads_bad, _attention_text, (ATTENTION_REMEDY,)),
    Rule("rng", "RNG consumed unevenly", lambda s: bool(s.rng_consumers) and len(s.n.rng_before_groups) == 1, _rng_text, (RNG_REMEDY,)),
    Rule("where", "first bad parameter", lambda s: s.grads_bad and s.only_gradients_wrong, _where_text),
)  # fmt: skip


def verdict_of(s: StepSignature) -> Verdict:
    bad = s.grads_bad or s.n.inputs_differ or s.n.out_grad_differ or (s.rng_consumers and len(s.n.rng_before_groups) == 1)
    return Verdict.FAIL if bad else Verdict.PASS


def rows(s: StepSignature) -> dict[str, JudgedRow]:
    """The finding's rows: the output (forward) and the parameter gradients (worst rank, every rank)."""
    tol = s.tol
    out = TensorRow(s.n.out_rel_err, s.n.out_max_abs, 0, worst_rank=s.n.ranks[0])
    worst = s.worst
    grads = TensorRow(
        worst.rel_err, worst.max_abs, s.nonfinite, worst_rank=worst.rank, per_rank_rel_err=tuple(g.rel_err for g in s.n.grads)
    )
    table = {
        "out": JudgedRow.judged(out, tol, (), Verdict.PASS if s.n.out_rel_err <= tol else Verdict.FAIL),
        "grads": JudgedRow.judged(grads, tol, s.bad_ranks, Verdict.FAIL if s.grads_bad else Verdict.PASS),
    }
    worst_param = max(s.n.params, key=lambda p: p.rel_err, default=None)
    if worst_param is not None:
        row = TensorRow(worst_param.rel_err, worst_param.max_abs, 0, name=worst_param.name, numel=worst_param.numel)
        table["worst_param"] = JudgedRow.judged(row, tol, (), Verdict.PASS if worst_param.rel_err <= tol else Verdict.FAIL)
    return table


def describe(n: StepNumbers) -> str:
    return f"training step, CP group ranks {_ranks(n.ranks)} (ring {n.ring} × Ulysses {n.ulysses}, dp {n.dp}, {n.dtype})"


def step_finding(n: StepNumbers, evidence: object = None) -> Finding:
    """The finding of one CP group's step."""
    s = StepSignature(n)
    verdict = verdict_of(s)
    if verdict is Verdict.PASS:
        diagnosis = (
            f"the step matches one fp64 process: same inputs and loss on every CP peer, gradients reduced right "
            f"(worst rank rel err {s.worst.rel_err:.2g}, out {n.out_rel_err:.2g}), RNG states in step"
        )
        remedy = ""
    else:
        diagnosis, remedy, spoken = diagnose(RULES, s)
        if "constant factor" in spoken:
            remedy = join_remedies([remedy, _factor_remedy(s)])
    command = attention_command(s) if verdict is Verdict.FAIL and "gradients wrong" in diagnose(RULES, s)[2] else None
    return Finding(describe(n), verdict, diagnosis, remedy, rows(s), evidence=evidence, command=command)
