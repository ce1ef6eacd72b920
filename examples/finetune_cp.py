"""Context-parallel fine-tuning of a diffusers transformer, with cpdoctor's pre-flight at the top, and the
picture that shows why it is there.

    torchrun --nproc-per-node 3 examples/finetune_cp.py --ring 3 --steps 30 --out curves.png
    torchrun --nproc-per-node 2 examples/finetune_cp.py --model ./my-flux --ring 2     # your Flux checkpoint

Every rank trains the same model through diffusers' own `enable_parallelism` (the model's `_cp_plan` splits
the sequence; each rank back-propagates its own tokens, so the parameter gradients are summed over the CP
group), twice from the same initial weights and data: once with the installed diffusers' ring attention as it
is ("stock"), once after `cpdoctor.preflight(...)` (which leaves cpdoctor's fix patched in when the stock code
is wrong). Rank 0 also trains the same model in one process (the truth). It writes the per-step loss and
gradient norm of all three to JSON, and to a PNG when matplotlib is installed: with a CP defect the stock curves
part from the single-process ones; after the pre-flight they coincide. The first step of each CP run is examined
by `cpdoctor.watch_step` against one fp64 process: the stock run's says where its gradients went wrong.

The default model is a tiny Flux (random weights, seeded alike on every rank); `--model` takes a Flux-family
checkpoint directory (or its pipeline folder) instead. On CPU the attention backend is cpdoctor's CPU backend
(no stock diffusers backend runs ring attention on a CPU); on GPUs pass `--backend _native_flash` or `flash`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpdoctor
from cpdoctor.fix.patch import is_patched

TINY_FLUX = dict(
    patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
)  # fmt: skip


def build_model(path: str | None):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    if path is None:
        return FluxTransformer2DModel(**TINY_FLUX)
    sub = "transformer" if os.path.isdir(os.path.join(path, "transformer")) else None
    return FluxTransformer2DModel.from_pretrained(path, subfolder=sub, use_safetensors=True)


def make_batches(config, steps: int, grid: int, text: int, batch: int = 1, distinct: int = 1) -> list[tuple[dict, torch.Tensor]]:
    """Synthetic (inputs, target) pairs, the same on every rank: image tokens (grid × grid latents) and text;
    `distinct` different batches cycled over the steps (1: fine-tune on one sample, where a wrong gradient
    shows as a different trajectory rather than drowning in the noise of new data every step)."""
    gen = torch.Generator().manual_seed(1)
    h = torch.arange(grid).repeat_interleave(grid).float()
    w = torch.arange(grid).repeat(grid).float()
    img_ids = torch.stack([torch.zeros_like(h), h, w], dim=1)
    txt_ids = torch.zeros(text, 3)
    batches = []
    for _ in range(distinct):
        inputs = dict(
            hidden_states=torch.randn(batch, grid * grid, config.in_channels, generator=gen),
            encoder_hidden_states=torch.randn(batch, text, config.joint_attention_dim, generator=gen),
            pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=gen),
            timestep=torch.rand(batch, generator=gen),
            img_ids=img_ids,
            txt_ids=txt_ids,
        )
        if config.guidance_embeds:
            inputs["guidance"] = torch.full((batch,), 3.5)
        batches.append((inputs, torch.randn(batch, grid * grid, config.out_channels or config.in_channels, generator=gen)))
    return [batches[i % distinct] for i in range(steps)]


def train(model, batches, cp_group=None, lr: float = 1e-2, watch: bool = False) -> tuple[dict[str, list[float]], object]:
    """AdamW steps; under CP the parameter gradients are summed over the CP group before the step. With `watch`,
    the first step runs inside `cpdoctor.watch_step` (against one fp64 process); its report is returned too."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    curves: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    report = None
    for i, (inputs, target) in enumerate(batches):
        with cpdoctor.watch_step(model) if watch and i == 0 else contextlib.nullcontext() as watched:
            out = model(**inputs, return_dict=False)[0]  # the _cp_plan gathers the full output on every rank
            loss = F.mse_loss(out.float(), target)
            opt.zero_grad()
            loss.backward()
            if cp_group is not None:
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=cp_group)
        if watched is not None:
            report = watched.report
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        curves["loss"].append(loss.item())
        curves["grad_norm"].append(norm.item())
    return curves, report


def cp_model(path, backend: str, ring: int, ulysses: int):
    """The model with diffusers' context parallelism enabled on this job's ranks."""
    from cpdoctor.compat.diffusers import accelerator_count_at_least_one, context_parallel_config

    model = build_model(path)
    model.set_attention_backend(backend)
    # Some releases divide by the number of accelerators inside enable_parallelism; on a CPU-only host that is
    # 0 (docs/FACTS.md), hence cpdoctor's shim. On GPUs it changes nothing.
    with accelerator_count_at_least_one():
        model.enable_parallelism(config=context_parallel_config(ring, ulysses))
    return model


