"""The step matrix: many spellings of the same training steps, right and wrong, each run twice by this one script:

    python -m torch.distributed.run --nproc-per-node 4 step_matrix.py cp OUT_DIR [--only a,b]   # with CP, watched
    python step_matrix.py one OUT_DIR [--only a,b]                                             # one process, no CP

With CP every variant runs on the job's ranks inside `cpdoctor.watch_step` (data-parallel 2 × CP 2, or ring 2 ×
Ulysses 2, tiny Flux, cpdoctor's fixed attention), and each CP group's first rank keeps the watcher's verdict and
the gradients as the step's clip found them (after its unscaling: `Job.tap`). In one process the same step code
runs with every degree 1, once per data-parallel replica's data, and the gradients at the same point are kept:
their mean over the replicas is what the CP step must end with. tests/integration/test_step_matrix.py compares
the two and decides each variant's expected verdict from that alone (nobody types it); the watcher never sees
the one-process run.

A variant names its loss spelling, its reduction, its clip, its GradScaler, its micro-batches and its dtypes; the
same step function runs them all, so the loss is written once per spelling with the job's own degrees
(`loss * job.cp` is `loss * 1` in one process). A variant whose one-run verdict rests on a reading says what it
reads (`reading`): that verdict must be a WARN, whatever the two runs' gradients say.

The steps in `ARMED` run a second time with CP under what `cpdoctor.preflight(model=)` arms on the first step (its
judge raises PreflightFailed only for a FAIL): `NAME@preflight` in the results, whether it stopped the job, and its
gradients, compared with the same one-process run (the false-stop test)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_ as named_clip_grad_norm_  # bound before any watch: the watcher must still see it

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_cp_2d import GRID, build_model, conditioning  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """One step of the matrix: how it writes its loss, reduces, clips, scales, accumulates, and in which dtypes."""

    loss: str = "mse"
    sync: str = "sum_cp_ddp_dp"
    layout: tuple[int, int, int] = (2, 2, 1)
    """(dp, ring, ulysses) of the run with CP."""
    clip: str = ""
    """"norm:X", "named:X" (clip_grad_norm_ imported by name before the watch), "value:X"; empty: no clip."""
    scaler: float = 0.0
    """GradScaler's init_scale (fp16 autocast); 0: no GradScaler."""
    unscale_inside: bool = True
    micro: int = 1
    dtype: str = "fp32"
    """fp32, bf16 (weights), lora (peft adapters in fp32 over a bf16 base), lora_fp32 (the same over an fp32 base)."""
    autocast: bool = True
    """With a GradScaler: fp16 autocast (False: the same step in fp32, the one-process twin of a half step)."""
    compile: str = ""
    step_inside: bool = False
    """The optimizer step and zero_grad(set_to_none=True) inside the watched block (the watcher takes the gradients
    as the optimizer step found them)."""
    reading: str = ""
    """What the one-run verdict rests on (a number whose meaning only its value tells, a loss node or a reduction the
    watcher cannot read): the watcher must WARN, naming it."""
    batch: str = ""
    """The sample: "" (one image), "kontext" (a condition image concatenated on the sequence and sliced off the
    output before the loss, as diffusers' train_dreambooth_lora_flux_kontext.py), "prior" (an instance and a class
    sample in one batch, chunked in two for the loss and the prior loss, as the DreamBooth scripts)."""
    grads_by: str = "backward"
    """"backward", "autograd_grad" (torch.autograd.grad, then p.grad = g), "in_backward" (an optimizer per parameter
    stepped from its post-accumulate-grad hook, after the sync there)."""
    autocast_dtype: str = ""
    """"bf16": the step under CPU autocast in bf16 with fp32 weights (no GradScaler)."""


