"""A torchtitan job's rank simulated in this process on torch's fake process group: what torchtitan builds from
the layout (its meshes, the seeds `set_determinism` gives) read one rank at a time, nothing exchanged. Shared by
test_torchtitan_step.py and test_torchtitan_command.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def simulated_rank(rank: int, world: int) -> Iterator[None]:
    """Rank `rank` of a world of `world` on torch's fake process group, in this process (nothing is exchanged:
    what torchtitan builds from the layout can be read, not run); this process's own group is restored after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    had = dist.is_initialized()
    if had:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if had:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
