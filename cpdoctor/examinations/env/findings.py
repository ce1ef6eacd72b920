"""The findings of `cpdoctor env` about the installed code: tables of rules over plain facts.

A rule is (probe, condition -> verdict, diagnosis, remedy, command). The facts are small dataclasses (what the
installed ring template does, what dispatch did with a parallel config, what the backends' ops did, which
uneven-length modes exist), gathered elsewhere (`code_facts`, `backend_table`); here they only become findings,
so a unit test can feed any combination of facts and read the verdicts and the wording. Nothing here imports
torch or diffusers, and nothing is decided from a version number.

For each probe name the first rule whose condition holds gives the finding; diagnosis, remedy, command and probe
are templates filled from the words derived from the facts (`str.format`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.examinations.env.backend_table import SHAPE, BackendRow
from cpdoctor.report import Finding, Verdict

PASS, FAIL, WARN, INFO = Verdict.PASS, Verdict.FAIL, Verdict.WARN, Verdict.INFO


@dataclass(frozen=True)
class FactRule:
    """One line of an env table: for the finding titled `subject`, when `when(facts)` holds, this verdict,
    diagnosis, remedy and command (templates filled from the words), and `evidence(facts)` as its details.
    (The op-level and model diagnoses use `judging.Rule`, which composes aspects; env's rules each decide one
    finding.)"""

    subject: str
    when: Callable[[Any], bool]
    verdict: Verdict
    diagnosis: str
    remedy: str = ""
    command: str | None = None
    final: bool = False
    """No later rule of the table applies once this one has."""
    evidence: Callable[[Any], Any] | None = None

    def finding(self, facts: Any, words: Mapping[str, Any]) -> Finding:
        return Finding(
            self.subject.format(**words),
            self.verdict,
            self.diagnosis.format(**words),
            self.remedy.format(**words),
            evidence=self.evidence(facts) if self.evidence else None,
            command=self.command.format(**words) if self.command else None,
        )


@dataclass(frozen=True)
class DispatchEvidence:
    tried: str | None
    ignores_config: list[str]
    drops_config: list[str]


@dataclass(frozen=True)
class KernelArgsEvidence:
    kernel_args: dict[str, list[Any]]


@dataclass(frozen=True)
class ModesEvidence:
    modes: list[str]


def apply(rules: list[FactRule], facts: Any, words: Mapping[str, Any]) -> list[Finding]:
    """The findings of `rules` on `facts`: per subject, the first rule whose condition holds."""
    out: list[Finding] = []
    decided: set[str] = set()
    for rule in rules:
        subject = rule.subject.format(**words)
        if subject in decided or not rule.when(facts):
            continue
        decided.add(subject)
        out.append(rule.finding(facts, words))
        if rule.final:
            break
    return out


# ----------------------------------------------------------------------------------------------------------
# The ring template, read from its source
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RingSource:
    """What the installed TemplatedRingAttention does, read from its code (None: could not be read). When
    cpdoctor's fixed ring is patched in, these describe the class it replaced."""

    patched: bool = False
    absent: bool = False
    passes_tensors: bool | None = None
    """backward_op gets the rotated query/key/value/out/lse (False: the stale-K/V backward)."""
    sends_to_next: bool | None = None
    """dK/dV is handed to rank r+1 with `list(range(1, W)) + [0]` (wrong at ring ≥ 3)."""
    gathers_mask: bool | None = None
    callers: list[str] = field(default_factory=list)


def ring_words(src: RingSource) -> dict[str, str]:
    return {
        "prefix": "the installed code (replaced in this process by cpdoctor's patch) " if src.patched else "the installed code ",
        "also": ", in ring × Ulysses too (it goes through the same class)" if "_templated_unified_attention" in src.callers else "",
        "hidden": "; today it hides behind the stale K/V defect above and remains once that is fixed"
        if src.passes_tensors is False
        else "",
    }


_STALE, _DIRECTION, _MASK = "ring backward: rotated K/V", "ring backward: dK/dV direction", "ring forward: mask rotation"
_RING2, _RING3, _MASKCMD = "cpdoctor check --ring 2", "cpdoctor check --ring 3", "cpdoctor check --ring 2 --mask-pad 3"

