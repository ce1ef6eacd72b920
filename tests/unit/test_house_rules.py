"""The rules of the house that a reader cannot check at a glance (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

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


PRIVATE_DEFINITION = re.compile(
    r"(?:def\s+(_[A-Za-z]\w*)|self\.(_[A-Za-z]\w*)\s*[:=]|^\s+(_[A-Za-z]\w*)\s*[:=]|^(_[A-Za-z]\w*)\s*[:=]|class\s+(_[A-Za-z]\w*))", re.M
)


def _private_names_defined(root: pathlib.Path) -> set[str]:
    """`_name`s a source tree defines: private functions, classes, class and instance attributes."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for match in PRIVATE_DEFINITION.finditer(path.read_text(errors="ignore")):
            names.update(g for g in match.groups() if g and not g.startswith("__"))
    return names


def private_attribute_reads(tree: ast.AST, theirs: set[str], ours: set[str]) -> list[str]:
    """`x._name` and getattr(x, "_name") where `_name` is private to diffusers (defined there, not by cpdoctor):
    `_cp_plan` read off a model class, `_ring_mesh` off a parallel config, ..."""
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") and len(node.args) >= 2:
            arg = node.args[1]
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        if name and name.startswith("_") and not name.startswith("__") and name in theirs and name not in ours:
            found.append(name)
    return found


TORCH_CORE = ("_ops.py", "_tensor.py", "library.py", "nn/modules/module.py", "autograd/function.py", "distributed/device_mesh.py")
"""torch's modules defining the objects cpdoctor handles besides diffusers' (ops, tensors, libraries, modules,
autograd functions, meshes): their private names are torch's (`op._schema`), not diffusers'."""


def test_private_attributes_of_diffusers_objects_only_in_compat():
    diffusers = pytest.importorskip("diffusers")
    torch_root = pathlib.Path(pytest.importorskip("torch").__file__).parent
    torch_names: set[str] = set()
    for rel in TORCH_CORE:
        for match in PRIVATE_DEFINITION.finditer((torch_root / rel).read_text()):
            torch_names.update(g for g in match.groups() if g)
    theirs = _private_names_defined(pathlib.Path(diffusers.__file__).parent) - torch_names
    ours = _private_names_defined(PACKAGE)
    offenders = {}
    for path in _sources(skip="compat"):
        names = private_attribute_reads(ast.parse(path.read_text()), theirs, ours)
        if names:
            offenders[str(path.relative_to(PACKAGE))] = sorted(set(names))
    assert not offenders, f"private attributes of diffusers objects read outside cpdoctor/compat/: {offenders}"
    caught = private_attribute_reads(
        ast.parse("plan = cls._cp_plan\nmesh = getattr(config, '_ring_mesh')\nx = self._mine"), theirs, {"_mine"}
    )
    assert caught == ["_cp_plan", "_ring_mesh"]


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
    pattern = re.compile(r"""__version__\s*([<>]|[!=]=)|version\.parse|["']0\.(3[6-9]|4\d)\.\d["']""")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, offenders


def test_help_imports_neither_torch_nor_diffusers():
    code = "import sys, runpy\nsys.argv=['cpdoctor','--help']\ntry:\n runpy.run_module('cpdoctor', run_name='__main__')\nexcept SystemExit: pass\nprint(sorted(m for m in ('torch','diffusers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip().endswith("[]"), out


# ------------------------------------------------------------------------------------------------ layering

ARCHITECTURE = PACKAGE.parent / "docs" / "ARCHITECTURE.md"


def layer_table() -> tuple[dict[str, int], dict[str, set[str]]]:
    """The layers docs/ARCHITECTURE.md declares, read from its ```layers block: `N: package package ...`, one line
    a layer, highest first, and `only NAME: package ...` lines that narrow what a package may import."""
    text = ARCHITECTURE.read_text()
    block = text.split("```layers", 1)[1].split("```", 1)[0]
    layers: dict[str, int] = {}
    only: dict[str, set[str]] = {}
    for line in block.strip().splitlines():
        head, _, names = line.partition(":")
        if head.startswith("only "):
            only[head.split()[1]] = set(names.split())
        else:
            for name in names.split():
                layers[name] = int(head)
    return layers, only


