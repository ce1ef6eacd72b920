"""Every launched examination by kind. A new examination is one new package and one line here; entries are
imported when first asked for, so `cpdoctor --help` imports neither torch nor diffusers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from cpdoctor.errors import BadInput
from cpdoctor.vocabulary import Kind

if TYPE_CHECKING:
    from cpdoctor.examinations.base import Examination
    from cpdoctor.launch.context import DistContext
    from cpdoctor.launch.jobs import Case, CaseNumbers, RankResult

ENTRIES: dict[Kind, str] = {
    Kind.ATTENTION: "cpdoctor.examinations.attention",
    Kind.MODEL: "cpdoctor.examinations.model",
    Kind.FIX_TRAINING: "cpdoctor.examinations.fix_training",
    Kind.PEER: "cpdoctor.examinations.peer",
    Kind.STEP: "cpdoctor.examinations.step",
}
"""kind -> the package whose `EXAMINATION` is the entry."""


def get(kind: Kind) -> Examination:
    """The entry of a kind."""
    return importlib.import_module(ENTRIES[kind]).EXAMINATION


def of(request: object) -> Examination:
    """The entry a request is for: every request type names its `kind` (a class attribute), so the API dispatches
    on the request's type, never on a name passed beside it."""
    kind = getattr(type(request), "kind", None)
    if not isinstance(kind, Kind):
        raise BadInput(f"not an examination's request: {type(request).__name__}")
    return get(kind)


def parse_kind(name: object) -> Kind:
    """A suite's word for a kind as its member; BadInput naming the kinds a suite may use."""
    for kind in suite_kinds():
        if kind == name:
            return kind
    raise BadInput(f"unknown kind {name!r} (one of {', '.join(suite_kinds())})")


def suite_kinds() -> tuple[Kind, ...]:
    """The kinds a suite or the API may name (internal probes excluded)."""
    return tuple(k for k in ENTRIES if get(k).in_suites)


class ByRequest:
    """The program of a launch whose cases are of several kinds (a suite's or the doctor's launch of one world
    size): each case runs on every rank and is evaluated on rank 0 by its own request's entry, so the ranks import
    torch and diffusers once for all of them (a `launch.jobs.RankProgram`)."""

    def run_rank(self, case: Case, ctx: DistContext) -> RankResult:
        return of(case.request).run_rank(case, ctx)

    def evaluate(self, case: Case, results: list[RankResult], ctx: DistContext) -> CaseNumbers:
        return of(case.request).evaluate(case, results, ctx)