RING_RULES: list[FactRule] = [
    FactRule(
        "ring template",
        lambda s: s.absent,
        WARN,
        "the installed diffusers has no TemplatedRingAttention: ring CP is not examined here",
        "measure it",
        _RING2,
        final=True,
    ),
    FactRule(
        _STALE,
        lambda s: s.passes_tensors is None,
        WARN,
        "the source of TemplatedRingAttention.backward cannot be read",
        "measure it",
        _RING2,
    ),
    FactRule(
        _STALE,
        lambda s: s.passes_tensors is False,
        FAIL,
        "{prefix}calls `ctx.backward_op(ctx, grad_out)` in TemplatedRingAttention.backward without the rotated "
        "query/key/value/out/lse: every ring step's gradient is recomputed against the iteration-0 (local) K/V and "
        "partial out/lse, so dQ/dK/dV are wrong at every ring degree ≥ 2{also}; the forward is right",
        "cpdoctor.patch(); or upgrade diffusers to a release whose ring backward passes key=/value= (then re-check "
        "ring ≥ 3); or Ulysses-only CP",
        _RING2,
    ),
    FactRule(_STALE, lambda s: True, PASS, "{prefix}passes the rotated key/value and the merged out/lse to backward_op", "", _RING2),
    FactRule(
        _DIRECTION,
        lambda s: s.sends_to_next is None,
        WARN,
        "the direction of the dK/dV hand-off cannot be read from the source",
        "measure it",
        _RING3,
    ),
    FactRule(
        _DIRECTION,
        lambda s: bool(s.sends_to_next),
        FAIL,
        "{prefix}sends the dK/dV accumulator to rank r+1 (`next_ranks = list(range(1, world_size)) + [0]`) while "
        "rank r holds KV chunk r+i at step i, so it belongs at r−1: dK/dV are wrong at ring degree ≥ 3 "
        "(the two directions agree only at ring 2){also}{hidden}",
        "cpdoctor.patch(); or keep ring_degree ≤ 2 and scale with Ulysses",
        _RING3,
    ),
    FactRule(_DIRECTION, lambda s: True, PASS, "{prefix}does not hand dK/dV to rank r+1 with `list(range(1, W)) + [0]`", "", _RING3),
    FactRule(
        _MASK,
        lambda s: s.gathers_mask is None,
        WARN,
        "whether the ring rotates the attention mask cannot be read from the source",
        "measure it",
        _MASKCMD,
    ),
    FactRule(
        _MASK,
        lambda s: s.gathers_mask is False,
        FAIL,
        "{prefix}passes each rank's local attn_mask to every rotated KV chunk of TemplatedRingAttention "
        "(it never gathers the mask with the keys): with a padding mask (e.g. Qwen-Image's text mask) out and "
        "gradients are silently wrong{also}; Ulysses all-gathers the mask and is exact",
        "cpdoctor.patch() (its ring rotates the mask with the keys); or Ulysses-only CP for masked models",
        _MASKCMD,
    ),
    FactRule(_MASK, lambda s: True, PASS, "{prefix}gathers the attention mask with the keys", "", _MASKCMD),
]


def ring_findings(src: RingSource) -> list[Finding]:
    return apply(RING_RULES, src, ring_words(src))


# ----------------------------------------------------------------------------------------------------------
# dispatch_attention_fn and a backend that is not registered for CP
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DispatchTrial:
    """dispatch_attention_fn called with a parallel config and a backend that runs here but is not registered
    for CP (one whose own backward runs here, when there is one)."""

    ignoring: list[str] = field(default_factory=list)
    """Such backends that accept the parallel config (and ignore it)."""
    dropping: list[str] = field(default_factory=list)
    """Such backends that do not accept it (dispatch drops it)."""
    tried: str | None = None
    error: str | None = None
    """What dispatch raised; None when it returned (local attention, without a word)."""


