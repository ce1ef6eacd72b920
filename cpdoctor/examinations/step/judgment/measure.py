"""Numbers only: the relations between CP peers and between the watched step and its one-process reference,
from which the rules (judge.py) read the cause. Nothing here names a fault; it measures:

- which inputs differ between peers (bitwise), or with two runs which are not what the run without CP fed the model
  (equal, or this rank's shard of it), and on which ranks (inputs.py);
- what the peers' output gradients are, per forward (`OutGrad`): the same on every peer (one loss on the gathered
  output), each confined to its own shard (a per-shard loss), or different otherwise (with two runs, none differs
  where each peer's is the run without CP's or its shard of it);
- the RNG states before and after the step, grouped;
- each rank's parameter gradients against the expected ones (relative error, the best constant factor and what
  is left after it), the spread between peers, and whether summing the peers gives the expected gradient;
- the model's output against the reference (the forward), and the per-parameter errors in the model's order.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.judgment.inputs import InputDiff, InputsJudged, input_diffs
from cpdoctor.examinations.step.watcher.group import StepGroup
from cpdoctor.examinations.step.watcher.messages import PeerRecord
from cpdoctor.vocabulary import DType


class OutGrad(str, enum.Enum):
    """What the CP peers' output gradients of one forward are: it decides what a mean on the loss means (factors.py)."""

    REPLICATED = "replicated"
    """The same on every peer (within the step's tolerance): one loss on the gathered output."""
    PER_SHARD = "per-shard"
    """Each peer's vanishes outside its own shard of the gathered output: a per-shard loss."""
    DIFFER = "differ"
    """Neither: the peers computed different losses."""


@dataclass(frozen=True)
class RankGrad:
    """One rank's parameter gradients (after the user's sync) against the expected ones."""

    rank: int
    rel_err: float
    max_abs: float
    nonfinite: int
    factor: float
    """The constant c that brings the expected gradients closest to this rank's (least squares)."""
    residual: float
    """The relative error left after that factor: ~0 when the gradients are exactly c × the expected ones."""


@dataclass(frozen=True)
class ParamError:
    """One parameter's gradient on the group's first rank against the expected one."""

    name: str
    rel_err: float
    numel: int
    max_abs: float = float("nan")


@dataclass(frozen=True)
class StepNumbers:
    """Everything measured for one CP group's step."""

    ranks: tuple[int, ...]
    """The CP group's global ranks (the first one measured)."""
    ring: int
    ulysses: int
    dp: int
    """How many CP groups the world holds (the data-parallel degree the expected gradient averages over)."""
    dtype: str
    forwards: tuple[int, ...]
    backwards: tuple[int, ...]
    inputs_differ: tuple[InputDiff, ...]
    rng_before_groups: tuple[tuple[int, ...], ...]
    rng_after_groups: tuple[tuple[int, ...], ...]
    out_grad_spread: float
    """Largest relative difference of a peer's output gradient from the first rank's (0 when identical)."""
    out_grad_differ: tuple[int, ...]
    out_rel_err: float
    """The model's output on the first rank against the reference forward."""
    out_max_abs: float
    grads: tuple[RankGrad, ...]
    peer_spread: float
    """Largest relative difference between a peer's gradients and the first rank's, after the sync."""
    sum_rel_err: float
    """Relative error of the peers' gradients summed over the CP group against the expected ones."""
    params: tuple[ParamError, ...]
    missing_grads: tuple[str, ...] = ()
    own_rel_err: float | None = None
    """The first rank's gradients against its own CP group's reference alone (None at dp 1): ~0 when the
    data-parallel averaging is what is missing."""
    reference: str = "one fp64 process recomputing the recorded step"
    recomputed: bool = True
    """Whether the expected gradients were recomputed from the recorded output gradient (one run), or are the
    final gradients of the same code run without CP (two runs: nothing to interpret)."""
    out_numel: int = 0
    params_scaled: tuple[ParamError, ...] = ()
    """Each parameter's error against the expected gradients times the worst rank's best factor."""
    baseline_rel_err: float | None = None
    """The same step without CP in the step's own dtypes (bf16/fp16) against the fp64 reference: the rounding
    a correct CP step may show on top (None for fp32 steps: the fixed tolerance holds there)."""
    param_baselines: tuple[float, ...] = ()
    """That baseline per parameter, in `params` order."""
    inputs_judged: InputsJudged | None = None
    """Two runs: the inputs against the run without CP (what each is; `inputs_differ` are its wrong ones)."""
    out_grads: tuple[OutGrad, ...] = ()
    """What the peers' output gradients are, per forward."""
    own_residual: float | None = None
    """What is left of the first rank's gradients after the best factor against its own CP group's reference alone
    (None at dp 1): ~0 when each replica holds a multiple of its own data's gradient (no data-parallel averaging)."""

    @property
    def out_grad_own_shard(self) -> bool:
        """Every forward's output gradients are each peer's own shard (a per-shard loss)."""
        return bool(self.out_grads) and all(g is OutGrad.PER_SHARD for g in self.out_grads)

    @property
    def losses_differ(self) -> bool:
        """Some forward's output gradients differ between the peers, and not as a per-shard loss's."""
        return OutGrad.DIFFER in self.out_grads

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    @property
    def world_size(self) -> int:
        return self.cp * self.dp