V = Variant
CP_LITERAL = "the 2 on the loss is cp = 2 or a weight"
"""The one-run reading of `loss * job.cp` at CP 2: a literal 2, cp or a weight of the step's own."""
VARIANTS: dict[str, Variant] = {
    # the loss: plain, and the factor cp in every spelling, with a sum over CP (λ must be 1) or a mean (λ must be cp)
    "mse_sum_cp": V(),
    "x_cp_sum_cp_bug": V(loss="x_cp", reading=CP_LITERAL),
    "x_cp_ddp_world": V(loss="x_cp", sync="ddp_world", reading=CP_LITERAL),
    "x_cp_tensor_ddp_world": V(loss="x_cp_tensor", sync="ddp_world", reading=CP_LITERAL),
    "x_cp_1elem_ddp_world": V(loss="x_cp_1elem", sync="ddp_world", reading=CP_LITERAL),
    "x_cp_inside_mean_ddp_world": V(loss="x_cp_inside", sync="ddp_world", reading=CP_LITERAL),
    "x_cp_over_accum_one_factor": V(loss="x_cp_over_accum", sync="ddp_world", micro=3, reading="cp / 3 micro-batches"),
    "x_cp_then_over_accum": V(loss="x_cp_then_accum", sync="ddp_world", micro=3, reading=CP_LITERAL),
    "mse_ddp_world_bug": V(sync="ddp_world"),
    "over_cp_ddp_world_bug": V(loss="over_cp", sync="ddp_world"),
    "over_cp_sum_cp_bug": V(loss="over_cp", reading="the 0.5 on the loss is 1/cp = 0.5 or a weight"),
    # per-shard losses
    "shard_sum_over_full": V(loss="shard_sum_full"),
    "shard_sum_over_shard_bug": V(loss="shard_sum_shard", reading="1/32, this rank's shard's count"),
    "shard_mse_bug": V(loss="shard_mse"),
    "shard_mse_over_cp": V(loss="shard_mse_over_cp", reading="the 0.5 on the loss is 1/cp = 0.5 or a weight"),
    "shard_mse_ddp_world": V(loss="shard_mse", sync="ddp_world"),
    # sums of terms
    "terms_x_cp_ddp_world": V(loss="terms_x_cp", sync="ddp_world", reading=CP_LITERAL),
    "terms_one_x_cp_ddp_world": V(loss="terms_one_x_cp", sync="ddp_world", reading=CP_LITERAL),
    # reductions
    "x_cp_fsdp2": V(loss="x_cp", sync="fsdp2", reading=CP_LITERAL),
    "mse_fsdp2_bug": V(sync="fsdp2"),
    "mse_fsdp2_rescaled": V(sync="fsdp2_rescale"),
    "x_cp_sum_world_manual_mean": V(loss="x_cp", sync="sum_world_mean", reading=CP_LITERAL),
    "mse_sum_world_manual_mean_bug": V(sync="sum_world_mean"),
    "ulysses_ring_sum_flat": V(layout=(1, 2, 2), sync="sum_cp"),
    "ulysses_ring_sum_each": V(layout=(1, 2, 2), sync="sum_uly_sum_ring"),
    "ulysses_ring_mean_ring_bug": V(layout=(1, 2, 2), sync="sum_uly_mean_ring"),
    "x_ring_mean_ring": V(layout=(1, 2, 2), loss="x_ring", sync="sum_uly_mean_ring", reading="the 2 on the loss is ring = 2"),
    "ulysses_ring_sum_ring_only_bug": V(layout=(1, 2, 2), sync="sum_ring"),
    # clipping
    "clip_active": V(clip="norm:0.01"),
    "clip_inactive": V(clip="norm:1000"),
    "clip_0707": V(clip="norm:0.707"),
    "clip_named_import": V(clip="named:0.05"),
    "clip_by_value": V(clip="value:0.0005"),
    "clip_active_mean_cp_bug": V(sync="ddp_world", clip="norm:0.01"),
    "clip_bf16_grads": V(dtype="bf16", clip="norm:0.01"),
    "clip_then_step_and_zero_grad_inside": V(clip="norm:0.01", step_inside=True),
    "mean_cp_bug_step_inside": V(sync="ddp_world", step_inside=True),
    # GradScaler (fp16 autocast)
    "scaler_1024": V(scaler=1024.0),
    "scaler_8": V(scaler=8.0),
    "scaler_4096_unscaled_after": V(scaler=4096.0, unscale_inside=False),
    "scaler_mean_cp_bug": V(scaler=1024.0, sync="ddp_world"),
    "scaler_first_step_skipped": V(scaler=2.0**40),
    "manual_loss_scale": V(loss="x_1024", sync="sum_cp_ddp_dp_unscale_1024"),
    # accumulation
    "accum_2_over_2": V(loss="over_accum", micro=2, reading="the 0.5 on the loss is 1/cp = 0.5 or the mean over its 2 micro-batches"),
    "accum_2_summed": V(micro=2),
    "accum_2_x_cp_two_factors_ddp_world": V(loss="x_cp_then_accum", sync="ddp_world", micro=2, reading=CP_LITERAL),
    "accelerate_x_cp": V(loss="x_cp", sync="accelerate", micro=2, reading=CP_LITERAL),
    # dtypes and compile
    "lora_bf16": V(dtype="lora"),
    "lora_bf16_mean_cp_bug": V(dtype="lora", sync="ddp_world"),
    "compiled_aot_eager_x_cp": V(loss="x_cp", sync="ddp_world", compile="aot_eager", reading=CP_LITERAL),
    "compiled_loss_x_cp": V(
        loss="compiled_x_cp", sync="ddp_world", reading="cannot be read: the loss's constants inside CompiledFunctionBackward"
    ),
    # issue 36: a mean over a part of the output that is not the rank's shard, literals that are weights
    "kontext_condition_sliced_off": V(batch="kontext", loss="kontext"),
    "prior_preservation_chunked": V(batch="prior", loss="prior"),
    "half_mse_weight": V(loss="half_mse", reading="the 0.5 on the loss is 1/cp = 0.5 or a weight"),
    "weight_2_meant_as_a_weight": V(loss="x_2", reading=CP_LITERAL),
    "autocast_bf16": V(autocast_dtype="bf16"),
    # the backward the watcher observes, the gradients it compares
    "autograd_grad_sum_cp": V(layout=(1, 2, 2), sync="sum_cp", grads_by="autograd_grad"),
    "autograd_grad_x_cp_sum_bug": V(
        layout=(1, 2, 2), loss="x_cp_4", sync="sum_cp", grads_by="autograd_grad", reading="the 4 on the loss is cp = 4 or a weight"
    ),
    "clip_per_parameter_group": V(clip="groups:0.01"),
    "optimizer_in_backward": V(layout=(1, 2, 2), sync="in_hook", grads_by="in_backward"),
    "optimizer_in_backward_no_cp_sum_bug": V(layout=(1, 2, 2), sync="none", grads_by="in_backward"),
    "two_roots_one_forward_weight_2_ring_4": V(layout=(1, 4, 1), loss="two_roots_x_2", sync="sum_cp"),
    # the step's own normaliser of its gradients, a hidden node on the loss, a comm hook
    "accum_2_grads_over_2": V(sync="sum_cp_ddp_dp_over_micro", micro=2, reading="the 0.5 on the gradients"),
    "grads_over_all_tokens": V(sync="sum_cp_ddp_dp_over_tokens"),
    "grads_over_shard_tokens_bug": V(sync="sum_cp_ddp_dp_over_shard_tokens", reading="1/8, this rank's shard's count"),
    "differentiable_all_reduce_loss_bug": V(loss="all_reduced", reading="cannot be read: the loss's constants inside"),
    "differentiable_all_reduce_loss_over_cp": V(loss="all_reduced_over_cp", reading="cannot be read: the loss's constants inside"),
    "ddp_fp16_compress_hook_x_cp": V(loss="x_cp", sync="ddp_world_fp16_hook", reading="DDP's comm hook fp16_compress_hook"),
    "mse_ddp_allreduce_hook_bug": V(sync="ddp_world_allreduce_hook", reading="DDP's comm hook allreduce_hook"),
}

