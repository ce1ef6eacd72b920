"""Whether a model class's context-parallel plan fits a model built from a config: every module path the plan
names exists (Helios's plan names its blocks by index up to 39, so a Helios with fewer layers has entries no
module matches), and every input the plan splits is one the module's forward takes.

diffusers finds the plan's modules as `apply_context_parallel` does (`hooks/context_parallel.py`
`_find_submodule_by_name`: dotted attributes, one `*` over a ModuleList, a ValueError for an atom that is not a
submodule) and reads a split input from the module's forward signature (`ModuleForwardMetadata`: a name the
signature lacks raises at the first forward, unless it arrives as a keyword into `**kwargs`). A plan that does not
fit is therefore not an attention defect: `enable_parallelism` or the first forward raises. `plan_misfit` finds it
on a model built on the meta device, before any rank starts, and names the plan's entry and what the model has
there. torch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from cpdoctor.compat.diffusers import cp_plan


@dataclasses.dataclass(frozen=True)
class PlanMisfit:
    """One entry of a `_cp_plan` that the model does not have: the plan's entry as the class declares it, and
    what the model built from this config has in its place."""

    class_name: str
    entry: str  # the plan's module key ("" is the model itself), e.g. "blocks.39.attn1"
    plan_says: str  # what the plan does there: "gathers its output", "splits input 'rotary_emb' on dim 1"
    model_has: str  # what the model has: "blocks holds 2 modules (blocks.0 .. blocks.1)"
    entries_not_fitting: int = 1  # how many plan entries do not fit (the first is described)

    def line(self) -> str:
        """One line for a finding, an error or a test."""
        where = repr(self.entry) if self.entry else "'' (the model itself)"
        more = "" if self.entries_not_fitting == 1 else f" (and {self.entries_not_fitting - 1} more entries)"
        return (
            f"{self.class_name}'s _cp_plan does not fit this model: entry {where} {self.plan_says}, but "
            f"{self.model_has}{more}; diffusers would raise in enable_parallelism or the first forward, before any "
            "attention runs"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _describe(spec: Any) -> str:
    """What a plan entry does, in words (inputs split, or outputs gathered)."""
    if isinstance(spec, dict):
        parts = []
        for key, value in spec.items():
            dim = getattr(value, "split_dim", "?")
            parts.append(f"output {key}" if isinstance(key, int) else f"input {key!r}")
            parts[-1] = f"splits {parts[-1]} on dim {dim}"
        return ", ".join(parts)
    return "gathers its output"


def _children(module: Any) -> list[str]:
    return [name for name, _ in module.named_children()]


def _modules(model: Any, module_id: str) -> tuple[list[Any], str | None]:
    """The modules `module_id` names (as diffusers finds them), or what the model has where one is not there."""
    import torch

    current: list[tuple[str, Any]] = [("", model)]
    for atom in module_id.split(".") if module_id else []:
        nxt = []
        for path, mod in current:
            here = f"{path}.{atom}" if path else atom
            if atom == "*":
                if not isinstance(mod, torch.nn.ModuleList):
                    return [], f"{path or 'the model'} is a {type(mod).__name__}, not a ModuleList '*' can expand"
                nxt += [(f"{path}.{i}", m) for i, m in enumerate(mod)]
            elif atom in dict(mod.named_children()):
                nxt.append((here, getattr(mod, atom)))
            elif isinstance(mod, torch.nn.ModuleList):
                last = f" ({path}.0 .. {path}.{len(mod) - 1})" if len(mod) else ""
                return [], f"{path} holds {len(mod)} module{'s' if len(mod) != 1 else ''}{last}"
            else:
                names = ", ".join(_children(mod)[:8]) or "no submodules"
                return [], f"{path or 'the model'} ({type(mod).__name__}) has no submodule {atom!r} (it has {names})"
        current = nxt
    return [m for _, m in current], None


def _missing_input(modules: list[Any], spec: Any) -> str | None:
    """What the modules' forward takes where the plan splits an input it does not take (None when it takes all)."""
    if not isinstance(spec, dict):
        return None
    names = [k for k, v in spec.items() if isinstance(k, str) and not getattr(v, "split_output", False)]
    for module in modules[:1]:  # every module of a '*' entry is the same class
        params = inspect.signature(type(module).forward).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return None  # the input may arrive as a keyword into **kwargs, which diffusers reads
        taken = [n for n in params if n != "self"]
        for name in names:
            if name not in taken:
                return f"{type(module).__name__}.forward takes {', '.join(taken) or 'nothing'}, not {name!r}"
    return None


def plan_misfit(model: Any) -> PlanMisfit | None:
    """The first entry of the model class's `_cp_plan` that the model (built from its config, on any device) does
    not have, with the count of all such entries; None when the plan fits."""
    plan = cp_plan(type(model))
    misfits = []
    for module_id, spec in plan.items():
        modules, has = _modules(model, module_id)
        if has is None:
            has = _missing_input(modules, spec)
        if has is not None:
            misfits.append((module_id, spec, has))
    if not misfits:
        return None
    module_id, spec, has = misfits[0]
    return PlanMisfit(type(model).__name__, module_id, _describe(spec), has, len(misfits))


def inner_gathers(cls: type, stacks: list[str]) -> tuple[str, ...]:
    """The plan's gathers (ContextParallelOutput entries) inside the block stacks named, as `cpdoctor plan` names
    rows ("blocks.{0..39}.attn1"): after such a gather every rank holds, and back-propagates, the whole sequence
    until the next split (Helios gathers after every attention and feed-forward). Empty for a plan that gathers
    only after its blocks (Flux, Wan, LTX...)."""
    from cpdoctor.model_zoo.splits.measure import display_modules

    plan = cp_plan(cls)
    shown = display_modules(plan)
    inside = [m for m, spec in plan.items() if not isinstance(spec, dict) and any(m.startswith(f"{s}.") for s in stacks)]
    return tuple(dict.fromkeys(shown[m] for m in inside))
