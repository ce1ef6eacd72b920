"""The step examination at real width: one full-width FLUX.1-dev double-stream block (the `cpdoctor model --blocks 1`
slice: hidden 3072, 24 heads × 128, joint_attention_dim 4096, guidance embeddings; random weights of the real shapes,
as no checkpoint can be downloaded here), CP 2 on two CPU ranks, fp32, 256×256 px (256 image tokens) and 64 text
tokens. Measured on rank 0 (the CP group's first rank, which holds the one-process reference):

- wall time of the unwatched step, and of the same step watched by `cpdoctor.watch_step` (one run: the fp64
  reference recomputed from the recorded step), alternating, `--reps` each;
- the reference's memory plan (copy + gradients, printed in the report's evidence) against the growth of the
  process's peak RSS during the first watched step.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_step_full_width.py --out benchmarks/results/step_full_width.json
    python benchmarks/bench_step_full_width.py --two-runs --out benchmarks/results/step_full_width.json   # adds "two_runs"

`--two-runs` (not under torchrun) times `cpdoctor step benchmarks/bench_step_full_width.py:full_width_step --ring 2`:
the same step run without CP (one process) and with CP (two ranks), no copy of the model, and adds its wall time
and verdict to the same JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

FULL_WIDTH = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=0, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
"""FLUX.1-dev's transformer config (docs/FACTS.md) sliced to one double-stream block."""

IMAGE_SIDE, TEXT = 16, 64


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def build(mesh):
    from diffusers import FluxTransformer2DModel
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from cpdoctor.compat.diffusers import accelerator_count_at_least_one
    from cpdoctor.cpu_kernels import cpu_backend

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FULL_WIDTH)
    model.set_attention_backend(cpu_backend.register())
    with accelerator_count_at_least_one():
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=mesh["ring"].size(), ulysses_degree=1, mesh=mesh))
    return model


def inputs(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    h, w = torch.arange(IMAGE_SIDE).repeat_interleave(IMAGE_SIDE).float(), torch.arange(IMAGE_SIDE).repeat(IMAGE_SIDE).float()
    return dict(
        hidden_states=torch.randn(1, IMAGE_SIDE * IMAGE_SIDE, 64, generator=gen),
        encoder_hidden_states=torch.randn(1, TEXT, 4096, generator=gen),
        pooled_projections=torch.randn(1, 768, generator=gen),
        timestep=torch.rand(1, generator=gen),
        img_ids=torch.stack([torch.zeros_like(h), h, w], dim=1),
        txt_ids=torch.zeros(TEXT, 3),
        guidance=torch.full((1,), 3.5),
        return_dict=False,
    )


def step(model, cp_group, watch=None) -> tuple[float, object]:
    import contextlib

    kw = inputs(0)
    dist.barrier()
    t0 = time.perf_counter()
    with watch(model) if watch is not None else contextlib.nullcontext() as watched:
        out = model(**kw)[0]
        F.mse_loss(out, torch.zeros_like(out)).backward()
        for p in model.parameters():
            if p.grad is not None:  # the sliced model leaves some embeddings unused
                dist.all_reduce(p.grad, group=cp_group)
    dist.barrier()
    wall = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return wall, getattr(watched, "report", None)


def full_width_step(watch_step, cp: int, dp: int, ring: int, ulysses: int) -> None:
    """For `cpdoctor step FILE:full_width_step --ring 2` (two runs: without CP, then with CP)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, ring, ulysses), mesh_dim_names=("dp", "ring", "ulysses"))
    if cp > 1:
        model = build(mesh)
    else:
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        model = FluxTransformer2DModel(**FULL_WIDTH)
    with watch_step(model):
        out = model(**inputs(0))[0]
        F.mse_loss(out, torch.zeros_like(out)).backward()
        if cp > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=mesh["ring"].get_group())


def two_runs(out_path: str) -> None:
    import subprocess
    import sys

    import run_record  # benchmarks/ is on sys.path when run as a script (the ranks of `cpdoctor step` import this file without it)

    cmd = [sys.executable, "-m", "cpdoctor", "step", f"{os.path.abspath(__file__)}:full_width_step", "--ring", "2", "--json", "-"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    report = json.loads(proc.stdout)
    f = report["findings"][0]
    with open(out_path) as fh:
        result = json.load(fh)
    result["two_runs"] = {
        "command": " ".join(cmd[2:]),
        "wall_s": wall,
        "verdict": report["verdict"],
        "diagnosis": f["diagnosis"],
        "grads_rel_err": f["tensors"].get("grads", {}).get("rel_err"),
        "load_average": run_record.load_average(),
    }
    with open(out_path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["two_runs"], indent=1))


def main() -> None:
    import run_record  # see two_runs

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--two-runs", action="store_true")
    a = p.parse_args()
    if a.two_runs:
        return two_runs(a.out)
    load_before = run_record.load_average()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    import cpdoctor

    mesh = init_device_mesh("cpu", (1, dist.get_world_size(), 1), mesh_dim_names=("dp", "ring", "ulysses"))
    model = build(mesh)
    params = sum(p.numel() for p in model.parameters())
    plain, watched, report, rss = [], [], None, {}
    for rep in range(a.reps):
        wall, _ = step(model, mesh["ring"].get_group())
        plain.append(wall)
        before = peak_rss_gib()
        wall, report = step(model, mesh["ring"].get_group(), cpdoctor.watch_step)
        watched.append(wall)
        if rep == 0:
            rss = {"peak_rss_before_gib": before, "peak_rss_after_gib": peak_rss_gib()}
    if dist.get_rank() == 0:
        f = report.findings[0]
        evidence = f.details()
        result = {
            "what": "one full-width FLUX.1-dev double block (cpdoctor model --blocks 1 slice), CP 2, fp32, 256 image + 64 text tokens",
            "machine": run_record.machine(),
            "versions": run_record.versions(),
            "load_average": {"before": load_before, "after": run_record.load_average()},
            "command": "python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_step_full_width.py --reps " + str(a.reps),
            "parameters": params,
            "reps": a.reps,
            "unwatched_s": plain,
            "watched_s": watched,
            "unwatched_spread_s": run_record.summary(plain, 2)["spread"],
            "watched_spread_s": run_record.summary(watched, 2)["spread"],
            "watched_over_unwatched": statistics.median(w / u for w, u in zip(watched, plain)),
            "watched_over_unwatched_spread": run_record.summary([w / u for w, u in zip(watched, plain)], 2)["spread"],
            "verdict": str(report.verdict),
            "diagnosis": f.diagnosis,
            "grads_rel_err": f.tensors["grads"].rel_err if "grads" in f.tensors else None,
            "reference_plan_gib": evidence.get("reference_gib"),
            **rss,
            "peak_rss_growth_gib": rss["peak_rss_after_gib"] - rss["peak_rss_before_gib"],
        }
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(json.dumps(result, indent=1))
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
