"""A watched CP step of a compiled model, per compiler backend given: the same step compiled and run without the
watcher, then with it (a fresh copy of the same weights each time); rank 0 writes, per backend, the watcher's
verdict and whether the gradients came out bit-identical to the unwatched compiled step's on every rank.

    python -m torch.distributed.run --nproc-per-node 2 compile_step.py OUT.json aot_eager [inductor]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from train_cp_2d import GRID, build_model, conditioning, enable_cp  # noqa: E402


def step(backend: str, mesh, watch) -> tuple[list, object]:
    from cpdoctor.cpu_kernels import cpu_backend

    model = enable_cp(build_model("flux"), mesh, cpu_backend.register())
    run = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, GRID * GRID, model.config.in_channels, generator=gen)
    block = watch(run) if watch is not None else None
    with block if block is not None else torch.enable_grad():
        out = run(hidden_states=x0, timestep=torch.rand(1, generator=gen), **conditioning(model, 0, 0))[0]
        (F.mse_loss(out, torch.randn(out.shape, generator=gen)) * 2).backward()  # × cp ...
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh["ring"].get_group())
                p.grad /= 2  # ... and the mean over the CP ranks that cancels it
    torch._dynamo.reset()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], getattr(block, "report", None)


def main() -> None:
    out, backends = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    import cpdoctor

    cpdoctor.patch()
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    results = {}
    for backend in backends:
        plain, _ = step(backend, mesh, None)
        watched, report = step(backend, mesh, cpdoctor.watch_step)
        same = len(plain) == len(watched) and all(torch.equal(a, b) for a, b in zip(plain, watched))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, same)
        results[backend] = {
            "verdict": str(report.verdict.value),
            "diagnosis": report.findings[0].diagnosis,
            "identical_on_every_rank": everyone,
        }
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
