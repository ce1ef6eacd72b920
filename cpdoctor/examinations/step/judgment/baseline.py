"""What a watched CP step's final gradients are compared with: the gradients one process computes for the same
step. Two sources, one interface (`Baseline`):

- `OneProcessReference` (`watch_step`, `preflight(model=...)`: one run only): each CP group's first rank
  recomputes the step in one fp64 process from the recorded inputs and output gradients (reference.py); the
  groups' results are averaged over the data-parallel groups. The output gradient already carries whatever the
  user's code scaled the loss by; the judge reads those factors from the autograd graph (loss_graph.py).
- `RecordedRun` (`cpdoctor step` with a function that takes its degrees): the same user code ran before without
  CP (one process, or dp processes) and left its final gradients and what it fed the model on disk (`SavedStep`,
  `SavedInputs`); nothing is recomputed or guessed, so loss scaling, clipping, accumulation, adapters and wrappers
  are the user's own in both. Each CP rank judges its inputs against that run's (inputs.py: equal, or its shard), and
  the CP group is compared with the rank of that run it fed the same data from the same weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

from cpdoctor.examinations.step.judgment.input_layouts import Placement
from cpdoctor.examinations.step.judgment.inputs import InputsJudged, judge_against_run
from cpdoctor.examinations.step.judgment.measure import reference_out_grads
from cpdoctor.examinations.step.watcher.group import StepGroup
from cpdoctor.examinations.step.watcher.messages import PeerRecord, ReplicaLayouts
from cpdoctor.examinations.step.watcher.record import Recorded
from cpdoctor.model_zoo import memory
from cpdoctor.vocabulary import DType


class Baseline(Protocol):
    name: str
    needs_inputs: bool
    """Whether the CP group's first rank must keep the model's inputs and weights (to recompute the step)."""
    needs_weights_digest: bool
    """Whether the watch fingerprints the weights it starts from (two runs: the same weights in both?)."""
    judges_inputs: bool
    """Whether every rank keeps its own inputs and judges them against the run without CP (two runs)."""
    ref_output: Any
    judged: InputsJudged | None
    """After `expected`: the CP group's inputs against the run without CP (None: compared between peers, one run)."""
    native: Any
    """After `expected`: the flat gradient recomputed at the step's own precision and backend (None: not recomputed)."""
    plan: Any
    """After `expected`: what the recomputation costs against the memory there is (None: nothing is recomputed)."""

    def input_layouts(self, group: StepGroup, recorded: Recorded) -> tuple[ReplicaLayouts, ...]:
        """On every rank: its inputs and output gradients against each rank of the run without CP (empty: one run)."""

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        """On a CP group's first rank: this group's flat expected gradient (float32, in `names` order)."""

    def combine(self, own: Any, n_groups: int) -> Any:
        """On every rank (a collective where needed): the gradient a correct step ends with everywhere."""

    def output(self, hooks: Any) -> Any:
        """The watched step's output to compare with `ref_output` (None when there is none)."""

    def unmatched(self) -> str | None:
        """None when the baseline holds a run of this CP group's inputs and weights; else what differs ("" where
        unknown): two runs with nothing to compare."""


class OneProcessReference:
    """The step recomputed in one process from what the CP group's first rank recorded."""

    needs_inputs = True
    needs_weights_digest = False
    judges_inputs = False
    judged = None

    def __init__(self, precision: str = "fp64") -> None:
        self.precision = precision
        self.native: Any = None
        self.plan: Any = None
        self.name = f"one {precision} process recomputing the recorded step"
        self.ref_output: Any = None

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        from cpdoctor.compat import parallel_config as compat
        from cpdoctor.examinations.step.judgment.reference import Precision, ReferenceTooLarge, reference_plan, reference_step

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

    def input_layouts(self, group: StepGroup, recorded: Recorded) -> tuple[ReplicaLayouts, ...]:
        return ()

    def combine(self, own: Any, n_groups: int) -> Any:
        from cpdoctor.launch import watcher_comm

        if n_groups == 1:  # the world is this CP group: its reference is the expected gradient (every rank knows it)
            return own
        total = watcher_comm.sum_over_world(own)
        total /= n_groups  # in place: a fresh copy of a real model's gradient costs seconds of page faults
        return total

    def output(self, hooks: Any) -> Any:
        return hooks.calls[0].output if hooks.calls else None

    def unmatched(self) -> str | None:
        return None


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

    @property
    def inputs(self) -> str:
        return os.path.join(self.directory, f"step{self.index}-rank{self.rank}.inputs.pt")