NEW_SPELLINGS = tuple(VARIANTS)[tuple(VARIANTS).index("kontext_condition_sliced_off") :]
"""The spellings issue 36 added (benchmarks/record_step_matrix.py counts them apart)."""

ARMED = (
    "mse_sum_cp", "x_cp_ddp_world", "shard_mse_ddp_world", "clip_active", "accum_2_summed", "accum_2_over_2", "scaler_1024",
    "lora_bf16", "kontext_condition_sliced_off", "prior_preservation_chunked", "half_mse_weight", "weight_2_meant_as_a_weight",
    "autocast_bf16", "autograd_grad_sum_cp", "clip_per_parameter_group", "optimizer_in_backward",
    "two_roots_one_forward_weight_2_ring_4", "grads_over_all_tokens", "accum_2_grads_over_2",
)  # fmt: skip
"""Correct steps run again under what preflight(model=) arms: none may stop the job (the false-stop test)."""
ARMED_SUFFIX = "@preflight"


SMOKE = "x_cp_sum_cp_bug_2"
"""The one case of the default tier: two ranks (CP 2), a loss × cp summed over CP (FAIL, factor cp)."""
VARIANTS[SMOKE] = V(loss="x_cp", layout=(1, 2, 1), sync="sum_cp")


@dataclass
class Job:
    """What the step function gets: the degrees of this run, this rank's place, the groups, the model."""

    cp: int
    ring: int
    ulysses: int
    dp: int
    dp_rank: int
    cp_rank: int
    groups: dict[str, Any]
    model: Any = None
    run: Any = None
    tapped: Any = None
    extra: dict = field(default_factory=dict)

    def tap(self) -> None:
        """The gradients now, flat in float32 (the watched model's trainable parameters; DTensors gathered whole)."""
        if self.tapped is not None:
            return
        parts = []
        inner = self.extra.get("inner", {})
        for p in self.model.parameters():
            if p.requires_grad:
                g = inner[p] if p in inner else p.grad
                full = getattr(g, "full_tensor", None)
                g = full() if callable(full) else g
                parts.append(torch.zeros(p.numel()) if g is None else g.detach().float().reshape(-1).clone())
        self.tapped = torch.cat(parts)


