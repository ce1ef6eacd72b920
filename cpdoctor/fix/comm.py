"""Everything the fixed CP attention communicates, over one process group (the ring's or the Ulysses').

`all_gather`, `shift` and `all_to_all` return at once and `wait` blocks, so a transfer overlaps whatever is
computed between the two. `shift` is the ring's one hop: a point-to-point send to one neighbour and receive
from the other (`batch_isend_irecv`), into a buffer the caller may hand back, so a ring that streams its chunks
holds two of them, not W. With one rank every call is the identity and nothing is communicated (gloo refuses a
send to oneself), which is what lets the fixed Ulysses run the ring's own forward and backward as "a ring of
one" after its all-to-all. A test can stand in an in-memory object with the same attributes and methods.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cpdoctor.compat import diffusers as compat


def _all_gather(flat: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """torch renamed the functional collective (the old name warns); same signature. Looked up at each call, so
    a wrapper installed meanwhile (launch/flight.py, while a rank examines) sees it."""
    return (getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor)(flat, dim, group)


class InFlight:
    """A hop posted by `GroupComm.shift`: the buffer being received into and the send/receive requests.
    `GroupComm.wait` waits for both, so the sent buffer is free for reuse once it returns."""

    def __init__(self, received: torch.Tensor, requests: list[Any]) -> None:
        self.received, self.requests = received, requests


class GroupComm:
    """This rank's position in one process group and the collectives the fix needs, on flat buffers."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    @classmethod
    def alone(cls) -> GroupComm:
        """A group of one: every collective is the identity."""
        return cls(None, 0, 1)

    @classmethod
    def ring(cls, parallel_config: Any) -> GroupComm:
        """The ring group of diffusers' parallel config (where the KV chunks travel)."""
        pc = parallel_config
        return cls(compat.ring_group(pc), compat.ring_rank(pc), compat.ring_degree(pc))

    @classmethod
    def ulysses(cls, parallel_config: Any) -> GroupComm | None:
        """The Ulysses group, None without Ulysses (under ring × Ulysses the all-to-all before the ring
        gathered this ring rank's keys over it, but not their mask, which the ring then gathers itself)."""
        world = compat.ulysses_degree(parallel_config)
        if world == 1:
            return None
        group = compat.ulysses_group(parallel_config)
        return cls(group, dist.get_rank(group), world)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `flat`, concatenated in rank order (pending: pass it to `wait`)."""
        return _all_gather(flat, 0, self.group) if self.world > 1 else flat

    def shift(self, t: torch.Tensor, offset: int, into: torch.Tensor | None = None) -> torch.Tensor | InFlight:
        """Send `t` to rank r+offset and receive rank r−offset's `t` into `into` (a new buffer when None), by
        point-to-point (pending: pass it to `wait`; do not write `t` or read `into` before). Every rank of
        the group must call it, in the same order as its other shifts."""
        if self.world == 1:
            return t
        received = torch.empty_like(t) if into is None else into
        to, source = (self.rank + offset) % self.world, (self.rank - offset) % self.world
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=to),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=source),
        ]
        return InFlight(received, dist.batch_isend_irecv(ops))

    def all_to_all(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` is W equal parts; part p goes to rank p, and the result holds every rank's part r in rank
        order (pending: pass it to `wait`)."""
        return funcol.all_to_all_single(flat, None, None, self.group) if self.world > 1 else flat

    def wait(self, t: torch.Tensor | InFlight) -> torch.Tensor:
        """The finished result of `all_gather`, `shift` or `all_to_all`."""
        if isinstance(t, InFlight):
            for request in t.requests:
                request.wait()
            return t.received
        return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_gather_last(x: torch.Tensor, comm: GroupComm) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, in rank order (bool sent as uint8)."""
    is_bool = x.dtype == torch.bool
    send = (x.to(torch.uint8) if is_bool else x).contiguous()
    got = comm.wait(comm.all_gather(send.view(-1)))
    out = torch.cat(got.view(comm.world, *send.shape).unbind(0), dim=-1)
    return out.bool() if is_bool else out
