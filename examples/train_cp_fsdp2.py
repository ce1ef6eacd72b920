"""Context-parallel training with FSDP2 (`fully_shard`) sharding the model over the data-parallel × CP ranks,
watched by `cpdoctor.watch_step` against one process.

    torchrun --nproc-per-node 2 examples/train_cp_fsdp2.py                  # CP 2, tiny Flux, CPU ranks (gloo)
    torchrun --nproc-per-node 4 examples/train_cp_fsdp2.py --dp 2 --cp 2

FSDP2 reduce-scatters the gradients over the mesh it shards on and divides by that mesh's size. When the mesh
includes the CP ranks, that mean divides the CP group's contributions, which must be summed, by cp as well:
gradients exactly cp× too small (NVIDIA NeMo Automodel's CP guide lists it). `set_gradient_divide_factor(dp)`
divides by the data-parallel size only (NCCL; gloo has no PREMUL_SUM, so on CPU the script multiplies by cp
after); `--divide-by-world` leaves FSDP's default, and watch_step names the
factor. Parameters and gradients are DTensors; the watcher gathers them whole (`full_tensor`).

On CPU (gloo, torch 2.13) this runs; one of three tiny FSDP2 runs measured here aborted at teardown
(SIGABRT in gloo), so this script leaves without destroying its process group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_cp_2d import GRID, build_model, conditioning, enable_cp  # noqa: E402  (the same tiny model and inputs)

import cpdoctor  # noqa: E402


def run(args, watch=None) -> list:
    watch = watch or cpdoctor.watch_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cpdoctor.cpu_kernels import cpu_backend

    mesh = init_device_mesh("cpu", (args.dp, args.cp, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank = mesh["dp"].get_local_rank()
    model = enable_cp(build_model(args.family), mesh, cpu_backend.register())
    fully_shard(model, mesh=mesh["dp", "ring"]._flatten())  # shard over every rank: dp × cp
    # FSDP divides the reduce-scattered sum by dp × cp; the CP group's contributions must be summed, so divide by
    # dp only: set_gradient_divide_factor on NCCL (gloo has no PREMUL_SUM: there, undo the extra 1/cp after).
    rescale = not args.divide_by_world and dist.get_backend() != "nccl"
    if not args.divide_by_world and not rescale:
        model.set_gradient_divide_factor(float(args.dp))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reports = []
    for step in range(args.steps):
        cond = conditioning(model, dp_rank, step)
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)  # the same on every rank of a CP group
        x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen)
        with watch(model) as watched:
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.rand(1, generator=gen)
            out = model(hidden_states=(1 - t) * x0 + t * noise, timestep=t, **cond)[0]
            loss = F.mse_loss(out, (noise - x0)[..., : out.shape[-1]])
            loss.backward()  # FSDP2 reduce-scatters here
            if rescale:
                for p in model.parameters():
                    if p.grad is not None:  # tiny Qwen-Image leaves some parameters unused
                        p.grad.mul_(args.cp)
        opt.step()
        opt.zero_grad()
        reports.append(watched.report)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}  cpdoctor: {watched.report.verdict} — {watched.report.findings[0].diagnosis}")
    return reports


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="flux", choices=("flux", "qwen-image"))
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--divide-by-world", action="store_true", help="leave FSDP's mean over every rank (the bug)")
    return p


def main() -> None:
    args = parser().parse_args()
    dist.init_process_group("gloo")
    reports = run(args)
    dist.barrier()
    print(end="", flush=True)
    os._exit(max(int(r.exit_code) for r in reports))  # no gloo teardown (see above)


if __name__ == "__main__":
    main()
