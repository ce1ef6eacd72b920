"""The rules of the house that a reader cannot check at a glance (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest


@functools.cache
def parsed(path: pathlib.Path) -> ast.AST:
    """A module's syntax tree, parsed once for the whole file of rules (the rules only read it): the owner rule
    alone walked every module once per owner, 45 s of the unit tier under load."""
    return ast.parse(path.read_text())


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
        names = _diffusers_private_uses(parsed(path))
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
        names = private_attribute_reads(parsed(path), theirs, ours)
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
        str(p.relative_to(PACKAGE)): _process_calls(parsed(p))
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


BROAD = {"Exception", "BaseException"}


def _is_broad(node: ast.expr | None) -> bool:
    """A bare `except:`, `Exception` / `BaseException`, or a tuple holding one of them."""
    if node is None:
        return True
    if isinstance(node, ast.Tuple):
        return any(_is_broad(e) for e in node.elts)
    return (node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)) in BROAD


def unexplained_broad_excepts(source: str) -> list[int]:
    """Lines of `except Exception` / `except BaseException` / bare `except:` / `suppress(Exception)` with no
    reason: a comment of two words or more (a `noqa` code aside) on the same line or on a comment line just above."""
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}

    def explained(line: int) -> bool:
        above = line - 1 if line > 1 and lines[line - 2].lstrip().startswith("#") else None
        for n in (line, above):
            text = re.sub(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?", "", comments.get(n, "") if n else "")
            if len(re.findall(r"\w+", text)) >= 2:
                return True
        return False

    broad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and _is_broad(node.type):
            broad.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "suppress":
            if any(_is_broad(a) for a in node.args):
                broad.append(node.lineno)
    return sorted(n for n in broad if not explained(n))


def test_every_broad_except_says_why():
    offenders = {str(p.relative_to(PACKAGE)): lines for p in PACKAGE.rglob("*.py") if (lines := unexplained_broad_excepts(p.read_text()))}
    assert not offenders, f"broad excepts without a one-line reason (narrow them, or say why): {offenders}"


def test_the_broad_except_rule_catches_an_offender():
    planted = (
        "import contextlib\n"
        "try:\n    f()\nexcept Exception:  # noqa: BLE001\n    pass\n"  # 4: a noqa code is no reason
        "try:\n    f()\nexcept (ValueError, BaseException):\n    pass\n"  # 8
        "with contextlib.suppress(Exception):\n    f()\n"  # 10
        "try:\n    f()\nexcept:\n    pass\n"  # 14
        "try:\n    f()\nexcept Exception:  # noqa: BLE001 - the user's code may raise anything\n    pass\n"
        "# broad: teardown of a broken group raises anything\nwith contextlib.suppress(Exception):\n    f()\n"
        "try:\n    f()\nexcept ValueError:\n    pass\n"
    )
    assert unexplained_broad_excepts(planted) == [4, 8, 10, 14]


TRACEBACK_READS = {"format_exc", "exc_info", "print_exc", "format_exception"}
NOT_A_PROBE = re.compile(r"#.*\bnot a probe:\s*\w+\s+\w+")


def exceptions_made_data(source: str, tree: ast.AST | None = None) -> list[int]:
    """Lines of `except` handlers that keep the exception as data (they read the name they bind, or the traceback
    text, and do not end by raising) with no `# not a probe: <why>` on the handler's line or the comment line just
    above: a probe's exception becomes data only through `Attempt.of` (attempt.py). A handler that re-raises, or
    that maps a narrow, expected exception to a default without keeping it (`except ImportError: return None`),
    keeps nothing of it and is not one."""
    lines = source.splitlines()

    def justified(line: int) -> bool:
        above = lines[line - 2] if line > 1 and lines[line - 2].lstrip().startswith("#") else ""
        return bool(NOT_A_PROBE.search(lines[line - 1]) or NOT_A_PROBE.search(above))

    found = []
    for node in ast.walk(tree if tree is not None else ast.parse(source)):
        if not isinstance(node, ast.ExceptHandler) or isinstance(node.body[-1], ast.Raise):
            continue
        inner = [n for stmt in node.body for n in ast.walk(stmt)]
        reads = node.name is not None and any(isinstance(n, ast.Name) and n.id == node.name for n in inner)
        traced = any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) in TRACEBACK_READS for n in inner)
        if (reads or traced) and not justified(node.lineno):
            found.append(node.lineno)
    return sorted(found)


def test_exceptions_become_data_only_through_attempt():
    offenders = {
        str(p.relative_to(PACKAGE)): lines
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE) != pathlib.Path("attempt.py") and (lines := exceptions_made_data(p.read_text(), parsed(p)))
    }
    assert not offenders, f"exceptions kept as data outside Attempt.of (use it, or say `# not a probe: why`): {offenders}"


def test_the_attempt_rule_catches_an_offender():
    planted = (
        "import traceback\n"
        "try:\n    f()\nexcept ValueError as exc:\n    why = str(exc)\n"  # 4: the message kept
        "try:\n    f()\nexcept Exception:  # noqa: BLE001 - reported\n    tb = traceback.format_exc()\n"  # 8: the traceback kept
        "try:\n    f()\nexcept OSError as exc:\n    log(exc)\n    raise\n"  # re-raised: fine
        "try:\n    f()\nexcept ImportError:\n    x = None\n"  # a default, nothing kept: fine
        "try:\n    f()\nexcept KeyError as exc:  # not a probe: the caller's one-line error\n    print(exc)\n"
        "try:\n    f()\n# not a probe: the command's exit code\nexcept SystemExit as exc:\n    code = exc.code\n"
        "try:\n    f()\nexcept TypeError as exc:  # not a probe:\n    print(exc)\n"  # 30: a marker without a reason
    )
    assert exceptions_made_data(planted) == [4, 8, 30]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's own modules a module imports, at module level and inside functions alike (a function-level
    import is the same dependency, paid later), `if TYPE_CHECKING:` blocks aside. `from pkg import mod` names the
    module."""
    found: set[str] = set()
    body: list[ast.AST] = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body += node.orelse
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        else:
            body += list(ast.iter_child_nodes(node))
    return {m for m in found if m in modules}


