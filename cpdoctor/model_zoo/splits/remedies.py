"""The ways out of a plan's problems, measured.

For every group of tensors that does not split (grouped by what their length depends on: resolution, frames,
text) it re-runs the forward at the nearest resolutions, frame counts and text lengths and keeps those that
divide (on a one-block copy of the model when that copy is shown to give the same lengths); it lists the CP
degrees that divide the measured lengths and heads; and, when this diffusers' ContextParallelConfig has them,
the "anything" modes (constructed to see which degrees they accept; their backward called to see that they are
inference only). The arithmetic on numbers (divisors, degree options, candidates, wording) is plain functions
at the top, which a unit test can call without a model.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.diffusers import forward_params
from cpdoctor.errors import CannotExamine
from cpdoctor.model_zoo.inputs import InputBuilder
from cpdoctor.model_zoo.splits.measure import Key, MeasuredSplits, Measurer, try_measure
from cpdoctor.model_zoo.splits.result import HeadsCheck, Problem, Remedy, RemedyKind

# How far the remedy search looks (in steps of the pipeline's resolution / frame multiple) and how many extra
# forwards it may spend. A one-block forward costs ~10-50 ms on meta, a full-depth one 0.3-3 s.
MAX_STEPS = 8
MAX_RESOLUTION_RUNS = 48
MAX_TEXT_RUNS = 64
RESOLUTION_OPTIONS = 3
FRAME_OPTIONS = 2

TOKEN_LABELS = {
    ("resolution",): "image tokens",
    ("resolution", "frames"): "video tokens",
    ("frames",): "frame tokens",
    ("text",): "text tokens",
}


# --------------------------------------------------------------------------------------------------------------
# arithmetic and wording (no model)
# --------------------------------------------------------------------------------------------------------------


def per_rank(length: int, world: int) -> float:
    return length // world if length % world == 0 else round(length / world, 2)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_options(lengths: list[int], heads: list[int], ring: int, ulysses: int, limit: int = 4) -> list[tuple[int, int]]:
    """(ring, ulysses) pairs other than the requested one, nearest world size first (then the same world size,
    then the nearest degrees), for which every length divides the world size and every head count the Ulysses
    degree. World sizes from 2 up to max(8, 2 × the requested one)."""
    world = ring * ulysses
    options = []
    for w in range(2, max(8, 2 * world) + 1):
        if any(length % w for length in lengths):
            continue
        for u in divisors(w):
            r = w // u
            if any(h % u for h in heads) or (r, u) == (ring, ulysses):
                continue
            options.append((abs(w - world), w != world, abs(r - ring) + abs(u - ulysses), r, u))
    options.sort()
    return [(r, u) for *_, r, u in options[:limit]]


def resolution_candidates(height: int, width: int, step: int) -> list[tuple[int, int]]:
    """Resolutions within MAX_STEPS steps of `step` px, fewest steps first, larger before smaller."""
    cands = []
    for dh in range(-MAX_STEPS, MAX_STEPS + 1):
        for dw in range(-MAX_STEPS, MAX_STEPS + 1):
            h, w = height + dh * step, width + dw * step
            if (dh, dw) == (0, 0) or h < step or w < step:
                continue
            cands.append((abs(dh) + abs(dw), max(abs(dh), abs(dw)), dh < 0 or dw < 0, h, w))
    cands.sort()
    return [(h, w) for *_, h, w in cands]


def frame_candidates(frames: int, step: int, offset: int) -> list[int]:
    """Valid frame counts (step·k + offset) nearest to `frames`, more before fewer."""
    out = []
    for k in range(1, MAX_STEPS + 1):
        for f in (frames + k * step, frames - k * step):
            if f >= offset and (f - offset) % step == 0:
                out.append(f)
    return out


def fmt_lengths(m: MeasuredSplits, keys: set[Key], world: int) -> str:
    """ "6972 -> 3486 per rank" when the tensors agree, else one "name length -> per rank" per length."""
    by_length: dict[int, list[str]] = {}
    for k in sorted(keys, key=lambda k: k.name):
        for length in m.lengths.get(k, {}):
            by_length.setdefault(length, []).append(k.name)
    if len(by_length) == 1:
        length = next(iter(by_length))
        return f"{length} -> {per_rank(length, world)} per rank"
    return ", ".join(f"{'/'.join(names)} {length} -> {per_rank(length, world)}" for length, names in sorted(by_length.items()))


def padding_advice(text_len: int, padded: int, mask_param: str | None, ring: int) -> str:
    """How to pad the text from `text_len` to `padded` tokens, with or without a mask argument."""
    if mask_param:
        how = f"pad the text to {padded} tokens and mark the {padded - text_len} padding token(s) in `{mask_param}`"
        if ring > 1:
            how += " (under ring attention the mask must follow the KV chunks: see the note)"
        return how
    return (
        f"pad the text to {padded} tokens; this model's forward takes no text mask, so the padding is attended "
        "to: pad as the pipeline does (its max_sequence_length padding), not with zeros"
    )


def degrees_remedy(group_lengths: list[int], all_lengths: list[int], heads: list[int], ring: int, ulysses: int) -> Remedy:
    """The degrees that divide a group's lengths and the heads, marked where every length divides too."""
    opts = degree_options(group_lengths, heads, ring, ulysses)
    if not opts:
        top = max(8, 2 * ring * ulysses)
        text = f"no ring x ulysses up to {top} ranks divides " + ", ".join(str(x) for x in group_lengths)
        return Remedy(kind=RemedyKind.DEGREES, text=text, measured=True, values={"options": []})
    full = set(degree_options(all_lengths, heads, ring, ulysses, limit=64))
    text = "degrees that divide these lengths and the heads: " + ", ".join(
        f"ring={r} x ulysses={u}" + (" (everything divides)" if (r, u) in full else "") for r, u in opts
    )
    options = [{"ring": r, "ulysses": u, "all_divide": (r, u) in full} for r, u in opts]
    return Remedy(kind=RemedyKind.DEGREES, text=text, measured=True, values={"options": options})


