"""What `cpdoctor.watch_step` adds to a training step: the same CP step of a small Flux, unwatched and watched
(fp64 and fp32 reference), in the same run, the ratio per step.

    torchrun --nproc-per-node 2 benchmarks/bench_step.py [--layers 2 --grid 16 --text 32 --repeats 5]

The watcher's extra work is one forward+backward on each CP group's first rank (the one-process reference, on
the full sequence: about CP × one rank's share of the step's compute), plus copies of the inputs, weights and
gradients and a few object collectives; the other ranks wait for it at the watcher's exit. Rank 0 prints the
medians and the ratios (and, with --json FILE, writes them)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train_cp_2d import enable_cp  # noqa: E402

import cpdoctor  # noqa: E402


def flux(args):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=args.layers, num_single_layers=args.layers, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=(8, 8, 16),
    )  # fmt: skip


def model_and_inputs(args):
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.cpu_kernels import cpu_backend

    model = flux(args)
    mesh = init_device_mesh("cpu", (1, dist.get_world_size(), 1), mesh_dim_names=("dp", "ring", "ulysses"))
    enable_cp(model, mesh, cpu_backend.register())
    g = args.grid
    h, w = torch.arange(g).repeat_interleave(g).float(), torch.arange(g).repeat(g).float()
    gen = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, g * g, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, args.text, 64, generator=gen),
        pooled_projections=torch.randn(1, 64, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.stack([torch.zeros_like(h), h, w], dim=1),
        txt_ids=torch.zeros(args.text, 3),
        return_dict=False,
    )
    return model, inputs, torch.randn(1, g * g, 16, generator=gen)


def one_step(model, inputs, target) -> None:
    out = model(**inputs)[0]
    F.mse_loss(out, target).backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
    model.zero_grad(set_to_none=True)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--grid", type=int, default=16, help="image tokens per side")
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, inputs, target = model_and_inputs(args)
    one_step(model, inputs, target)  # warm-up

    def watched(reference: str):
        def run() -> None:
            with cpdoctor.watch_step(model, reference=reference):
                out = model(**inputs)[0]
                F.mse_loss(out, target).backward()
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
            model.zero_grad(set_to_none=True)

        return run

    single = flux(args)  # what the watcher's reference costs: one process, full sequence, no CP (rank 0 only)
    single.set_attention_backend("native")

    def one_process(dtype):
        def run() -> None:
            if dist.get_rank() == 0:
                m = single.to(dtype)
                cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
                F.mse_loss(m(**cast)[0], target.to(dtype)).backward()
                m.zero_grad(set_to_none=True)

        return run

    times: dict[str, list[float]] = {
        "unwatched": [],
        "watched fp64": [],
        "watched fp32": [],
        "one process fp64": [],
        "one process fp32": [],
    }
    for _ in range(args.repeats):  # interleaved, so a slower moment of a shared machine hits all alike
        times["unwatched"].append(timed(lambda: one_step(model, inputs, target)))
        times["watched fp64"].append(timed(watched("fp64")))
        times["watched fp32"].append(timed(watched("fp32")))
        times["one process fp64"].append(timed(one_process(torch.float64)))
        times["one process fp32"].append(timed(one_process(torch.float32)))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "world_size": dist.get_world_size(),
        "tokens": args.grid**2 + args.text,
        "layers": args.layers,
        "median_s": med,
        "ratio": {k: med[k] / med["unwatched"] for k in med if k != "unwatched"},
        "overhead_over_one_process_fwd_bwd": {
            p: (med[f"watched {p}"] - med["unwatched"]) / med[f"one process {p}"] for p in ("fp64", "fp32")
        },
    }
    if dist.get_rank() == 0:
        print(
            f"CP {result['world_size']}, {result['tokens']} tokens, {args.layers}+{args.layers} blocks: unwatched {med['unwatched'] * 1e3:.0f} ms; "
            + "; ".join(f"{k} {med[k] * 1e3:.0f} ms ({result['ratio'][k]:.2f}×)" for k in result["ratio"])
            + "; watched − unwatched = "
            + ", ".join(f"{v:.2f}× one {p} fwd+bwd" for p, v in result["overhead_over_one_process_fwd_bwd"].items())
        )
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