def _package_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in it)."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py") if "flash_attn_standin" not in p.parts}
    return {name: _imports(parsed(path), name, path.name == "__init__.py", set(paths)) - {name} for name, path in paths.items()}


def import_cycles(root: pathlib.Path = PACKAGE) -> list[list[str]]:
    """Circles of imports among the package's modules (module level and inside functions), each as the modules
    around it."""
    graph = _package_graph(root)
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycle = trail[trail.index(node) :]
            start = cycle.index(min(cycle))
            if (rotated := cycle[start:] + cycle[:start]) not in cycles:
                cycles.append(rotated)
            return
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*trail, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    return cycles


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "modules that import each other (at module level or inside a function):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_the_cycle_rule_catches_a_planted_cycle(tmp_path):
    pkg = tmp_path / "cpdoctor"
    (pkg / "model_zoo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model_zoo" / "__init__.py").write_text("")
    (pkg / "model_zoo" / "catalog.py").write_text("from cpdoctor.model_zoo.inputs import build\n")
    (pkg / "model_zoo" / "inputs.py").write_text("from . import names\n")
    (pkg / "model_zoo" / "names.py").write_text("import cpdoctor.model_zoo.catalog\n")
    (pkg / "model_zoo" / "lazy.py").write_text("def f():\n    from cpdoctor.model_zoo import lazy2\n")
    (pkg / "model_zoo" / "lazy2.py").write_text("from cpdoctor.model_zoo import lazy\n")
    (pkg / "model_zoo" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cpdoctor.model_zoo import typed2\n"
    )
    (pkg / "model_zoo" / "typed2.py").write_text("from cpdoctor.model_zoo import typed\n")
    assert import_cycles(pkg) == [
        ["cpdoctor.model_zoo.catalog", "cpdoctor.model_zoo.inputs", "cpdoctor.model_zoo.names"],
        ["cpdoctor.model_zoo.lazy", "cpdoctor.model_zoo.lazy2"],
    ]


