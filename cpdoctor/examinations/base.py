"""The one shape of every launched examination: a request, its cases, what every rank runs, what rank 0
evaluates (numbers only), and the finding the numbers turn into. attention, model and the others are entries
(registry.py), each typed by its request (`Examination[AttentionRequest]`, ...: an `examinations.request.Request`,
which names its kind); the CLI, the Python API and suites build the same request objects and reach the entry
through it, and a launch Job carries the entry itself as its program (launch/ never looks an examination up)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from cpdoctor.errors import Unsupported
from cpdoctor.examinations import judging
from cpdoctor.examinations.request import Request
from cpdoctor.launch.context import DistContext
from cpdoctor.launch.jobs import Case, CaseNumbers, RankFailure, RankResult
from cpdoctor.report import Finding
from cpdoctor.vocabulary import Kind

R = TypeVar("R", bound=Request)


class Examination(Generic[R]):
    """Base of every launched examination, typed by its request `R`. A subclass sets `kind` and `request_type` and
    implements `run_rank`, `evaluate`, `finding` and `describe`; the rest has defaults that fit most, reading only
    what every request has (`Request`)."""

    kind: Kind
    request_type: type[R]
    probe: str = ""
    """The module whose `run_rank` and `evaluate` the ranks run (`cpdoctor.examinations.<kind>.probe`), imported on
    the rank when first asked for (it imports torch and diffusers; `cpdoctor --help` must not)."""
    in_suites: bool = True
    """Whether YAML suites and the API may name this kind (internal examinations say False)."""

    # -- in the parent, before anything launches ---------------------------------------------------------
    def build_request(self, **fields: object) -> R:
        """Receives the request's fields as keywords (None = the default); returns the validated request.
        Raises BadInput (one line, exit 2) for anything wrong with them."""
        return self.request_type.from_dict({k: v for k, v in fields.items() if v is not None}).validate()  # type: ignore[attr-defined]

    def prepare(self, request: R) -> R:
        """Receives a validated request (validated once, where it was built); returns it with what depends on the
        installed software resolved (default: nothing does). Runs in the parent; BadInput for what cannot work."""
        return request

    def unsupported_here(self, request: R) -> Unsupported | None:
        """Receives a request; returns why nothing of it can run here, known in the parent in well under a
        second (no rank, no torch or diffusers import): a backend whose package is missing (the backend asked for,
        unless it is auto or emulated). None when the ranks must find out."""
        backend = request.asked().attention.backend
        if backend in (None, "auto") or request.emulate:
            return None
        from cpdoctor.compat.requirements import missing_requirement

        return missing_requirement(backend)

    def unsupported_finding(self, request: R, why: Unsupported) -> Finding:
        """Receives a request and what `unsupported_here` returned; returns its UNSUPPORTED finding (the remedy
        of its kind; an examination with better advice, such as a peer's install command, overrides it)."""
        return judging.unsupported_finding(self.describe(request), why)

    def cases(self, request: R) -> list[Case]:
        """Receives a prepared request; returns the cases to launch: the stock code first, then, with
        `patch`, the same with cpdoctor's fix patched in."""
        cases = [Case(request, patched=False)]
        if request.patch:
            cases.append(Case(request, patched=True))
        return cases

    def stages(self, request: R) -> list[tuple[list[Case], int]]:
        """Receives a prepared request; returns its launches in order, each (cases, world size): one launch of
        `cases` by default. An examination that needs a run before the examined one (the step's run without CP)
        returns two; a launch whose ranks failed ends the examination with their findings."""
        return [(self.cases(request), self.world_size(request))]

    def finish(self, request: R) -> None:
        """In the parent, after the last launch (failed or not): release what `prepare` made (default: nothing)."""

    def world_size(self, request: R) -> int:
        """The number of ranks the request's cases run on."""
        return int(request.world_size)

    def fresh_interpreter(self, request: R) -> bool:
        """Whether the ranks must import diffusers themselves, after something is put first on sys.path: with
        `emulate`, the CUDA kernels' stand-ins (diffusers looks for flash-attn when it is imported), so they are
        spawned, never forked from the warm server (launch/warm.py)."""
        return request.emulate

    def device(self, request: R) -> str:
        """The device preference of the request ("auto", "cpu" or "cuda")."""
        return str(request.device)

    # -- on every rank / on rank 0 ------------------------------------------------------------------------
    def run_rank(self, case: Case, ctx: DistContext) -> RankResult:
        """On every rank: receives the case and the rank's DistContext; returns this rank's typed numbers
        (tensors on the CPU), by default its `probe` module's. Raises whatever the examined code raises (it becomes a
        CRASH finding)."""
        return importlib.import_module(self.probe).run_rank(case, ctx)

    def evaluate(self, case: Case, results: list[RankResult], ctx: DistContext) -> CaseNumbers:
        """On rank 0: receives every rank's result in rank order; returns the case's measured numbers against
        the reference (numbers only, no verdict), by default its `probe` module's."""
        return importlib.import_module(self.probe).evaluate(case, results, ctx)

    # -- judging, in the parent -------------------------------------------------------------------------------
    def finding(self, case: Case, evaluated: CaseNumbers) -> Finding:
        """In the parent: receives rank 0's numbers for a case; returns the judged finding (verdict,
        diagnosis, remedy, rows)."""
        raise NotImplementedError

    def findings(self, case: Case, evaluated: CaseNumbers) -> list[Finding]:
        """In the parent: the findings of one case (one by default; the step's one per CP group and step)."""
        return [self.finding(case, evaluated)]

    def describe(self, request: R) -> str:
        """One line naming what the request examines (a finding's subject)."""
        raise NotImplementedError

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        """In the parent: receives the ranks that failed a case; returns its CRASH / HANG findings."""
        return judging.failure_findings(self.describe(case.request), failures, timeout_s)
