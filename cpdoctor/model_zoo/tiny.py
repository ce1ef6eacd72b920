"""Tiny configs derived from the model class itself: the same architecture (the real diffusers class, its real
blocks and CP plan) shrunk until one forward + backward takes milliseconds on a CPU. Weights are random, seeded
identically on every rank. `cpdoctor model ltx` examines one; tests and examples train them.

Nothing here is a list of configs. `derive(cls)` starts from the class's `__init__` defaults and:
1. shrinks every width (heads, head dim, channels, hidden sizes, rope axes...) with every block stack cut to one
   block, trying each smaller value on the meta device (shrink.py: the smallest the architecture accepts, its
   relations kept, heads divisible by 2 so that Ulysses 2 runs, head dims by 8 so that flash kernels run);
2. gives each block stack the fewest blocks the class's `_cp_plan` names (Helios's plan names its blocks by index
   up to 39: it keeps 40), bisected on whether the plan fits (plan_fit.py);
3. runs the result for real (one block a stack), on the CPU in fp32: forward and backward through the family's inputs, the output
   finite and varying across tokens, the gradients finite and not all zero. Where that fails, the floors double
   and the search runs again; a class that still fails, or whose defaults fail on the meta device, raises
   `CannotShrink` (exit 3) saying why.
What each key could not go below, and why (the trial's own error), is kept in `TinyConfig.constraints`. Derived
once per class per process (`DERIVED`); the parent carries the result to the ranks inside the request.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from cpdoctor.errors import CannotExamine
from cpdoctor.memo import Memo
from cpdoctor.model_zoo import shrink

SMALL_RESOLUTION_STEPS = 8
"""Trial inputs: 8 resolution steps a side (the family's pipeline rounding), 8 text tokens, two latent frames."""
SMALL_TEXT = 8
FLOOR_TRIES = 3
"""How many times the floors double when the real run finds the smallest config degenerate."""


class CannotShrink(CannotExamine):
    """The class has no tiny config cpdoctor can derive (exit 3): its defaults fail on the meta device, no block
    count fits its plan, or every shrunk config fails a real forward and backward."""


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    """A derived tiny config: the keys changed from the class's defaults, what each key could not go below and
    why, and what the derivation cost."""

    class_name: str
    config: dict[str, Any]  # the keys that differ from the class's __init__ defaults
    constraints: dict[str, str]  # key -> why it went no lower
    blocks: dict[str, int]  # each block stack's depth key -> its blocks (the fewest the plan names, at least 1)
    parameters: int
    trials: int
    seconds: float

    def lines(self) -> list[str]:
        """What a user reads before the launch: the config, then the constraints met."""
        shown = ", ".join(f"{k}={v}" for k, v in self.config.items())
        return [f"tiny config derived from {self.class_name}'s defaults ({self.parameters} parameters): {shown}"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DERIVED: Memo[TinyConfig] = Memo("model class -> its tiny config (one derivation per class per process)")
"""`derive`'s memo. Lifetime: the process's (a class derives alike every time); cleared by tests only."""


def derive(cls: type) -> TinyConfig:
    """The tiny config of `cls` (derived once per process). CannotShrink when there is none."""
    return DERIVED.get(f"{cls.__module__}.{cls.__qualname__}", lambda: _derive(cls))


def _derive(cls: type) -> TinyConfig:
    from cpdoctor.model_zoo.catalog import full_config

    started = time.perf_counter()
    defaults = full_config(cls)
    stacks = stack_depth_keys(cls, defaults)
    keys = shrink.size_keys(defaults, set(stacks))
    why = "no real run"
    trials = 0
    for attempt in range(FLOOR_TRIES):
        floors = {k: f * 2**attempt for k, f in keys.items()}
        search = shrink.Shrinking(Trial(cls), {**defaults, **dict.fromkeys(stacks, 1)}, floors, shrink.relations(defaults, keys))
        try:
            config = search.run()
        except ValueError as exc:
            raise CannotShrink(f"cannot derive a tiny {cls.__name__}: {exc}") from exc
        trials += search.trials
        config = fewest_blocks(cls, config, stacks)
        why = examinable(cls, {**config, **dict.fromkeys(stacks, 1)})  # one block a stack: its depth is the plan's
        if why is None:
            changed = {k: v for k, v in config.items() if v != defaults.get(k)}
            parameters = count_parameters(cls, config)
            blocks = {k: int(config[k]) for k in stacks}
            return TinyConfig(cls.__name__, changed, search.stopped, blocks, parameters, trials, time.perf_counter() - started)
    raise CannotShrink(f"cannot derive a tiny {cls.__name__}: the smallest configs found fail a real forward and backward ({why})")


def stack_depth_keys(cls: type, defaults: dict[str, Any]) -> dict[str, int]:
    """Config key -> default depth, for each key that sizes a block stack: one meta build with every candidate
    depth key at its own small value, the stacks' lengths read back (as `slicing.stack_config_keys`, on meta)."""
    from cpdoctor.model_zoo.catalog import build_model
    from cpdoctor.model_zoo.slicing import block_stacks, depth_candidates

    probe = {k: i + 2 for i, k in enumerate(depth_candidates(defaults))}
    lengths = {len(ml) for _, ml in block_stacks(build_model(cls, {**defaults, **probe}, device="meta"))}
    return {k: int(defaults[k]) for k, v in probe.items() if v in lengths}


class Trial:
    """One trial config on the meta device: (parameters + buffers, None) when it builds, runs its family's inputs,
    every attention's heads divide by HEADS_MULTIPLE, its head dims by HEAD_DIM_MULTIPLE (flash kernels run it) and its
    queries and keys have its values' head dim; else
    (None, why). The plan is not asked here: the widths are searched at one block a stack (`fewest_blocks`)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, config: dict[str, Any]) -> tuple[int | None, str | None]:
        import torch

        from cpdoctor.model_zoo.catalog import build_model
        from cpdoctor.model_zoo.splits.measure import attention_spy, meta_safe

        with meta_safe():
            model = build_model(self.cls, config, device="meta")
            dims: set[tuple[int, int]] = set()
            with torch.no_grad(), attention_spy(dims) as heads:
                model(**small_inputs(self.cls, dict(model.config), "meta").kwargs)
        if not heads:
            return None, "its forward makes no attention call"
        widened = next(((qk, v) for qk, v in sorted(dims) if qk != v), None)
        if widened is not None:
            return None, f"queries and keys of head dim {widened[0]} against values of {widened[1]}: something broadcast"
        unaligned = sorted({d for pair in dims for d in pair if d % shrink.HEAD_DIM_MULTIPLE})
        if unaligned:
            return None, f"an attention of head dim {unaligned[0]}: flash kernels take multiples of {shrink.HEAD_DIM_MULTIPLE}"
        odd = sorted({h for pair in heads for h in pair if h % shrink.HEADS_MULTIPLE})
        if odd:
            return None, f"an attention with {odd[0]} heads: Ulysses {shrink.HEADS_MULTIPLE} could not split them"
        return sum(t.numel() for t in (*model.parameters(), *model.buffers())), None


def small_inputs(cls: type, config: dict[str, Any], device: Any, generator: Any = None) -> Any:
    """The family's inputs at the trial shape (masks included where the family takes one)."""
    from cpdoctor.model_zoo.inputs import build_inputs, builder_for

    builder = builder_for(cls)
    side = SMALL_RESOLUTION_STEPS * builder.resolution_multiple(config)
    return build_inputs(cls, config, side, side, SMALL_TEXT, builder.small_frames, device=device, text_mask=True, generator=generator)


def fewest_blocks(cls: type, config: dict[str, Any], stacks: dict[str, int]) -> dict[str, Any]:
    """Each stack at the fewest blocks (at least 1, at most its default) for which the class's plan fits: the
    model built once at the default depths (on meta), each stack cut to n blocks and the plan tried on it, n
    bisected. CannotShrink when even the default depths do not fit."""
    import torch

    from cpdoctor.model_zoo.catalog import build_model
    from cpdoctor.model_zoo.plan_fit import plan_misfit
    from cpdoctor.model_zoo.slicing import block_stacks

    out = {**config, **stacks}
    model = build_model(cls, out, device="meta")
    by_length = {len(ml): name for name, ml in block_stacks(model)}
    for key, depth in stacks.items():
        name = by_length.get(depth)
        if name is None:
            continue
        full = list(getattr(model, name))
        low, high = 0, depth  # n = low does not fit (or is no block), n = high does or is the default
        while high - low > 1:
            mid = (low + high) // 2
            setattr(model, name, torch.nn.ModuleList(full[:mid]))
            low, high = (low, mid) if plan_misfit(model) is None else (mid, high)
        setattr(model, name, torch.nn.ModuleList(full[:high]))
        out[key] = high
    misfit = plan_misfit(model)
    if misfit is not None:
        raise CannotShrink(f"cannot derive a tiny {cls.__name__}: {misfit.line()}")
    return out


def examinable(cls: type, config: dict[str, Any]) -> str | None:
    """Why one real forward and backward of the config in fp32 on the CPU teaches nothing (None when it does):
    an error, a non-finite output or gradient, an output equal for every token, or no gradient at all."""
    import torch

    from cpdoctor.attempt import Attempt
    from cpdoctor.model_zoo.catalog import build_model, model_outputs

    def run() -> str | None:
        torch.manual_seed(0)
        model = build_model(cls, config, device="cpu").float().train()
        kwargs = small_inputs(cls, dict(model.config), "cpu", torch.Generator().manual_seed(1)).kwargs
        outs = model_outputs(model(**kwargs))
        flat = torch.cat([o.reshape(-1) for o in outs])
        flat.backward(torch.randn_like(flat))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not torch.isfinite(flat).all() or not all(torch.isfinite(g).all() for g in grads):
            return "non-finite output or gradients"
        if all(o.ndim < 2 or bool((o - o.mean(dim=1, keepdim=True)).abs().max() == 0) for o in outs):
            return "the output is the same for every token"
        if not any(bool(g.abs().max() > 0) for g in grads):
            return "no parameter gets a gradient"
        return None

    tried = Attempt.of(run)
    return tried.value if tried.ok else tried.why(limit=200)


def count_parameters(cls: type, config: dict[str, Any]) -> int:
    from cpdoctor.model_zoo.catalog import build_model

    return sum(p.numel() for p in build_model(cls, config, device="meta").parameters())