CHUNK = 1 << 22
"""Elements per slice: a real model's flat gradient (0.4 B elements for one FLUX.1-dev block) is never copied
whole; each slice's products are float32 BLAS dots (relative rounding ~1e-6 of the quantity itself, far below
what is judged) summed in Python floats. A whole-vector float64 copy of one block cost 9 s here, the slices 0.3 s."""


@dataclass(frozen=True)
class Dots:
    """One pass over x and ref: ‖x − c·ref‖², ‖ref‖², x·ref, max |x − c·ref|."""

    d2: float
    r2: float
    xr: float
    max_abs: float
    nonfinite: int = 0
    """Non-finite elements of x (counted only when the sums say there are some)."""


def dots(x: Any, ref: Any, c: float = 1.0) -> Dots:
    import torch

    d2 = r2 = xr = worst = 0.0
    nonfinite = 0
    x, ref = x.reshape(-1), ref.reshape(-1)
    buf = torch.empty(min(CHUNK, x.numel()))  # one slice's difference, reused: a fresh 16 MB each slice is page faults
    for i in range(0, x.numel(), CHUNK):
        a, b = x[i : i + CHUNK].float(), ref[i : i + CHUNK].float()
        diff = torch.sub(a, b, alpha=c, out=buf[: a.numel()])
        d2 += float(torch.dot(diff, diff))
        r2 += float(torch.dot(b, b))
        xr += float(torch.dot(a, b))
        if diff.numel():
            worst = max(worst, float(diff.abs().max()))
        if not math.isfinite(d2) and not nonfinite:  # counted only where one is (isfinite over 0.4 B elements: 10 s)
            nonfinite = -1
    if nonfinite:
        nonfinite = int((~torch.isfinite(x)).sum())
    return Dots(d2, r2, xr, worst, nonfinite)


def rel(x: Any, ref: Any) -> float:
    """Relative L2 error of x against ref (the absolute norm when ref is zero)."""
    d = dots(x, ref)
    return d.d2**0.5 / d.r2**0.5 if d.r2 > 0 else d.d2**0.5


def best_factor(x: Any, ref: Any, first: Dots | None = None) -> tuple[float, float]:
    """(c, residual): the least-squares c with x ≈ c·ref, and the relative error left after it."""
    d = first or dots(x, ref)
    if d.r2 == 0:
        return 0.0, float("inf")
    c = d.xr / d.r2
    if c == 0:
        return c, float("inf")
    return c, dots(x, ref, c).d2 ** 0.5 / (abs(c) * d.r2**0.5)