def dispatch_words(t: DispatchTrial) -> dict[str, str]:
    names = []
    if t.ignoring:
        names.append(f"{', '.join(t.ignoring)} (accept the parallel config and ignore it)")
    if t.dropping:
        names.append(f"{', '.join(t.dropping)} (do not accept it: dispatch drops it)")
    return {"tried": t.tried or "", "error": t.error or "", "names": "; ".join(names)}


_DISPATCH = "dispatch: CP check"
DISPATCH_RULES: list[FactRule] = [
    FactRule(
        _DISPATCH,
        lambda t: not (t.ignoring or t.dropping),
        INFO,
        "no backend that is not registered for CP runs here, so nothing could route a parallel config to one",
    ),
    FactRule(
        _DISPATCH,
        lambda t: t.error is not None and "parallel" in t.error.lower(),
        PASS,
        "dispatch_attention_fn refuses a parallel config for {tried}, which is not registered for CP ({error})",
    ),
    FactRule(
        _DISPATCH,
        lambda t: t.error is not None,
        INFO,
        "dispatch_attention_fn with a parallel config and {tried} raised {error}; whether it checks "
        "supports_context_parallel is not settled here",
        "",
        "cpdoctor check --ring 2 --backend {tried}",
    ),
    FactRule(
        _DISPATCH,
        lambda t: True,
        WARN,
        "dispatch_attention_fn called with a parallel config and backend {tried} (not registered for CP) returned "
        "local attention without a word: it never checks supports_context_parallel. Backends here that would do "
        "this: {names}; each rank then attends only to its own 1/W of the keys. enable_parallelism and "
        "set_attention_backend do check, so this bites when the backend is chosen afterwards (the installed "
        "attention_backend context manager does not check) or dispatch_attention_fn is called directly",
        "choose a CP-capable backend (a ✓ in the Ulysses column) before enable_parallelism and do not switch it afterwards",
        "cpdoctor check --ring 2 --backend {tried}",
        evidence=lambda t: DispatchEvidence(t.tried, list(t.ignoring), list(t.dropping)),
    ),
]


def dispatch_finding(trial: DispatchTrial) -> Finding:
    return apply(DISPATCH_RULES, trial, dispatch_words(trial))[0]


# ----------------------------------------------------------------------------------------------------------
# The backends' CP ops, as Ulysses calls them in training
# ----------------------------------------------------------------------------------------------------------


def shape_mismatch(shapes: list | None) -> str:
    """'dK, dV of shape [1, 2, 16, 32], the kernel layout (B, H, S, D)' for the gradients that differ from SHAPE."""
    b, s, h, d = SHAPE
    labels = ("dQ", "dK", "dV")
    wrong = [(labels[i], sh) for i, sh in enumerate(shapes or []) if sh is None or tuple(sh) != SHAPE]
    if not wrong:
        return "gradients of the right shape"
    shape = wrong[0][1]
    layout = ", the kernel layout (B, H, S, D)" if shape is not None and tuple(shape) == (b, h, s, d) else ""
    return f"{', '.join(n for n, _ in wrong)} of shape {shape}{layout}"


def op_words(row: BackendRow, dtype_name: str) -> dict[str, str]:
    op = row.op
    meta = op.on_meta
    return {
        "name": row.name,
        "on": (
            "measured on the meta device, as this device has no kernel for it: shapes and kernel arguments only"
            if meta
            else f"measured on {op.measured_on} in {dtype_name}"
        ),
        # On the meta device the numbers are for a machine where the backend runs (bf16 is what training uses there).
        "command": f"cpdoctor check --ulysses 2 --backend {row.name}" + (" --dtype bf16" if meta else ""),
        "lse_how": "asks its kernel not to compute the LSE (compute_log_sumexp=False)" if op.lse_not_requested else "saves no LSE",
        "grads": shape_mismatch(op.grad_shapes),
        "shape": str(list(SHAPE)),
        "backward_error": op.backward_error or "",
        "errs": ", ".join(f"{k} {v:.2g}" for k, v in (op.rel_err or {}).items()),
        "tolerance": f"{op.tolerance:.2g}" if op.tolerance is not None else "",
        "patch": (
            "cpdoctor.patch() (its ring and Ulysses call the kernel directly and never these ops); or "
            if op.fix_calls_kernel
            else "cpdoctor.patch() for ring layouts (its ring never calls these ops; under Ulysses this backend still runs them); or "
        ),
        "rng_how": "advanced the device generator"
        if op.rng_advanced
        else f"gave its kernel dropout_p={op.forced_dropout or 0:g} (the generator will advance)",
    }