# -- losses: each spelling once, with the job's degrees ------------------------------------------------------------
def _mse(out, target):
    return F.mse_loss(out.float(), target.float())


def _piece(job, x):
    return x.chunk(job.cp, dim=1)[job.cp_rank]


_compiled_loss: dict = {}


def _compiled_x_cp(job, out, target):
    fn = _compiled_loss.get("fn")
    if fn is None:
        fn = _compiled_loss["fn"] = torch.compile(lambda o, t, c: F.mse_loss(o.float(), t.float()) * c, backend="aot_eager")
    return fn(out, target, float(job.cp))


LOSSES = {
    "mse": lambda job, o, t, m: _mse(o, t),
    "x_cp": lambda job, o, t, m: _mse(o, t) * job.cp,
    "x_cp_tensor": lambda job, o, t, m: _mse(o, t) * torch.tensor(float(job.cp)),
    "x_cp_1elem": lambda job, o, t, m: _mse(o, t) * torch.tensor([float(job.cp)]),
    "x_cp_inside": lambda job, o, t, m: (job.cp * (o.float() - t.float()) ** 2).mean(),
    "x_cp_over_accum": lambda job, o, t, m: _mse(o, t) * (job.cp / m),
    "x_cp_then_accum": lambda job, o, t, m: _mse(o, t) * job.cp / m,
    "over_cp": lambda job, o, t, m: _mse(o, t) / job.cp,
    "over_accum": lambda job, o, t, m: _mse(o, t) / m,
    "x_ring": lambda job, o, t, m: _mse(o, t) * job.ring,
    "x_1024": lambda job, o, t, m: _mse(o, t) * 1024.0,
    "shard_sum_full": lambda job, o, t, m: (_piece(job, o).float() - _piece(job, t).float()).pow(2).sum() / o.numel(),
    "shard_sum_shard": lambda job, o, t, m: (_piece(job, o).float() - _piece(job, t).float()).pow(2).sum() / _piece(job, o).numel(),
    "shard_mse": lambda job, o, t, m: F.mse_loss(_piece(job, o).float(), _piece(job, t).float()),
    "shard_mse_over_cp": lambda job, o, t, m: F.mse_loss(_piece(job, o).float(), _piece(job, t).float()) / job.cp,
    "terms_x_cp": lambda job, o, t, m: _mse(o, t) * job.cp + 0.1 * o.float().pow(2).mean() * job.cp,
    "terms_one_x_cp": lambda job, o, t, m: _mse(o, t) * job.cp + 0.1 * o.float().pow(2).mean(),
    "compiled_x_cp": lambda job, o, t, m: _compiled_x_cp(job, o, t),
    "x_cp_4": lambda job, o, t, m: _mse(o, t) * job.cp,
    "half_mse": lambda job, o, t, m: 0.5 * _mse(o, t),
    "x_2": lambda job, o, t, m: _mse(o, t) * 2.0,
    "kontext": lambda job, o, t, m: _kontext(o, t),
    "prior": lambda job, o, t, m: _prior(o, t),
    "two_roots_x_2": lambda job, o, t, m: (_mse(o, t) * 2.0, 0.1 * o.float().pow(2).mean() * 2.0),
    "all_reduced": lambda job, o, t, m: _all_reduced(job, o, t),
    "all_reduced_over_cp": lambda job, o, t, m: _all_reduced(job, o, t) / job.cp,
}