def heads_degrees_remedy(all_lengths: list[int], heads: list[int], ring: int, ulysses: int) -> Remedy | None:
    """Degrees whose Ulysses group divides the heads and every length, the same world size first."""
    world = ring * ulysses
    opts = [(r, u) for r, u in degree_options(all_lengths, heads, ring, ulysses, limit=64) if r * u == world]
    opts = (opts or degree_options(all_lengths, heads, ring, ulysses))[:4]
    if not opts:
        return None
    return Remedy(
        kind=RemedyKind.DEGREES,
        text="degrees whose Ulysses group divides the heads (and every length): " + ", ".join(f"ring={r} x ulysses={u}" for r, u in opts),
        measured=True,
        values={"options": [{"ring": r, "ulysses": u, "all_divide": True} for r, u in opts]},
    )


def group_by_dependency(failing: set[Key], depends: dict[Key, list[str]]) -> dict[tuple[str, ...], set[Key]]:
    """The failing tensors, grouped by the knobs their length depends on."""
    groups: dict[tuple[str, ...], set[Key]] = {}
    for key in failing:
        groups.setdefault(tuple(depends[key]), set()).add(key)
    return groups


def tokens_what(deps: tuple[str, ...], keys: set[Key], lengths: dict[Key, dict[int, int]], ring: int, ulysses: int) -> str:
    """'image tokens: hidden_states 6889, ... do not split over 2 ranks (ring 2 x ulysses 1)'."""
    label = TOKEN_LABELS.get(deps, "tokens that depend on " + " and ".join(deps) if deps else "fixed-size tokens")
    seen = ", ".join(f"{k.name} {length}" for k in sorted(keys, key=lambda k: k.name) for length in sorted(lengths[k]))
    return f"{label}: {seen} do not split over {ring * ulysses} ranks (ring {ring} x ulysses {ulysses})"


def heads_what(h: HeadsCheck) -> str:
    kv = "" if h.kv_heads == h.heads else f" ({h.kv_heads} key/value heads)"
    return (
        f"{h.heads} attention heads{kv} do not split over ulysses={h.ulysses} (Ulysses scatters heads across its "
        f"group; divisors of {h.heads}: {', '.join(str(d) for d in divisors(h.heads) if d > 1)})"
    )


# --------------------------------------------------------------------------------------------------------------
# the "anything" modes of this diffusers
# --------------------------------------------------------------------------------------------------------------


def cp_config_fields() -> set[str]:
    """The fields of this diffusers' ContextParallelConfig (ulysses_anything / ring_anything are recent)."""
    from cpdoctor.compat import diffusers as diffusers_compat

    try:
        return set(diffusers_compat.context_parallel_fields())
    except CannotExamine:
        return set()


def cp_config_refuses(ring: int, ulysses: int, **flags: Any) -> str | None:
    """None when this diffusers' ContextParallelConfig accepts these degrees and flags, else its error."""
    from cpdoctor.compat import diffusers as diffusers_compat

    # its __post_init__ raises ValueError with the reason
    return Attempt.of(lambda: diffusers_compat.parallel_config_classes()[0](ring_degree=ring, ulysses_degree=ulysses, **flags)).why(
        with_type=False
    )