def imported_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a file imports, at module level or in a function, absolute imports only:
    `import a.b` is `a.b`; `from a.b import c` is `a.b.c` (c a module or a name in a.b: a rule reads the prefix)."""
    names = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
    return names


def sibling_imports(root: pathlib.Path = PACKAGE) -> list[str]:
    """`file:line imports examinations.<kind>` for every import (module level or inside a function) from one
    examination package (examinations/<kind>/) into a sibling kind's. What two kinds share lives in modules at
    examinations/ level (commands, backend_choice, request, judging, ...) or in the rooms docs/ARCHITECTURE.md
    names; one kind runs another only through the registry, by its `Kind`."""
    home = root / "examinations"
    kinds = {p.name for p in home.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    offences = []
    for path in sorted(home.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 3:  # an examinations-level module
            continue
        for lineno, module in imported_names(path):
            parts = module.split(".")
            if parts[:2] == ["cpdoctor", "examinations"] and len(parts) > 2 and parts[2] in kinds - {rel.parts[1]}:
                offences.append(f"{rel.as_posix()}:{lineno} imports examinations.{parts[2]}")
    return offences


def test_examination_packages_do_not_import_their_siblings():
    offences = sibling_imports()
    assert not offences, "an examination package importing another kind's (move what they share up):\n" + "\n".join(offences)


def test_the_sibling_rule_catches_an_offender(tmp_path):
    home = tmp_path / "examinations"
    for kind in ("attention", "model", "step"):
        (home / kind).mkdir(parents=True)
        (home / kind / "__init__.py").write_text("")
    (home / "registry.py").write_text("from cpdoctor.examinations.attention import judge\n")  # examinations level: allowed
    (home / "model" / "probe.py").write_text(
        "from cpdoctor.examinations import registry\nfrom cpdoctor.examinations.model import build\n"
        "def f():\n    from cpdoctor.examinations.attention import probe\n"
    )
    (home / "step" / "judge.py").write_text(
        "import cpdoctor.examinations.model.judge\nfrom cpdoctor.examinations import attention, commands\n"
    )
    assert sibling_imports(tmp_path) == [
        "examinations/model/probe.py:4 imports examinations.attention",
        "examinations/step/judge.py:1 imports examinations.model",
        "examinations/step/judge.py:2 imports examinations.attention",
    ]


STEP_ROOMS_MAY_IMPORT = {
    "runs": {"runs", "watcher", "judgment"},
    "watcher": {"watcher", "judgment"},
    "judgment": {"judgment"},
}
"""The step wing's three rooms (examinations/step/__init__.py): the command runs a step, the watcher records it and
hands the recorded group to the judgment. The judgment reads the watcher's records only as data (below)."""
WATCHER_DATA = {"events", "group", "messages", "record"}
"""The watcher's modules whose types the judgment reads (the events, the group, the ranks' messages, the records)."""


def step_room_offences(root: pathlib.Path = PACKAGE) -> list[str]:
    """`file:line imports step.<room>.<module>` for every import, module level or in a function, that goes against
    the step wing's direction: runs → watcher → judgment, and the judgment reading the watcher's data only."""
    home = root / "examinations" / "step"
    prefix = ["cpdoctor", "examinations", "step"]
    offences = []
    for room in STEP_ROOMS_MAY_IMPORT:
        for path in sorted((home / room).rglob("*.py")):
            for lineno, module in imported_names(path):
                parts = module.split(".")
                if parts[:3] != prefix or len(parts) < 5 or parts[3] not in STEP_ROOMS_MAY_IMPORT:
                    continue
                target, name = parts[3], parts[4]
                allowed = target in STEP_ROOMS_MAY_IMPORT[room] or (room == "judgment" and target == "watcher" and name in WATCHER_DATA)
                if not allowed:
                    offences.append(f"{path.relative_to(root).as_posix()}:{lineno} imports step.{target}.{name}")
    return offences


def test_the_step_rooms_import_one_way():
    offences = step_room_offences()
    assert not offences, "the step wing's rooms import runs → watcher → judgment:\n" + "\n".join(offences)


def test_the_step_room_rule_catches_an_offender(tmp_path):
    home = tmp_path / "examinations" / "step"
    for room in STEP_ROOMS_MAY_IMPORT:
        (home / room).mkdir(parents=True)
    (home / "judgment" / "judge.py").write_text(
        "from cpdoctor.examinations.step.watcher.group import StepGroup\n"  # data: allowed
        "from cpdoctor.examinations.step.watcher.observe import OBSERVING\n"
        "def f():\n    from cpdoctor.examinations.step.runs import capture\n    import cpdoctor.examinations.step.runs.first\n"
    )
    (home / "watcher" / "watch.py").write_text("from cpdoctor.examinations.step.judgment.judge import rules\n")  # allowed
    (home / "watcher" / "record.py").write_text("from cpdoctor.examinations.step.runs.capture import CAPTURE\n")
    assert step_room_offences(tmp_path) == [
        "examinations/step/watcher/record.py:1 imports step.runs.capture",
        "examinations/step/judgment/judge.py:2 imports step.watcher.observe",
        "examinations/step/judgment/judge.py:4 imports step.runs.capture",
        "examinations/step/judgment/judge.py:5 imports step.runs.first",
    ]


def classes_sharing_a_name(root: pathlib.Path = PACKAGE) -> dict[str, list[str]]:
    """Class names defined more than once in the package, with the files defining them: one class per name, so
    that a name read anywhere (`Variant`, `Step`) means one thing (the vocabulary's enum, the examination)."""
    seen: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if "flash_attn_standin" in path.parts:  # a stand-in of another package, with that package's names
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(path.relative_to(root).as_posix())
    return {name: files for name, files in seen.items() if len(files) > 1}


