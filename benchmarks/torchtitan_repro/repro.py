"""Reproduction: torchtitan's FLUX trainer draws a different timestep and noise on each context-parallel rank of
one sample (torchtitan 0.3.0).

Run with 2 processes (cp 2):   torchrun --nproc-per-node 2 repro.py
                               torchrun --nproc-per-node 4 repro.py --dp 2
                               torchrun --nproc-per-node 2 repro.py --fix     # seeds distinct over the batch mesh only
CPU: gloo (no GPU needed). GPU: NCCL, one GPU per process. Needs only torch and torchtitan.

What it runs: torchtitan's own `FluxTrainer.forward_backward_step`, unmodified, after seeding the way
`FluxTrainer.__init__` seeds (`dist_utils.set_determinism(..., distinct_seed_mesh_dims=...)`, the dims chosen by
the same expression), with the model replaced by a module that records what it is called with, so no attention
kernel, no encoder weights and no dataset are needed. Every CP rank of one data-parallel replica holds the same
sample; torchtitan shards the image and text tokens across them (`cp_shard`) and the model must see one noisy
latent of that sample at one timestep. It prints the `timesteps` each CP rank fed the model and exits 1 when they
differ (the noise that makes each rank's image shard is drawn from the same generator right before, so it differs
with them).

Why: FluxTrainer seeds distinct over ["cp", "dp_shard", "dp_replicate"] (spmd_types, full_dtensor) or
["fsdp", "dp_replicate"] (partial_dtensor, where `fsdp` = dp_shard × cp). Both include the CP ranks, so the
global generator that `forward_backward_step` draws `noise = torch.randn_like(labels)` and
`timesteps = torch.rand((bsz,))` from differs between CP peers (the seeds differ by the CP rank). Distinct seeds
are meant for data-parallel ranks (prompt dropout, noise per sample: pytorch/torchtitan#1946); CP peers share a
sample. `--fix` seeds distinct over the `batch` mesh (dp_replicate × dp_shard) only.
"""

import argparse
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

SEED = 42


def cpu_environment() -> None:
    """On CPU only: torchtitan picks "cuda" when no accelerator is found, and builds size-1 mesh dims on the
    "fake" backend that this torch import registers."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    parallel_dims_module.device_type = "cpu"


class Recorder(torch.nn.Module):
    """Stands in for FluxModel: records its inputs, returns a differentiable prediction of the target's shape."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(channels, channels)
        self.seen = {}

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y):
        self.seen = {"img": img.detach().clone(), "timesteps": timesteps.detach().clone()}
        return self.proj(img)


class FixedEncoder(torch.nn.Module):
    def __init__(self, dim: int, pooled: bool) -> None:
        super().__init__()
        self.dim, self.pooled = dim, pooled

    def forward(self, tokens):
        out = tokens.float().unsqueeze(-1).expand(*tokens.shape, self.dim) / 100
        return out.mean(1) if self.pooled else out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--spmd-backend", default="partial_dtensor", choices=("partial_dtensor", "full_dtensor", "spmd_types"))
    p.add_argument("--fix", action="store_true", help="seed distinct over the batch mesh only")
    args = p.parse_args()

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        cpu_environment()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")

    from torchtitan.components.loss import MSELoss
    from torchtitan.config import DebugConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.flux.trainer import FluxTrainer

    cp = world // args.dp
    dims = ParallelDims(dp_replicate=1, dp_shard=args.dp, cp=cp, tp=1, pp=1, ep=1, world_size=world, spmd_backend=args.spmd_backend)
    dims.build_mesh()
    dist_utils.set_spmd_backend(args.spmd_backend)

    # torchtitan/models/flux/trainer.py, FluxTrainer.__init__ (0.3.0): the same expression
    distinct_seed_mesh_dims = (
        ["cp", "dp_shard", "dp_replicate"] if args.spmd_backend in ("full_dtensor", "spmd_types") else ["fsdp", "dp_replicate"]
    )
    if args.fix:
        distinct_seed_mesh_dims = ["batch"]
    dist_utils.set_determinism(dims, device, DebugConfig(seed=SEED), distinct_seed_mesh_dims=distinct_seed_mesh_dims)

    batch_mesh = dims.get_optional_mesh("batch")
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    cp_rank = dims.get_mesh("cp").get_local_rank()
    gen = torch.Generator().manual_seed(1000 + dp_rank)  # one sample per data-parallel replica, the same on its CP ranks
    latent = torch.randn(1, 4, 8, 8, generator=gen).to(device)
    input_dict = {
        "t5": torch.randint(0, 100, (1, 1, 16), generator=gen),
        "clip": torch.randint(0, 100, (1, 1, 4), generator=gen),
        "img_encodings": latent,
    }

    model = Recorder(16).to(device)
    trainer = SimpleNamespace(
        device=device,
        _dtype=torch.float32,
        autoencoder=None,
        clip_encoder=FixedEncoder(8, pooled=True),
        t5_encoder=FixedEncoder(8, pooled=False),
        parallel_dims=dims,
        model_parts=[model],
        loss_fn=MSELoss(MSELoss.Config()),
        train_context=dist_utils.get_spmd_context(parallel_dims=dims),
        ntokens_seen=0,
        config=SimpleNamespace(training=SimpleNamespace(seq_len=16 + 16)),
    )
    FluxTrainer.forward_backward_step(trainer, input_dict=input_dict, labels=latent)

    # What the model saw on each CP rank of this replica
    cp_group = dims.get_mesh("cp").get_group()
    seen = [None] * cp
    dist.all_gather_object(seen, {k: v.cpu() for k, v in model.seen.items()}, group=cp_group)
    t = [float(s["timesteps"][0]) for s in seen]
    # One noisy latent of the sample split across the CP ranks has a single timestep: (1 - t) * x + t * noise.
    same_t = all(abs(x - t[0]) == 0.0 for x in t)
    if rank == 0 or cp_rank == 0:
        print(
            f"dp replica {dp_rank}: timesteps seen by CP ranks 0..{cp - 1}: {', '.join(f'{x:.6f}' for x in t)} "
            f"(seeds distinct over {distinct_seed_mesh_dims})",
            flush=True,
        )
    dist.barrier()
    bad = torch.tensor([int(cp_rank == 0 and not same_t)], device=device)  # one count per replica
    dist.all_reduce(bad)
    if rank == 0:
        if bad.item():
            print(
                f"FAIL: in {int(bad.item())} of {args.dp} replica(s) the CP ranks of one sample fed the model different timesteps "
                "(and noised their image shards with different noise): each CP rank trains on another sample's shard"
            )
        else:
            print("OK: every CP rank of a replica fed the model the same timestep")
    code = 1 if bad.item() else 0
    dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
