"""Which package a diffusers attention backend needs, read from the installed diffusers' source without
importing it (or torch), so that the parent can answer UNSUPPORTED for `--backend flash` without flash-attn in
well under a second, before any rank starts.

The truth is diffusers' own `_check_attention_backend_requirements(backend)` in models/attention_dispatch.py:
each branch names the backends it covers (`backend in [AttentionBackendName.FLASH, ...]` or `backend ==
AttentionBackendName.X`) and raises a message that says what to install ("Please install
`flash-attn>={_REQUIRED_FLASH_VERSION}`"). This module parses that function with `ast` and resolves the
backend names through the `AttentionBackendName` class and the version constants of the same file. What it
cannot read (another shape of code, a package named without a pip spec, a backend not listed) says nothing,
and the ranks find out by trying, as before.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass

from cpdoctor.errors import Unsupported, UnsupportedKind
from cpdoctor.memo import Memo


@dataclass(frozen=True)
class Requirement:
    package: str
    minimum: str | None
    message: str  # diffusers' own words, with the constants filled in


def _dispatch_source() -> str | None:
    spec = importlib.util.find_spec("diffusers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "models", "attention_dispatch.py")
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                out[node.targets[0].id] = node.value.value
    return out


def _enum_values(tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AttentionBackendName":
            return {
                t.id: n.value.value
                for n in node.body
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
    return {}


def _members(test: ast.expr, enum: dict[str, str]) -> list[str]:
    """Backend values a branch's test names (`backend in [...]` or `backend == ...`)."""
    if not isinstance(test, ast.Compare) or len(test.comparators) != 1:
        return []
    target = test.comparators[0]
    items = target.elts if isinstance(target, (ast.List, ast.Tuple, ast.Set)) else [target]
    return [enum[i.attr] for i in items if isinstance(i, ast.Attribute) and i.attr in enum]


def _message(body: list[ast.stmt], constants: dict[str, str]) -> str | None:
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            arg = node.exc.args[0]
            if isinstance(arg, ast.JoinedStr):
                parts = []
                for v in arg.values:
                    if isinstance(v, ast.Constant):
                        parts.append(str(v.value))
                    elif isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Name):
                        parts.append(constants.get(v.value.id, "{" + v.value.id + "}"))
                    else:
                        parts.append("…")
                return "".join(parts)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                return arg.value
    return None


def parse_requirements(source: str) -> dict[str, Requirement]:
    """Backend value -> the first package its branch of `_check_attention_backend_requirements` asks for."""
    tree = ast.parse(source)
    constants, enum = _constants(tree), _enum_values(tree)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_check_attention_backend_requirements"), None)
    out: dict[str, Requirement] = {}
    branch = fn.body[0] if fn is not None and fn.body and isinstance(fn.body[0], ast.If) else None
    while isinstance(branch, ast.If):
        message = _message(branch.body, constants)
        spec = re.search(r"install[^`]*`(?:pip install (?:-U )?)?([A-Za-z0-9_.\-]+)(?:>=([0-9][0-9A-Za-z.\-]*))?`", message or "")
        if spec is not None:
            for value in _members(branch.test, enum):
                out.setdefault(value, Requirement(spec.group(1), spec.group(2), message or ""))
        branch = branch.orelse[0] if len(branch.orelse) == 1 and isinstance(branch.orelse[0], ast.If) else None
    return out


READ: Memo[dict[str, Requirement]] = Memo("backend -> the package diffusers' own check asks for")
"""`installed_requirements`' memo. Lifetime: the process's (the installed diffusers' source does not change
under it); cleared by tests only."""


def installed_requirements() -> dict[str, Requirement]:
    """What the installed diffusers requires per backend (read once per process; {} when it cannot be read)."""
    return READ.get((), _read_requirements)


def _read_requirements() -> dict[str, Requirement]:
    source = _dispatch_source()
    if source is None:
        return {}
    try:
        return parse_requirements(source)
    except SyntaxError:
        return {}


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:4])


def missing_requirement(backend: str) -> Unsupported | None:
    """Why `backend` cannot run here for want of a package (diffusers' own message), or None when it has what it
    needs or nothing could be read. torch itself is left to the ranks."""
    req = installed_requirements().get(backend)
    if req is None or req.package == "torch":
        return None
    said = req.message.replace("'…'", repr(backend))
    try:
        version = importlib.metadata.version(req.package)
    except importlib.metadata.PackageNotFoundError:
        return Unsupported(
            UnsupportedKind.MISSING_PACKAGE, f"{backend} needs {req.package}, which is not installed here (diffusers: {said})"
        )
    if req.minimum and _version_tuple(version) < _version_tuple(req.minimum):
        return Unsupported(
            UnsupportedKind.MISSING_PACKAGE, f"{backend} needs {req.package}>={req.minimum}, found {version} (diffusers: {said})"
        )
    return None