@dataclass(frozen=True)
class SavedInputs:
    """What the model was fed in one watched step of the run without CP, and the gradient that flowed into its
    output: what each CP rank's are judged against (inputs.judge_against_run)."""

    inputs: dict[str, Any]
    """Every forward's inputs by name (record.Hooks.inputs: tensors and plain values, other values fingerprinted)."""
    out_grads: dict[str, Any]
    """Every forward's output gradient by name (record.Hooks.out_grads)."""

    def save(self, path: str) -> None:
        import torch

        torch.save({"inputs": self.inputs, "out_grads": self.out_grads}, path)

    @classmethod
    def load(cls, path: str) -> SavedInputs:
        import torch

        data = torch.load(path, weights_only=True)  # tensors and plain values only
        return cls(data["inputs"], data["out_grads"])


def save_step(
    directory: str,
    rank: int,
    index: int,
    grads: dict[str, Any],
    prints: list[tuple[str, str]],
    dtype: str,
    weights: str,
    inputs: SavedInputs | None = None,
) -> None:
    """Write one rank's final gradients of one watched step of the run without CP (and what it fed the model)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    where = SavedStep(directory, rank, index)
    if inputs is not None:
        inputs.save(where.inputs)
    save_file({n: g.detach().float().cpu().contiguous() for n, g in grads.items()}, where.tensors)
    with open(where.meta, "w", encoding="utf-8") as fh:
        json.dump({"prints": prints, "dtype": dtype, "names": list(grads), "weights": weights}, fh)


class RecordedRun:
    """The final gradients of the same step run without CP (`cpdoctor step`'s first launch)."""

    needs_inputs = False
    needs_weights_digest = True
    judges_inputs = True
    ref_output = None
    native = None
    plan = None
    name = "the same step run without CP"

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.weights_seen = True
        """Some rank of the run without CP started from this group's weights (set by `expected`)."""
        self.matched: int | None = None
        """The rank of the run without CP whose inputs this CP group fed (None: matched by group order)."""
        self.judged: InputsJudged | None = None

    def _saved(self, seq: int) -> list[int]:
        """The ranks of the run without CP that left watched step `seq`."""
        return sorted(
            int(f.split("rank")[1].split(".")[0]) for f in os.listdir(self.directory) if f.startswith(f"step{seq}-") and f.endswith(".json")
        )

    def input_layouts(self, group: StepGroup, recorded: Recorded) -> tuple[ReplicaLayouts, ...]:
        """This rank's inputs and output gradients against every rank of the run without CP that saved them: equal,
        or this rank's shard (its place in the CP group); output gradients within the step's tolerance."""
        from cpdoctor.examinations.step.judgment.input_layouts import classify_all

        hooks, cp, place = recorded.hooks, len(group.ranks), group.ranks.index(group.rank)
        mine, out_grads = hooks.inputs(), hooks.out_grads()
        rtol = DType(recorded.dtype).grad_tolerance
        found = []
        for rank in self._saved(group.seq):
            where = SavedStep(self.directory, rank, group.seq).inputs
            if os.path.exists(where):
                saved = SavedInputs.load(where)
                found.append(
                    ReplicaLayouts(
                        rank, classify_all(mine, saved.inputs, cp, place), classify_all(out_grads, saved.out_grads, cp, place, rtol)
                    )
                )
        return tuple(found)

    def expected(self, group: StepGroup, recorded: Recorded, records: list[PeerRecord], names: list[str]) -> Any:
        import torch
        from safetensors import safe_open

        saved = self._saved(group.seq)
        if not saved:
            raise RuntimeError(f"the run without CP left no gradients for watched step {group.seq} in {self.directory}")
        metas = {}
        for rank in saved:
            with open(SavedStep(self.directory, rank, group.seq).meta, encoding="utf-8") as fh:
                metas[rank] = json.load(fh)
        same_weights = {r for r, m in metas.items() if m.get("weights") == recorded.weights_digest}
        fallback = saved[group.group_number % len(saved)]
        if all(r.layouts for r in records):  # judged by what each input should be
            self.judged = judge_against_run(records, same_weights, fallback)
            choice = self.judged.replica
        else:  # the run without CP saved no inputs: matched by the fingerprints of the first rank's
            mine = [(p.name, p.digest) for p in records[0].inputs]
            choice = next((r for r in saved if [tuple(p) for p in metas[r]["prints"]] == mine and r in same_weights), None)
        self.matched = choice
        self.weights_seen = bool(same_weights)
        if choice is None:
            choice = fallback
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

    def unmatched(self) -> str | None:
        """None when a rank of the run without CP fed this CP group's inputs from its weights; else what of this
        group no rank of that run shares: its weights, and the inputs that match no rank of that run (as the peers
        judged them: equal, or their shard)."""
        if self.matched is not None:
            return None
        said = [] if self.weights_seen else ["the weights it started from differ from every rank's"]
        if self.judged is not None:
            wrong = [g.name for g in self.judged.inputs if g.placement is Placement.WRONG]
            if wrong and not self.judged.diffs:
                said.append(f"its inputs {', '.join(wrong)} are no rank's (nor its shard of them)")
        return "; ".join(said)
