"""What the ranks of a watched step tell each other, as typed messages: through the process group's store before any
collective (`Arrival`, `Decision`, `ReferenceOutcome`), and to the CP group's first rank once they agreed to go on
(`PeerRecord`). No sentinel strings, no tuples read by position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.judgment.input_layouts import InputLayout
from cpdoctor.examinations.step.watcher.events import Event
from cpdoctor.report import Finding


@dataclass(frozen=True)
class Arrival:
    """A rank reached the end of the watched block: which step, how many forwards and backwards it saw, and the
    traceback when the step raised there."""

    rank: int
    index: int
    forwards: int
    backwards: int
    error: str | None = None


@dataclass(frozen=True)
class Decision:
    """A rank's word after everyone's arrival: the findings that stop the examination (empty: go on)."""

    stop: tuple[Finding, ...] = ()

    @property
    def goes_on(self) -> bool:
        return not self.stop


@dataclass(frozen=True)
class ReferenceOutcome:
    """A CP group leader's word once its reference ran: the traceback when it raised, the memory plan's refusal
    when it did not fit (neither: done)."""

    failed: str | None = None
    refused: str | None = None


@dataclass(frozen=True)
class InputPrint:
    """One input of the forward on one rank: its fingerprint and (for a tensor) its float64 norm."""

    name: str
    digest: str
    norm: float | None


@dataclass(frozen=True)
class ReplicaLayouts:
    """What one CP rank's inputs and output gradients are against one rank of the run without CP (two runs; each
    rank classifies its own, input_layouts.classify_all): replicated, its shard, or wrong."""

    replica: int
    """The rank of the run without CP compared with."""
    inputs: tuple[InputLayout, ...]
    out_grads: tuple[InputLayout, ...]
    """The gradient that flowed into each forward's output, equal within the step's tolerance (torchtitan's output
    stays sharded: each CP rank's is its shard of the run without CP's)."""

    @property
    def inputs_right(self) -> bool:
        return all(x.right for x in self.inputs)


@dataclass
class PeerRecord:
    """What one rank sends to its CP group's first rank (small, apart from the output and parameter gradients)."""

    rank: int
    forwards: int
    backwards: int
    inputs: tuple[InputPrint, ...]
    rng_before: str
    rng_after: str
    out_grads: tuple[Any, ...]
    """The gradient that flowed into the model's (gathered) output, per forward, CPU float32 (None: no backward)."""
    grads: Any
    """Every parameter gradient as compared (before clipping), flattened in `param_names` order, CPU float32."""
    missing_grads: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    """What this rank saw happen to its gradients (observe.py)."""
    layouts: tuple[ReplicaLayouts, ...] = ()
    """Two runs: this rank's inputs and output gradients against each rank of the run without CP (empty: one run)."""

    @property
    def out_grad(self) -> Any:
        """Every forward's output gradient, flattened into one vector (what peers are compared on)."""
        import torch

        got = [g.reshape(-1) for g in self.out_grads if g is not None]
        return torch.cat(got) if got else None
