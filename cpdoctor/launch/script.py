"""Processes for checking an upstream fix: a plain script under torchrun (the written repro.py), and every rank
cpdoctor launches importing a given folder first (a patched copy of diffusers).

A verified fix runs against a copy of the installed package, never the user's install: the copy goes first on
PYTHONPATH of the processes started here, so `import diffusers` finds it before site-packages."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from cpdoctor.launch.spawn import PORT_TAKEN, PORT_TRIES, free_port


def path_first(folder: str, path: str | None) -> str:
    """PYTHONPATH with `folder` first and what was there after it."""
    return os.pathsep.join(p for p in (folder, path) if p)


@contextlib.contextmanager
def ranks_import_first(folder: str) -> Iterator[None]:
    """While inside, every rank cpdoctor spawns (they inherit this process's environment) imports from `folder`
    before anything else; the environment is restored on the way out."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path_first(folder, before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@dataclass(frozen=True)
class ScriptRun:
    """What a script printed and how it ended (returncode None: it ran past its timeout and was killed)."""

    returncode: int | None
    stdout: str
    stderr: str


def run_under_torchrun(script: str, world_size: int, import_first: str, cwd: str, timeout_s: float) -> ScriptRun:
    """`torchrun --nproc-per-node W script` on this host, `import_first` first on the ranks' PYTHONPATH and
    nothing of cpdoctor's on it (the script must need only torch and diffusers). A run whose rendezvous port was
    taken before torchrun bound it (spawn.PORT_TRIES: our race, not the script's failure) is started again."""
    run = _torchrun_once(script, world_size, import_first, cwd, timeout_s)
    for _ in range(PORT_TRIES - 1):
        if run.returncode in (0, None) or PORT_TAKEN not in run.stderr:
            break
        run = _torchrun_once(script, world_size, import_first, cwd, timeout_s)
    return run


def _torchrun_once(script: str, world_size: int, import_first: str, cwd: str, timeout_s: float) -> ScriptRun:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = import_first
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-port",
        str(free_port()),
        script,
    ]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: a timeout kills torchrun and every rank it started
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return ScriptRun(None, stdout, stderr)
    return ScriptRun(proc.returncode, stdout, stderr)
