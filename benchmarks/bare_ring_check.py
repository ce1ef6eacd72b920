"""The baseline of bench_check.py: what a user would hand-write to check ring=2 once under torchrun.

Imports, sets up the process group and mesh, runs diffusers' ring attention forward+backward on its shard
(through the same CPU backend), compares with a full-sequence reference on every rank, prints one line.
"""

import torch
import torch.distributed as dist
from diffusers.models import attention_dispatch as ad
from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
from torch.distributed.device_mesh import init_device_mesh

from cpdoctor.cpu_kernels import cpu_backend

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
name = cpu_backend.register()
mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ring", "ulysses"))
config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=world, ulysses_degree=1))
config.setup(rank, world, torch.device("cpu"), mesh=mesh)
gen = torch.Generator().manual_seed(0)
q, k, v, g = (torch.randn(2, 512, 8, 64, generator=gen) for _ in range(4))
shard = lambda x: x.chunk(world, dim=1)[rank].clone().requires_grad_(True)  # noqa: E731
ql, kl, vl = shard(q), shard(k), shard(v)
out = ad.dispatch_attention_fn(ql, kl, vl, backend=name, parallel_config=config)
out.backward(g.chunk(world, dim=1)[rank])
qr, kr, vr = (x.clone().requires_grad_(True) for x in (q, k, v))
ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (qr, kr, vr))).transpose(1, 2)
ref.backward(g)
errs = [
    ((a - b.chunk(world, dim=1)[rank]).norm() / b.chunk(world, dim=1)[rank].norm()).item()
    for a, b in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad))
]
print(f"rank {rank}: out/dq/dk/dv rel err " + " ".join(f"{e:.2e}" for e in errs))
dist.barrier()
dist.destroy_process_group()
