"""Flow-matching training of a diffusers transformer over a 2-D mesh, data-parallel × context-parallel, with
DDP over the data-parallel ranks and the parameter gradients summed over each CP group, and every step watched
by `cpdoctor.watch_step` against one process.

    torchrun --nproc-per-node 4 examples/train_cp_2d.py --dp 2 --cp 2              # tiny Flux on CPU ranks
    torchrun --nproc-per-node 4 examples/train_cp_2d.py --family qwen-image --steps 3

What a correct CP step needs, and where this script does it (each is a line `cpdoctor.watch_step` checks):
- every rank of a CP group feeds the same full inputs: noise and timesteps are drawn from generators seeded by
  the data-parallel rank, never by the global rank;
- the loss is computed on the full output (diffusers' `_cp_plan` gathers it on every CP rank);
- DDP averages over the data-parallel group only; the CP group's contributions are summed (each CP rank
  back-propagates its own tokens).

The step is `run(args)`, so a driver (tests/integration/test_step_targets.py) can run copies of it in one
process group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpdoctor

TINY = {
    "flux": dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    ),
    "qwen-image": dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    ),
}  # fmt: skip


def build_model(family: str):
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    cls = {"flux": FluxTransformer2DModel, "qwen-image": QwenImageTransformer2DModel}[family]
    torch.manual_seed(0)  # the same weights on every rank
    return cls(**TINY[family])


def enable_cp(model, mesh, backend: str):
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from cpdoctor.compat.diffusers import accelerator_count_at_least_one

    model.set_attention_backend(backend)
    with accelerator_count_at_least_one():  # some releases divide by the accelerator count: 0 on a CPU host
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=mesh["ring"].size(), ulysses_degree=1, mesh=mesh))
    return model


GRID = 4  # image tokens per side (16 tokens); TEXT text tokens: both divisible by the CP degree
TEXT = 8


def conditioning(model, dp_rank: int, step: int) -> dict:
    """This data-parallel rank's sample (text embeddings, positions): the same on every rank of its CP group."""
    gen = torch.Generator().manual_seed(10_000 + 100 * step + dp_rank)
    cfg = model.config
    kw = {"encoder_hidden_states": torch.randn(1, TEXT, cfg.joint_attention_dim, generator=gen), "return_dict": False}
    if "pooled_projection_dim" in cfg:  # Flux: pooled text, and (0, h, w) positions per image token
        kw["pooled_projections"] = torch.randn(1, cfg.pooled_projection_dim, generator=gen)
        h, w = torch.arange(GRID).repeat_interleave(GRID).float(), torch.arange(GRID).repeat(GRID).float()
        kw["img_ids"] = torch.stack([torch.zeros_like(h), h, w], dim=1)
        kw["txt_ids"] = torch.zeros(TEXT, 3)
    else:  # Qwen-Image: the image's (frames, height, width) in tokens
        kw["img_shapes"] = [[(1, GRID, GRID)]]
    if cfg.get("guidance_embeds"):
        kw["guidance"] = torch.full((1,), 3.5)
    return kw


def run(args, watch=None) -> list:
    """Train `args.steps` watched steps; return each step's cpdoctor Report. `watch` is `cpdoctor.watch_step`
    unless `cpdoctor step` hands its own."""
    watch = watch or cpdoctor.watch_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpdoctor.cpu_kernels import cpu_backend

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (args.dp, args.cp, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank = mesh["dp"].get_local_rank()
    cp_rank = mesh["ring"].get_local_rank()
    dp_group, cp_group = mesh["dp"].get_group(), mesh["ring"].get_group()
    model = enable_cp(build_model(args.family), mesh, cpu_backend.register())
    ddp = DDP(model, process_group=dp_group, find_unused_parameters=True)  # tiny Qwen-Image leaves some unused
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    reports = []
    for step in range(args.steps):
        cond = conditioning(model, dp_rank, step)
        x0 = torch.randn(
            1, GRID * GRID, model.config.out_channels or model.config.in_channels, generator=torch.Generator().manual_seed(dp_rank)
        )
        x0 = x0.repeat(1, 1, model.config.in_channels // x0.shape[-1])
        noise_gen = torch.Generator().manual_seed(1000 * step + dp_rank)
        time_gen = torch.Generator().manual_seed(2000 * step + dp_rank)
        with watch(ddp) as watched:
            noise = torch.randn(x0.shape, generator=noise_gen)
            t = torch.rand(1, generator=time_gen)
            x_t = (1 - t) * x0 + t * noise
            out = ddp(hidden_states=x_t, timestep=t, **cond)[0]
            target = (noise - x0)[..., : out.shape[-1]]
            loss = F.mse_loss(out, target)
            loss.backward()  # DDP averages over the data-parallel group
            for p in model.parameters():  # each CP rank back-propagated its own tokens: sum them
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=cp_group)
        opt.step()
        opt.zero_grad()
        reports.append(watched.report)
        if rank == 0:
            finding = watched.report.findings[0]
            print(f"step {step}: loss {loss.item():.4f}  cpdoctor: {watched.report.verdict} — {finding.diagnosis}")
    del cp_rank
    return reports


def one_step(watch) -> None:
    """For `cpdoctor step examples/train_cp_2d.py:one_step --nproc 4`: one watched step of this training, CP 2 ×
    data-parallel (ranks / 2), in the process group cpdoctor started."""
    run(parser().parse_args(["--dp", str(dist.get_world_size() // 2), "--cp", "2", "--steps", "1"]), watch)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="flux", choices=sorted(TINY))
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--preflight",
        action="store_true",
        help="examine diffusers' CP attention first (cpdoctor.preflight) and patch in the fix if it is wrong",
    )
    return p


def main() -> None:
    args = parser().parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != args.dp * args.cp:
        raise SystemExit(f"--dp {args.dp} × --cp {args.cp} needs {args.dp * args.cp} ranks, not {dist.get_world_size()}")
    if args.preflight:
        import cpdoctor

        cpdoctor.preflight(args.cp, 1)  # every rank; leaves cpdoctor's fix patched in when the stock attention is wrong
    reports = run(args)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(max(int(r.exit_code) for r in reports))


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: gloo's worker thread may still be releasing the last collective's
    # tensors then, and aborts the process at exit (SIGABRT after a clean run; cpdoctor's docs/DECISIONS.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
