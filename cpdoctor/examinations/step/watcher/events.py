"""What a watched step did to its gradients, as typed events: one per call of a public entry point the watcher
wraps while a watch is open (observe.py), plus what the backward roots' autograd graphs say (loss_graph.py).

The judge reads these instead of guessing from numbers: the constants on the path from the loss to the model's
output, the GradScaler's scale and whether it unscaled or skipped the step, the clip (its pre-clip norm and the
coefficient it applied), and every reduction of the gradients (its op and the ranks of its group). What the
watcher knows it could not see is an `Unobserved` event with the reason; the judge says it.

Numbers and words only (no tensors): events travel to the CP group's first rank with the rest of a rank's record."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Source(str, enum.Enum):
    """Where a factor on the loss comes from."""

    CONSTANT = "constant"  # a Python number or a 0-dim / 1-element tensor on the loss (`loss * cp`, `/ accum`)
    MEAN = "mean"  # a mean reduction: 1/count
    SCALER = "scaler"  # GradScaler.scale's multiplication
    ACCELERATE = "accelerate"  # Accelerator.backward's division by gradient_accumulation_steps
    GRADIENT = "gradient"  # the gradient passed to backward(gradient=...)


@dataclass(frozen=True)
class LossFactor:
    """One linear factor on the loss, read from one node of the autograd graph (its value as it multiplies)."""

    value: float
    source: Source
    count: int | None = None
    """The elements a mean averaged over (MEAN only)."""
    place: int = 0
    """Where on its term it sits (0: next to the root): the same number at the same place of every term and every
    micro-batch's root is one line of the step's code, read one way."""


@dataclass(frozen=True)
class LossTerm:
    """One path from a backward root to a model output: the linear factors on it, root first, up to the first
    node that is not a linear scalar operation (the loss's own math: a square, a weighting by a tensor)."""

    factors: tuple[LossFactor, ...] = ()
    output: int = 0
    """Which recorded forward's output the path reaches (0-based)."""


@dataclass(frozen=True)
class BackwardRoot:
    """A tensor `backward()` was called on, read before the backward freed its graph."""

    terms: tuple[LossTerm, ...] = ()
    hidden: tuple[str, ...] = ()
    """Nodes on a term's linear part whose constants cannot be read (a compiled loss, a custom autograd Function)."""
    param_paths: int = 0
    """Paths that reach the model's trainable parameters without passing through its output (a regulariser on
    the weights): the recomputation back-propagates the output gradient only, so their gradient is not in it."""

    @property
    def reaches_output(self) -> bool:
        return bool(self.terms)


class Op(str, enum.Enum):
    """A reduction's op, as torch.distributed names it."""

    SUM = "sum"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"
    OTHER = "other"


@dataclass(frozen=True)
class Collective:
    """A reduction the step's code called through torch.distributed (all_reduce, reduce_scatter_tensor, their
    coalesced and list forms, reduce) while the watch was open."""

    call: str
    op: Op
    ranks: tuple[int, ...]
    on_gradients: bool
    """Whether its tensor is (one of) the watched model's parameter gradients."""
    param: int | None = None
    """The index of the trainable parameter whose gradient it reduced (the first, for a list)."""
    during_backward: bool = False


@dataclass(frozen=True)
class DDPReduce:
    """DistributedDataParallel around the watched model: its reducer sums the gradients over its process group and
    divides by the group's size (no comm hook), inside backward."""

    ranks: tuple[int, ...]
    comm_hook: str | None = None
    """The registered comm hook's name: it replaces the averaging, which the watcher then cannot see."""
    synced: bool = True
    """False under `no_sync()`: this backward does not reduce."""


@dataclass(frozen=True)
class FSDPReduce:
    """FSDP2's reduction of the watched model's gradients (fully_shard): a reduce-scatter over its shard group (an
    all-reduce over the replicate group for HSDP), divided by `divide_factor` (the groups' size by default)."""

    ranks: tuple[int, ...]
    divide_factor: float


@dataclass(frozen=True)
class ScalerScale:
    """GradScaler.scale(loss): the loss multiplied by `scale`."""

    scale: float


@dataclass(frozen=True)
class ScalerUnscale:
    """GradScaler.unscale_(optimizer): the gradients divided by `scale`; `found_inf` when any was inf/NaN (the
    scaler then skips `optimizer.step()`); None when the scaler's record could not be read."""

    scale: float
    found_inf: bool | None


@dataclass(frozen=True)
class ScalerStep:
    """GradScaler.step(optimizer): `skipped` when it did not call optimizer.step() (inf/NaN found)."""

    skipped: bool


@dataclass(frozen=True)
class ScalerUpdate:
    scale: float


@dataclass(frozen=True)
class ClipNorm:
    """A clip by the total norm (torch's clip_grad_norm_ / clip_grads_with_norm_, accelerate's, FSDP's): the
    pre-clip total norm, max_norm, and the coefficient the gradients were multiplied by (1 when inactive)."""

    max_norm: float
    total_norm: float
    coefficient: float
    norm_type: float = 2.0
    params: int = 0
    """How many of the watched model's trainable parameters it clipped (its coefficient is divided out of those only)."""

    @property
    def active(self) -> bool:
        return self.coefficient < 1.0


@dataclass(frozen=True)
class ClipValue:
    """clip_grad_value_: every gradient element clamped to ±clip_value (not a uniform scale)."""

    clip_value: float


@dataclass(frozen=True)
class GradScale:
    """The step's own code scaled the gradients between two moments the watcher saw (`p.grad /= dp` after a sum
    over the data-parallel ranks, a manual unscaling or clip): measured on a few elements of one gradient before
    and after, a uniform factor."""

    factor: float
    between: str


@dataclass(frozen=True)
class InnerStep:
    """An optimizer stepped inside backward (a post-accumulate-grad hook): `params` of the watched model's trainable
    parameters, each compared as its step found it; it neither ends the watched step nor narrows the comparison."""

    params: int


@dataclass(frozen=True)
class AccelerateBackward:
    """Accelerator.backward(loss): the loss divided by gradient_accumulation_steps before its backward."""

    accumulation_steps: int


@dataclass(frozen=True)
class Unobserved:
    """Something the step did to its gradients that the watcher could not read, and why."""

    what: str


Event = (
    BackwardRoot
    | Collective
    | DDPReduce
    | FSDPReduce
    | ScalerScale
    | ScalerUnscale
    | ScalerStep
    | ScalerUpdate
    | ClipNorm
    | ClipValue
    | GradScale
    | InnerStep
    | AccelerateBackward
    | Unobserved
)


@dataclass
class EventLog:
    """One rank's events of one watched step, in the order they happened."""

    events: list[Event] = field(default_factory=list)

    def add(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def roots(self) -> list[BackwardRoot]:
        return self.of(BackwardRoot)

    @property
    def clips(self) -> list[ClipNorm]:
        """The norm clips that touched the watched model's gradients."""
        return self.of(ClipNorm)

    @property
    def value_clipped(self) -> bool:
        return bool(self.of(ClipValue))

    @property
    def scale(self) -> float | None:
        """The GradScaler's scale on the loss (the last one used), None without a GradScaler."""
        scales = self.of(ScalerScale)
        return scales[-1].scale if scales else None

    @property
    def unscaled_by(self) -> float | None:
        """The scale the gradients were divided by (GradScaler.unscale_), None when they were not."""
        unscales = self.of(ScalerUnscale)
        return unscales[-1].scale if unscales else None

    @property
    def found_inf(self) -> bool:
        return any(e.found_inf for e in self.of(ScalerUnscale)) or any(e.skipped for e in self.of(ScalerStep))

    @property
    def unobserved(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.what for e in self.of(Unobserved)))
