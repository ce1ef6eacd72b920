"""The rules of the house that a reader cannot check at a glance (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "cpdoctor"


def _sources(skip: str) -> list[pathlib.Path]:
    return [p for p in PACKAGE.rglob("*.py") if skip not in p.relative_to(PACKAGE).parts]


def _diffusers_private_uses(tree: ast.AST) -> list[str]:
    """`_private` names imported from diffusers, and `_private` attributes read off a module alias bound to a
    diffusers import (e.g. `import diffusers.models.attention_dispatch as ad; ad._foo`)."""
    aliases: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diffusers"):
            found += [a.name for a in node.names if a.name.startswith("_")]
            aliases.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("diffusers"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(node.attr)
    for node in ast.walk(tree):  # getattr(module, "_name") on a diffusers module
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
            target, name = node.args[0], node.args[1]
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and name.value.startswith("_")
                and not name.value.startswith("__")
            ):
                if isinstance(target, ast.Name) and target.id in aliases | {"mod", "dispatch", "module"}:
                    found.append(name.value)
    return found


def test_private_diffusers_names_only_in_compat():
    offenders = {}
    for path in _sources(skip="compat"):
        names = _diffusers_private_uses(ast.parse(path.read_text()))
        if names:
            offenders[str(path.relative_to(PACKAGE))] = sorted(set(names))
    assert not offenders, f"private diffusers names outside cpdoctor/compat/: {offenders}"


def test_the_rule_catches_an_offender():
    tree = ast.parse(
        "import diffusers.models.attention_dispatch as ad\nx = ad._AttentionBackendRegistry\nfrom diffusers.models import _modeling_parallel\n"
    )
    assert set(_diffusers_private_uses(tree)) == {"_AttentionBackendRegistry", "_modeling_parallel"}


def _process_calls(tree: ast.AST) -> list[str]:
    """Calls that start processes or run collectives (code only: a generated script's text does not count)."""
    names = {
        "init_process_group",
        "all_reduce",
        "gather_object",
        "all_gather_object",
        "broadcast_object_list",
        "barrier",
        "Popen",
        "new_group",
    }
    return [
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
    ]


def test_collectives_only_in_launch_and_the_fix():
    offenders = {
        str(p.relative_to(PACKAGE)): _process_calls(ast.parse(p.read_text()))
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("launch", "fix")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, offenders


def test_the_collective_rule_catches_an_offender():
    assert _process_calls(ast.parse("import torch.distributed as dist\ndist.all_reduce(t)\ns = 'dist.barrier()'\n")) == ["all_reduce"]


def test_no_version_strings_in_product_code():
    import re

    pattern = re.compile(r"""__version__\s*([<>]|[!=]=)|version\.parse|["']0\.(3[6-9]|4\d)\.\d["']""")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, offenders


def test_help_imports_neither_torch_nor_diffusers():
    code = "import sys, runpy\nsys.argv=['cpdoctor','--help']\ntry:\n runpy.run_module('cpdoctor', run_name='__main__')\nexcept SystemExit: pass\nprint(sorted(m for m in ('torch','diffusers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip().endswith("[]"), out
