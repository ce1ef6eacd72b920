"""A context-parallel training step guarded by cpdoctor's pre-flight.

    torchrun --nproc-per-node 2 examples/train_with_preflight.py --ring 2

Every rank calls `cpdoctor.preflight(...)` once, before training: it examines diffusers' CP attention with
this job's degrees, and if the installed ring attention is wrong it checks that cpdoctor's fix is exact and
leaves it patched in (or stops the job with the diagnosis). Then one training step of a small attention
block runs on sequence shards, and its parameter gradients are compared with a single-process step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import cpdoctor


class AttentionBlock(nn.Module):
    """qkv projection -> diffusers' dispatch_attention_fn (CP when given a parallel config) -> output projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, backend: str, parallel_config=None) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).unbind(2)
        out = dispatch_attention_fn(q, k, v, backend=backend, parallel_config=parallel_config)
        return self.proj(out.reshape(b, s, d))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--seq", type=int, default=96)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    heads, dim = 4, 64

    # The pre-flight: all ranks, before the first CP step. Raises cpdoctor.PreflightFailed if unsafe.
    report = cpdoctor.preflight(args.ring, args.ulysses, heads=heads, head_dim=dim // heads, seq=args.seq)
    patched = report.before is not None and report.before.verdict != "PASS"

    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.cpu_kernels import cpu_backend

    backend = cpu_backend.register()
    mesh = init_device_mesh("cpu", (args.ring, args.ulysses), mesh_dim_names=("ring", "ulysses"))
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=args.ring, ulysses_degree=args.ulysses))
    config.setup(rank, world, torch.device("cpu"), mesh=mesh)
    flat = config.context_parallel_config._flattened_mesh.get_local_rank()

    torch.manual_seed(0)
    block = AttentionBlock(dim, heads)
    x = torch.randn(2, args.seq, dim)
    target = torch.randn(2, args.seq, dim)

    # One CP training step on this rank's shard; each rank back-propagates only its own tokens.
    shard = lambda t: t.chunk(world, dim=1)[flat]  # noqa: E731
    (block(shard(x), backend, config) * shard(target)).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in block.parameters()])
    dist.all_reduce(grads)

    # The same step in one process on the full sequence.
    block.zero_grad()
    (block(x, backend) * target).sum().backward()
    reference = torch.cat([p.grad.flatten() for p in block.parameters()])
    err = ((grads - reference).norm() / reference.norm()).item()
    if rank == 0:
        print(f"preflight: {report.verdict} (patched: {patched}); parameter-gradient rel err after one CP step: {err:.2e}")
    dist.barrier()  # every rank done with every group before any of them is torn down (gloo aborts otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: gloo's worker thread may still be releasing the last collective's
    # tensors then, and aborts the process at exit (SIGABRT after a clean run; cpdoctor's docs/DECISIONS.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
