"""What a watched CP step's final gradients are compared with: the gradients one process computes for the same
step. Two sources, one interface (`Baseline`):

- `OneProcessReference` (`watch_step`, `preflight(model=...)`: one run only): each CP group's first rank
  recomputes the step in one fp64 process from the recorded inputs and output gradients (reference.py); the
  groups' results are averaged over the data-parallel groups. The output gradient already carries whatever the
  user's code scaled the loss by; the judge reads those factors from the autograd graph (loss_graph.py).
- `RecordedRun` (`cpdoctor step` with a function that takes its degrees): the same user code ran before without
  CP (one process, or dp processes) and left its final gradients on disk (`SavedRun`); nothing is recomputed
  or guessed, so loss scaling, clipping, accumulation, adapters and wrappers are the user's own in both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

from cpdoctor.examinations.step.group import StepGroup
from cpdoctor.examinations.step.measure import reference_out_grads
from cpdoctor.examinations.step.messages import PeerRecord
from cpdoctor.examinations.step.record import Recorded
from cpdoctor.model_zoo import memory
from cpdoctor.vocabulary import DType


class Baseline(Protocol):
    name: str
    needs_inputs: bool
    """Whether the CP group's first rank must keep the model's inputs and weights (to recompute the step)."""
    needs_weights_digest: bool
    """Whether the watch fingerprints the weights it starts from (two runs: the same weights in both?)."""
    ref_output: Any

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        """On a CP group's first rank: this group's flat expected gradient (float32, in `names` order)."""

    def combine(self, own: Any, n_groups: int) -> Any:
        """On every rank (a collective where needed): the gradient a correct step ends with everywhere."""

    def output(self, hooks: Any) -> Any:
        """The watched step's output to compare with `ref_output` (None when there is none)."""

    def unmatched(self) -> bool:
        """Whether the baseline holds no run of this CP group's inputs and weights (two runs: nothing to compare)."""


class OneProcessReference:
    """The step recomputed in one process from what the CP group's first rank recorded."""

    needs_inputs = True
    needs_weights_digest = False

    def __init__(self, precision: str = "fp64") -> None:
        self.precision = precision
        self.native: Any = None
        self.plan: Any = None
        self.name = f"one {precision} process recomputing the recorded step"
        self.ref_output: Any = None

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        from cpdoctor.compat import parallel_config as compat
        from cpdoctor.examinations.step.reference import Precision, ReferenceTooLarge, reference_plan, reference_step

        hooks = recorded.hooks
        out_grads = reference_out_grads(records, compat.output_gather_dim(recorded.module))
        calls = [(f.args, f.kwargs, g) for f, g in zip(hooks.calls, out_grads)]
        device = recorded.device if str(recorded.device) != "meta" else "cpu"
        low = DType(recorded.dtype).is_half
        native = Precision(*hooks.autocast, compat.attention_backend_of(recorded.module)) if low else None
        trainable = int(records[0].grads.numel())
        peers = len(records)
        self.plan = reference_plan(hooks.weights, trainable, self.precision, native is not None, memory.available_memory(device), peers)
        if not self.plan.fits:
            half = reference_plan(hooks.weights, trainable, "fp32", False, self.plan.available, peers)
            fits = "watch_step(model, reference='fp32') fits" if half.fits else "an fp32 reference does not fit either"
            raise ReferenceTooLarge(
                self.plan,
                f"{fits}; `cpdoctor step path/train.py:fn --ring R` with a function that takes its degrees needs no copy "
                "(two runs); `cpdoctor model MODEL --blocks N` slices a checkpoint to the blocks that fit",
            )
        result = reference_step(recorded.module, hooks.weights, calls, names, self.precision, device, native)
        self.ref_output = result.outputs[0] if result.outputs else None
        self.native = result.native
        return result.grads

    def combine(self, own: Any, n_groups: int) -> Any:
        from cpdoctor.launch import watcher_comm

        if n_groups == 1:  # the world is this CP group: its reference is the expected gradient (every rank knows it)
            return own
        total = watcher_comm.sum_over_world(own)
        total /= n_groups  # in place: a fresh copy of a real model's gradient costs seconds of page faults
        return total

    def output(self, hooks: Any) -> Any:
        return hooks.calls[0].output if hooks.calls else None

    def unmatched(self) -> bool:
        return False


# ----------------------------------------------------------------------------------------------------------
# Two runs: the same function without CP first, its final gradients on disk
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SavedStep:
    """Where one rank of the run without CP left one watched step: its gradients (safetensors, canonical names)
    and the fingerprints of the model's first inputs (to find the replica a CP group matches)."""

    directory: str
    rank: int
    index: int

    @property
    def tensors(self) -> str:
        return os.path.join(self.directory, f"step{self.index}-rank{self.rank}.safetensors")

    @property
    def meta(self) -> str:
        return os.path.join(self.directory, f"step{self.index}-rank{self.rank}.json")


def save_step(
    directory: str, rank: int, index: int, grads: dict[str, Any], prints: list[tuple[str, str]], dtype: str, weights: str
) -> None:
    """Write one rank's final gradients of one watched step of the run without CP."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    where = SavedStep(directory, rank, index)
    save_file({n: g.detach().float().cpu().contiguous() for n, g in grads.items()}, where.tensors)
    with open(where.meta, "w", encoding="utf-8") as fh:
        json.dump({"prints": prints, "dtype": dtype, "names": list(grads), "weights": weights}, fh)


class RecordedRun:
    """The final gradients of the same step run without CP (`cpdoctor step`'s first launch)."""

    needs_inputs = False
    needs_weights_digest = True
    ref_output = None
    name = "the same step run without CP"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.matched: int | None = None
        """The rank of the run without CP whose inputs this CP group fed (None: matched by group order)."""

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        import torch
        from safetensors import safe_open

        mine = [(p.name, p.digest) for p in records[0].inputs]
        saved = sorted(
            (
                int(f.split("rank")[1].split(".")[0])
                for f in os.listdir(self.directory)
                if f.startswith(f"step{group.seq}-") and f.endswith(".json")
            ),
        )
        if not saved:
            raise RuntimeError(f"the run without CP left no gradients for watched step {group.seq} in {self.directory}")
        choice = None
        for rank in saved:
            with open(SavedStep(self.directory, rank, group.seq).meta, encoding="utf-8") as fh:
                meta = json.load(fh)
            if [tuple(p) for p in meta["prints"]] == mine and meta.get("weights") == recorded.weights_digest:
                choice = rank
                break
        self.matched = choice
        if choice is None:
            choice = saved[group.group_number % len(saved)]
        parts = []
        with safe_open(SavedStep(self.directory, choice, group.seq).tensors, "pt") as fh:
            keys = set(fh.keys())
            lacking = [n for n in names if n not in keys]
            if lacking:
                raise RuntimeError(f"the run without CP trained other parameters: it has no gradient for {', '.join(lacking[:3])}")
            for n in names:
                parts.append(fh.get_tensor(n).reshape(-1).float())
        return torch.cat(parts) if parts else torch.zeros(0)

    def combine(self, own: Any, n_groups: int) -> Any:
        return own

    def output(self, hooks: Any) -> Any:
        return None

    def unmatched(self) -> bool:
        return self.matched is None
