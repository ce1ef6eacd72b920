"""The step the GPU acceptance run hands to `cpdoctor.examine_step` (benchmarks/gpu_acceptance.py, section
"step"): one Flux block (one double-stream and one single-stream layer) trained one step in bf16 with diffusers'
ring over every rank, watched against one process.

On a GPU the block is 1024 wide (8 heads of 128, Flux's head size) over 32×32 image and 64 text tokens on
`_native_flash`, torch's own flash kernel; with CPDOCTOR_ACCEPTANCE_DRY=1 (the script's --dry-run) it is the tiny
Flux of examples/train_cp_2d.py on cpdoctor's CPU op, so the same code runs in CI. The function takes only
`watch_step`, so cpdoctor runs it once and recomputes the step in one fp64 process (docs/STEP.md, "One run")."""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

GPU_FLUX_BLOCK = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=8,
    joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
GPU_GRID, GPU_TEXT = 32, 64


def flux_block_step(watch_step) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from diffusers import FluxTransformer2DModel
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from train_cp_2d import GRID, TEXT, TINY, enable_cp

    dry = os.environ.get("CPDOCTOR_ACCEPTANCE_DRY") == "1" or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    config, grid, text = (TINY["flux"], GRID, TEXT) if dry else (GPU_FLUX_BLOCK, GPU_GRID, GPU_TEXT)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (1, world, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    torch.manual_seed(0)  # the same weights on every rank
    model = FluxTransformer2DModel(**config).to(device=device, dtype=torch.bfloat16)
    if dry:
        from cpdoctor.cpu_kernels import cpu_backend

        backend = cpu_backend.register()
    else:
        backend = "_native_flash"
    enable_cp(model, mesh, backend)
    gen = torch.Generator().manual_seed(1)  # the same inputs on every rank of the CP group
    h, w = torch.arange(grid).repeat_interleave(grid).float(), torch.arange(grid).repeat(grid).float()
    cfg = model.config
    bf16 = dict(device=device, dtype=torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, grid * grid, cfg.in_channels, generator=gen).to(**bf16),
        encoder_hidden_states=torch.randn(1, text, cfg.joint_attention_dim, generator=gen).to(**bf16),
        pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=gen).to(**bf16),
        timestep=torch.tensor([0.5]).to(**bf16),
        img_ids=torch.stack([torch.zeros_like(h), h, w], dim=1).to(device),
        txt_ids=torch.zeros(text, 3).to(device),
        return_dict=False,
    )
    target = torch.randn(1, grid * grid, cfg.in_channels, generator=gen).to(**bf16)
    with watch_step(model):
        out = model(**inputs)[0]
        F.mse_loss(out.float(), target.float()).backward()
        for p in model.parameters():  # each CP rank back-propagated its own tokens: sum them
            if p.grad is not None:
                dist.all_reduce(p.grad)
