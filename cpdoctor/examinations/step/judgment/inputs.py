"""Whether the CP peers fed the model what they should. Two ways, one result (`InputDiff`s):

- one run (`input_diffs`): every peer must feed the same full inputs (diffusers' `_cp_plan` splits them inside the
  model), so each input's fingerprint on every rank is compared with the group's first rank's;
- two runs (`judge_against_run`): each CP rank's input is judged against the same-named input of the run without
  CP (input_layouts.py, classified on each rank: equal, this rank's shard of it along a sequence dimension, or
  wrong), so a trainer that shards the tokens before calling the model (torchtitan's FLUX) is right, and a
  timestep drawn on each CP rank is named with the ranks that drew it. The replica of the run without CP a CP
  group is judged against is the one where every input of every peer is right and the weights are the same."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpdoctor.examinations.step.judgment.input_layouts import GroupInput, Placement, judge_inputs
from cpdoctor.examinations.step.watcher.messages import PeerRecord, ReplicaLayouts


@dataclass(frozen=True)
class InputDiff:
    """An input that is not what it should be: the ranks that have it right (one run: equal to the group's first
    rank's), the ones that do not, and (two runs) what it is instead on them."""

    name: str
    same_as_first: tuple[int, ...]
    different: tuple[int, ...]
    detail: str = ""


def input_diffs(records: list[PeerRecord]) -> tuple[InputDiff, ...]:
    """The inputs whose fingerprints differ between the peers (records in group order, the first rank's first)."""
    first = {p.name: p.digest for p in records[0].inputs}
    diffs = []
    names = list(first) + [p.name for r in records[1:] for p in r.inputs if p.name not in first]
    for name in dict.fromkeys(names):
        same, other = [], []
        for r in records:
            d = next((p.digest for p in r.inputs if p.name == name), None)
            (same if d == first.get(name) else other).append(r.rank)
        if other:
            diffs.append(InputDiff(name, tuple(same), tuple(other)))
    return tuple(diffs)


@dataclass(frozen=True)
class InputsJudged:
    """A CP group's inputs and output gradients against the run without CP (two runs)."""

    replica: int | None
    """The rank of the run without CP against which every input of every peer is right, from the same weights
    (None: no such rank; the gradients then answer another question)."""
    against: int | None
    """The rank of the run without CP the judgement below is against (the replica; else the one where most peers'
    inputs are all right; else the CP group's by order)."""
    inputs: tuple[GroupInput, ...]
    """What each input is across the group (replicated, the ranks' shards, or which ranks have it wrong)."""
    diffs: tuple[InputDiff, ...]
    by_layout: bool
    """True: `diffs` were judged against the run without CP; False: no peer fed what any rank of that run did (the
    data depend on the layout), and the peers' full-shaped inputs were compared with each other instead."""
    out_grads_right: bool
    """Every peer's output gradient is the run without CP's, or its shard of it, within the step's tolerance."""

    def right(self) -> tuple[GroupInput, ...]:
        return tuple(g for g in self.inputs if g.placement is not Placement.WRONG)


def _by_replica(records: Sequence[PeerRecord]) -> dict[int, list[ReplicaLayouts]]:
    """Each replica's layouts on every peer, in group order (replicas some peer did not classify are left out)."""
    found: dict[int, list[ReplicaLayouts]] = {}
    for rec in records:
        for lay in rec.layouts:
            found.setdefault(lay.replica, []).append(lay)
    return {r: found[r] for r in sorted(found) if len(found[r]) == len(records)}


def _all_right(groups: Sequence[GroupInput]) -> bool:
    return all(g.placement is not Placement.WRONG for g in groups)


def judge_against_run(records: Sequence[PeerRecord], same_weights: set[int], fallback: int) -> InputsJudged:
    """The CP group's inputs (records in group order, each with its `layouts`) against the run without CP: the
    first of its ranks `same_weights` (which started from this run's weights) where every input is right is the
    replica; else the inputs are judged against the rank where most peers' inputs are all right (a peer that fed
    exactly that run's inputs shows which sample this is: the others' wrong inputs are named); else, no peer fed
    any rank's inputs (the data depend on the layout), the peers' full-shaped inputs are compared with each other
    as one run does, against `fallback` for what each input is."""
    ranks = tuple(r.rank for r in records)
    replicas = _by_replica(records)

    def judged(replica: int) -> tuple[tuple[GroupInput, ...], bool]:
        layouts = replicas[replica]
        return judge_inputs([x.inputs for x in layouts], ranks), _all_right(judge_inputs([x.out_grads for x in layouts], ranks))

    for replica in replicas:
        groups, out_right = judged(replica)
        if replica in same_weights and _all_right(groups):
            return InputsJudged(replica, replica, groups, (), True, out_right)
    witnesses = {r: sum(x.inputs_right for x in layouts) for r, layouts in replicas.items()}
    witness = max(witnesses, key=lambda r: witnesses[r], default=None)
    if witness is not None and witnesses[witness]:
        groups, out_right = judged(witness)
        diffs = tuple(
            InputDiff(g.name, tuple(r for r in ranks if r not in g.wrong_ranks), g.wrong_ranks, g.describe())
            for g in groups
            if g.placement is Placement.WRONG
        )
        return InputsJudged(None, witness, groups, diffs, True, out_right)
    groups = judged(fallback)[0] if fallback in replicas else ()
    parts = {x.name for lay in replicas.get(fallback, ()) for x in lay.inputs if x.dim is not None}  # fed as a part of it
    return InputsJudged(None, fallback, groups, tuple(d for d in input_diffs(list(records)) if d.name not in parts), False, False)