def _kontext(out, target):
    """diffusers' train_dreambooth_lora_flux_kontext.py: the output of the noisy latents concatenated with the
    condition image's on the sequence, sliced back to the noisy part, a weighted mean per sample, then over the batch."""
    pred = out[:, : target.shape[1]]
    weighting = torch.ones(target.shape[0], 1, 1)  # compute_loss_weighting_for_sd3("none", sigmas)
    return torch.mean((weighting * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()


PRIOR_LOSS_WEIGHT = 1.0
"""The DreamBooth scripts' --prior_loss_weight default."""


def _prior(out, target):
    """The DreamBooth scripts with prior preservation: the instance and class halves of the batch, chunked."""
    pred, pred_prior = torch.chunk(out, 2, dim=0)
    target, target_prior = torch.chunk(target, 2, dim=0)
    prior = F.mse_loss(pred_prior.float(), target_prior.float(), reduction="mean")
    return F.mse_loss(pred.float(), target.float(), reduction="mean") + PRIOR_LOSS_WEIGHT * prior


def _all_reduced(job, out, target):
    """Each rank's per-shard sum over the full count, made the whole loss by a differentiable all_reduce over the CP
    group (a custom autograd Function: its backward all-reduces the gradient too, so the loss's gradient is cp×)."""
    from torch.distributed.nn.functional import all_reduce

    local = (_piece(job, out).float() - _piece(job, target).float()).pow(2).sum() / out.numel()
    return all_reduce(local, group=job.groups["cp"])


# -- reductions: how the gradients are wrapped and synced ---------------------------------------------------------
def wrap(v: Variant, job: Job, model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = job.groups
    if v.sync.startswith("ddp_world"):
        ddp = DDP(model, process_group=g["world"], find_unused_parameters=True)
        if v.sync.endswith("_hook"):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if v.sync.endswith("fp16_hook") else default_hooks.allreduce_hook
            ddp.register_comm_hook(g["world"], hook)
        return ddp
    if v.sync.startswith("sum_cp_ddp_dp"):
        return DDP(model, process_group=g["dp"], find_unused_parameters=True)
    if v.sync.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=fsdp_mesh(job))
        return model
    if v.sync == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True, gradient_accumulation_steps=v.micro)
        job.extra["accelerator"] = acc
        return acc.prepare(model)
    return model


def sync(v: Variant, job: Job, model) -> None:
    g = job.groups
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if v.sync in ("sum_cp_ddp_dp", "sum_cp"):
        for x in grads:
            dist.all_reduce(x, group=g["cp"])
    elif v.sync == "sum_cp_ddp_dp_unscale_1024":
        for x in grads:
            dist.all_reduce(x, group=g["cp"])
            x /= 1024.0  # the step's own unscaling of its own loss scale
    elif v.sync == "sum_cp_ddp_dp_over_micro":  # the accumulation's mean taken on the gradients, not the loss
        for x in grads:
            dist.all_reduce(x, group=g["cp"])
            x /= v.micro
    elif v.sync in ("sum_cp_ddp_dp_over_tokens", "sum_cp_ddp_dp_over_shard_tokens"):
        tokens = GRID * GRID // (job.cp if v.sync.endswith("shard_tokens") else 1)  # the shard's: a layout-dependent count
        for x in grads:
            dist.all_reduce(x, group=g["cp"])
            x /= tokens
    elif v.sync == "fsdp2_rescale":
        for x in grads:
            x.mul_(job.cp)  # FSDP2's mean over dp × cp undone for the CP ranks (what set_gradient_divide_factor(dp) does)
    elif v.sync == "sum_world_mean":
        for x in grads:
            dist.all_reduce(x, group=g["world"])
            x /= job.dp * job.cp
    elif v.sync == "sum_uly_sum_ring":
        for x in grads:
            dist.all_reduce(x, group=g["ulysses"])
            dist.all_reduce(x, group=g["ring"])
    elif v.sync == "sum_uly_mean_ring":
        for x in grads:
            dist.all_reduce(x, group=g["ulysses"])
            dist.all_reduce(x, group=g["ring"])
            x /= job.ring
    elif v.sync == "sum_ring":
        for x in grads:
            dist.all_reduce(x, group=g["ring"])


def clip(v: Variant, job: Job, model) -> None:
    if not v.clip:
        return
    kind, value = v.clip.split(":")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "norm":
        torch.nn.utils.clip_grad_norm_(trainable, float(value))
    elif kind == "groups":  # one clip per parameter group: the blocks', the rest's
        blocks = [p for n, p in model.named_parameters() if p.requires_grad and "transformer_blocks" in n]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and "transformer_blocks" not in n]
        torch.nn.utils.clip_grad_norm_(blocks, float(value))
        torch.nn.utils.clip_grad_norm_(rest, float(value) / 10)
    elif kind == "named":
        named_clip_grad_norm_(trainable, float(value))
    else:
        torch.nn.utils.clip_grad_value_(trainable, float(value))


