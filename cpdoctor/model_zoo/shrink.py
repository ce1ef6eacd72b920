"""The search behind a tiny config: a model class's `__init__` defaults shrunk, key by key, to the smallest values
its architecture accepts, found by trying (tiny.py runs it and checks the result for real).

What is shrunk is read from the signature's names and values, never listed per model: the widths (an int or a
tuple of ints whose name says heads, channels, hidden_size or dim(s)) and the depths (a name that says layers or
blocks; the block stacks' own depth keys are found by `slicing.stack_config_keys`). Patch sizes, VAE factors, rope
thetas, sampling rates and flags keep their defaults: they are not sizes, and the input builders read them.

A trial builds the model on the meta device (no memory), runs its forward on the meta inputs its family's builder
makes, and accepts the config when both work, every attention call's heads divide by `HEADS_MULTIPLE` (the
smallest Ulysses degree) and its head dims by `HEAD_DIM_MULTIPLE` (flash kernels') and, with `plan=True`, the class's `_cp_plan` fits the model (plan_fit.py). Constraints
between keys are discovered, not listed: relations that hold among the defaults (a tuple summing to an int, as
rope axes sum to the head dim; an int equal to another; an int that is the product of two others, as a
cross-attention width is heads x head dim) are kept when one of their keys moves, and a move that fails with them
is tried alone. Every key records why it could go no lower (the trial's own first error line).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from cpdoctor.attempt import Attempt

HEADS_MULTIPLE = 2
"""Attention heads must divide by this (the smallest Ulysses degree), so that a tiny model runs Ulysses 2."""
HEAD_DIM_MULTIPLE = 8
"""Every attention's head dim must divide by this, so that a tiny model runs on every backend cpdoctor examines:
flash-attn 2's mha_fwd/mha_bwd (and aten's vendored copy behind `_native_flash`) refuse a head size that is not a
multiple of 8 (csrc/flash_attn/flash_api.cpp; cpu_kernels/standin_checks.py keeps the same check)."""
WIDTH_FLOOR = 2
"""No width goes below 2: a norm over a single channel is constant, and an examination of a constant learns nothing."""
DEPTH_FLOOR = 1
SMALL = 16
"""Below this every integer is a candidate; above it, the powers of two and halves."""
SCAN = 4
"""The smallest candidates tried one by one; past them the search bisects (most keys take their floor)."""

_WIDTH = re.compile(r"heads|channels|hidden_size|(^|_)dims?(_|$)")
_DEPTH = re.compile(r"layers|blocks|depth")

Config = dict[str, Any]
Value = int | tuple[int, ...]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_int_tuple(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and len(v) > 1 and all(is_int(e) and e >= 1 for e in v)


def size_keys(defaults: Mapping[str, Any], stack_keys: set[str]) -> dict[str, int]:
    """The keys the search shrinks, each with its floor (stack depths are handled apart: depth.py's plan fit)."""
    keys = {}
    for key, value in defaults.items():
        if key in stack_keys or "patch" in key or not (is_int(value) or is_int_tuple(value)):
            continue
        if _DEPTH.search(key) and is_int(value) and value > DEPTH_FLOOR:
            keys[key] = DEPTH_FLOOR
        elif _WIDTH.search(key) and (is_int_tuple(value) or value > WIDTH_FLOOR):
            keys[key] = WIDTH_FLOOR
    return keys


# -- relations among the defaults, kept when a key moves ----------------------------------------------------------


class Tie(enum.Enum):
    """How a relation ties its keys: a tuple's sum, an equality, a product."""

    SUM = "sum"
    EQUAL = "equal"
    PRODUCT = "product"


@dataclasses.dataclass(frozen=True)
class Relation:
    """`total` = sum of `parts` (one tuple key), = one key (equality), or = the product of two keys."""

    total: str
    parts: tuple[str, ...]
    tie: Tie

    def holds(self, cfg: Mapping[str, Any]) -> bool:
        if self.tie is Tie.SUM:
            return sum(cfg[self.parts[0]]) == cfg[self.total]
        product = 1
        for p in self.parts:
            product *= cfg[p]
        return product == cfg[self.total]

    def describe(self) -> str:
        joined = ("sum({})" if self.tie is Tie.SUM else "{}").format(" x ".join(self.parts))
        return f"{self.total} = {joined}"


def relations(defaults: Mapping[str, Any], keys: Mapping[str, int]) -> list[Relation]:
    """The relations that hold among the defaults of the searched keys."""
    ints = {k: defaults[k] for k in keys if is_int(defaults[k])}
    tuples = {k: tuple(defaults[k]) for k in keys if is_int_tuple(defaults[k])}
    found = [Relation(i, (t,), Tie.SUM) for t, tv in tuples.items() for i, iv in ints.items() if sum(tv) == iv]
    for a, b in itertools.combinations(ints, 2):
        if ints[a] == ints[b]:
            found.append(Relation(a, (b,), Tie.EQUAL))
    for total, (a, b) in itertools.product(ints, itertools.combinations(ints, 2)):
        if total not in (a, b) and ints[a] * ints[b] == ints[total] and min(ints[a], ints[b]) > 1:
            found.append(Relation(total, (a, b), Tie.PRODUCT))
    return found


def spread(parts: tuple[int, ...], total: int, floor: int) -> tuple[int, ...] | None:
    """`parts` rescaled to sum to `total`, each at least `floor` and even where every part was (rope axes are
    pairs of channels); None when no such tuple exists."""
    step = 2 if all(p % 2 == 0 for p in parts) else 1
    floor = max(floor, step)
    if total % step or total < floor * len(parts):
        return None
    out = [max(floor, round(total * p / sum(parts) / step) * step) for p in parts]
    while sum(out) != total:
        grow = sum(out) < total
        order = sorted(range(len(out)), key=lambda i: out[i], reverse=True)
        i = next((i for i in order if grow or out[i] - step >= floor), None)
        if i is None:
            return None
        out[i] += step if grow else -step
    return tuple(out)


def follow(cfg: Config, key: str, value: Value, rels: list[Relation], floors: Mapping[str, int]) -> Config | None:
    """`cfg` with `key` set to `value` and every relation that holds in `cfg` and involves `key` kept; None when
    one cannot be kept (a tuple that cannot sum to the new value)."""
    new = {**cfg, key: value}
    for rel in rels:
        if not rel.holds(cfg):
            continue
        if rel.tie is Tie.SUM and key == rel.total:
            parts = spread(tuple(cfg[rel.parts[0]]), int(value), floors.get(rel.parts[0], WIDTH_FLOOR))  # type: ignore[arg-type]
            if parts is None:
                return None
            new[rel.parts[0]] = parts
        elif rel.tie is Tie.SUM and key in rel.parts:
            new[rel.total] = sum(value)  # type: ignore[arg-type]
        elif rel.tie is Tie.EQUAL and key in (rel.total, *rel.parts):
            new[rel.parts[0] if key == rel.total else rel.total] = value
        elif rel.tie is Tie.PRODUCT and key in rel.parts:
            other = rel.parts[1] if key == rel.parts[0] else rel.parts[0]
            new[rel.total] = int(value) * int(cfg[other])  # type: ignore[arg-type]
    return new


def candidates(value: Value, floor: int) -> Iterator[Value]:
    """Smaller values than `value`, smallest first: every int up to SMALL, then powers of two and halves."""
    if is_int_tuple(value):
        parts = tuple(value)  # type: ignore[arg-type]
        for total in candidates(sum(parts), floor * len(parts)):
            got = spread(parts, int(total), floor)  # type: ignore[arg-type]
            if got is not None and got != parts:
                yield got
        return
    v = int(value)  # type: ignore[arg-type]
    small = range(floor, min(v, SMALL + 1))
    powers = [2**p for p in range(5, v.bit_length() + 1) if SMALL < 2**p < v]
    yield from sorted({*small, *powers, *([v // 2] if v // 2 >= floor else [])} - {v})


# -- the search --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Shrinking:
    """The state of one shrinking search: the config so far, its cost, the relations, each key's reason for stopping."""

    trial: Callable[[Config], tuple[int | None, str | None]]  # config -> (cost, None) or (None, why it fails)
    config: Config
    floors: dict[str, int]
    rels: list[Relation]
    cost: int = 0
    trials: int = 0
    stopped: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> why it went no lower
    seen: dict[tuple, tuple[int | None, str | None]] = dataclasses.field(default_factory=dict)  # config -> its trial
    last_why: str = ""

    def attempt(self, cfg: Config) -> tuple[int | None, str | None]:
        """The trial of `cfg` (each config tried once: a later pass asks again only where something moved)."""
        key = _frozen(cfg)
        if key not in self.seen:
            self.trials += 1
            tried = Attempt.of(lambda: self.trial(cfg))
            self.seen[key] = tried.value if tried.ok else (None, tried.why(limit=200))  # type: ignore[assignment]
        return self.seen[key]

    def lower(self, key: str) -> bool:
        """Move `key` (with the keys its relations tie to it) to its smallest accepted candidate; True when it moved.
        The SCAN smallest candidates are tried in order, the rest bisected (the current value is known to work)."""
        product = next((r for r in self.rels if r.tie is Tie.PRODUCT and r.total == key and r.holds(self.config)), None)
        if product is not None:  # it follows its factors (it cannot move alone and keep their product)
            self.stopped[key] = f"follows {product.describe()}"
            return False
        values = list(candidates(self.config[key], self.floors[key]))
        self.last_why = f"the floor ({self.floors[key]})"
        found = next((got for got in (self.moved(key, v) for v in values[:SCAN]) if got), None)
        rest = values[SCAN:]
        low, high = -1, len(rest)  # rest[low] fails, rest[high] works (the current value, past the end)
        while found is None and high - low > 1:
            mid = (low + high) // 2
            got = self.moved(key, rest[mid])
            if got:
                high, best = mid, got
            else:
                low = mid
            if high - low <= 1 and high < len(rest):
                found = best
        if found is None:
            self.stopped[key] = self.last_why
            return False
        self.config, self.cost = found
        return True

    def moved(self, key: str, value: Value) -> tuple[Config, int] | None:
        """The config with `key` at `value` and its cost, when the trial accepts it and it is cheaper; else None
        (and `last_why` says why)."""
        cfg = follow(self.config, key, value, self.rels, self.floors)
        if cfg is None:
            self.last_why = f"{_show(value)} fails: {self.unkept(key)}"
            return None
        cost, why = self.attempt(cfg)
        if cost is not None and cost < self.cost:
            return cfg, cost
        self.last_why = f"{_show(value)} fails: {why or 'no fewer parameters'}"
        return None

    def unkept(self, key: str) -> str:
        rels = [r.describe() for r in self.rels if r.tie is Tie.SUM and r.total == key and r.holds(self.config)]
        return f"{' and '.join(rels)} cannot hold (parts of at least {self.floors[key]}, even where they were)"

    def required(self, rel: Relation) -> bool:
        """Whether the architecture needs `rel`: moving any one of its keys alone (halved) fails a trial. A relation
        the defaults only happen to meet (Flux2's in_channels 128 = the sum of its rope axes, LTX-2's in_channels
        128 = its head dim) has a key that moves alone, and is dropped."""
        for key in (rel.total, *rel.parts):
            value = self.config[key]
            half = spread(tuple(value), sum(value) // 2, 1) if is_int_tuple(value) else int(value) // 2
            if not half or self.attempt({**self.config, key: half})[0] is not None:
                return False
        return True

    def run(self, passes: int = 4) -> Config:
        cost, why = self.attempt(self.config)
        if cost is None:
            raise ValueError(f"the class's defaults themselves fail: {why}")
        self.cost = cost
        self.rels = [r for r in self.rels if self.required(r)]
        for _ in range(passes):
            if not [key for key in self.floors if self.lower(key)]:
                break
        return self.config


def _frozen(cfg: Config) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in cfg.items())


def _show(value: Value) -> str:
    return str(tuple(value)) if is_int_tuple(value) else str(value)