def _imported_packages(path: pathlib.Path) -> list[tuple[str, int]]:
    """(top-level cpdoctor package, line) of every import in the file, module level and inside functions alike."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [f"{node.module}.{a.name}" for a in node.names] if node.module == "cpdoctor" else [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "cpdoctor" and len(parts) > 1:
                out.append((parts[1], node.lineno))
    return out


def layering_offences(layers: dict[str, int], only: dict[str, set[str]], root: pathlib.Path = PACKAGE) -> list[str]:
    offences = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "flash_attn_standin" in rel.parts:  # a stand-in of another package, imported by path
            continue
        source = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        assert source in layers, f"{rel}: package {source} has no layer in docs/ARCHITECTURE.md"
        for target, line in _imported_packages(path):
            if target == source:
                continue
            allowed = target in only[source] if source in only else layers.get(target, 99) < layers[source]
            if not allowed:
                offences.append(f"{rel}:{line} imports cpdoctor.{target}")
    return offences


def test_imports_follow_the_layers_of_the_architecture():
    layers, only = layer_table()
    offences = layering_offences(layers, only)
    assert not offences, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(offences)


def test_the_layering_rule_catches_an_offender(tmp_path):
    layers, only = layer_table()
    assert layers["launch"] < layers["examinations"] < layers["api"] and layers["fix"] == layers["launch"]
    assert "examinations" not in only["cli"]
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "worker.py").write_text(
        "def f():\n    from cpdoctor.examinations import registry\n    from cpdoctor import fix\n"
    )
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "env.py").write_text("from cpdoctor.examinations.env import examination\nfrom cpdoctor import api\n")
    assert sorted(layering_offences(layers, only, tmp_path)) == [
        "cli/env.py:1 imports cpdoctor.examinations",
        "launch/worker.py:2 imports cpdoctor.examinations",
        "launch/worker.py:3 imports cpdoctor.fix",
    ]


DTYPE_WORDS = {"fp64", "fp32", "bf16", "fp16"}
TORCH_DTYPES = {"float64", "float32", "bfloat16", "float16", "half", "double"}


def dtype_tables(tree: ast.AST) -> list[int]:
    """Lines of literal tables (dict, tuple, list, set) that spell two or more dtypes, by cpdoctor's names or as
    torch attributes: the vocabulary (cpdoctor/vocabulary.py `DType`) is the one place that may."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None] + list(node.values)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = list(node.elts)
        else:
            continue
        words = {i.value for i in items if isinstance(i, ast.Constant) and i.value in DTYPE_WORDS}
        attrs = {i.attr for i in items if isinstance(i, ast.Attribute) and i.attr in TORCH_DTYPES}
        if len(words) >= 2 or len(attrs) >= 2:
            lines.append(node.lineno)
    return lines


def test_no_dtype_table_outside_the_vocabulary():
    offenders = {}
    for path in _sources("flash_attn_standin"):
        if path.name != "vocabulary.py" or path.parent != PACKAGE:
            found = dtype_tables(ast.parse(path.read_text()))
            if found:
                offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"dtype tables outside cpdoctor/vocabulary.py (file: lines): {offenders}"


def test_the_dtype_table_rule_catches_an_offender():
    planted = (
        'EPS = {"fp32": 2.0**-23, "bf16": 2.0**-7}\n'
        "HALF = (torch.float16, torch.bfloat16)\n"
        'ok = DType("bf16").eps\n'
        'one = "fp32" if x else "auto"\n'
    )
    assert dtype_tables(ast.parse(planted)) == [1, 2]


def str_kinds(tree: ast.AST) -> list[int]:
    """Lines where an examination's kind is a `str`: a `kind` annotated `str` (a field, a variable, a parameter)
    or a class attribute `kind = "..."`. Kinds are `vocabulary.Kind` members, never names looked up as text."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "kind":
            annotation = node.annotation
        elif isinstance(node, ast.arg) and node.arg == "kind":
            annotation = node.annotation
        elif isinstance(node, ast.ClassDef):
            lines += [
                a.lineno
                for a in node.body
                if isinstance(a, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "kind" for t in a.targets)
                and isinstance(a.value, ast.Constant)
                and isinstance(a.value.value, str)
            ]
            continue
        else:
            continue
        if annotation is not None and "str" in re.findall(r"\w+", ast.unparse(annotation)):
            lines.append(node.lineno)
    return lines


def test_no_str_kind():
    offenders = {}
    for path in _sources("flash_attn_standin"):
        found = str_kinds(ast.parse(path.read_text()))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert not offenders, f"`kind: str` (file: lines): {offenders}"


def test_the_str_kind_rule_catches_an_offender():
    planted = (
        "class Examination:\n"
        '    kind: str = ""\n'
        "class Attention(Examination):\n"
        '    kind = "attention"\n'
        "def get(kind: str | None) -> None: ...\n"
        "def typed(kind: Kind) -> None: ...\n"
        "class Fine:\n"
        "    kind = Kind.ATTENTION\n"
    )
    assert sorted(str_kinds(ast.parse(planted))) == [2, 4, 5]
