"""Processes, process groups, meshes, timeouts and the gather to rank 0: the only place that does them.

Two ways in, one worker body:
- started plainly, `run_spawned(job, world_size, timeout)` starts `world_size` copies of this module
  (`python -m cpdoctor.launch JOB OUTDIR`) with torchrun's environment variables, supervises them and turns
  a rank that raised, died or hung into a `RankFailure` within the timeout, killing every process it
  started;
- under torchrun (RANK and WORLD_SIZE set), `run_in_this_process(job, timeout)` joins the existing world.

Either way each rank runs `execute_job`, which calls the job's probe with a `DistContext`; the probe's
per-rank payloads are gathered on rank 0 over a gloo group of their own (so a rank that failed before a
collective of the examination can still report), and rank 0 evaluates them. This module must not import
torch at module level: the CLI imports it to spawn workers and stays light.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from cpdoctor.errors import BadInput, CannotExamine

FAULT_ENV = "CPDOCTOR_INJECT_FAULT"
"""Test hook: `raise@R`, `hang@R` or `exit@R` makes rank R fail that way just before the examination's
first collective, so that the tests can prove the launcher reports it (see tests/test_launch.py)."""

GRACE_AFTER_FAILURE_S = 3.0
"""How long the survivors of a failed rank get to report before they are killed."""

COLLECTIVE_TIMEOUT_SHARE = 0.8
"""A rank's collectives time out at this share of the examination's timeout, so a rank that waited for a
hung peer says so before the deadline, and the rank that never reported is the one named as hung."""


def is_collective_timeout(message: str) -> bool:
    """A collective that gave up waiting for a peer (gloo / NCCL wording), as opposed to a rank's own error."""
    return "timed out" in message.lower() or "timeout" in message.lower()


def under_torchrun() -> bool:
    """True when torchrun (or any launcher with its conventions) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "CPDOCTOR_SPAWNED" not in os.environ


def torchrun_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class RankFailure:
    """A rank that did not deliver a result: `kind` is CRASH (raised or died) or HANG (ran past the timeout)."""

    rank: int
    kind: str
    message: str
    traceback: str = ""


@dataclass
class LaunchResult:
    """What came back: rank 0's evaluated results, or the failures, or a bad-input / cannot-examine line."""

    results: list[Any] | None = None
    failures: list[RankFailure] = field(default_factory=list)
    bad_input: str | None = None
    cannot_examine: str | None = None
    wall_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------
# Inside a rank
# ----------------------------------------------------------------------------------------------------------