def anything_remedy(mode: str, ring: int, ulysses: int, fallback: tuple[int, int]) -> Remedy | None:
    """`mode` at the requested degrees, or at `fallback` when the config refuses those; None when it refuses both."""
    from cpdoctor.compat import diffusers as diffusers_compat

    error = cp_config_refuses(ring, ulysses, **{mode: True})
    use_r, use_u = (ring, ulysses) if error is None else fallback
    if error is not None and cp_config_refuses(use_r, use_u, **{mode: True}) is not None:
        return None
    backward = diffusers_compat.anything_backward_refused(mode)
    scope = (
        "inference only: its backward raises NotImplementedError" if backward else "check that its backward works before training with it"
    )
    return Remedy(
        kind=RemedyKind(mode),
        text=f"ContextParallelConfig(ring_degree={use_r}, ulysses_degree={use_u}, {mode}=True) splits uneven lengths; {scope}",
        measured=backward is not None,
        values={"ring": use_r, "ulysses": use_u, "inference_only": bool(backward), "refuses_requested_degrees": error},
    )


def anything_remedies(ring: int, ulysses: int, fields: set[str], heads_problem: bool) -> list[Remedy]:
    """ulysses_anything (all ranks in Ulysses) and, unless the heads are the problem, ring_anything (all in ring)."""
    world = ring * ulysses
    modes = [("ulysses_anything", (1, world))] + ([] if heads_problem else [("ring_anything", (world, 1))])
    found = [anything_remedy(mode, ring, ulysses, fallback) for mode, fallback in modes if mode in fields]
    return [r for r in found if r is not None]


# --------------------------------------------------------------------------------------------------------------
# the searches (each extra forward is one meta-device run)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Search:
    """What the remedy search works from: the measurer, the measurement at the requested settings, the degrees."""

    meas: Measurer
    builder: InputBuilder
    base: MeasuredSplits
    heads: list[HeadsCheck]
    ring: int
    ulysses: int

    @property
    def world(self) -> int:
        return self.ring * self.ulysses

    @cached_property
    def step(self) -> int:
        return self.builder.resolution_multiple(self.meas.full_config)

    @cached_property
    def mask_param(self) -> str | None:
        param = self.builder.text_mask_param
        return param if param in forward_params(self.meas.cls) else None

    @cached_property
    def fields(self) -> set[str]:
        return cp_config_fields()

    @property
    def all_lengths(self) -> list[int]:
        return sorted({length for seen in self.base.lengths.values() for length in seen})

    @property
    def all_heads(self) -> list[int]:
        return sorted({h.heads for h in self.heads} | {h.kv_heads for h in self.heads})

    @property
    def heads_bad(self) -> list[HeadsCheck]:
        return [h for h in self.heads if not h.divisible]

    def failing(self) -> set[Key]:
        return {k for k, seen in self.base.lengths.items() if any(length % self.world for length in seen)}

    def kept(self, keys: set[Key]) -> set[Key]:
        """`keys` and every tensor that divides at the requested settings: a way out must not break one that was
        fine (Helios's self-attention, history latents included, and its cross-attention move apart with the
        resolution)."""
        return keys | (set(self.base.lengths) - self.failing())


def dependencies(s: Search) -> dict[Key, list[str]]:
    """What each tensor's length depends on: perturb one knob at a time and see which lengths move."""
    b = s.base
    probes = {
        "text": (b.height, b.width, b.text_len + 1, b.frames),
        "resolution": (b.height + s.step, b.width + s.step, b.text_len, b.frames),
    }
    if b.frames is not None and s.builder.frames_step:
        probes["frames"] = (b.height, b.width, b.text_len, b.frames + s.builder.frames_step)
    moved: dict[str, set[Key]] = {}
    for knob, settings in probes.items():
        m = try_measure(s.meas, *settings)
        moved[knob] = set() if m is None else {k for k in b.lengths if m.signature().get(k) != b.signature()[k]}
    return {key: [knob for knob in ("resolution", "frames", "text") if key in moved.get(knob, set())] for key in b.lengths}


def _lengths_of(m: MeasuredSplits, keys: set[Key]) -> dict[str, list[int]]:
    return {k.name: sorted(m.lengths.get(k, {})) for k in keys}


