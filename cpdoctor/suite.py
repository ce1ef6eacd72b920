"""YAML suites: a named list of examinations, shipped in cpdoctor/suites/ or written by the user.

    name: quick
    description: what it is for
    checks:
      - attention: {ring: 2}
      - attention: {ring: 2, mask_pad: 3, dtype: bf16}
      - model: {model: flux, ring: 2}

Each check is a one-key mapping: the kind of examination (`attention`, the op-level `cpdoctor check`; `model`,
`cpdoctor model`) and the same fields as the Python API and the CLI options. Loading validates every check
into its request, so a malformed suite is one line of bad input before any process starts.

A model check may name `each: video` (or `image`, `all`) instead of a `model:`: it becomes one check per class
of that family in the installed diffusers (found by scanning it, as `cpdoctor plan --list` does: 0.42.1 has six
video classes, 0.39.0 five), keeping only the classes the check's fields apply to: with `mask_pad`, those whose
forward takes a text mask; with `checkpointing`, those that support gradient checkpointing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.errors import BadInput
from cpdoctor.examinations import registry
from cpdoctor.vocabulary import Kind

SUITES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suites")


@dataclass
class Suite:
    """A named list of checks: each a YAML check's kind and fields (validated into its request by
    `build_requests`), or a request built already (the doctor's plan holds its requests)."""

    name: str
    description: str
    source: str
    checks: list[tuple[Kind, dict[str, Any]] | Any] = field(default_factory=list)


@dataclass(frozen=True)
class SuiteRequest:
    """What a suite's report says was asked: the suite, whether every check ran patched too, and every check as
    its full, validated request (JSON `request`: `suite`, `source`, `patch`, `checks` as [{kind: request}])."""

    suite: str
    source: str
    patch: bool
    checks: tuple[Any, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "source": self.source,
            "patch": self.patch,
            "checks": [{r.kind.value: r.to_dict()} for r in self.checks],
        }


def shipped() -> dict[str, str]:
    """Suites that come with cpdoctor: name -> path."""
    return {f[: -len(".yaml")]: os.path.join(SUITES_DIR, f) for f in sorted(os.listdir(SUITES_DIR)) if f.endswith(".yaml")}


def _resolve(name_or_path: str) -> str:
    if os.path.isfile(name_or_path):
        return name_or_path
    suites = shipped()
    if name_or_path in suites:
        return suites[name_or_path]
    import difflib

    close = difflib.get_close_matches(name_or_path, list(suites), n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"shipped suites: {', '.join(suites)}"
    raise BadInput(f"no suite file or shipped suite named {name_or_path!r} ({hint})")


def load(name_or_path: str) -> Suite:
    """Read and validate a suite (BadInput with the file and the check at fault)."""
    import yaml

    path = _resolve(name_or_path)
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadInput(f"suite {path}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from exc
    except OSError as exc:
        raise BadInput(f"suite {path}: cannot read it ({exc.strerror})") from exc
    unknown = set(data) - {"name", "description", "checks"} if isinstance(data, dict) else set()
    if unknown:
        raise BadInput(f"suite {path}: unknown top-level keys {', '.join(sorted(unknown))} (name, description, checks)")
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list) or not data["checks"]:
        raise BadInput(f"suite {path}: expected a mapping with a non-empty list under 'checks'")
    suite = Suite(str(data.get("name") or os.path.basename(path)), str(data.get("description") or ""), path)
    for i, check in enumerate(data["checks"], 1):
        if not (isinstance(check, dict) and len(check) == 1):
            raise BadInput(f"suite {path}: check {i} must be one mapping like `attention: {{ring: 2}}`, got {check!r}")
        ((name, fields),) = check.items()
        try:
            kind = registry.parse_kind(name)
        except BadInput as exc:
            raise BadInput(f"suite {path}: check {i}: {exc}") from None
        if not isinstance(fields, dict):
            raise BadInput(f"suite {path}: check {i}: the fields of {kind} must be a mapping, got {fields!r}")
        suite.checks.append((kind, dict(fields)))
    return suite


def build_requests(suite: Suite, patch: bool) -> list[Any]:
    """Each check as its validated, prepared request, the same object the CLI and the API build (a model check is
    resolved: the parent imports diffusers); each names its kind (`request.kind`)."""
    requests = []
    numbered = [(i, one) for i, check in enumerate(suite.checks, 1) for one in _each(check, suite.source, i)]
    for i, check in numbered:
        built = not isinstance(check, tuple)
        kind, fields = (check.kind, {}) if built else check
        entry = registry.get(kind)
        patched = "patch" in {f.name for f in dataclasses.fields(entry.request_type)}  # the fix concerns diffusers' code only
        if patched and not built:
            fields = dict(fields, patch=bool(fields.get("patch", patch)))
        try:
            request = check if built else entry.build_request(**fields)
            if patched and built:
                request = dataclasses.replace(request, patch=request.patch or patch)
            requests.append(entry.prepare(request))
        except BadInput as exc:
            raise BadInput(f"suite {suite.source}: check {i} ({kind}): {exc}") from exc
        except TypeError as exc:  # an unknown field name
            raise BadInput(f"suite {suite.source}: check {i} ({kind}): {exc}") from exc
    return requests


def _each(check: Any, source: str, i: int) -> list[Any]:
    """A model check with `each: video|image|all`, one check per class of that family in the installed diffusers
    that the check's fields apply to (a text mask for `mask_pad`, gradient checkpointing for `checkpointing`);
    any other check as it is."""
    if not isinstance(check, tuple) or check[0] is not Kind.MODEL or "each" not in check[1]:
        return [check]
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.model_zoo.catalog import models_of
    from cpdoctor.model_zoo.inputs import builder_for

    fields = dict(check[1])
    kind = fields.pop("each")
    if "model" in fields:
        raise BadInput(f"suite {source}: check {i}: give `model` or `each`, not both")
    try:
        classes = models_of(str(kind))
    except BadInput as exc:
        raise BadInput(f"suite {source}: check {i}: {exc}") from None
    if fields.get("mask_pad"):
        classes = [(c, e) for c, e in classes if builder_for(c).text_mask_param in compat.forward_params(c)]
    if fields.get("checkpointing"):
        classes = [(c, e) for c, e in classes if compat.supports_gradient_checkpointing(c)]
    return [(Kind.MODEL, dict(fields, model=entry.short_name)) for _, entry in classes]
