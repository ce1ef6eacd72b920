"""torchtitan's own FLUX training step (`FluxTrainer.forward_backward_step`, torchtitan 0.3.0, unmodified) on a
tiny FLUX config, CPU ranks (gloo), examined by `cpdoctor step` against the same step run without CP:

    cpdoctor step examples/torchtitan_flux_step.py:step --ring 2            # dp 1 × cp 2
    cpdoctor step examples/torchtitan_flux_step.py:step --ring 2 --dp 2     # dp 2 × cp 2
    torchrun --nproc-per-node 2 examples/torchtitan_flux_step.py --cp 2 --out grads-cp2.pt   # by hand

`step(job, cp, dp)` takes its degrees, so `cpdoctor step` runs it twice: first as the same job without CP (dp
processes, cp 1), then on dp × cp ranks; both build torchtitan's `ParallelDims`, mesh and model from the degrees
they are given (torchtitan's `parallelize_flux`: CP on every inner attention, FSDP2 over dp_shard × cp with its
gradient division off) and call torchtitan's step, which shards the image and text tokens across the CP ranks
itself (`cp_shard`, contiguous chunks of dim 1, no load balancer) before calling the model, takes a summed MSE over
the global token count, and lets FSDP sum the gradients. Weights and data are seeded by the data-parallel rank
only, so both runs train the same weights on the same samples.

Correct by default. Switches (module flags, or the same-named arguments of `step`), for tests:
- `PLANT = "input"`: the step's RNG seeded with the CP rank mixed in, so each CP rank draws its own noise and
  timestep inside `forward_backward_step` (an input every CP peer must share that differs between them);
- `PLANT = "reduction"`: FSDP's gradient division put back to its default, the mean over its mesh
  (dp_shard × cp): an extra average over CP (gradients exactly 1/cp of one process's);
- `SEEDING = "torchtitan"`: the RNG seeded the way `FluxTrainer.__init__` seeds it (`dist_utils.set_determinism`
  with `distinct_seed_mesh_dims=["fsdp", "dp_replicate"]` for this backend), instead of by the data-parallel rank.

Environment shims, each only where CPU ranks differ from CUDA ones; no torchtitan logic is changed:
1. `torchtitan.tools.utils.device_type` and `torchtitan.distributed.parallel_dims.device_type` set to "cpu":
   torchtitan computes `_get_available_device_type() or "cuda"` at import and builds its meshes on it.
2. `import torch.testing._internal.distributed.fake_pg` (torch 2.13): torchtitan builds its size-1 mesh dims and
   the `batch` dim on the "fake" backend, which that import registers.
3. `FSDPModule.set_force_sum_reduction_for_comms(True)` on every FSDP module: gloo has no PREMUL_SUM; with
   torchtitan's divide factor 1.0 a SUM is the same math.
4. spmd_backend "partial_dtensor" (torch's context_parallel ring through DTensor SDPA): torchtitan's default
   "spmd_types" needs torch >= 2.14 (2.13's FSDP refuses: "all parameters must be DTensors").
5. `F.scaled_dot_product_attention` routed to `aten._scaled_dot_product_efficient_attention`, served on CPU by
   cpdoctor's contract-faithful stand-in (cpdoctor/cpu_kernels/standins.py): torch's context_parallel intercepts
   only the CUDA SDPA ops, and on CPU tensors SDPA picks `*_for_cpu` ops that have no DTensor sharding strategy.
   The same routing runs in the run without CP, so both compute with one kernel. The stand-in pads its LSE to 32
   queries, so each rank's local length (image + text tokens) is kept a multiple of 32.
6. The trainer object: `forward_backward_step` is called on a stand-in `self` holding what the method reads
   (device, dtype, the parallel dims, the model, torchtitan's `MSELoss`, `dist_utils.get_spmd_context` as
   `train_context`, fixed text encoders in place of T5/CLIP, which need downloaded weights, and the image's latent
   given as `img_encodings`, so no autoencoder runs): the Trainer's constructor needs a dataset, a tokenizer and
   hub assets, none of which the step uses.
7. Weights re-initialised at random from one seed before `parallelize_flux` (torchtitan's init zeroes the
   modulation and final layers, whose gradients would then be zero), the same whatever the degrees.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Any

import torch

PLANT: str | None = None
"""None (correct), "input" (noise and timestep drawn per CP rank) or "reduction" (FSDP's mean over dp_shard × cp)."""
SEEDING = "dp"
""""dp": the step's RNG seeded by the data-parallel rank; "torchtitan": as FluxTrainer.__init__ seeds it."""

SEED = 1234
BATCH = 1
LATENT_CHANNELS = 4  # the image latent (B, 4, H, W); pack_latents tiles 2×2 patches: 16 features per token
LATENT_SIDE = 16  # 8 × 8 = 64 image tokens
TEXT_TOKENS = 64  # image + text = 128 tokens: a local length that is a multiple of 32 up to cp 4
HIDDEN, HEADS, AXES = 32, 2, (4, 6, 6)  # head dim 16 = sum(AXES)
CONTEXT_DIM, VEC_DIM, VOCAB = 32, 32, 97


def cpu_shims() -> None:
    """Shims 1 and 2 (see the module docstring)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    parallel_dims_module.device_type = "cpu"


def tiny_flux_config() -> Any:
    """torchtitan's `_flux_debug` config shrunk: 1 double and 1 single block, hidden 32, 2 heads."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.flux import _make_double_block_config, _make_single_block_config
    from torchtitan.models.flux.model.hf_embedder import FluxEmbedder
    from torchtitan.models.flux.model.layers import EmbedND, LastLayer, MLPEmbedder
    from torchtitan.models.flux.model.model import FluxModel

    def linear(i: int, o: int) -> Any:
        return Linear.Config(in_features=i, out_features=o, bias=True)

    channels = LATENT_CHANNELS * 4
    return FluxModel.Config(
        in_channels=channels,
        out_channels=channels,
        vec_in_dim=VEC_DIM,
        context_in_dim=CONTEXT_DIM,
        hidden_size=HIDDEN,
        mlp_ratio=2.0,
        num_heads=HEADS,
        depth=1,
        depth_single_blocks=1,
        axes_dim=AXES,
        img_in=linear(channels, HIDDEN),
        txt_in=linear(CONTEXT_DIM, HIDDEN),
        clip_encoder=FluxEmbedder.Config(version="(not built)"),
        t5_encoder=FluxEmbedder.Config(version="(not built)"),
        pe_config=EmbedND.Config(dim=HIDDEN // HEADS, theta=10_000, axes_dim=AXES),
        time_in_config=MLPEmbedder.Config(in_dim=256, hidden_dim=HIDDEN, in_layer=linear(256, HIDDEN), out_layer=linear(HIDDEN, HIDDEN)),
        vector_in_config=MLPEmbedder.Config(
            in_dim=VEC_DIM, hidden_dim=HIDDEN, in_layer=linear(VEC_DIM, HIDDEN), out_layer=linear(HIDDEN, HIDDEN)
        ),
        double_blocks=[_make_double_block_config(hidden_size=HIDDEN, num_heads=HEADS, mlp_ratio=2.0, qkv_bias=True)],
        single_blocks=[_make_single_block_config(hidden_size=HIDDEN, num_heads=HEADS, mlp_ratio=2.0)],
        final_layer_config=LastLayer.Config(
            hidden_size=HIDDEN,
            patch_size=1,
            out_channels=channels,
            linear=linear(HIDDEN, channels),
            adaln_linear=linear(HIDDEN, 2 * HIDDEN),
        ),
    )


class FixedEncoder(torch.nn.Module):
    """A text encoder stand-in: a fixed random embedding of the tokens (T5: one vector per token; CLIP: their mean)."""

    def __init__(self, dim: int, pooled: bool, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, dim, generator=gen)
        self.pooled = pooled

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.table[tokens.long()]
        return out.mean(dim=1) if self.pooled else out


def parallel_dims(cp: int, dp: int) -> Any:
    from torchtitan.distributed.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=cp, tp=1, pp=1, ep=1, world_size=dp * cp, spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def build_model(dims: Any, plant: str | None) -> Any:
    """torchtitan's FluxModel from the tiny config, re-initialised from one seed (shim 7), then torchtitan's own
    `parallelize_flux` (CP on the inner attentions, FSDP2, gradient division off) and shim 3."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.flux.parallelize import parallelize_flux

    dist_utils.set_spmd_backend("partial_dtensor")
    config = tiny_flux_config()
    config.update_from_config(config=None)
    model = config.build()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms' weights around 1, biases around 0
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * 0.3 if p.ndim > 1 else noise * 0.1 + (1.0 if "norm" in name else 0.0))
    model = parallelize_flux(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=dims.dp_shard, context_parallel_degree=dims.cp, spmd_backend="partial_dtensor"
        ),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # shim 3
            if plant == "reduction":
                module.set_gradient_divide_factor(fsdp_divisor(dims.dp_shard, dims.cp, plant))
    model.train()
    return model


def fsdp_divisor(dp: int, cp: int, plant: str | None) -> float:
    """What FSDP divides the summed gradients by: 1.0 as torchtitan sets it (its loss is already normalised by
    the global token count); with the reduction fault, FSDP's default, the size of its mesh (dp_shard × cp)."""
    return float(dp * cp) if plant == "reduction" else 1.0


def step_seed(dp_rank: int, cp_rank: int, plant: str | None) -> int:
    """The seed of the generator the step draws its noise and timesteps from: the data-parallel rank's, the
    same on every CP rank of a replica; with the input fault, the CP rank mixed in."""
    return SEED + 1000 * dp_rank + (7919 * cp_rank if plant == "input" else 0)


def seed_step_rng(dims: Any, plant: str | None, seeding: str) -> None:
    """What `forward_backward_step` draws its noise and timesteps from (the global generator)."""
    from torchtitan.config import DebugConfig
    from torchtitan.distributed import utils as dist_utils

    if seeding == "torchtitan":  # FluxTrainer.__init__, partial_dtensor backend
        dist_utils.set_determinism(dims, torch.device("cpu"), DebugConfig(seed=SEED), distinct_seed_mesh_dims=["fsdp", "dp_replicate"])
        return
    cp_rank = dims.get_mesh("cp").get_local_rank() if dims.cp_enabled else 0
    torch.manual_seed(step_seed(dp_rank_of(dims), cp_rank, plant))


def dp_rank_of(dims: Any) -> int:
    batch = dims.get_optional_mesh("batch")
    return batch.get_local_rank() if batch is not None and dims.dp_enabled else 0


def batch_for(dp_rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One data-parallel rank's sample: the image's latent (as `img_encodings`) and the prompt's tokens."""
    gen = torch.Generator().manual_seed(SEED + 17 + dp_rank)
    latent = torch.randn(BATCH, LATENT_CHANNELS, LATENT_SIDE, LATENT_SIDE, generator=gen)
    t5 = torch.randint(0, VOCAB, (BATCH, 1, TEXT_TOKENS), generator=gen)
    clip = torch.randint(0, VOCAB, (BATCH, 1, 8), generator=gen)
    return {"t5": t5, "clip": clip, "img_encodings": latent}, latent


def trainer_for(dims: Any, model: Any) -> Any:
    """Shim 6: what `FluxTrainer.forward_backward_step` reads from `self`."""
    from torchtitan.components.loss import MSELoss
    from torchtitan.distributed import utils as dist_utils

    return SimpleNamespace(
        device=torch.device("cpu"),
        _dtype=torch.float32,
        autoencoder=None,
        clip_encoder=FixedEncoder(VEC_DIM, pooled=True, seed=SEED + 1),
        t5_encoder=FixedEncoder(CONTEXT_DIM, pooled=False, seed=SEED + 2),
        parallel_dims=dims,
        model_parts=[model],
        loss_fn=MSELoss(MSELoss.Config()),
        train_context=dist_utils.get_spmd_context(parallel_dims=dims),
        ntokens_seen=0,
        config=SimpleNamespace(training=SimpleNamespace(seq_len=(LATENT_SIDE // 2) ** 2 + TEXT_TOKENS)),
    )


def build(cp: int, dp: int, plant: str | None = None, seeding: str = "dp") -> tuple[Any, Any, Any]:
    """(trainer stand-in, model, parallel dims) for the job's degrees; the process group must exist."""
    cpu_shims()
    dims = parallel_dims(cp, dp)
    model = build_model(dims, plant)
    seed_step_rng(dims, plant, seeding)
    return trainer_for(dims, model), model, dims


def run_step(trainer: Any, dims: Any) -> torch.Tensor:
    """torchtitan's own step, with SDPA routed to the efficient op (shim 5) in both runs."""
    from torchtitan.models.flux.trainer import FluxTrainer

    from cpdoctor.cpu_kernels import standins
    from cpdoctor.peer_impls.shims import cuda_sdpa_routing

    standins.LIBRARY.install()
    input_dict, labels = batch_for(dp_rank_of(dims))
    with cuda_sdpa_routing("efficient"):
        return FluxTrainer.forward_backward_step(trainer, input_dict=input_dict, labels=labels)


def step(job: Any, cp: int, dp: int, plant: str | None = None, seeding: str | None = None) -> None:
    """What `cpdoctor step` runs on every rank: build torchtitan's job for these degrees, then run its step inside
    the watcher (forward, loss, backward and FSDP's reduce-scatter all happen in `forward_backward_step`)."""
    trainer, model, dims = build(cp, dp, PLANT if plant is None else plant, seeding or SEEDING)
    with job(model):
        run_step(trainer, dims)


def step_input_fault(job: Any, cp: int, dp: int) -> None:
    """The step with each CP rank drawing its own noise and timestep (`PLANT = "input"`)."""
    step(job, cp, dp, plant="input")


def step_reduction_fault(job: Any, cp: int, dp: int) -> None:
    """The step with FSDP's mean over dp_shard × cp (`PLANT = "reduction"`): 1/cp of one process's gradients."""
    step(job, cp, dp, plant="reduction")


def step_titan_seeding(job: Any, cp: int, dp: int) -> None:
    """The step seeded as `FluxTrainer.__init__` seeds it (`SEEDING = "torchtitan"`)."""
    step(job, cp, dp, seeding="torchtitan")


def full_grads(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor (FSDP2's DTensor gathered), under its bare name."""
    from cpdoctor.examinations.step.watcher.full_grads import full_gradients

    return full_gradients(model)


def main() -> None:
    """By hand under torchrun: one step, every gradient gathered whole, rank 0 saves them."""
    import torch.distributed as dist

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--plant", choices=("input", "reduction"), default=None)
    p.add_argument("--seeding", choices=("dp", "torchtitan"), default="dp")
    p.add_argument("--out", default="", help="rank 0 saves every gradient, whole, under bare names here")
    p.add_argument("--inputs", default="", help="every rank saves what the model was called with to INPUTS.rank<R>.pt")
    args = p.parse_args()
    dist.init_process_group("gloo")
    trainer, model, dims = build(args.cp, args.dp, args.plant, args.seeding)
    seen: dict[str, torch.Tensor] = {}
    hook = model.register_forward_pre_hook(lambda m, a, kw: seen.update({k: v.detach().clone() for k, v in kw.items()}), with_kwargs=True)
    loss = run_step(trainer, dims)
    hook.remove()
    grads = full_grads(model)
    total = torch.stack([g.double().norm() for g in grads.values()]).norm()
    if args.inputs:
        torch.save(seen, f"{args.inputs}.rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        print(f"cp {args.cp} dp {args.dp}: loss {loss.item():.6f}  |grad| {total.item():.6f}  ({len(grads)} parameters)")
        if args.out:
            torch.save(grads, args.out)
    dist.barrier()
    os._exit(0)  # no gloo teardown: FSDP2 on gloo aborts there now and then (docs/FACTS.md)


if __name__ == "__main__":
    main()
