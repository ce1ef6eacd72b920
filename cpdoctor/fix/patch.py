"""Apply / revert / detect the fixed CP attention in an imported diffusers (in memory only, never files).

diffusers looks its CP templates up as module globals of `diffusers.models.attention_dispatch` each time CP
attention runs, so replacing two globals is the whole patch and putting the original objects back is the
whole revert:

| global                      | replaced by                           | used for                 |
|-----------------------------|---------------------------------------|--------------------------|
| `TemplatedRingAttention`    | `cpdoctor.fix.ring.RingAttention`     | ring, ring × Ulysses     |
| `TemplatedUlyssesAttention` | `cpdoctor.fix.ulysses.UlyssesAttention` | Ulysses                |

A ring class that does not look like the one the fix was written against (missing, another `forward`
signature, nobody looking it up by name) is refused with `PatchRefused` unless `force=True`; a Ulysses class
like that is left in place, `force` or not, and the report says why (`skipped`). The fixed Ulysses calls the
original class wherever it has no fused kernel to run (`UlyssesAttention.original`, read from `STATE`).

What the patch put aside lives in one owner, `STATE` (a `PatchState`, in `put_aside.py`, which the fixed Ulysses
reads without importing this module): the originals to put back and the report of the apply that replaced them.

    from cpdoctor.fix import patch
    report = patch.apply()          # idempotent
    with patch.patched(): ...       # scoped
    patch.revert()                  # the original objects, by identity
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from cpdoctor.compat import diffusers as compat
from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.fix.put_aside import STATE


class PatchRefused(CannotExamine):
    """The installed diffusers does not have the private API the fix replaces, in the shape it expects
    (a CannotExamine: the CLI's exit code 3)."""


@dataclass
class Replacement:
    module: str
    name: str
    original: str
    replacement: str


@dataclass
class PatchReport:
    """What `apply()` did and why (plain data: `to_dict()` for JSON)."""

    diffusers: str
    replaced: list[Replacement] = field(default_factory=list)
    already_patched: bool = False
    forced: bool = False
    problem: str | None = None
    original_backward_passes_tensors: bool | None = None
    original_sends_dkv_to_next: bool | None = None
    original_gathers_mask: bool | None = None
    callers: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        names = ", ".join(f"{r.module}.{r.name}" for r in self.replaced) or "nothing"
        state = "already patched: " if self.already_patched else ""
        forced = " (forced past: " + self.problem + ")" if self.forced and self.problem else ""
        kept = "; kept " + "; ".join(self.skipped) if self.skipped else ""
        return f"cpdoctor: {state}replaced {names} with cpdoctor's fixed CP attention (diffusers {self.diffusers}){forced}{kept}"


def _replacement() -> Any:
    from cpdoctor.fix.ring import RingAttention

    return RingAttention


def _ulysses_replacement() -> Any:
    from cpdoctor.fix.ulysses import UlyssesAttention

    return UlyssesAttention


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def is_patched() -> bool:
    """True when diffusers' module global is cpdoctor's ring right now."""
    try:
        mod = compat.dispatch_module()
    except Exception:  # noqa: BLE001 - no diffusers: nothing is patched
        return False
    return getattr(mod, compat.RING_CLASS, None) is _replacement()


def apply(force: bool = False) -> PatchReport:
    """Replace diffusers' ring and Ulysses templates with the fixed ones (idempotent). Raises PatchRefused for a ring it
    does not recognise unless `force`, and when diffusers or its CP support is missing (force or not)."""
    try:
        mod = compat.dispatch_module()
    except (BadInput, CannotExamine) as exc:
        raise PatchRefused(f"cpdoctor cannot patch: {exc}") from exc
    replacement = _replacement()
    report = PatchReport(diffusers=compat.diffusers_version(), callers=compat.callers_of_ring(mod))
    current = getattr(mod, compat.RING_CLASS, None)
    if current is replacement:
        previous = STATE.report
        report.already_patched = True
        if previous is not None:
            report.replaced, report.forced, report.problem = previous.replaced, previous.forced, previous.problem
            for name in ("original_backward_passes_tensors", "original_sends_dkv_to_next", "original_gathers_mask", "reasons", "skipped"):
                setattr(report, name, getattr(previous, name))
        return report
    problem = compat.ring_class_problem(mod)
    if problem and not force:
        raise PatchRefused(f"cpdoctor will not patch this diffusers ({report.diffusers}): {problem}. Pass force=True to patch anyway.")
    report.forced = bool(problem)
    report.problem = problem
    if current is not None:
        report.original_backward_passes_tensors = compat.backward_passes_tensors(current)
        report.original_sends_dkv_to_next = compat.backward_sends_dkv_to_next(current)
        report.original_gathers_mask = compat.forward_gathers_mask(current)
    report.reasons = _reasons(report)
    _replace(mod, compat.RING_CLASS, replacement, report)
    _replace_ulysses(mod, report)
    STATE.report = report
    return report


def _replace(mod: Any, name: str, replacement: Any, report: PatchReport) -> None:
    """mod.<name> := replacement, the original kept for `revert` (never the replacement itself: a global that is
    already cpdoctor's keeps the original an earlier apply recorded)."""
    key = (mod.__name__, name)
    current = getattr(mod, name, None)
    if current is not replacement:
        STATE.originals[key] = current
    original = STATE.originals.get(key)
    setattr(mod, name, replacement)
    report.replaced.append(
        Replacement(mod.__name__, name, _qualname(original) if original is not None else "(absent)", _qualname(replacement))
    )


def _replace_ulysses(mod: Any, report: PatchReport) -> None:
    """The Ulysses template too, only when it is the class the fix knows; otherwise it stays (whatever `force`
    says: the original is a working fallback, a forced replacement of an unknown signature would bind diffusers'
    arguments wrongly) and `report.skipped` says why."""
    replacement = _ulysses_replacement()
    current = getattr(mod, compat.ULYSSES_CLASS, None)
    if current is not replacement:
        problem = compat.ulysses_class_problem(mod)
        if problem:
            report.skipped.append(f"{compat.ULYSSES_CLASS} ({problem})")
            return
        if compat.backward_calls_backend_op(current):
            report.reasons.append(
                "its Ulysses backward runs the backend's own backward op, so that op's defects (0.39.0's _native_flash and "
                "_native_cudnn transpose K/V twice) reach Ulysses; the fix's Ulysses calls the fused kernel with explicit layouts"
            )
    _replace(mod, compat.ULYSSES_CLASS, replacement, report)


def _reasons(report: PatchReport) -> list[str]:
    """What the replaced code does wrong, as read from its source (nothing when it cannot be read)."""
    reasons = []
    if report.original_backward_passes_tensors is False:
        reasons.append(
            "its backward calls backward_op(ctx, grad_out) without the rotated chunk: every step recomputes against the step-0 K/V (stale KV)"
        )
    if report.original_sends_dkv_to_next:
        reasons.append(
            "its dK/dV accumulator travels to rank r+1, right only for ring degree 2 (the fix sends it to r−1, where its keys go next)"
        )
    if report.original_gathers_mask is False:
        reasons.append("it hands the local attention mask to every rotated KV chunk (the fix gathers the mask with the keys)")
    return reasons


def revert() -> bool:
    """Put the original objects back (identity). Returns True when something was restored."""
    if not STATE.originals:
        return False
    import importlib

    for (module_name, attr), original in list(STATE.originals.items()):
        mod = importlib.import_module(module_name)
        if original is None:
            with contextlib.suppress(AttributeError):
                delattr(mod, attr)
        else:
            setattr(mod, attr, original)
    STATE.clear()
    return True


def set_patched(flag: bool) -> None:
    """Patched or not, whatever the state was (used by the probes; idempotent)."""
    if flag:
        apply()
    else:
        revert()


def last_report() -> PatchReport | None:
    return STATE.report


@contextlib.contextmanager
def patched(force: bool = False) -> Iterator[PatchReport]:
    """The fix in place for the duration of the block; the previous state afterwards."""
    was = is_patched()
    report = apply(force=force)
    try:
        yield report
    finally:
        if not was:
            revert()