# -- the step ----------------------------------------------------------------------------------------------------
def build(v: Variant, job: Job, backend: str):
    model = build_model("flux")
    if v.dtype.startswith("lora"):
        from conventions_driver import lora

        lora(model, torch.bfloat16 if v.dtype == "lora" else torch.float32)
    elif v.dtype == "bf16":
        model.to(torch.bfloat16)
    if job.cp > 1:
        from diffusers.models._modeling_parallel import ContextParallelConfig

        from cpdoctor.compat.diffusers import accelerator_count_at_least_one

        model.set_attention_backend(backend)
        with accelerator_count_at_least_one():
            model.enable_parallelism(
                config=ContextParallelConfig(ring_degree=job.ring, ulysses_degree=job.ulysses, mesh=job.groups["mesh"])
            )
    return model


def step(v: Variant, job: Job, watch: Any) -> Any:
    """One training step of variant `v`; the watcher's context manager (or a null one) around it."""
    dtype = next(p.dtype for p in job.model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=v.scaler) if v.scaler else None
    trainable = [p for p in job.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)
    hooks = in_backward(v, job, trainable) if v.grads_by == "in_backward" else []
    half = {"bf16": torch.bfloat16, "": torch.float16}[v.autocast_dtype]
    with watch:
        for k in range(v.micro):
            kwargs, target = sample(v, job, k, dtype)
            with torch.autocast("cpu", dtype=half, enabled=(scaler is not None and v.autocast) or bool(v.autocast_dtype)):
                out = job.run(**kwargs)[0]
                loss = LOSSES[v.loss](job, out, target, v.micro)
            backward(v, job, loss, scaler, trainable)
        sync(v, job, job.model)
        if scaler is not None and v.unscale_inside:
            scaler.unscale_(opt)
        job.tap()
        clip(v, job, job.model)
        if v.step_inside:
            optimizer_step(scaler, opt)
            opt.zero_grad(set_to_none=True)
    if not v.step_inside:
        optimizer_step(scaler, opt)
    for h in hooks:
        h.remove()
    return getattr(watch, "report", None)


def sample(v: Variant, job: Job, k: int, dtype: Any) -> tuple[dict, Any]:
    """Micro-batch `k` of this data-parallel rank: the model's keyword arguments and the loss's target."""
    cond = {
        key: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for key, x in conditioning(job.model, job.dp_rank, 0).items()
    }
    batch = 2 if v.batch == "prior" else 1
    gen = torch.Generator().manual_seed(1000 * k + job.dp_rank)
    x0 = torch.randn(batch, GRID * GRID, job.model.config.in_channels, generator=gen).to(dtype)
    noise = torch.randn(x0.shape, generator=gen).to(dtype)
    t = torch.rand(batch, generator=gen).to(dtype)
    hidden = (1 - t.reshape(-1, 1, 1)) * x0 + t.reshape(-1, 1, 1) * noise
    if v.batch == "prior":  # the instance and the class sample share the prompt here
        shared = ("encoder_hidden_states", "pooled_projections", "guidance")
        cond = {key: x.repeat(2, *[1] * (x.dim() - 1)) if key in shared else x for key, x in cond.items()}
    if v.batch == "kontext":  # the condition image's latents after the noisy ones, its positions marked 1 (Flux Kontext)
        image = torch.randn(x0.shape, generator=gen).to(dtype)
        hidden = torch.cat([hidden, image], dim=1)
        ids = cond["img_ids"].clone()
        ids[:, 0] = 1
        cond["img_ids"] = torch.cat([cond["img_ids"], ids])
    return {"hidden_states": hidden, "timestep": t, **cond}, noise - x0