def _saves_no_lse(row: BackendRow) -> bool:
    op = row.op
    return bool(op.lse_not_requested) or (
        op.saved_lse is False and op.backward_ok is False and not op.backward_error and bool(op.grad_shapes_ok)
    )


OP_RULES: list[FactRule] = [
    FactRule(
        "{name}: LSE for backward",
        _saves_no_lse,
        FAIL,
        "called as Ulysses calls it in training (return_lse=False), {name}'s forward op {lse_how} although its "
        "backward reads one: training through it (Ulysses, and the ring's first step) gets wrong gradients or an "
        "error; {on}",
        "{patch}another backend for training (cpdoctor_cpu on CPU; one with ✓ in the training column); or upgrade diffusers to a "
        "release whose {name} forward computes the LSE whenever a backward may need it",
        "{command}",
        evidence=lambda row: KernelArgsEvidence(row.op.kernel_args),
    ),
    FactRule(
        "{name}: backward",
        lambda row: bool(row.op.backward_error),
        FAIL,
        "{name}'s backward op raises after a forward that was not asked for an LSE: {backward_error}; {on}",
        "{patch}another backend for training",
        "{command}",
    ),
    FactRule(
        "{name}: backward",
        lambda row: row.op.grad_shapes_ok is False,
        FAIL,
        "{name}'s backward op returns {grads} for q/k/v of shape {shape} = (B, S, H, D) (it transposes tensors its "
        "forward saved in kernel layout once more): training through it raises, or, where the shapes happen to "
        "agree, gets wrong gradients; {on}",
        "{patch}another backend for training; or upgrade diffusers to a release whose backward ops return model layout",
        "{command}",
    ),
    FactRule(
        "{name}: backward",
        lambda row: row.op.rel_err is not None and row.op.backward_ok is False and not row.op.lse_not_requested,
        FAIL,
        "{name}'s ops disagree with an fp64 reference on one process ({errs}; tolerance {tolerance}); {on}",
        "another backend",
        "{command}",
    ),
    FactRule(
        "{name}: RNG",
        lambda row: bool(row.op.rng_advanced or row.op.forced_dropout),
        WARN,
        "a forward+backward through {name}'s ops with dropout 0 {rng_how} ({on}): runs are not bitwise "
        "reproducible and other random draws (noise, dropout elsewhere) shift with every attention call",
        "a backend whose RNG column is steady; or upgrade diffusers (the flash op forcing dropout_p=1e-30 to "
        "obtain an LSE was removed upstream)",
    ),
]
"""Per backend whose CP ops were called: LSE for training, backward correctness, RNG advance."""


def _clean(rows: list[BackendRow]) -> list[str]:
    """Backends measured on this device whose ops train right and leave the generator alone."""
    return [
        r.name
        for r in rows
        if r.op is not None and not r.op.error and not r.op.on_meta and r.training.ok and not r.op.rng_advanced and not r.op.forced_dropout
    ]


SUMMARY_RULES: list[FactRule] = [
    FactRule(
        "CP ops on this device",
        lambda rows: bool(_clean(rows)),
        PASS,
        "{clean}: the forward saves what the backward needs when no LSE is asked for, the backward matches an fp64 "
        "reference, and the device generator does not move",
    ),
    FactRule(
        "CP backends here",
        lambda rows: not any(r.ulysses.ok for r in rows),
        WARN,
        "no attention backend can run CP on this device and dtype",
        "install a CP-capable backend for this device, or try --device/--dtype",
    ),
]


def op_findings(rows: list[BackendRow], dtype_name: str) -> list[Finding]:
    out: list[Finding] = []
    for row in rows:
        if row.op is not None and not row.op.error:
            out += apply(OP_RULES, row, op_words(row, dtype_name))
    return out + apply(SUMMARY_RULES, rows, {"clean": ", ".join(_clean(rows))})


