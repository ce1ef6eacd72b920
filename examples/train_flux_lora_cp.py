"""A LoRA fine-tune of a Flux transformer with context parallelism, written the way diffusers' LoRA scripts are
(examples/dreambooth/train_dreambooth_lora_flux.py: argparse, the transformer frozen in the weight dtype with a peft
adapter whose parameters are cast to fp32, flow matching with `compute_density_for_timestep_sampling` and
`compute_loss_weighting_for_sd3`, packed latents, `clip_grad_norm_` then `optimizer.step()`), plus what CP needs:
`--ring/--ulysses` (or `--cp`), a (dp, ring, ulysses) mesh, `enable_parallelism` with the transformer's `_cp_plan`,
the parameter gradients summed over the CP group and averaged over dp (plain all_reduce, or DDP over dp with --ddp).
It knows nothing of cpdoctor's step examination; examine it unmodified:

    torchrun --nproc-per-node 2 examples/train_flux_lora_cp.py --ring 2                 # train (CPU ranks: gloo)
    cpdoctor step --ring 2 -- torchrun --nproc-per-node {nproc} examples/train_flux_lora_cp.py --ring {ring}
    cpdoctor step --ring 2 --dp 2 -- torchrun --nproc-per-node {nproc} examples/train_flux_lora_cp.py --ring {ring} --ddp

The model is a tiny Flux built from a config (the scripts load FLUX.1-dev with from_pretrained; the step is the
same code at any size), the data synthetic: this data-parallel rank's latents, prompt embeddings and noise from
generators seeded by (seed, step, micro-batch, dp rank), so every CP rank of one replica feeds the same sample and
the job without CP trains the same samples. On CPU no stock diffusers backend runs ring attention (docs/FACTS.md):
there the script registers cpdoctor's CPU backend (`--attention-backend auto`); on GPUs it uses diffusers' own.

Faults to plant (`--fault`), each a real mistake of CP training scripts:
- `timesteps-per-rank`: timesteps drawn from a generator seeded by the global rank, not the data-parallel rank (CP
  peers noise one sample at different timesteps);
- `loss-times-cp`: the loss multiplied by the CP degree with nothing that undoes it (gradients cp times too large);
- `no-cp-sum`: the CP group's sum of the parameter gradients left out (each CP rank keeps its own tokens' part).
And for the examination's own failure paths: `--crash-rank R` (rank R raises once its process group is up),
`--hang-rank R` (rank R sleeps before its first forward), `--no-step` (the job ends before any optimizer step).
`--preflight` calls `cpdoctor.preflight(model=transformer)` after `enable_parallelism` (the one-run guard of a
running job: tests/integration/test_preflight.py runs it at dp 2 × ring 2)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TINY_FLUX = dict(
    patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
)  # fmt: skip
LATENT_CHANNELS = 1  # packed 2x2: 4 features per image token (the model's in_channels)
LATENT_SIDE = 8  # 8x8 latent -> 4x4 = 16 image tokens
TEXT_TOKENS = 8
FAULTS = ("timesteps-per-rank", "loss-times-cp", "no-cp-sum")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ring", type=int, default=1, help="ring degree of context parallelism")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses degree of context parallelism")
    p.add_argument("--cp", type=int, default=None, help="the CP degree as ring (same as --ring)")
    p.add_argument("--ddp", action="store_true", help="DDP over the data-parallel group instead of all_reduce")
    p.add_argument("--max_train_steps", type=int, default=3)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--train_batch_size", type=int, default=1)
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--weighting_scheme", default="none", choices=["sigma_sqrt", "logit_normal", "mode", "cosmap", "none"])
    p.add_argument("--mixed_precision", default="no", choices=["no", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", default="auto", help="diffusers attention backend for CP (auto: cpdoctor's on CPU)")
    p.add_argument("--fault", choices=FAULTS, default=None, help="plant a real CP mistake (see the module docstring)")
    p.add_argument("--crash-rank", type=int, default=None)
    p.add_argument("--hang-rank", type=int, default=None)
    p.add_argument("--no-step", action="store_true", help="stop before the first optimizer step")
    p.add_argument("--preflight", action="store_true", help="call cpdoctor.preflight(model=...) before training (one run's guard)")
    args = p.parse_args(argv)
    if args.cp is not None:
        args.ring = args.cp
    return args


@dataclass(frozen=True)
class Layout:
    """This rank's place in the (dp, ring, ulysses) mesh."""

    rank: int
    dp: int
    ring: int
    ulysses: int
    dp_rank: int
    mesh: Any = None
    cp_group: Any = None

    @property
    def cp(self) -> int:
        return self.ring * self.ulysses

    def group(self, dim: str) -> Any:
        return self.cp_group if dim == "cp" else self.mesh[dim].get_group()


