"""cpdoctor's startup module for `cpdoctor step -- <command>`: this folder goes first on PYTHONPATH of the command
cpdoctor launches, so every Python process of the job (the torchrun agent and each rank alike) imports this file at
startup, as coverage.py arms its subprocess measurement.

Without `CPDOCTOR_STEP_DIR` in the environment it does nothing of its own: no torch import, no hook; it only runs
the `sitecustomize` this folder hides (the next one on sys.path, imported by its path, so the user's or the
distribution's keeps working). With it, it installs an excepthook that leaves this process's traceback in that
folder (`raised/<who>.txt`, who: `rank<RANK>`, else `pid<PID>`), and arms the capture named in the folder's
`arm.json` (its `entry`, `module:function`, called with the folder) when torch is first imported: an import hook
that lets torch's own import finish, then calls the entry. A process that never imports torch never pays for it.

Standard library only: this file runs in whatever Python the command starts, before anything else."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback

VARIABLE = "CPDOCTOR_STEP_DIR"
"""The folder of one run of `cpdoctor step -- <command>`: its arm.json, and where the processes leave what they found."""

HERE = os.path.dirname(os.path.realpath(__file__))


def who() -> str:
    """This process's name in the run's folder: its rank when its launcher set RANK (torchrun's workers), else its pid."""
    rank = os.environ.get("RANK")
    return f"rank{rank}" if rank is not None and rank.isdigit() else f"pid{os.getpid()}"


def chain() -> None:
    """Run the `sitecustomize` this one hides: the first found on sys.path after this folder, imported by its path
    under the name `sitecustomize` (which then names it in sys.modules). Its failure is reported as Python's own
    site does ("Error in sitecustomize"), never raised."""
    entries = [os.path.realpath(p or os.getcwd()) for p in sys.path]
    after = entries[entries.index(HERE) + 1 :] if HERE in entries else entries
    for folder in after:
        for path, package in (
            (os.path.join(folder, "sitecustomize.py"), None),
            (os.path.join(folder, "sitecustomize", "__init__.py"), folder),
        ):
            if os.path.isfile(path) and os.path.dirname(os.path.realpath(path)) != HERE:
                _load(path, package)
                return


def _load(path: str, package: str | None) -> None:
    locations = [os.path.dirname(path)] if package else None
    spec = importlib.util.spec_from_file_location("sitecustomize", path, submodule_search_locations=locations)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    # not a probe: what site.py itself does with a failing sitecustomize, before cpdoctor can be imported
    except Exception as exc:  # noqa: BLE001 - as site.py does with a failing sitecustomize: said, not raised
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}", file=sys.stderr)


def write_raised(directory: str, message: str, text: str) -> None:
    """This process's exception for the parent: its one line, then its traceback (launch/progress.py reads it)."""
    folder = os.path.join(directory, "raised")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{who()}.txt")
    with open(path + ".tmp", "w") as fh:
        fh.write(message.replace("\n", " ") + "\n" + text)
    os.replace(path + ".tmp", path)


def install_excepthook(directory: str) -> None:
    """An exception nobody caught in this process is written for the parent before Python prints it."""
    previous = sys.excepthook

    def hook(kind: type, value: BaseException, tb: object) -> None:
        try:
            write_raised(directory, f"{kind.__name__}: {value}", "".join(traceback.format_exception(kind, value, tb)))
        except OSError:
            pass  # the run's folder is gone (the parent ended): Python still prints the traceback
        previous(kind, value, tb)

    sys.excepthook = hook


class _ArmedLoader(importlib.abc.Loader):
    """torch's own loader, with the capture armed once torch's import has finished."""

    def __init__(self, loader: importlib.abc.Loader, arm: object) -> None:
        self.loader = loader
        self.arm = arm

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        return self.loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        self.loader.exec_module(module)
        self.arm()

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...: torch's loader answers
        return getattr(self.loader, name)


class OnTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is first imported, it takes torch's own spec from the finders after it and
    wraps its loader, so that `arm()` runs right after `import torch` completes. It leaves sys.meta_path at once."""

    def __init__(self, arm: object) -> None:
        self.arm = arm

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            spec.loader = _ArmedLoader(spec.loader, self.arm)
        return spec


def armer(directory: str) -> object:
    """The call that arms this process: the entry arm.json names, called with the run's folder. A failure to arm
    is written for the parent (`raised/<who>.arm.txt`) and the process goes on unarmed."""

    def arm() -> None:
        try:
            with open(os.path.join(directory, "arm.json")) as fh:
                entry = json.load(fh)["entry"]
            module, _, function = entry.partition(":")
            getattr(importlib.import_module(module), function)(directory)
        # not a probe: the startup module imports nothing of cpdoctor's until armed; written for the parent
        except Exception as exc:  # noqa: BLE001 - the user's job must start all the same; the parent reports it
            folder = os.path.join(directory, "raised")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{who()}.arm.txt"), "w") as fh:
                fh.write(f"cpdoctor could not arm {sys.executable}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")

    return arm


def main() -> None:
    directory = os.environ.get(VARIABLE)
    if directory:
        install_excepthook(directory)
        arm = armer(directory)
        if "torch" in sys.modules:
            arm()
        else:
            sys.meta_path.insert(0, OnTorchImport(arm))
    chain()


main()