# ----------------------------------------------------------------------------------------------------------
# DIFFUSERS_ATTN_BACKEND, and the uneven-length modes
# ----------------------------------------------------------------------------------------------------------

_DEFAULT = "default backend (DIFFUSERS_ATTN_BACKEND)"
DEFAULT_BACKEND_RULES: list[FactRule] = [
    FactRule(
        _DEFAULT,
        lambda row: row is None,
        WARN,
        "DIFFUSERS_ATTN_BACKEND={name} is not a backend of the installed diffusers",
        "unset it or name a backend from the table",
    ),
    FactRule(
        _DEFAULT,
        lambda row: not row.ulysses.ok,
        WARN,
        "DIFFUSERS_ATTN_BACKEND={name} cannot do CP here: {ulysses_why}",
        "name a backend with ✓ in the Ulysses (and ring) column",
    ),
    FactRule(
        _DEFAULT,
        lambda row: not row.ring.ok or not row.training.ok,
        WARN,
        "DIFFUSERS_ATTN_BACKEND={name} does Ulysses here but not everything: {gaps}",
        "name a backend with ✓ in the ring and training columns if you need them",
    ),
    FactRule(_DEFAULT, lambda row: True, PASS, "DIFFUSERS_ATTN_BACKEND={name} can do ring, Ulysses and training here"),
]


def default_backend_finding(name: str | None, rows: list[BackendRow]) -> Finding | None:
    """DIFFUSERS_ATTN_BACKEND picks the backend of every processor that sets none: can that one do CP here?"""
    if not name:
        return None
    row = next((r for r in rows if r.name == name), None)
    words = {"name": name, "ulysses_why": "", "gaps": ""}
    if row is not None:
        words["ulysses_why"] = row.ulysses.why
        words["gaps"] = "; ".join(c.why for c in (row.ring, row.training) if not c.ok)
    return apply(DEFAULT_BACKEND_RULES, row, words)[0]


_UNEVEN, _PLAN = "uneven sequence lengths", "cpdoctor plan MODEL --ring R --ulysses U"
UNEVEN_RULES: list[FactRule] = [
    FactRule(
        _UNEVEN,
        lambda modes: not modes,
        INFO,
        "ContextParallelConfig has no ulysses_anything/ring_anything: every split length must divide ring × ulysses",
        "",
        _PLAN,
    ),
    FactRule(
        _UNEVEN,
        lambda modes: True,
        INFO,
        "ContextParallelConfig has {scopes}: they shard lengths that do not divide the CP world",
        "for training, pick lengths that divide (`cpdoctor plan MODEL` lists the nearest ones)",
        _PLAN,
        evidence=lambda modes: ModesEvidence(list(modes)),
    ),
]


def _scope(refused: bool | None) -> str:
    if refused:
        return "inference only: its backward raises NotImplementedError"
    return "backward not refused" if refused is False else "no class found"


def uneven_finding(modes: dict[str, bool | None]) -> Finding:
    """`modes`: each uneven-length mode ContextParallelConfig has -> whether its backward is refused (None: no
    class found)."""
    scopes = ", ".join(f"{mode} ({_scope(refused)})" for mode, refused in modes.items())
    return apply(UNEVEN_RULES, modes, {"scopes": scopes})[0]


# ----------------------------------------------------------------------------------------------------------
# All of them
# ----------------------------------------------------------------------------------------------------------


@dataclass
class CodeFacts:
    """Everything the findings are judged from, besides the backend rows."""

    ring: RingSource
    dispatch: DispatchTrial
    uneven_modes: dict[str, bool | None]
    default_backend: str | None = None


def judge(code: CodeFacts, rows: list[BackendRow], dtype_name: str) -> list[Finding]:
    """Every finding, in the order the report lists them."""
    findings = ring_findings(code.ring)
    findings.append(dispatch_finding(code.dispatch))
    findings += op_findings(rows, dtype_name)
    default = default_backend_finding(code.default_backend, rows)
    if default is not None:
        findings.append(default)
    findings.append(uneven_finding(code.uneven_modes))
    return findings