def test_one_class_per_name():
    assert classes_sharing_a_name() == {}


def test_the_one_class_per_name_rule_catches_an_offender(tmp_path):
    (tmp_path / "vocabulary.py").write_text("import enum\nclass Variant(enum.Enum):\n    BASIC = 'basic'\n")
    (tmp_path / "peer_impls").mkdir()
    (tmp_path / "peer_impls" / "base.py").write_text("def f():\n    class Variant:\n        pass\nclass VariantSpec:\n    pass\n")
    assert classes_sharing_a_name(tmp_path) == {"Variant": ["peer_impls/base.py", "vocabulary.py"]}


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
    for lineno, module in imported_names(path):
        parts = module.split(".")
        if parts[0] == "cpdoctor" and len(parts) > 1:
            out.append((parts[1], lineno))
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


# ------------------------------------------------------------------------------------------ state owners

CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "bytearray"}
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "appendleft", "extendleft", "popleft", "sort", "reverse", "difference_update", "intersection_update",
    "symmetric_difference_update",
}  # fmt: skip
CACHE_DECORATORS = {"cache", "lru_cache"}

STATE_OWNERS = {
    "fix/put_aside.py": "STATE",
    "launch/torchrun.py": "HELD",
    "launch/progress.py": "ACTIVE",
    "launch/warm.py": "WARM",
    "cpu_kernels/standins.py": "LIBRARY",
    "examinations/step/watcher/watch.py": "WATCHED",
    "examinations/step/watcher/observe.py": "OBSERVING",
    "examinations/step/runs/capture.py": "CAPTURE",
    "autopatch.py": "AUTOPATCH",
    "peer_impls/yunchang.py": "GROUPS",
    "examinations/model/spec.py": "SURVEYS",
    "model_zoo/catalog.py": "SCANNED",
    "model_zoo/tiny.py": "DERIVED",
    "compat/requirements.py": "READ",
}
"""The owners of cpdoctor's process-wide state (module -> its module-level owner instance), each listed with its
lifetime in docs/ARCHITECTURE.md. State lives inside them (their own methods change it), nowhere else."""

ALLOWED_STATE: dict[str, dict[str, str]] = {}
"""module -> {what the state rule reports there (without its line, e.g. "global _x"): why it is allowed}. Empty:
every piece of state has its owner (STATE_OWNERS)."""