def plot(curves: dict[str, dict[str, list[float]]], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    styles = {
        "single process": dict(color="black", lw=3, alpha=0.35),
        "CP, stock diffusers": dict(color="tab:red", lw=1.5),
        "CP, after cpdoctor.preflight": dict(color="tab:green", lw=1.5, ls="--"),
    }
    for ax, key, label in zip(axes, ("loss", "grad_norm"), ("loss", "gradient norm")):
        for name, c in curves.items():
            ax.plot(range(1, len(c[key]) + 1), c[key], label=name, **styles.get(name, {}))
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    ref = curves["single process"]["loss"]
    for name, c in curves.items():
        if name != "single process":
            gaps = [max(abs(a - b) / abs(b), 1e-9) for a, b in zip(c["loss"], ref)]
            axes[2].plot(range(1, len(gaps) + 1), gaps, label=name, **styles.get(name, {}))
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("loss: relative gap to one process")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Flux-family checkpoint directory (default: a tiny Flux)")
    parser.add_argument("--ring", type=int, default=2)
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--backend", default=None, help="attention backend (default: cpdoctor_cpu on CPU, _native_flash on GPU)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--distinct", type=int, default=1, help="different batches cycled over the steps")
    parser.add_argument("--grid", type=int, default=12, help="image latents per side (grid² image tokens)")
    parser.add_argument("--text", type=int, default=12, help="text tokens")
    parser.add_argument("--out", default="curves.png", help="the PNG (and, beside it, the JSON of the curves)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    # The pre-flight, on every rank before the first CP step: if this diffusers' CP attention is wrong here and
    # cpdoctor's fix is exact, the fix stays patched in; if neither is safe, PreflightFailed stops the job.
    report = cpdoctor.preflight(args.ring, args.ulysses)
    fixed = is_patched()

    from cpdoctor.cpu_kernels import cpu_backend

    backend = args.backend or (cpu_backend.register() if not torch.cuda.is_available() else "_native_flash")
    config = build_model(args.model).config
    batches = make_batches(config, args.steps, args.grid, args.text, distinct=args.distinct)

    curves: dict[str, dict[str, list[float]]] = {}
    if rank == 0:
        single = build_model(args.model)
        single.set_attention_backend(backend)
        curves["single process"], _ = train(single, batches)
    cpdoctor.unpatch()  # the stock code, for the picture only
    steps: dict[str, object] = {}  # the first step of each CP run, examined by cpdoctor.watch_step
    curves["CP, stock diffusers"], steps["CP, stock diffusers"] = train(
        cp_model(args.model, backend, args.ring, args.ulysses), batches, dist.group.WORLD, watch=True
    )
    if fixed:
        cpdoctor.patch()
    curves["CP, after cpdoctor.preflight"], steps["CP, after cpdoctor.preflight"] = train(
        cp_model(args.model, backend, args.ring, args.ulysses), batches, dist.group.WORLD, watch=True
    )

    if rank == 0:
        ref = curves["single process"]

        def gap(name: str, key: str) -> float:
            return max(abs(a - b) / abs(b) for a, b in zip(curves[name][key], ref[key]))

        summary = {
            "preflight": {"verdict": str(report.verdict), "before": str(report.before.verdict) if report.before else None, "fixed": fixed},
            "layout": {"ring": args.ring, "ulysses": args.ulysses, "backend": backend},
            "max_rel_gap": {name: {k: gap(name, k) for k in ("loss", "grad_norm")} for name in curves if name != "single process"},
            "curves": curves,
            "step": {name: {"verdict": str(r.verdict.value), "diagnosis": r.findings[0].diagnosis} for name, r in steps.items()},
        }
        base = os.path.splitext(args.out)[0]
        with open(base + ".json", "w") as fh:
            json.dump(summary, fh, indent=1)
        import diffusers

        verdict = summary["preflight"]["before"] or str(report.verdict)
        after = "cpdoctor's fix patched in" if fixed else "nothing to fix"
        title = f"diffusers {diffusers.__version__}, ring {args.ring} × Ulysses {args.ulysses}, {backend}: pre-flight found the stock CP attention {verdict}, {after}"
        drew = plot(curves, args.out, title)
        for name, step in summary["step"].items():
            print(f"{name}: cpdoctor.watch_step on the first step: {step['verdict']} — {step['diagnosis']}")
        for name, g in summary["max_rel_gap"].items():
            print(f"{name}: largest relative gap to one process: loss {g['loss']:.2e}, gradient norm {g['grad_norm']:.2e}")
        print(f"wrote {base}.json" + (f" and {args.out}" if drew else " (pip install matplotlib for the PNG)"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: gloo's worker thread may still be releasing the last collective's
    # tensors then, and aborts the process at exit (SIGABRT after a clean run; cpdoctor's docs/DECISIONS.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