def backward(v: Variant, job: Job, loss: Any, scaler: Any, trainable: list) -> None:
    """The step's backward: Accelerator.backward, torch.autograd.grad then p.grad = g, or backward (of each term of
    a loss given as terms: a root per term of one forward)."""
    if v.sync == "accelerate":
        job.extra["accelerator"].backward(loss)
    elif v.grads_by == "autograd_grad":
        for p, g in zip(trainable, torch.autograd.grad(loss, trainable, allow_unused=True)):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
    elif isinstance(loss, tuple):
        for i, term in enumerate(loss):
            term.backward(retain_graph=i < len(loss) - 1)
    else:
        (scaler.scale(loss) if scaler else loss).backward()


def in_backward(v: Variant, job: Job, trainable: list) -> list:
    """An optimizer per parameter, stepped from its post-accumulate-grad hook (torch's optimizer-in-backward recipe),
    after summing the gradient over the CP group there; the gradient each step found is what both runs compare."""
    optimizers = {p: torch.optim.SGD([p], lr=0.0) for p in trainable}
    job.extra["inner"] = found = {}

    def hook(p: torch.Tensor) -> None:
        if v.sync == "in_hook":
            dist.all_reduce(p.grad, group=job.groups["cp"])
        found[p] = p.grad.detach().float().reshape(-1).clone()
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    return [p.register_post_accumulate_grad_hook(hook) for p in trainable]


def optimizer_step(scaler: Any, opt: Any) -> None:
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