def groups_of(values: list[str], ranks: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The ranks grouped by equal value, the first rank's group first."""
    order: dict[str, list[int]] = {}
    for v, r in zip(values, ranks):
        order.setdefault(v, []).append(r)
    return tuple(tuple(g) for g in order.values())


def own_shard_only(grads: list[Any], dim: int) -> bool:
    """Each peer's output gradient vanishes outside its own chunk along the gather dimension (and not inside)."""
    n = len(grads)
    if n < 2 or any(g is None for g in grads) or grads[0].dim() <= dim or grads[0].shape[dim] % n:
        return False
    for i, g in enumerate(grads):
        chunks = g.chunk(n, dim=dim)
        if float(chunks[i].abs().sum()) == 0 or any(float(c.abs().sum()) != 0 for j, c in enumerate(chunks) if j != i):
            return False
    return True


def out_grad_shapes(records: list[PeerRecord], dim: int, dtype: str) -> tuple[OutGrad, ...]:
    """What the peers' output gradients are, per forward (a forward no peer back-propagated counts as replicated),
    equal within the step's dtype's tolerance."""
    tol = DType(dtype).grad_tolerance if dtype in DType.names() else DType.FP32.grad_tolerance
    shapes = []
    for k in range(len(records[0].out_grads)):
        grads = [r.out_grads[k] if k < len(r.out_grads) else None for r in records]
        if all(g is None for g in grads):
            shapes.append(OutGrad.REPLICATED)
        elif any(g is None for g in grads):
            shapes.append(OutGrad.DIFFER)
        elif all(rel(g, grads[0]) <= tol for g in grads[1:]):
            shapes.append(OutGrad.REPLICATED)
        else:
            shapes.append(OutGrad.PER_SHARD if own_shard_only(grads, dim) else OutGrad.DIFFER)
    return tuple(shapes)


def reference_out_grads(records: list[PeerRecord], dim: int) -> list[Any]:
    """The output gradient the reference back-propagates for each forward: the peers' common one (their mean,
    which is it when they agree); when each peer's is confined to its own shard (a per-shard loss), their sum:
    the gradient of the sum of the shards' losses, which is what summing the peers' gradients computes."""
    out = []
    for k in range(len(records[0].out_grads)):
        grads = [r.out_grads[k] for r in records if k < len(r.out_grads) and r.out_grads[k] is not None]
        if not grads:
            out.append(None)
            continue
        total = sum(grads[1:], grads[0].double())
        out.append(total if own_shard_only(grads, dim) else total / len(grads))
    return out


def output_grad_spread(records: list[PeerRecord]) -> tuple[float, list[int]]:
    """How far each peer's output gradient is from the first rank's (the largest), and the peers that differ."""
    first_g = records[0].out_grad
    spread, differ = 0.0, []
    for r in records[1:]:
        e = rel(r.out_grad, first_g) if r.out_grad is not None and first_g is not None else float("inf")
        if e != 0:
            differ.append(r.rank)
        spread = max(spread, e)
    return spread, differ


def rank_grad(rank: int, g: Any, expected: Any) -> RankGrad:
    """One rank's flat gradient against the expected one: error, max abs, non-finite, best factor and residual
    (two passes over the vectors)."""

    d = dots(g, expected)
    c, resid = best_factor(g, expected, d)
    err = d.d2**0.5 / d.r2**0.5 if d.r2 > 0 else d.d2**0.5
    return RankGrad(rank, err, d.max_abs, d.nonfinite, c, resid)


def param_errors(first: Any, expected: Any, names: list[str], numels: list[int], c: float = 1.0) -> list[ParamError]:
    """Each parameter's error in the first rank's flat gradient (the slices of `names` / `numels`, in order)."""
    params, offset = [], 0
    for name, n in zip(names, numels):
        d = dots(first[offset : offset + n], expected[offset : offset + n], c)
        norm = abs(c) * d.r2**0.5
        params.append(ParamError(name, d.d2**0.5 / norm if norm > 0 else d.d2**0.5, n, d.max_abs))
        offset += n
    return params


@dataclass(frozen=True)
class Against:
    """What a CP group's numbers are measured against: the baseline's results (baseline.py, after `expected`)."""

    ref_out: Any
    """The baseline's output (None: two runs keep none)."""
    expected: Any
    """The flat parameter gradient a correct step ends with (the mean of every CP group's baseline)."""
    own: Any
    """This CP group's baseline alone."""
    param_names: list[str]
    param_numels: list[int]
    reference: str = "one fp64 process recomputing the recorded step"
    recomputed: bool = True
    native: Any = None
    """The gradient recomputed at the step's own precision and backend (None: not recomputed)."""
    judged: InputsJudged | None = None
    """Two runs: the inputs and output gradients against the run without CP."""


def measure(
    records: list[PeerRecord], group: StepGroup, against: Against, *, dtype: str, gather_dim: int, out: Any, out_numel: int
) -> StepNumbers:
    """The numbers of one CP group: `records` in group order (the first rank's first), `out` the first rank's
    output. With two runs, where every peer's output gradient is that run's or its shard of it (`against.judged`),
    the peers' are not compared with each other."""

    a = against
    ref_out, expected, own, param_names, param_numels = a.ref_out, a.expected, a.own, a.param_names, a.param_numels
    judged, native, recomputed, dp = a.judged, a.native, a.recomputed, group.dp
    ranks = tuple(r.rank for r in records)
    right = judged is not None and judged.out_grads_right
    spread, differ = (0.0, []) if right else output_grad_spread(records)
    shapes = tuple(OutGrad.REPLICATED for _ in records[0].out_grads) if right else out_grad_shapes(records, gather_dim, dtype)
    gradients = gradient_relations(records, expected, param_names, param_numels)
    first = records[0].grads
    baselines = param_errors(native, own, param_names, param_numels) if native is not None and own is not None else []
    return StepNumbers(
        ranks=ranks,
        ring=group.ring,
        ulysses=group.ulysses,
        dp=dp,
        dtype=dtype,
        forwards=tuple(r.forwards for r in records),
        backwards=tuple(r.backwards for r in records),
        inputs_differ=judged.diffs if judged is not None else input_diffs(records),
        inputs_judged=judged,
        rng_before_groups=groups_of([r.rng_before for r in records], ranks),
        rng_after_groups=groups_of([r.rng_after for r in records], ranks),
        out_grad_spread=spread,
        out_grad_differ=tuple(differ),
        out_grads=shapes,
        out_rel_err=rel(out, ref_out) if out is not None and ref_out is not None else float("nan"),
        out_max_abs=dots(out, ref_out).max_abs if out is not None and ref_out is not None else float("nan"),
        missing_grads=tuple(sorted({m for r in records for m in r.missing_grads})),
        own_rel_err=rel(first, own) if own is not None and dp > 1 and recomputed else None,
        own_residual=best_factor(first, own)[1] if own is not None and dp > 1 and recomputed else None,
        reference=a.reference,
        recomputed=recomputed,
        out_numel=out_numel,
        baseline_rel_err=rel(native, own) if baselines else None,
        param_baselines=tuple(p.rel_err for p in baselines),
        **gradients,
    )


def gradient_relations(records: list[PeerRecord], expected: Any, names: list[str], numels: list[int]) -> dict[str, Any]:
    """Each rank's final gradients against the expected ones, the peers against each other and summed, and each
    parameter on the first rank (raw, and after the worst rank's best factor)."""
    mine = [r.grads for r in records]  # float32, compared slice by slice
    grads = [rank_grad(r.rank, g, expected) for r, g in zip(records, mine)]
    first = mine[0]
    params = param_errors(first, expected, names, numels)
    worst = max(grads, key=lambda g: g.rel_err)
    scaled = param_errors(first, expected, names, numels, worst.factor) if worst.factor and worst.factor != 1.0 else params
    return {
        "grads": tuple(grads),
        "peer_spread": max((rel(g, first) for g in mine[1:]), default=0.0),
        "sum_rel_err": rel(sum(mine[1:], first.clone()), expected),
        "params": tuple(params),
        "params_scaled": tuple(scaled),
    }
