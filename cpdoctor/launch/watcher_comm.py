"""The collectives the step watcher makes, in the user's own process group (gloo or NCCL, CPU or CUDA): the
house keeps every collective in launch/, so the watcher calls these and never `torch.distributed` itself.

Objects travel with the object collectives (pickled, on the CPU for gloo; NCCL needs the current CUDA device,
which a training script has set). Every function here is called by every rank of the group in the same order:
the watcher's exit is the only place that calls them."""

from __future__ import annotations

from typing import Any


def world() -> tuple[int, int]:
    """(rank, world size) of the default group; (0, 1) without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of `group`, in group order (the first is the group's leader)."""
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj` on every rank of `group` (the default group when None), in group order."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def cp_subgroup(mine: tuple[int, ...]) -> Any:
    """This rank's CP group as a torch process group, when nothing on the model holds one (a model whose CP is not
    diffusers': its ranks come from the job's degrees, a mesh or the world, examinations/step/watcher/degrees.py). Every rank
    of the default group calls it at the same point: each says its CP group's ranks (an object all-gather), then every
    distinct group is created in one order on every rank (`new_group` is a collective over the world)."""
    import torch.distributed as dist

    groups = list(dict.fromkeys(tuple(int(r) for r in g) for g in all_gather(tuple(mine))))
    made = {g: dist.new_group(list(g)) for g in groups}
    return made[tuple(mine)]


def gather_to_first(obj: Any, group: Any) -> list[Any] | None:
    """Every rank's `obj` on the group's first rank, in group order; None on the others."""
    import torch.distributed as dist

    ranks = group_ranks(group)
    mine = dist.get_rank()
    out: list[Any] | None = [None] * len(ranks) if mine == ranks[0] else None
    dist.gather_object(obj, out, dst=ranks[0], group=group)
    return out


def gather_tensor_to_first(tensor: Any, group: Any) -> list[Any] | None:
    """Every rank's `tensor` (same shape and dtype everywhere) on the group's first rank, on the CPU, in group
    order; None on the others. A tensor collective: no pickling of large gradients."""
    import torch
    import torch.distributed as dist

    ranks = group_ranks(group)
    device = _device()
    buf = tensor.detach().to(device).contiguous()
    out = [torch.empty_like(buf) for _ in ranks] if dist.get_rank() == ranks[0] else None
    dist.gather(buf, out, dst=ranks[0], group=group)
    return None if out is None else [t.cpu() for t in out]


def _device() -> Any:
    """Where a tensor collective's buffers live: the current CUDA device under NCCL, the CPU otherwise."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def sum_over_world(tensor: Any) -> Any:
    """The element-wise sum of `tensor` over every rank of the default group, returned on the CPU (NCCL gets it
    on the current CUDA device)."""
    import torch.distributed as dist

    buf = tensor.detach().to(_device()).clone()
    dist.all_reduce(buf)
    return buf.cpu()


def full_tensor(t: Any) -> Any:
    """A DTensor's full value (a collective over its mesh: FSDP2's sharded parameters and gradients), a plain
    tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def exchange(key: str, obj: Any, ranks: tuple[int, ...], timeout_s: float) -> list[Any]:
    """Every rank of `ranks` posts `obj` under `key` in the process group's store and reads the others', waiting
    at most `timeout_s` in all: the entries of ranks that never posted are None. Not a collective: a rank that
    raised, or is stuck in a collective of the user's step, cannot leave its peers blocked here, so the watcher
    agrees on "everyone is here and well" through this before it makes any collective of its own."""
    import pickle
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", pickle.dumps(obj))
    deadline = time.monotonic() + timeout_s
    out: list[Any] = []
    for r in ranks:
        name = f"{key}/{r}"
        left = deadline - time.monotonic()
        try:
            store.wait([name], timedelta(seconds=max(left, 0.01)))
        except (RuntimeError, dist.DistStoreError):  # noqa: PERF203 - a rank that never posted: its entry stays None
            out.append(None)
            continue
        out.append(pickle.loads(store.get(name)))
    return out
