"""Whether every CP peer fed the model the same inputs: each input's fingerprint on every rank of the CP group
against the group's first rank. One function (`input_diffs`), so a layout whose ranks feed shards of the full
input (torchtitan splits the tokens before the model) compares them its own way here."""

from __future__ import annotations

from dataclasses import dataclass

from cpdoctor.examinations.step.messages import PeerRecord


@dataclass(frozen=True)
class InputDiff:
    """An input that is not bitwise equal on every CP peer: the ranks that agree with the group's first rank,
    and the ones that do not."""

    name: str
    same_as_first: tuple[int, ...]
    different: tuple[int, ...]


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
