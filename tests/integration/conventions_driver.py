"""The steps diffusion trainers write, each watched by `cpdoctor.watch_step` in ONE torchrun world of 4 gloo ranks
(data-parallel 2 × CP 2, tiny Flux): LoRA through peft on a bf16 base with fp32 adapters, bf16 weights,
autocast, gradient checkpointing (diffusers' and torch's checkpoint_wrapper), accumulation, clipping, GradScaler,
torch.compile, loss × cp with a mean over the CP ranks (DDP over the whole mesh; FSDP2 over dp × cp), a per-shard
loss normalised by the full token count, and the faults of the last issue in their LoRA + bf16 form. Rank 0
writes every variant's verdict and diagnoses to JSON (tests/integration/test_step_conventions.py reads it).

    python -m torch.distributed.run --nproc-per-node 4 conventions_driver.py OUT.json [--patch]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from step_driver import write_and_leave  # noqa: E402  (this folder: the script's own)
from train_cp_2d import GRID, build_model, conditioning, enable_cp  # noqa: E402

DP, CP = 2, 2


def lora(model, dtype=torch.bfloat16):
    """diffusers' LoRA scripts: the base in bf16, a peft adapter on the attention projections, the adapters cast
    back to fp32 (cast_training_params); lora_B made non-zero, as after a few steps (at init its zeros leave
    lora_A without a gradient)."""
    from peft import LoraConfig

    model.to(dtype)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    gen = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()
            if "lora_B" in name:
                p.data = 0.1 * torch.randn(p.shape, generator=gen)
    return model


VARIANTS: dict[str, dict] = {
    "lora_bf16": {"lora": True},
    "bf16_weights": {"dtype": torch.bfloat16},
    "autocast_bf16": {"autocast": torch.bfloat16},
    "gradient_checkpointing": {"gc": "diffusers"},
    "checkpoint_wrapper": {"gc": "torch"},
    "accumulation_3": {"micro": 3},
    "clip_inside": {"clip": 1e-3},
    "grad_scaler": {"scaler": True},
    "compiled": {"compile": True},
    "loss_x_cp_ddp_world": {"loss_x_cp": True, "sync": "ddp_world"},
    "loss_x_cp_fsdp2": {"loss_x_cp": True, "sync": "fsdp2"},
    "shard_loss_full_count": {"shard_loss": "full"},
    "lora_bf16_explicit_scale": {"lora": True, "loss_x_cp": True, "sync": "ddp_world", "loss_scale": float(CP)},
    "accelerate_loss_x_cp": {"loss_x_cp": True, "sync": "accelerate"},
    "trainer_wrapper": {"wrapper": True},
    "gc_stock_ring": {"gc": "diffusers", "stock": True},
    "reference_raises": {"inject": "reference_raises"},
    "one_rank_raises": {"fault_on_rank_1": "raise"},
    "one_rank_stuck": {"fault_on_rank_1": "sleep", "timeout_s": 2.0},
    "reference_too_large": {"inject": "no_memory"},
    # the faults, in their LoRA + bf16 form
    "bug_lora_noise_by_rank": {"lora": True, "noise_seed": "rank"},
    "bug_lora_no_cp_reduce": {"lora": True, "sync": "dp_only"},
    "bug_lora_mean_over_cp": {"lora": True, "sync": "ddp_world"},
    "bug_lora_shard_loss_local": {"lora": True, "shard_loss": "local"},
    "bug_lora_no_dp_average": {"lora": True, "sync": "cp_only"},
}
"""What each variant changes from a correct fp32 full fine-tune with DDP over dp and a sum over CP."""


def inject(fault: str | None):
    """A fault in cpdoctor's own reference on the CP groups' first ranks: it raises, or the machine has no memory
    for it. Returns the undo."""
    from cpdoctor.examinations.step.judgment import reference
    from cpdoctor.model_zoo import memory

    if fault is None:
        return lambda: None
    saved = (reference.reference_step, memory.available_memory)
    if fault == "reference_raises":

        def raising(*args, **kwargs):
            raise RuntimeError("injected: the reference failed")

        reference.reference_step = raising
    else:
        memory.available_memory = lambda device: 1 << 20

    def undo() -> None:
        reference.reference_step, memory.available_memory = saved

    return undo


def build(v: dict, mesh):
    from cpdoctor.cpu_kernels import cpu_backend

    model = build_model("flux")
    if v.get("lora"):
        lora(model)
    elif "dtype" in v:
        model.to(v["dtype"])
    if v.get("gc") == "diffusers":
        model.enable_gradient_checkpointing()
    model = enable_cp(model, mesh, cpu_backend.register())
    if v.get("gc") == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__.endswith("TransformerBlock"))
    return model


def sync(model, v: dict, mesh) -> None:
    """The gradient sync after backward (DDP's and FSDP2's happen inside backward)."""
    if v.get("sync") in ("ddp_world", "fsdp2", "accelerate"):
        return
    for p in model.parameters():
        if p.grad is None:
            continue
        if v.get("sync") != "dp_only":
            dist.all_reduce(p.grad, group=mesh["ring"].get_group())  # sum over the CP ranks
        if v.get("sync") != "cp_only":
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            p.grad /= DP


def wrap(model, v: dict, mesh):
    from torch.nn.parallel import DistributedDataParallel as DDP

    if v.get("sync") == "ddp_world":
        return DDP(model, find_unused_parameters=True)  # averages over every rank: dp × cp
    if v.get("sync") == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh["dp", "ring"]._flatten())  # mean over dp × cp
        return model
    if v.get("sync") == "accelerate":  # Accelerator.prepare wraps in DDP over every rank (dp × cp)
        from accelerate import Accelerator

        return Accelerator(cpu=True).prepare(model)
    if v.get("compile"):
        return torch.compile(model, backend="aot_eager")  # "eager" compiles nothing; aot_eager traces the graphs
    if v.get("wrapper"):  # a trainer's own module around the transformer (watch_step is given the wrapper)
        return TrainerModule(model)
    return model


class TrainerModule(torch.nn.Module):
    def __init__(self, transformer) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, **kwargs):
        return self.transformer(**kwargs)


def one_step(name: str, v: dict, watch) -> object:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, CP, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["ring"].get_local_rank()
    model = build(v, mesh)
    run = wrap(model, v, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if v.get("scaler") else None
    seed = dist.get_rank() if v.get("noise_seed") == "rank" else dp_rank
    cond = conditioning(model, dp_rank, 0)
    dtype = next(p.dtype for p in model.parameters())
    cond = {k: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for k, x in cond.items()}
    kwargs = {k: v[k] for k in ("loss_scale", "timeout_s") if k in v}
    watched = watch(run, **kwargs)
    try:
        _body(watched, v, run, model, mesh, opt, scaler, cond, dtype, seed, cp_rank, trainable)
    except Exception as exc:  # noqa: BLE001 - the user's own exception: the watcher's report says what it saw
        return watched.report, f"{type(exc).__name__}: {exc}"
    return watched.report, None


def _body(watched, v, run, model, mesh, opt, scaler, cond, dtype, seed, cp_rank, trainable) -> None:
    micro = v.get("micro", 1)
    with watched:
        for k in range(micro):
            gen = torch.Generator().manual_seed(1000 * k + seed)
            x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen).to(dtype)
            noise = torch.randn(x0.shape, generator=gen).to(dtype)
            t = torch.rand(1, generator=gen).to(dtype)
            auto = v.get("autocast") or (torch.float16 if scaler else None)
            with torch.autocast("cpu", dtype=auto, enabled=auto is not None):
                out = run(hidden_states=(1 - t) * x0 + t * noise, timestep=t, **cond)[0]
                target = noise - x0
                if v.get("shard_loss"):
                    piece = lambda x: x.chunk(CP, dim=1)[cp_rank]  # noqa: E731
                    if v["shard_loss"] == "full":
                        loss = (piece(out).float() - piece(target).float()).pow(2).sum() / out.numel()
                    else:
                        loss = F.mse_loss(piece(out).float(), piece(target).float())
                else:
                    loss = torch.mean(((out.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1).mean()
            if v.get("loss_x_cp"):
                loss = loss * CP
            loss = loss / micro
            if v.get("sync") == "accelerate":
                from accelerate import Accelerator

                Accelerator(cpu=True).backward(loss)
            else:
                (scaler.scale(loss) if scaler else loss).backward()
        sync(model, v, mesh)
        if v.get("fault_on_rank_1") and dist.get_rank() == 1:  # after the sync: no collective of the step is left open
            if v["fault_on_rank_1"] == "raise":
                raise RuntimeError("rank 1's step failed after its sync")
            import time

            time.sleep(3 * v["timeout_s"])  # stuck past the watcher's timeout
        if scaler is not None:
            scaler.unscale_(opt)
        if v.get("clip"):
            torch.nn.utils.clip_grad_norm_(trainable, v["clip"])
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def preflight_clip() -> dict:
    """What `cpdoctor.preflight(model=...)` arms (the first optimizer step closes the watch): a LoRA step on a bf16
    base whose script clips after its sync and before optimizer.step(); the judge preflight uses raises only for a
    FAIL, so a PASS (or a WARN) lets the job go on."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.examinations.step import arm_first_step

    mesh = init_device_mesh("cpu", (DP, CP, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank = mesh["dp"].get_local_rank()
    model = build({"lora": True}, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    seen = []
    armed = arm_first_step(model, seen.append)
    cond = {
        k: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for k, x in conditioning(model, dp_rank, 0).items()
    }
    gen = torch.Generator().manual_seed(dp_rank)
    x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen).to(torch.bfloat16)
    out = model(hidden_states=x0, timestep=torch.rand(1, generator=gen).to(torch.bfloat16), **cond)[0]
    F.mse_loss(out.float(), torch.randn(out.shape, generator=gen)).backward()
    sync(model, {}, mesh)
    torch.nn.utils.clip_grad_norm_(trainable, 1e-3)
    opt.step()
    return {**summary(armed.report), "callbacks": len(seen)}


def preflight_scaler_skip() -> dict:
    """fp16 training's usual start under `preflight(model=...)`: the GradScaler's first scale overflows and it skips
    optimizer.step(); the armed watch must not stay open past it (nor read the inf as a loss that differs between
    ranks): it re-arms and examines the next step, which the optimizer takes."""
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.examinations.step import arm_first_step

    mesh = init_device_mesh("cpu", (DP, CP, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank = mesh["dp"].get_local_rank()
    model = build({}, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)  # overflows once, then 1024
    seen = []
    armed = arm_first_step(model, seen.append)
    for step in range(2):
        cond = conditioning(model, dp_rank, step)
        gen = torch.Generator().manual_seed(100 * step + dp_rank)
        x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(hidden_states=x0, timestep=torch.rand(1, generator=gen), **cond)[0]
        scaler.scale(F.mse_loss(out.float(), torch.randn(out.shape, generator=gen))).backward()
        sync(model, {}, mesh)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return {**summary(armed.report), "callbacks": len(seen), "skipped": armed.skipped}


def train(watch, steps: int = 3) -> list:
    """A few AdamW steps of the correct fp32 step, watched or not, noise from the global RNG (so a watcher that
    drew random numbers on one rank only, or left its state moved, changes the next step's noise)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, CP, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    dp_rank = mesh["dp"].get_local_rank()
    model = build({}, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + dp_rank)
    for step in range(steps):
        cond = conditioning(model, dp_rank, step)
        block = watch(model) if watch is not None else contextlib.nullcontext()
        with block:
            x0 = torch.randn(1, GRID * GRID, model.config.in_channels)
            out = model(hidden_states=x0, timestep=torch.rand(1), **cond)[0]
            F.mse_loss(out, torch.randn(out.shape)).backward()
            sync(model, {}, mesh)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def no_trace(watch) -> dict:
    """The same 3 steps watched and unwatched: bit-identical weights on every rank (and the RNG where it was)."""
    plain = train(None)
    rng_plain = torch.get_rng_state()
    watched = train(watch)
    same = all(torch.equal(a, b) for a, b in zip(plain, watched)) and torch.equal(rng_plain, torch.get_rng_state())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, same)
    return {"identical_on_every_rank": everyone}


def summary(report, error=None) -> dict:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (str(report.verdict.value), report.findings[0].diagnosis if report.findings else ""))
    return {
        "raised": error,
        "every_rank": everyone,
        "verdict": str(report.verdict.value),
        "diagnoses": [f.diagnosis for f in report.findings],
        "remedies": [f.remedy for f in report.findings],
        "grads": [f.tensors["grads"].rel_err if "grads" in f.tensors else None for f in report.findings],
        "details": [f.details() for f in report.findings],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--patch", action="store_true")
    p.add_argument("--only", default="")
    a = p.parse_args()
    dist.init_process_group("gloo")
    import cpdoctor

    if a.patch:
        cpdoctor.patch()
    results = {}
    for name, v in VARIANTS.items():
        if a.only and name not in a.only.split(","):
            continue
        if v.get("stock"):
            cpdoctor.unpatch()
        undo = inject(v.get("inject"))
        try:
            results[name] = summary(*one_step(name, v, cpdoctor.watch_step))
        except Exception as exc:  # noqa: BLE001 - a variant that raises is recorded, the others still run
            import traceback

            results[name] = {"verdict": "RAISED", "diagnoses": [f"{type(exc).__name__}: {exc}"], "traceback": traceback.format_exc()}
        finally:
            undo()
            if v.get("stock") and a.patch:
                cpdoctor.patch()
        torch._dynamo.reset() if v.get("compile") else None
    if not a.only:
        results["no_trace"] = no_trace(cpdoctor.watch_step)
        results["preflight_clip"] = preflight_clip()
        results["preflight_scaler_skip"] = preflight_scaler_skip()
    write_and_leave(results, a.out)


if __name__ == "__main__":
    main()
