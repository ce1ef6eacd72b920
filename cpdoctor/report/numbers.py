"""The numbers every examination measures and judges, as typed rows: what crosses from a probe to a judge and
from a judge to the report, so nothing between them is a string-keyed dict.

`Comparison` is one tensor against its reference; `TensorRow` is what rank 0 measured for one tensor (the
whole tensor, the worst rank, every rank, the error without CP); `JudgedRow` is the same row with its
tolerance, the ranks outside it and its verdict. They become dicts only in the report's serialiser
(`cpdoctor.report.serialize`), whose keys (`rel_err`, `max_abs`, `nonfinite`, `worst_rank`, `per_rank_rel_err`,
`baseline_rel_err`, `tolerance`, `bad_ranks`, `verdict`, ...) are the JSON contract.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from cpdoctor.report.serialize import json_field
from cpdoctor.report.verdict import Verdict


@dataclass(frozen=True)
class Comparison:
    """One tensor against its reference: relative L2 error, max abs error, non-finite elements."""

    rel_err: float
    max_abs: float
    nonfinite: int


@dataclass(frozen=True)
class TensorRow:
    """What rank 0 measured for one tensor (or one vector of parameters)."""

    rel_err: float
    max_abs: float
    nonfinite: int
    worst_rank: int | None = None
    per_rank_rel_err: tuple[float, ...] = ()
    baseline_rel_err: float | None = None
    """The same backend's (or model's) error without CP, same dtype, same run: the tolerance is built on it."""
    name: str | None = json_field("param", default=None)
    """What the row is about when the key does not say it (the worst parameter's name; JSON key "param")."""
    numel: int | None = None

    @classmethod
    def of(cls, whole: Comparison, **more: object) -> TensorRow:
        return cls(whole.rel_err, whole.max_abs, whole.nonfinite, **more)  # type: ignore[arg-type]


@dataclass(frozen=True)
class JudgedRow(TensorRow):
    """A measured row with its tolerance, the ranks outside it and its verdict."""

    tolerance: float = 0.0
    bad_ranks: tuple[int, ...] = ()
    verdict: Verdict = Verdict.PASS

    @classmethod
    def judged(cls, row: TensorRow, tolerance: float, bad_ranks: tuple[int, ...], verdict: Verdict) -> JudgedRow:
        values = {f.name: getattr(row, f.name) for f in fields(TensorRow)}
        return cls(**values, tolerance=tolerance, bad_ranks=bad_ranks, verdict=verdict)

    @property
    def failed(self) -> bool:
        return self.verdict is Verdict.FAIL


@dataclass(frozen=True)
class BlockRow:
    """One block of a model: its output's and its input gradient's error against the reference, with and
    without CP (None where the block had no such tensor)."""

    name: str
    out_rel_err: float | None
    grad_rel_err: float | None
    nonfinite: int = 0
    baseline_out_rel_err: float | None = None
    baseline_grad_rel_err: float | None = None
    out_tolerance: float | None = None
    grad_tolerance: float | None = None
    verdict: Verdict | None = None


@dataclass(frozen=True)
class ParamRow:
    """One parameter's gradient against the reference."""

    rel_err: float
    max_abs: float
    nonfinite: int
    numel: int
    ref_norm: float
    baseline_rel_err: float | None = None
