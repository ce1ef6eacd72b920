"""A LoRA fine-tune of a Flux transformer with context parallelism, written as diffusers' LoRA scripts write it
(train_dreambooth_lora_flux.py): the base in bf16 and frozen, a peft adapter on the attention projections, the
adapters cast back to fp32, gradient accumulation, clip_grad_norm_ before optimizer.step(); the CP ranks' gradients
summed over the CP group. `cpdoctor.preflight(model=model)` at the top examines diffusers' CP attention at the
model's degrees (patching in cpdoctor's fix when the stock one is wrong) and arms the step examination on the
first training step: a wrong step raises PreflightFailed before its optimizer.step(); a correct one goes on. At CP 2
with 2 micro-batches the one run cannot tell the loss's `/ accumulation` (0.5) from 1/cp, so it says so (a WARN,
the job goes on); the two runs below decide.

    torchrun --nproc-per-node 2 examples/train_lora_cp.py                 # tiny Flux, CP 2, CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/train_lora_cp.py --steps 5 --accumulation 2

The same step, compared with the same code run without CP (two runs, nothing recomputed):

    cpdoctor step examples/train_lora_cp.py:lora_step --ring 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_cp_2d import GRID, build_model, conditioning, enable_cp  # noqa: E402  (the same tiny Flux and inputs)

TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def lora_model(cp: int, mesh, rank: int = 4):
    """Tiny Flux as the LoRA scripts hold it: bf16 base, frozen; a peft adapter; the adapters in fp32."""
    from peft import LoraConfig

    from cpdoctor.cpu_kernels import cpu_backend

    model = build_model("flux").to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=TARGETS))
    gen = torch.Generator().manual_seed(7)  # as after a few steps: lora_B away from its zeros (the same on every rank)
    for name, p in model.named_parameters():
        if p.requires_grad:  # diffusers' cast_training_params(model, dtype=torch.float32)
            p.data = 0.1 * torch.randn(p.shape, generator=gen) if "lora_B" in name else p.data.float()
    if cp > 1:
        model = enable_cp(model, mesh, cpu_backend.register())
    return model


def flow_matching_loss(model, dp_rank: int, step: int, micro: int):
    """The diffusers scripts' flow-matching loss on this data-parallel rank's sample (the same on every CP rank)."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + dp_rank)
    cond = {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in conditioning(model, dp_rank, step).items()
    }
    x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.rand(1, generator=gen)
    x_t = ((1 - t) * x0 + t * noise).to(torch.bfloat16)
    pred = model(hidden_states=x_t, timestep=t.to(torch.bfloat16), **cond)[0]
    target = noise - x0
    return torch.mean(((pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


def train_step(model, opt, mesh, step: int, accumulation: int, watch=None) -> float:
    """One optimizer step: `accumulation` micro-batches, the CP sum, the data-parallel mean, clipping."""
    import contextlib

    dp_rank, dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    with watch(model) if watch is not None else contextlib.nullcontext():
        total = 0.0
        for micro in range(accumulation):
            loss = flow_matching_loss(model, dp_rank, step, micro) / accumulation
            loss.backward()
            total += float(loss.detach())
        for p in trainable:
            if mesh["ring"].size() > 1:
                dist.all_reduce(p.grad, group=mesh["ring"].get_group())  # each CP rank back-propagated its own tokens
            if dp > 1:
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= dp
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def lora_step(watch_step, cp: int, dp: int, ring: int, ulysses: int) -> None:
    """For `cpdoctor step examples/train_lora_cp.py:lora_step --ring 2`: one watched step at the degrees cpdoctor
    hands (run once without CP, once with CP)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
    model = lora_model(cp, mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    train_step(model, opt, mesh, 0, 2, watch_step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--accumulation", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    import cpdoctor

    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, cp, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    model = lora_model(cp, mesh)

    def said(step_report) -> None:  # the first step's report, on every rank, before its optimizer.step()
        if dist.get_rank() == 0:
            print(f"cpdoctor, first step: {step_report.verdict}: {step_report.findings[0].diagnosis}", flush=True)

    # the attention at the model's degrees now (the fix patched in when the stock one is wrong); the first step when it runs
    report = cpdoctor.preflight(model=model, on_step=said)
    if dist.get_rank() == 0:
        print(f"cpdoctor preflight: CP attention {report.verdict}", flush=True)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    for step in range(args.steps):
        loss = train_step(model, opt, mesh, step, args.accumulation)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    dist.barrier()
    os._exit(0)  # no teardown: gloo's rarely aborts with several groups


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: gloo's worker thread may still be releasing the last collective's
    # tensors then, and aborts the process at exit (SIGABRT after a clean run; cpdoctor's docs/DECISIONS.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
