"""Ranks that start warm: forked from one process that already imported torch and diffusers.

A spawned rank used to be a fresh `python -m cpdoctor.launch`, and importing torch and diffusers again cost every
launch 3.3-3.8 s on a 2-core machine (issue 28): the doctor's five launches spent most of their time there. A
command that launches ranks now starts one server first (`WARM.start`, before it plans or prints anything), which
imports what every rank needs while the parent works; each rank is then a fork of it (~0.1 s).

The server is Python's own `multiprocessing` fork server (`forkserver` start method, `set_forkserver_preload`):
it relays each child's exit code to the parent, and stops when the parent does. What a warm rank adds on top:
- it leaves the fork server's process group (`os.setsid`, so the supervisor kills its whole tree as it does a
  spawned rank's), dies with the server (`PR_SET_PDEATHSIG`, set in worker_main), and lets go of the server's
  "alive" pipe, so that the server, and with it every rank, goes when the command dies;
- its stdout and stderr go to its own log file, its environment is exactly a spawned rank's, and its threads are
  the spawned rank's share of the cores (`torch.set_num_threads`: torch read nothing before the fork).

A launch starts warm only when a fork sees what a fresh interpreter would (`WarmStarts.serves`): the same
environment as the server's (a changed PYTHONPATH, e.g. the upstream fix's patched copy of diffusers, or a changed
HF_HOME would not be seen by modules already imported) and a job that needs nothing imported before diffusers
(the CUDA kernels' stand-ins must be on sys.path before diffusers looks for flash-attn: `Job.fresh_interpreter`).
Otherwise, or when the server cannot fork, the rank is spawned as before. Under torchrun nothing is started.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

PER_RANK_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "CPDOCTOR_SPAWNED",
        "PYTHONUNBUFFERED",
    }
)
"""The variables spawn.rank_environment sets per rank: they may differ from the server's environment."""

QUIET_MODULE = "cpdoctor.launch.warm_quiet"
"""Imported first in the server: points its stdout and stderr at /dev/null (the server inherits the command's
terminal, and a warning printed while diffusers imports must not land in a `--json -` document)."""


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_RANK_KEYS}


class WarmStarts:
    """The fork server warm ranks start from, and the environment it was started in. Lifetime: started by
    `start` (a CLI command that launches ranks, before it plans), kept for the process's life; `stop` ends the
    server (tests, and a command that changes what ranks must import)."""

    def __init__(self) -> None:
        self.context: Any = None
        self.environment: dict[str, str] | None = None
        self.sys_path: list[str] | None = None

    @property
    def started(self) -> bool:
        return self.context is not None

    def start(self, modules: tuple[str, ...]) -> bool:
        """Start the server, importing `modules` in it (in the background: this returns at once); False where
        there is no fork (not POSIX) or it cannot start. Idempotent."""
        if self.started:
            return True
        import multiprocessing
        from multiprocessing import forkserver

        if "forkserver" not in multiprocessing.get_all_start_methods() or not _main_is_importable():
            return False
        try:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([QUIET_MODULE, *modules])
            forkserver.ensure_running()
        except (OSError, ValueError, RuntimeError):  # no AF_UNIX socket or fork here: spawn as before
            return False
        self.context = context
        self.environment = _comparable(dict(os.environ))
        self.sys_path = list(sys.path)
        import atexit

        atexit.register(self.stop)  # a command that ends before its preload did leaves nothing importing behind
        return True

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a rank with environment `env` may be a fork of the server: it is running and a fork sees what
        a fresh interpreter started with `env` would."""
        return self.started and self.environment == _comparable(env) and self.sys_path == list(sys.path)

    def fork_rank(self, job_path: str, out_dir: str, env: dict[str, str], log_path: str) -> WarmRank:
        """One rank, forked from the server, running `worker_main(job_path, out_dir)` with environment `env` and
        its output in `log_path`. OSError where the server cannot fork (the caller spawns instead)."""
        process = self.context.Process(target=_rank_main, args=(job_path, out_dir, env, log_path), daemon=False)
        try:
            process.start()
        except (EOFError, ConnectionError, FileNotFoundError) as exc:  # the server went away
            raise OSError(f"the fork server did not answer: {exc}") from exc
        return WarmRank(process)

    def stop(self) -> None:
        """Stop the server now, even in the middle of its imports (at this process's exit, and in tests). Every
        rank forked from it has been waited for or killed by then (spawn.py); one still alive dies with it."""
        if not self.started:
            return
        import signal
        from multiprocessing import forkserver

        server = forkserver._forkserver  # the stdlib's one server of this process (private, stable since 3.4)
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None:  # not asked to stop politely: it may be in the middle of an import, and would finish it
            with contextlib.suppress(OSError):  # it is gone already
                os.kill(pid, signal.SIGKILL)
                # Dead before this returns, but not reaped (WNOWAIT): `ensure_running` reaps it, so a later `start`
                # finds it dead and starts a new server instead of connecting to the dying one.
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        self.context = None
        self.environment = None
        self.sys_path = None


WARM = WarmStarts()


def _main_is_importable() -> bool:
    """Whether a forked child can set up `__main__` as multiprocessing does (it imports the parent's main module
    again, under another name): a `-m` module or a script on disk; not `python -` or `python -c`, whose main has no
    file to import (the child would die before it runs anything)."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    return path is not None and os.path.isfile(path)


@dataclass
class WarmRank:
    """A forked rank, with the part of `subprocess.Popen`'s interface the supervisor uses (spawn.py)."""

    process: Any

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def _rank_main(job_path: str, out_dir: str, env: dict[str, str], log_path: str) -> None:
    """In the forked child: become a spawned rank, then run the worker."""
    os.setsid()
    with contextlib.suppress(AttributeError, OSError):  # let the server go when the command goes (stdlib private)
        from multiprocessing import forkserver

        fd = forkserver._forkserver._forkserver_alive_fd
        if fd is not None:
            os.close(fd)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit():
        torch.set_num_threads(int(threads))
    from cpdoctor.launch.worker import worker_main

    code = worker_main(job_path, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as launch/__main__.py: no interpreter finalization after a gloo job
