"""What a probe may use of the distributed world, inside one rank: identity, device, CP meshes, and the
report group that carries payloads to rank 0. Joining and leaving the process group happens here only."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.launch.jobs import wall_bound_s

COLLECTIVE_TIMEOUT_SHARE = 0.8
"""A rank's collectives time out at this share of the launch's wall bound (jobs.wall_bound_s), not of the
timeout: a rank may wait in a collective for as long as a peer keeps moving (rank 0's reference of a large
model takes many timeouts). Spawned, the parent names a stuck rank long before; under torchrun, where nobody
supervises, a collective that times out is the only sign of a hang."""


def device_and_group(device_pref: str, n_gpu: int, local_world: int) -> tuple[str, str]:
    """(device type, process-group backend) for a rank: CUDA when asked for or when there is a GPU, NCCL when
    every local rank has a GPU of its own, gloo otherwise (a one-GPU workstation can still examine CUDA
    kernels with ranks sharing it). The parent uses it too, to say where the ranks ran when none reported."""
    if device_pref == "cpu" or (device_pref == "auto" and n_gpu == 0):
        return "cpu", "gloo"
    return "cuda", "nccl" if n_gpu >= local_world else "gloo"


@dataclass(frozen=True)
class LocalRef:
    """A ticket for an object a rank keeps in its own process (`DistContext.keep`) instead of sending it."""

    ticket: int


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
    _kept: dict[int, Any] = field(default_factory=dict)
    replicas: int = 1
    """How many CP groups of `world_size` ranks the job's world holds (a dp × cp training job under torchrun): each
    examines at once; `rank` and `world_size` are this rank's within its own group."""
    _leader: int = 0
    """The global rank of this group's rank 0 (where its payloads are gathered)."""
    _group: Any = None
    """This CP group's process group for sums (None: the default group, one replica)."""
    _world_report: Any = None
    """A gloo group of the whole world, for rank 0's decision on every rank (None: the report group is the world)."""
    _found_groups: frozenset[int] = frozenset()
    """The ids of the process groups registered when this context joined a training script's world: every other
    group registered at `close` (report groups, CP meshes, the meshes diffusers flattens) is this context's."""

    @classmethod
    def join(cls, timeout_s: float, device_pref: str = "auto", group_size: int | None = None) -> DistContext:
        """Join (or create) the default process group. NCCL when every local rank has a GPU of its own,
        gloo otherwise, so a one-GPU workstation can still examine CUDA kernels with ranks sharing it.
        `group_size` smaller than the world: the world is split into consecutive groups of that size (the CP
        groups of a dp × cp job, dp outermost, as diffusers' and torch's meshes lay them out), each a replica of
        the examination."""
        import torch
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device_pref == "cuda" and n_gpu == 0:
            raise CannotExamine("--device cuda was asked for but torch sees no CUDA device here")
        device_type, pg_backend = device_and_group(device_pref, n_gpu, local_world)
        device = torch.device("cuda", local_rank % n_gpu) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=max(1.0, wall_bound_s(timeout_s) * COLLECTIVE_TIMEOUT_SHARE))
        owns_group = not dist.is_initialized()  # a training script's own group is joined, never destroyed
        if owns_group:
            kwargs: dict[str, Any] = {"backend": pg_backend, "timeout": timeout}
            if pg_backend == "nccl":
                kwargs["device_id"] = device
            dist.init_process_group(**kwargs)
        else:
            pg_backend = dist.get_backend()
        found = frozenset() if owns_group else frozenset(id(g) for g in registered_groups())
        # A group of its own for reports: a rank that failed early gathers there while its peers may still be
        # inside a collective of the examination on the default group, and the two must never pair up.
        size = world_size if group_size is None else group_size
        if size == world_size:
            report_group = dist.new_group(backend="gloo", timeout=timeout * 2)
            return cls(rank, world_size, local_rank, device, pg_backend, timeout_s, report_group, owns_group=owns_group,
                       _found_groups=found)  # fmt: skip
        world_report = dist.new_group(backend="gloo", timeout=timeout * 2)
        mine = rank // size
        groups = [(dist.new_group(list(range(r * size, (r + 1) * size)), timeout=timeout),
                   dist.new_group(list(range(r * size, (r + 1) * size)), backend="gloo", timeout=timeout * 2))
                  for r in range(world_size // size)]  # fmt: skip  # every rank creates every group, in one order
        group, report_group = groups[mine]
        return cls(rank % size, size, local_rank, device, pg_backend, timeout_s, report_group, owns_group=owns_group,
                   replicas=world_size // size, _leader=mine * size, _group=group, _world_report=world_report,
                   _found_groups=found)  # fmt: skip

    def cp_mesh(self, ring: int, ulysses: int) -> Any:
        """The (ring, ulysses) device mesh diffusers' ParallelConfig.setup expects."""
        from torch.distributed.device_mesh import init_device_mesh

        if ring * ulysses != self.world_size:
            raise BadInput(f"ring {ring} × ulysses {ulysses} = {ring * ulysses} but the world has {self.world_size} ranks")
        if (ring, ulysses) not in self._meshes:
            if self.replicas == 1:
                mesh = init_device_mesh(self.device.type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))
            else:  # this rank's CP group of the world's (replica, ring, ulysses) mesh
                whole = init_device_mesh(self.device.type, (self.replicas, ring, ulysses), mesh_dim_names=("replica", "ring", "ulysses"))
                mesh = whole["ring", "ulysses"]
            self._meshes[ring, ulysses] = mesh
        return self._meshes[ring, ulysses]

    def gather_to_root(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (picklable, tensors on CPU) in rank order on rank 0; None elsewhere."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._leader, group=self._report_group)
        return out

    def all_sum_cpu(self, tensor: Any) -> Any:
        """Sum a CPU tensor over all ranks (used for parameter gradients of a model examination)."""
        import torch.distributed as dist

        t = tensor.to(self.device)
        dist.all_reduce(t, group=self._group)
        return t.cpu()

    def keep(self, obj: Any) -> LocalRef:
        """Keep `obj` in this process and hand out a ticket to send instead: rank 0 evaluates in its own
        process, so what it measured (a model's summed gradients) need not cross the payload gather, which
        pickles every payload and pads each rank's to the largest."""
        ref = LocalRef(len(self._kept) + 1)
        self._kept[ref.ticket] = obj
        return ref

    def take(self, ref: LocalRef) -> Any:
        """The object `keep` was given for `ref` (once)."""
        return self._kept.pop(ref.ticket)

    def broadcast_from_root(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (so every rank of a training script takes the same decision)."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=self._leader, group=self._report_group)
        return box[0]

    def broadcast_to_world(self, obj: Any) -> Any:
        """Global rank 0's `obj` on every rank of the world: with replicas, the first CP group's result is every
        group's, so that every rank of the job takes one decision."""
        import torch.distributed as dist

        if self.replicas == 1:
            return self.broadcast_from_root(obj)
        box = [obj if self.rank == 0 and self._leader == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self._world_report)
        return box[0]

    def close(self, sync: bool = True) -> None:
        """Destroy what this context created: the report group always, the default group only if ours.
        With `sync`, first wait until every rank is done with the report group (a rank that tears it down
        while a peer still reads from it makes gloo abort the peer)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if sync:
            # broad: a peer that already died makes gloo raise anything; teardown goes on regardless
            with contextlib.suppress(Exception):
                dist.barrier(group=self._world_report or self._report_group)
        # broad: a group already broken by a lost peer may raise anything on destroy; the process is ending
        with contextlib.suppress(Exception):
            if self.owns_group:
                dist.destroy_process_group()
            else:
                self._leave_the_scripts_world()

    def _leave_the_scripts_world(self) -> None:
        """Leave a training script's process as it was found: destroy every group this context created (the report
        groups, the CP meshes and what diffusers flattened of them; the script's own groups stay), drop the meshes,
        and collect now what only reference cycles still hold: a preflight left one mesh group registered in the
        script's process and one destroyed group to the collector, whose gloo threads then lived on until the
        interpreter's finalization (docs/DECISIONS.md: the exit abort itself is gloo's barrier race, fixed apart)."""
        import torch.distributed as dist

        known = [self._report_group, self._group, self._world_report]
        created = [g for g in registered_groups() if id(g) not in self._found_groups]
        for group in dict.fromkeys(g for g in known + created if g is not None):
            with contextlib.suppress(Exception):  # one already destroyed (or broken) must not keep the rest
                dist.destroy_process_group(group)
        self._meshes.clear()
        self._report_group = self._group = self._world_report = None
        gc.collect()


def registered_groups() -> list[Any]:
    """The process groups torch's c10d has registered in this process, the default one included. c10d keeps them in
    `distributed_c10d._world.pg_map` (private, no public listing): read where it exists, [] where it does not (then
    `close` destroys only the groups it holds by name)."""
    import torch.distributed.distributed_c10d as c10d

    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    return list(pg_map) if isinstance(pg_map, dict) else []