@dataclass
class DistContext:
    """What a probe may use of the distributed world: identity, device, CP meshes, the gather to rank 0."""

    rank: int
    world_size: int
    local_rank: int
    device: Any
    pg_backend: str
    timeout_s: float
    _report_group: Any = None
    _meshes: dict = field(default_factory=dict)
    owns_group: bool = True

    @classmethod
    def join(cls, timeout_s: float, device_pref: str = "auto") -> "DistContext":
        """Join (or create) the default process group. NCCL when every local rank has a GPU of its own,
        gloo otherwise, so a one-GPU workstation can still examine CUDA kernels with ranks sharing it."""
        import torch
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise CannotExamine("--device cuda was asked for but torch sees no CUDA device here")
        if use_cuda:
            n_gpu = torch.cuda.device_count()
            device = torch.device("cuda", local_rank % n_gpu)
            torch.cuda.set_device(device)
            pg_backend = "nccl" if n_gpu >= local_world else "gloo"
        else:
            device = torch.device("cpu")
            pg_backend = "gloo"
        timeout = datetime.timedelta(seconds=max(1.0, timeout_s * COLLECTIVE_TIMEOUT_SHARE))
        owns_group = not dist.is_initialized()  # a training script's own group is joined, never destroyed
        if owns_group:
            kwargs: dict[str, Any] = {"backend": pg_backend, "timeout": timeout}
            if pg_backend == "nccl":
                kwargs["device_id"] = device
            dist.init_process_group(**kwargs)
        else:
            pg_backend = dist.get_backend()
        # A group of its own for reports: a rank that failed early gathers there while its peers may still be
        # inside a collective of the examination on the default group, and the two must never pair up.
        report_group = dist.new_group(backend="gloo", timeout=timeout * 2)
        return cls(rank, world_size, local_rank, device, pg_backend, timeout_s, report_group, owns_group=owns_group)

    def cp_mesh(self, ring: int, ulysses: int) -> Any:
        """The (ring, ulysses) device mesh diffusers' ParallelConfig.setup expects."""
        from torch.distributed.device_mesh import init_device_mesh

        if ring * ulysses != self.world_size:
            raise BadInput(f"ring {ring} × ulysses {ulysses} = {ring * ulysses} but the world has {self.world_size} ranks")
        if (ring, ulysses) not in self._meshes:
            self._meshes[ring, ulysses] = init_device_mesh(self.device.type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
        return self._meshes[ring, ulysses]

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (picklable, tensors on CPU) in rank order on rank 0; None elsewhere."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self._report_group)
        return out

    def all_sum_cpu(self, tensor: Any) -> Any:
        """Sum a CPU tensor over all ranks (used for parameter gradients of a model examination)."""
        import torch.distributed as dist

        t = tensor.to(self.device)
        dist.all_reduce(t)
        return t.cpu()

    def broadcast_from_root(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (so every rank of a training script takes the same decision)."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._report_group)
        return box[0]

    def close(self, sync: bool = True) -> None:
        """Destroy what this context created: the report group always, the default group only if ours.
        With `sync`, first wait until every rank is done with the report group (a rank that tears it down
        while a peer still reads from it makes gloo abort the peer)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if sync:
            with contextlib.suppress(Exception):
                dist.barrier(group=self._report_group)
        with contextlib.suppress(Exception):
            if self.owns_group:
                dist.destroy_process_group()
            elif self._report_group is not None:
                dist.destroy_process_group(self._report_group)


JobRunner = Callable[[dict, DistContext], Any]
JobEvaluator = Callable[[dict, list, DistContext], Any]


def _job_functions(kind: str) -> tuple[JobRunner, JobEvaluator]:
    """Probe modules are looked up by the job's kind, so a new examination is one new module."""
    import importlib

    module = importlib.import_module(f"cpdoctor.examinations.{kind}.probe")
    return module.run_rank, module.evaluate


def _inject_fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if "@" not in spec:
        return
    what, _, where = spec.partition("@")
    if int(where) != rank:
        return
    if what == "raise":
        raise RuntimeError(f"fault injected into rank {rank} by {FAULT_ENV}")
    if what == "hang":
        while True:
            time.sleep(3600)
    if what == "exit":
        os._exit(17)


def execute_job(job: dict, ctx: DistContext, on_local_error: Callable[[dict], None] | None = None) -> Any:
    """Run every case of `job` on this rank, gather, and evaluate on rank 0 (returns None elsewhere).

    A case's payload is `{"ok": payload}` or `{"error": ..., "traceback": ...}`; a rank that fails stops
    there, reports through `on_local_error` at once (the spawning parent reacts without waiting for the
    gather), then still joins the gather so torchrun users get the traceback on rank 0 too."""
    run_rank, evaluate = _job_functions(job["kind"])
    results = []
    for case in job["cases"]:
        try:
            _inject_fault(ctx.rank)
            payload: dict = {"ok": run_rank(case, ctx)}
        except BadInput as exc:
            payload = {"bad_input": str(exc)}
        except CannotExamine as exc:
            payload = {"cannot_examine": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a rank's exception is a finding, not our crash
            payload = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            if on_local_error is not None:
                on_local_error(payload)
        try:
            gathered = ctx.gather_to_root(payload)
        except Exception as exc:  # noqa: BLE001 - a peer never reported (torchrun: no supervisor to say so)
            if ctx.rank != 0:
                return None
            hung = {"error": f"did not report: {type(exc).__name__}", "hang": True}
            return results + [{"case": case, "rank_payloads": [payload] + [hung] * (ctx.world_size - 1)}]
        if ctx.rank != 0:
            if "ok" not in payload:
                return None
            continue
        assert gathered is not None
        stop = [p for p in gathered if "ok" not in p]
        if stop:
            return results + [{"rank_payloads": gathered, "case": case}]
        results.append({"case": case, "evaluated": evaluate(case, [p["ok"] for p in gathered], ctx)})
    return results


def _set_parent_death_signal() -> None:
    """Linux: die with the parent, so no worker outlives a killed `cpdoctor`."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(path + ".tmp", "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def worker_main(job_path: str, out_dir: str) -> int:
    """Entry of a spawned rank: results go to files the supervising parent reads."""
    _set_parent_death_signal()
    with open(job_path) as fh:
        job = json.load(fh)
    rank = int(os.environ["RANK"])
    status_path = os.path.join(out_dir, f"rank{rank}.status")

    def report_error(payload: dict) -> None:
        _write_atomic(status_path, pickle.dumps(payload))

    try:
        ctx = DistContext.join(job["timeout"], job.get("device", "auto"))
    except (BadInput, CannotExamine) as exc:
        key = "bad_input" if isinstance(exc, BadInput) else "cannot_examine"
        report_error({key: str(exc)})
        return 0
    try:
        results = execute_job(job, ctx, on_local_error=report_error)
        if rank == 0:
            _write_atomic(os.path.join(out_dir, "result.pkl"), pickle.dumps(results))
    except Exception as exc:  # noqa: BLE001
        report_error({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    finally:
        ctx.close()
    return 0


# ----------------------------------------------------------------------------------------------------------
# The supervising parent
# ----------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def rank_environment(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    """The environment of one single-node rank, torchrun's variables included, with the cores shared out
    (OMP_NUM_THREADS as the user set it, else cores / ranks)."""
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(_threads_per_rank(world_size))),
    )
    env.update(extra)
    return env


def _tail(path: str, n: int = 4000) -> str:
    with contextlib.suppress(OSError):
        with open(path, "rb") as fh:
            data = fh.read()
        return data[-n:].decode(errors="replace")
    return ""


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(Exception):
            p.wait(timeout=5)


def run_spawned(job: dict, world_size: int, timeout_s: float, on_tick: Callable[[], None] | None = None) -> LaunchResult:
    """Start `world_size` ranks, supervise them, and return what they found within `timeout_s`.

    Never leaves a process behind: on success the workers have exited; on a failure or a timeout every one
    still alive is killed (each runs in its own session, so its whole process group goes)."""
    start = time.monotonic()
    job = dict(job, timeout=timeout_s)
    with tempfile.TemporaryDirectory(prefix="cpdoctor-") as out_dir:
        job_path = os.path.join(out_dir, "job.json")
        with open(job_path, "w") as fh:
            json.dump(job, fh)
        port = free_port()
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world_size):
                env = rank_environment(rank, world_size, port, CPDOCTOR_SPAWNED="1", PYTHONUNBUFFERED="1")
                log = open(os.path.join(out_dir, f"rank{rank}.log"), "wb")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "cpdoctor.launch", job_path, out_dir],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
                log.close()
            result = _supervise(procs, out_dir, start + timeout_s, on_tick)
        finally:
            _kill_all(procs)
        result.wall_s = time.monotonic() - start
        return result


def _supervise(procs: list[subprocess.Popen], out_dir: str, deadline: float, on_tick: Callable[[], None] | None) -> LaunchResult:
    world_size = len(procs)
    status: dict[int, dict] = {}  # insertion order = the order in which ranks reported
    first_failure_at: float | None = None
    result_path = os.path.join(out_dir, "result.pkl")
    while True:
        now = time.monotonic()
        for rank, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.status")
            if rank not in status and os.path.exists(path):
                with open(path, "rb") as fh:
                    status[rank] = pickle.load(fh)
            code = p.poll()
            if rank not in status and code not in (None, 0):
                status[rank] = {"error": f"rank {rank} died with exit code {code}", "traceback": _tail(os.path.join(out_dir, f"rank{rank}.log"))}
        if any(("error" in s and not is_collective_timeout(s["error"])) for s in status.values()) and first_failure_at is None:
            first_failure_at = now
        all_exited = all(p.poll() is not None for p in procs)
        if all_exited and os.path.exists(result_path):
            with open(result_path, "rb") as fh:
                return LaunchResult(results=pickle.load(fh))
        for key in ("bad_input", "cannot_examine"):
            lines = [s[key] for s in status.values() if key in s]
            if lines and (all_exited or len(lines) == world_size):
                return LaunchResult(**{key: lines[0]})
        grace_over = first_failure_at is not None and (now - first_failure_at > GRACE_AFTER_FAILURE_S or all_exited)
        if grace_over or now > deadline or all_exited:
            break
        if on_tick is not None:
            on_tick()
        time.sleep(0.05)
    _kill_all(procs)
    failures = []
    for rank in list(status) + [r for r in range(world_size) if r not in status]:
        s = status.get(rank)
        if s is not None and "error" in s and first_failure_at is None and is_collective_timeout(s["error"]):
            failures.append(RankFailure(rank, "STOPPED", "gave up waiting for a peer in a collective", s.get("traceback", "")))
        elif s is not None and "error" in s:
            failures.append(RankFailure(rank, "CRASH", s["error"], s.get("traceback", "")))
        elif first_failure_at is None:
            failures.append(RankFailure(rank, "HANG", "did not finish within the timeout", _tail(os.path.join(out_dir, f"rank{rank}.log"))))
        else:
            failures.append(RankFailure(rank, "STOPPED", "stopped after another rank failed (was waiting in a collective)"))
    return LaunchResult(failures=failures)


def run_in_this_process(job: dict, timeout_s: float) -> LaunchResult:
    """Under torchrun (or inside a training script's process group): this process is one rank. Every rank
    gets rank 0's result, so every rank can act on it alike; `is_reporting_rank()` says who prints."""
    start = time.monotonic()
    job = dict(job, timeout=timeout_s)
    ctx = DistContext.join(timeout_s, job.get("device", "auto"))
    peer_hung = False
    try:
        results = execute_job(job, ctx)
        peer_hung = ctx.rank == 0 and any(p.get("hang") for item in results for p in item.get("rank_payloads", []))
        if not peer_hung:  # a hung peer would never join the broadcast
            try:
                results = ctx.broadcast_from_root(results)
            except Exception as exc:  # noqa: BLE001 - rank 0 saw a hung peer and did not share
                failure = RankFailure(0, "HANG", f"rank 0 did not share the result ({type(exc).__name__})")
                peer_hung = True
                return LaunchResult(failures=[failure], wall_s=time.monotonic() - start)
    finally:
        ctx.close(sync=not peer_hung)
    return LaunchResult(results=results, wall_s=time.monotonic() - start)


def is_reporting_rank() -> bool:
    """Only rank 0 of a torchrun world prints; a spawning parent always does."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


def failures_from_payloads(payloads: list[dict]) -> LaunchResult:
    """Turn the gathered per-rank payloads of a case that stopped into the same shape as a spawned failure."""
    failures = []
    for rank, p in enumerate(payloads):
        if "bad_input" in p:
            return LaunchResult(bad_input=p["bad_input"])
        if "cannot_examine" in p:
            return LaunchResult(cannot_examine=p["cannot_examine"])
        if p.get("hang"):
            failures.append(RankFailure(rank, "HANG", p["error"]))
        elif "error" in p:
            failures.append(RankFailure(rank, "CRASH", p["error"], p.get("traceback", "")))
    return LaunchResult(failures=failures)


def run(job: dict, world_size: int, timeout_s: float, on_tick: Callable[[], None] | None = None) -> LaunchResult:
    """Join torchrun's world when there is one, else spawn the ranks."""
    if under_torchrun():
        if torchrun_world_size() != world_size:
            raise BadInput(f"torchrun started {torchrun_world_size()} processes but ring × ulysses = {world_size}")
        return run_in_this_process(job, timeout_s)
    return run_spawned(job, world_size, timeout_s, on_tick)