def resolution_remedies(s: Search, keys: set[Key]) -> list[Remedy]:
    found: list[Remedy] = []
    for runs, (h, w) in enumerate(resolution_candidates(s.base.height, s.base.width, s.step)):
        if len(found) >= RESOLUTION_OPTIONS or runs >= MAX_RESOLUTION_RUNS:
            break
        m = try_measure(s.meas, h, w, s.base.text_len, s.base.frames)
        if m is not None and m.all_divide(s.world, s.kept(keys)):
            values = {"height": h, "width": w, "lengths": _lengths_of(m, keys)}
            found.append(Remedy(kind=RemedyKind.RESOLUTION, text=f"{h}x{w}: {fmt_lengths(m, keys, s.world)}", measured=True, values=values))
    return found or [
        Remedy(kind=RemedyKind.RESOLUTION, text=f"no resolution within {MAX_STEPS} steps of {s.step} px makes these divide", measured=True)
    ]


def frame_remedies(s: Search, keys: set[Key]) -> list[Remedy]:
    found: list[Remedy] = []
    for f in frame_candidates(s.base.frames or 1, s.builder.frames_step or 1, s.builder.frames_offset):
        if len(found) >= FRAME_OPTIONS:
            break
        m = try_measure(s.meas, s.base.height, s.base.width, s.base.text_len, f)
        if m is not None and m.all_divide(s.world, s.kept(keys)):
            values = {"frames": f, "lengths": _lengths_of(m, keys)}
            found.append(Remedy(kind=RemedyKind.FRAMES, text=f"{f} frames: {fmt_lengths(m, keys, s.world)}", measured=True, values=values))
    return found


def text_remedies(s: Search, keys: set[Key]) -> list[Remedy]:
    """The shortest padding that makes the text (and the mask, split once it is passed) divide."""
    b = s.base
    for t in range(b.text_len + 1, b.text_len + MAX_TEXT_RUNS + 1):
        m = try_measure(s.meas, b.height, b.width, t, b.frames, text_mask=s.mask_param is not None)
        if m is None:
            continue
        split = s.kept(keys) | {k for k in m.lengths if k not in b.lengths}  # e.g. the mask, split once it is passed
        if m.all_divide(s.world, split):
            text = f"{padding_advice(b.text_len, t, s.mask_param, s.ring)}: {fmt_lengths(m, split, s.world)}"
            values = {"text_len": t, "pad": t - b.text_len, "mask": s.mask_param}
            return [Remedy(kind=RemedyKind.TEXT_PADDING, text=text, measured=True, values=values)]
    return [Remedy(kind=RemedyKind.TEXT_PADDING, text=f"no text length up to {b.text_len + MAX_TEXT_RUNS} divides", measured=True)]


# --------------------------------------------------------------------------------------------------------------
# problems
# --------------------------------------------------------------------------------------------------------------


def tokens_problem(s: Search, deps: tuple[str, ...], keys: set[Key]) -> Problem:
    """One group of tensors that do not split, with every measured way out."""
    remedies: list[Remedy] = []
    if "resolution" in deps:
        remedies += resolution_remedies(s, keys)
    if "frames" in deps:
        remedies += frame_remedies(s, keys)
    if "text" in deps:
        remedies += text_remedies(s, keys)
    group_lengths = sorted({length for k in keys for length in s.base.lengths[k]})
    remedies.append(degrees_remedy(group_lengths, s.all_lengths, s.all_heads, s.ring, s.ulysses))
    remedies += anything_remedies(s.ring, s.ulysses, s.fields, heads_problem=bool(s.heads_bad))
    what = tokens_what(deps, keys, s.base.lengths, s.ring, s.ulysses)
    return Problem(what=what, tensors=sorted({k.name for k in keys}), remedies=remedies)


def heads_problem(s: Search, h: HeadsCheck) -> Problem:
    remedy = heads_degrees_remedy(s.all_lengths, s.all_heads, s.ring, s.ulysses)
    remedies = ([remedy] if remedy else []) + anything_remedies(s.ring, s.ulysses, s.fields, heads_problem=True)
    return Problem(what=heads_what(h), tensors=["attention heads"], remedies=remedies)


@dataclasses.dataclass
class Found:
    """The problems of a plan, what each tensor's length depends on (measured only when something fails), and
    notes about how the search ran."""

    problems: list[Problem] = dataclasses.field(default_factory=list)
    depends: dict[Key, list[str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


def find_problems(s: Search) -> Found:
    found = Found()
    failing = s.failing()
    if failing:
        if not s.meas.make_shallow(s.base, text_mask=False):
            found.notes.append("the remedy search ran the full-depth model (a one-block copy measured differently)")
        found.depends = dependencies(s)
        groups = group_by_dependency(failing, found.depends)
        found.problems = [tokens_problem(s, deps, keys) for deps, keys in sorted(groups.items())]
    found.problems += [heads_problem(s, h) for h in s.heads_bad]
    return found