def _is_mutable_value(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    func = value.func if isinstance(value, ast.Call) else None
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return name in CONTAINER_CALLS


def _locally_bound(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    """Names a function binds itself (its parameters, assignments, loops, imports): they shadow module names."""
    args = fn.args
    bound = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    bound |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound


def module_state_offences(source: str) -> list[str]:
    """Process-wide state held outside an owner object, as `line: what`: a `global` statement; a module-level
    dict/list/set (display, comprehension or constructor) that the module changes (item assignment or `del`,
    a mutating method, an attribute set on it); `functools.cache` / `lru_cache` on a function (a cache no one
    owns); a class attribute set through `cls.` or the class's name (class-level state). Constant tables (never
    changed) and owner instances (changed only by their own methods, through `self`) are what is left."""
    tree = ast.parse(source)
    found: list[str] = []
    tables = {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _is_mutable_value(node.value)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def scan(node: ast.AST, shadowed: set[str], cls_name: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            first = node.args.args[0].arg if node.args.args else None
            for deco in getattr(node, "decorator_list", []):
                target = deco.func if isinstance(deco, ast.Call) else deco
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                if name in CACHE_DECORATORS:
                    found.append(f"{node.lineno}: @{name} on {node.name}")
            inner = shadowed | _locally_bound(node)
            body = node.body if isinstance(node.body, list) else [node.body]
            for child in body:
                scan(child, inner, first if first == "cls" else None)
            return
        if isinstance(node, ast.Global):
            found.append(f"{node.lineno}: global {', '.join(node.names)}")
        live = tables - shadowed
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in (e for target in targets for e in ast.walk(target)):
            if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) and isinstance(t.ctx, (ast.Store, ast.Del)):
                base = t.value.id
                if base in live:
                    found.append(f"{node.lineno}: {base} changed")
                elif isinstance(t, ast.Attribute) and (base == cls_name or (base in classes and base not in shadowed)):
                    found.append(f"{node.lineno}: class attribute {base}.{t.attr} set")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            base = node.func.value
            if isinstance(base, ast.Name) and base.id in live:
                found.append(f"{node.lineno}: {base.id}.{node.func.attr}()")
        for child in ast.iter_child_nodes(node):
            scan(child, shadowed, cls_name)

    scan(tree, set(), None)
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_no_module_level_state_outside_its_owner():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = ALLOWED_STATE.get(rel, {})
        found = [f for f in module_state_offences(path.read_text()) if f.split(": ", 1)[1] not in allowed]
        if found:
            offenders[rel] = found
    assert not offenders, "process-wide state outside an owner (see docs/ARCHITECTURE.md, state owners):\n" + "\n".join(
        f"{rel}:{line}" for rel, lines in offenders.items() for line in lines
    )


def test_the_state_rule_catches_an_offender():
    planted = """
import functools

_SEEN = {}
_ORDER: list = []
TABLE = {"a": 1}
_count = 0


class Counter:
    n = 0

    @classmethod
    def next(cls):
        cls.n += 1
        return cls.n


def remember(key, value):
    global _count
    _count += 1
    _SEEN[key] = value
    _ORDER.append(key)
    Counter.n = 0
    return TABLE[key]


def local_only():
    _SEEN = {}
    _SEEN["x"] = 1


@functools.lru_cache(maxsize=1)
def scan():
    return TABLE
"""
    assert module_state_offences(planted) == [
        "15: class attribute cls.n set",
        "20: global _count",
        "22: _SEEN changed",
        "23: _ORDER.append()",
        "24: class attribute Counter.n set",
        "34: @lru_cache on scan",
    ]


def test_every_state_owner_is_documented():
    """Each owner instance exists at module level, its class's docstring states its lifetime, and
    docs/ARCHITECTURE.md lists it."""
    text = ARCHITECTURE.read_text()
    for rel, name in STATE_OWNERS.items():
        tree = parsed(PACKAGE / rel)
        value = next(
            (n.value for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) and name in [getattr(t, "id", None) for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]),
            None,
        )  # fmt: skip
        assert isinstance(value, ast.Call) and isinstance(value.func, ast.Name), f"{rel}: no module-level owner {name} = Owner(...)"
        docs = [
            ast.get_docstring(node) or ""
            for path in PACKAGE.rglob("*.py")
            for node in ast.walk(parsed(path))
            if isinstance(node, ast.ClassDef) and node.name == value.func.id
        ]
        assert docs and all("Lifetime:" in d for d in docs), f"{rel}: {value.func.id}'s docstring does not state its lifetime"
        assert f"`{name}`" in text and rel in text, f"docs/ARCHITECTURE.md does not list {rel}'s {name}"


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
            found = dtype_tables(parsed(path))
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
        found = str_kinds(parsed(path))
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


REPORT_CLASSES = ("Report", "Finding")
"""The classes every examination returns: what they hold is typed (an Environment, a request object, rows,
evidence dataclasses), a dict of anything only at the JSON boundary (report/serialize.py, `to_dict`)."""


def untyped_report_fields(tree: ast.AST) -> list[str]:
    """`Class.field` for each annotated field of Report / Finding whose annotation holds a string-keyed bag:
    `dict[str, Any]` or `dict[str, object]` (or `Dict[...]`, in a union or Optional). No exemption: what an
    examination adds to its report is a typed section (report/sections.py)."""
    found = []
    for cls in ast.walk(tree):
        if not (isinstance(cls, ast.ClassDef) and cls.name in REPORT_CLASSES):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                text = ast.unparse(stmt.annotation).replace(" ", "").replace("typing.", "")
                if re.search(r"(?i:dict)\[str,(Any|object)\]", text):
                    found.append(f"{cls.name}.{stmt.target.id}")
    return found


def test_no_untyped_dict_on_a_report_or_a_finding():
    offences = [f"{p.relative_to(PACKAGE)}: {f}" for p in PACKAGE.rglob("*.py") for f in untyped_report_fields(parsed(p))]
    assert offences == []


def test_the_untyped_report_field_rule_catches_an_offender():
    planted = (
        "class Report:\n"
        "    environment: dict[str, Any]\n"
        "    request: Dict[str, typing.Any] | None = None\n"
        "    extra: dict[str, object] = field(default_factory=dict)\n"
        "    def to_dict(self) -> dict[str, Any]:\n"
        "        out: dict[str, Any] = {}\n"
        "class Finding:\n"
        "    environment: 'dict[str, Any] | None' = None\n"
        "class Other:\n"
        "    environment: dict[str, Any]\n"
    )
    assert untyped_report_fields(ast.parse(planted)) == ["Report.environment", "Report.request", "Report.extra", "Finding.environment"]
