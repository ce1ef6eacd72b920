"""The one shape of every launched examination: a request, its cases, what every rank runs, what rank 0
evaluates (numbers only), and the finding the numbers turn into. attention, model and train_step are entries
(registry.py); the CLI, the Python API and suites reach them by kind only."""

from __future__ import annotations

import importlib
from typing import Any

from cpdoctor.examinations import judging
from cpdoctor.launch.jobs import Case, RankFailure
from cpdoctor.report import Finding


class Examination:
    """Base of every launched examination. A subclass sets `kind` and `request_type` and implements
    `run_rank`, `evaluate`, `finding` and `describe`; the rest has defaults that fit most."""

    kind: str = ""
    request_type: type = object
    probe: str = ""
    """The module with `run_rank(case, ctx)` and `evaluate(case, payloads, ctx)`, imported inside the ranks only
    (it imports torch and diffusers)."""
    in_suites: bool = True
    """Whether YAML suites and the API may name this kind (internal probes say False)."""

    # -- in the parent, before anything launches ---------------------------------------------------------
    def build_request(self, **fields: Any) -> Any:
        """A validated request from keyword fields (None = default). BadInput on bad input."""
        return self.request_type.from_dict({k: v for k, v in fields.items() if v is not None}).validate()

    def prepare(self, request: Any) -> Any:
        """Parent-side resolution of what depends on the installed software (default: validation only)."""
        return request.validate()

    def unsupported_here(self, request: Any) -> str | None:
        """Why nothing of `request` can run here, known in the parent in well under a second (no rank, no torch
        or diffusers import): a backend whose package is missing. None when the ranks must find out."""
        backend = getattr(request, "backend", "auto")
        if backend == "auto" or getattr(request, "emulate", False):
            return None
        from cpdoctor.compat.requirements import missing_requirement

        return missing_requirement(backend)

    def cases(self, request: Any) -> list[Case]:
        """The stock code first, then, with `patch`, the same with cpdoctor's fix patched in."""
        cases = [Case(request, patched=False)]
        if getattr(request, "patch", False):
            cases.append(Case(request, patched=True))
        return cases

    def world_size(self, request: Any) -> int:
        return int(request.world_size)

    def device(self, request: Any) -> str:
        return str(getattr(request, "device", "auto"))

    # -- on every rank / on rank 0 ------------------------------------------------------------------------
    def run_rank(self, case: Case, ctx: Any) -> Any:
        return importlib.import_module(self.probe).run_rank(case, ctx)

    def evaluate(self, case: Case, payloads: list[Any], ctx: Any) -> Any:
        return importlib.import_module(self.probe).evaluate(case, payloads, ctx)

    # -- judging, in the parent -------------------------------------------------------------------------------
    def finding(self, case: Case, evaluated: Any) -> Finding:
        raise NotImplementedError

    def describe(self, request: Any) -> str:
        raise NotImplementedError

    def failure_findings(self, case: Case, failures: list[RankFailure], timeout_s: float) -> list[Finding]:
        return judging.failure_findings(self.describe(case.request), failures, timeout_s)

    def environment(self, evaluated: Any) -> dict[str, Any] | None:
        """The environment the ranks reported with their numbers (None when they reported none)."""
        return getattr(evaluated, "environment", None)
