"""Step functions that take their degrees, for `cpdoctor step FILE:steps --ring 2 --dp 2` (two runs: without CP,
then with CP), with cpdoctor's fixed attention. One launch pair runs five watched steps, each a convention or a fault (test_step_two_runs.py):

1. SimpleTuner's convention: loss × cp, DDP over the whole (dp, ring, ulysses) mesh, then an active
   clip_grad_norm_ (max_norm 0.5 on gradients of norm ~3.7): PASS;
2. the same without the × cp (DDP's mean over the CP ranks uncancelled), no clip: FAIL, factor 1/cp;
3. diffusers' LoRA recipe: peft adapters on a bf16 base, fp32 adapters, accumulation over 2 micro-batches, a
   sum over CP and DDP over dp: PASS;
4. weights initialised without a seed (they differ between the two runs): nothing to compare, UNSUPPORTED;
5. step 2 with the active clip: both runs clip to the same norm, so their final gradients agree; compared as the
   clip found them, the 1/cp shows: FAIL.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))

from train_cp_2d import GRID, TINY, build_model, conditioning, enable_cp  # noqa: E402


def _setup(cp: int, dp: int, ring: int, ulysses: int, *, lora: bool = False, seeded: bool = True):
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.cpu_kernels import cpu_backend

    mesh = init_device_mesh("cpu", (dp, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
    if seeded:
        model = build_model("flux")
    else:
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(12345 + 1000 * cp)  # depends on the layout: the two runs start from other weights
        model = FluxTransformer2DModel(**TINY["flux"])
    if lora:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from conventions_driver import lora as add_lora

        add_lora(model)
    if cp > 1:
        model = enable_cp(model, mesh, cpu_backend.register())
    return model, mesh


def _batch(model, dp_rank: int, k: int = 0):
    gen = torch.Generator().manual_seed(100 * k + dp_rank)
    dtype = next(p.dtype for p in model.parameters())
    cond = {
        n: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in conditioning(model, dp_rank, k).items()
    }
    x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen).to(dtype)
    return cond, x0, torch.rand(1, generator=gen).to(dtype), torch.randn(x0.shape, generator=gen).to(dtype)


def _ddp_world_step(watch_step, cp, dp, ring, ulysses, scale_by_cp: bool, seeded: bool = True, clip: float | None = 0.5) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, mesh = _setup(cp, dp, ring, ulysses, seeded=seeded)
    run = DDP(model) if dist.get_world_size() > 1 else model
    cond, x0, t, target = _batch(model, mesh["dp"].get_local_rank())
    with watch_step(run):
        loss = F.mse_loss(run(hidden_states=x0, timestep=t, **cond)[0], target)
        (loss * cp if scale_by_cp else loss).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)


def _lora_step(watch_step, cp, dp, ring, ulysses) -> None:
    model, mesh = _setup(cp, dp, ring, ulysses, lora=True)
    dp_rank = mesh["dp"].get_local_rank()
    with watch_step(model):
        for k in range(2):
            cond, x0, t, target = _batch(model, dp_rank, k)
            out = model(hidden_states=x0, timestep=t, **cond)[0]
            (torch.mean(((out.float() - target.float()) ** 2).reshape(1, -1), 1).mean() / 2).backward()
        for p in model.parameters():
            if p.grad is not None:
                if cp > 1:
                    dist.all_reduce(p.grad, group=mesh["ring"].get_group())
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= dp


def steps(watch_step, cp: int, dp: int, ring: int, ulysses: int) -> None:
    import cpdoctor

    cpdoctor.patch()  # the step is examined, not diffusers' ring (wrong at ring 2 on 0.39.0): the fix on every release
    _ddp_world_step(watch_step, cp, dp, ring, ulysses, scale_by_cp=True)
    _ddp_world_step(watch_step, cp, dp, ring, ulysses, scale_by_cp=False, clip=None)
    _lora_step(watch_step, cp, dp, ring, ulysses)
    _ddp_world_step(watch_step, cp, dp, ring, ulysses, scale_by_cp=True, seeded=False)
    _ddp_world_step(watch_step, cp, dp, ring, ulysses, scale_by_cp=False)