# -- the two runs --------------------------------------------------------------------------------------------------
def groups_for(layout: tuple[int, int, int], cache: dict) -> dict:
    """The job's mesh and groups for a layout, made once per process (a new gloo group costs a connection round)."""
    if layout not in cache:
        from torch.distributed.device_mesh import init_device_mesh

        dp, ring, ulysses = layout
        mesh = init_device_mesh("cpu", (dp, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
        both = ring > 1 and ulysses > 1
        assert not both or dp == 1, "a 2-D CP layout here spans the whole world"
        cp = dist.group.WORLD if both else mesh["ulysses" if ring == 1 else "ring"].get_group()
        cache[layout] = {
            "mesh": mesh,
            "world": dist.group.WORLD,
            "dp": mesh["dp"].get_group(),
            "ring": mesh["ring"].get_group(),
            "ulysses": mesh["ulysses"].get_group(),
            "cp": cp,
            "cp_rank": mesh["ring"].get_local_rank() * ulysses + mesh["ulysses"].get_local_rank(),
        }
    return cache[layout]


def fsdp_mesh(job: Job) -> Any:
    """The mesh FSDP2 shards over: data-parallel × CP (NeMo Automodel's dp_shard_cp), flattened once."""
    g = job.groups
    if "dp_cp_mesh" not in g:
        g["dp_cp_mesh"] = g["mesh"]["dp", "ring"]._flatten()
    return g["dp_cp_mesh"]


def job_for(v: Variant, layout: tuple[int, int, int], dp_rank: int, cache: dict) -> Job:
    dp, ring, ulysses = layout
    g = groups_for(layout, cache)
    return Job(ring * ulysses, ring, ulysses, dp, dp_rank, g["cp_rank"], g)


def with_cp(names: list[str], out: str, backend: str, world: int) -> None:
    cache: dict = {}
    results = {}
    grads = {}
    for name in names:
        v = VARIANTS[name.removesuffix(ARMED_SUFFIX)]
        if v.layout[0] * v.layout[1] * v.layout[2] != world:
            continue
        started = time.perf_counter()
        job = job_for(v, v.layout, 0, cache)
        job.dp_rank = job.groups["mesh"]["dp"].get_local_rank()
        try:
            job.model = build(v, job, backend)
            job.run = wrap(v, job, job.model)
            if v.compile:
                job.run = torch.compile(job.run, backend=v.compile)
            mine = armed(v, job) if name.endswith(ARMED_SUFFIX) else watched(v, job)
        except Exception as exc:  # noqa: BLE001 - a variant that raises is recorded, the others still run
            import traceback

            mine = {"verdict": "RAISED", "diagnosis": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            if v.compile or v.loss.startswith("compiled"):
                torch._dynamo.reset()
                _compiled_loss.clear()
        results[name] = {**mine, "variant": asdict(v), "wall_s": round(time.perf_counter() - started, 2)}
        if job.cp_rank == 0 and job.tapped is not None:
            grads[name] = job.tapped
    rank = dist.get_rank()
    torch.save(grads, os.path.join(out, f"cp_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "cp.json"), "w") as fh:
            json.dump(results, fh, indent=1)


def summary(report: Any) -> dict:
    f = report.findings[0] if report.findings else None
    return {
        "verdict": str(report.verdict.value),
        "diagnosis": f.diagnosis if f else "",
        "verdicts": [str(x.verdict.value) for x in report.findings],
        "not_read": list(getattr(f.evidence, "not_read", ()) or ()) if f else [],
    }


def watched(v: Variant, job: Job) -> dict:
    import cpdoctor

    return summary(step(v, job, cpdoctor.watch_step(job.run, timeout_s=120)))


def armed(v: Variant, job: Job) -> dict:
    """The step under what `cpdoctor.preflight(model=)` arms on the first training step, its own judge included (it
    raises PreflightFailed only for a FAIL; its attention half is examined by test_preflight.py, and needs a world
    of ring × ulysses ranks under torchrun). Whether it stopped the job, and its report."""
    import warnings

    import cpdoctor
    from cpdoctor import api

    seen: list = []
    stopped = False
    with warnings.catch_warnings():  # a WARN is a Python warning and the job goes on
        warnings.simplefilter("ignore")
        first = api._arm_first_step(job.run, None, seen.append)
        try:
            step(v, job, contextlib.nullcontext())
        except cpdoctor.PreflightFailed:
            stopped = True
    if first.report is None:  # never closed: nothing examined
        first.cancel()
        first.watch.discard()
        return {"verdict": "NOT CLOSED", "stopped": stopped, "diagnosis": "", "verdicts": [], "not_read": []}
    return {**summary(first.report), "stopped": stopped, "callbacks": len(seen)}


def one_process(names: list[str], out: str) -> None:
    """Every variant with every degree 1, once per data-parallel replica's data; the mean over the replicas. Half-dtype
    variants also in fp32 (their one-process rounding sets the comparison's tolerance)."""
    cache: dict = {}
    grads, fp32 = {}, {}
    for name in dict.fromkeys(n.removesuffix(ARMED_SUFFIX) for n in names):  # a step run twice with CP, once here
        v = VARIANTS[name]
        for target, variant in ((grads, v), (fp32, _in_fp32(v))):
            if variant is None:
                continue
            per_replica = []
            for d in range(v.layout[0]):
                job = job_for(variant, (1, 1, 1), d, cache)
                job.model = build(variant, job, "native")
                job.run = wrap(variant, job, job.model)
                if variant.compile:
                    job.run = torch.compile(job.run, backend=variant.compile)
                step(variant, job, contextlib.nullcontext())
                per_replica.append(job.tapped)
                if variant.compile or variant.loss.startswith("compiled"):
                    torch._dynamo.reset()
                    _compiled_loss.clear()
            target[name] = torch.stack(per_replica).mean(0)
    torch.save({"grads": grads, "fp32": fp32}, os.path.join(out, "one.pt"))


def _in_fp32(v: Variant) -> Variant | None:
    """The same step in fp32 (weights and no autocast), for a step that computes in a half dtype."""
    from dataclasses import replace

    if v.dtype == "fp32" and not v.scaler and not v.autocast_dtype:
        return None
    return replace(v, dtype="lora_fp32" if v.dtype.startswith("lora") else "fp32", autocast=False, autocast_dtype="")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("cp", "one"))
    p.add_argument("out")
    p.add_argument("--only", default="")
    a = p.parse_args()
    names = [n for n in VARIANTS if n != SMOKE] + [n + ARMED_SUFFIX for n in ARMED] if not a.only else a.only.split(",")
    os.makedirs(a.out, exist_ok=True)
    if a.mode == "one":
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        one_process(names, a.out)
        os._exit(0)
    dist.init_process_group("gloo")
    import cpdoctor
    from cpdoctor.cpu_kernels import cpu_backend

    cpdoctor.patch()  # the steps are examined, not diffusers' attention (0.39.0's stock ring backward is wrong)
    with_cp(names, a.out, cpu_backend.register(), dist.get_world_size())
    dist.barrier()
    print(end="", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