def make_layout(args: argparse.Namespace) -> Layout:
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = args.ring * args.ulysses
    if world % cp:
        raise SystemExit(f"the world of {world} processes is not a multiple of CP {cp}")
    dp = world // cp
    mesh = init_device_mesh("cpu" if not torch.cuda.is_available() else "cuda", (dp, args.ring, args.ulysses),
                            mesh_dim_names=("dp", "ring", "ulysses"))  # fmt: skip
    cp_groups = [dist.new_group(list(range(d * cp, (d + 1) * cp))) for d in range(dp)]  # mesh order: a replica's CP ranks are consecutive
    return Layout(rank, dp, args.ring, args.ulysses, mesh["dp"].get_local_rank(), mesh, cp_groups[rank // cp])


def attention_backend(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "_native_cudnn"
    from cpdoctor.cpu_kernels import cpu_backend  # no stock diffusers backend runs ring attention on CPU

    return cpu_backend.register()


def build_transformer(args: argparse.Namespace, layout: Layout) -> Any:
    """The transformer as the LoRA scripts hold it: frozen in the weight dtype, a LoRA adapter on the attention
    projections, the trainable adapters in fp32; CP enabled from its `_cp_plan` at the mesh's degrees."""
    from diffusers import FluxTransformer2DModel
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    torch.manual_seed(args.seed)  # the same weights on every rank and in every layout
    transformer = FluxTransformer2DModel.from_config(TINY_FLUX)
    weight_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    transformer.requires_grad_(False)
    transformer.to(dtype=weight_dtype)
    lora = LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"])
    transformer.add_adapter(lora)
    gen = torch.Generator().manual_seed(args.seed + 1)  # lora_B away from its zeros, as after a few steps
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data = 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
    cast_training_params(transformer, dtype=torch.float32)
    if layout.cp > 1:
        from diffusers import ContextParallelConfig

        transformer.set_attention_backend(attention_backend(args.attention_backend))
        config = ContextParallelConfig(ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=layout.mesh)
        with _accelerators_counted_as_one():
            transformer.enable_parallelism(config=config)
    return transformer


class _accelerators_counted_as_one:
    """diffusers 0.42.1's enable_parallelism divides by torch.accelerator.device_count(), 0 on a CPU host."""

    def __enter__(self) -> None:
        self.saved = torch.accelerator.device_count
        if not torch.cuda.is_available():
            torch.accelerator.device_count = lambda: 1

    def __exit__(self, *exc: Any) -> None:
        torch.accelerator.device_count = self.saved


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4), as FluxPipeline packs them."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def latent_image_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3)


def draw_batch(args: argparse.Namespace, layout: Layout, step: int, micro: int, cp_for_loss: int | None = None) -> dict:
    """This data-parallel rank's sample for (step, micro-batch) and what the loss needs: the transformer's keyword
    inputs, the target and the loss weighting. The same on every CP rank of a replica unless a fault says otherwise."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    seed = args.seed + 100_000 * step + 1000 * micro + layout.dp_rank
    data = torch.Generator().manual_seed(seed)
    bsz = args.train_batch_size
    latents = torch.randn(bsz, LATENT_CHANNELS, LATENT_SIDE, LATENT_SIDE, generator=data)
    prompt_embeds = torch.randn(bsz, TEXT_TOKENS, TINY_FLUX["joint_attention_dim"], generator=data)
    pooled = torch.randn(bsz, TINY_FLUX["pooled_projection_dim"], generator=data)
    noise = torch.randn(latents.shape, generator=data)
    timestep_seed = seed + 7919 * layout.rank if args.fault == "timesteps-per-rank" else seed
    u = compute_density_for_timestep_sampling(
        args.weighting_scheme, bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29, generator=torch.Generator().manual_seed(timestep_seed)
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    sigmas = scheduler.sigmas[indices].reshape(bsz, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    weight_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    inputs = dict(
        hidden_states=pack_latents(noisy).to(weight_dtype),
        timestep=(timesteps / 1000).to(weight_dtype),
        pooled_projections=pooled.to(weight_dtype),
        encoder_hidden_states=prompt_embeds.to(weight_dtype),
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
        img_ids=latent_image_ids(LATENT_SIDE, LATENT_SIDE),
        return_dict=False,
    )
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
    return {"inputs": inputs, "target": pack_latents(noise - latents), "weighting": pack_latents(weighting.expand_as(latents))}


def loss_of(args: argparse.Namespace, layout: Layout, model_pred: torch.Tensor, batch: dict) -> torch.Tensor:
    target, weighting = batch["target"], batch["weighting"]
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
    if args.fault == "loss-times-cp":
        loss = loss * layout.cp
    return loss


def sync_gradients(args: argparse.Namespace, layout: Layout, params: list[torch.nn.Parameter]) -> None:
    """Each CP rank back-propagated its own tokens: sum over the CP group; then the mean over data-parallel ranks
    (DDP did that already with --ddp)."""
    for p in params:
        if p.grad is None:
            continue
        if layout.cp > 1 and args.fault != "no-cp-sum":
            dist.all_reduce(p.grad, group=layout.group("cp"))
        if layout.dp > 1 and not args.ddp:
            dist.all_reduce(p.grad, group=layout.group("dp"))
            p.grad /= layout.dp


def training_step(args: argparse.Namespace, layout: Layout, model: Any, params: list, step: int) -> float:
    """Forward and backward of every micro-batch, the gradient sync, the clip (the optimizer step is the caller's)."""
    total = 0.0
    for micro in range(args.gradient_accumulation_steps):
        if step == 0 and micro == 0 and args.hang_rank == layout.rank:
            time.sleep(10**6)
        batch = draw_batch(args, layout, step, micro)
        model_pred = model(**batch["inputs"])[0]
        loss = loss_of(args, layout, model_pred, batch) / args.gradient_accumulation_steps
        loss.backward()
        total += float(loss.detach())
    sync_gradients(args, layout, params)
    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
    return total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    layout = make_layout(args)
    if args.crash_rank == layout.rank:
        raise RuntimeError(f"planted crash on rank {layout.rank}")
    transformer = build_transformer(args, layout)
    if args.preflight and layout.cp > 1:  # the one-run guard: the attention now, the first step when it runs
        import cpdoctor

        report = cpdoctor.preflight(model=transformer)
        if layout.rank == 0:
            print(f"preflight: attention {report.verdict}", flush=True)
    model = transformer
    if args.ddp and layout.dp > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(transformer, process_group=layout.group("dp"))
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate)
    for step in range(args.max_train_steps):
        loss = training_step(args, layout, model, params, step)
        if args.no_step:
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if layout.rank == 0:
            print(f"step {step}: loss {loss:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: gloo's worker thread may still be releasing the last collective's
    # tensors then, and aborts the process at exit (SIGABRT after a clean run; cpdoctor's docs/DECISIONS.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
