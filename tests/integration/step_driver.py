"""Run copies of examples/train_cp_2d.py (each with one fault injected by the test) in ONE torchrun world, one
watched step each, plus the watcher's bad inputs; rank 0 writes every variant's verdicts and diagnoses to JSON.
One launch per diffusers release keeps the targets' test time small (diffusers is imported once per rank).

    python -m torch.distributed.run --nproc-per-node 4 step_driver.py OUT.json DIR_OF_COPIES [--patch]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch
import torch.distributed as dist


def load(path: str):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(report) -> dict:
    return {
        "verdict": str(report.verdict.value),
        "exit_code": int(report.exit_code),
        "diagnoses": [f.diagnosis for f in report.findings],
        "remedies": [f.remedy for f in report.findings],
        "commands": [f.command for f in report.findings],
    }


def checkpointed_step(model, x, cond, patched: bool) -> dict:
    """A step of the model under its own enable_gradient_checkpointing() through diffusers' stock ring (unpatched
    for it): what the watcher names when the attention raises inside the step (issue 30)."""
    import cpdoctor
    from cpdoctor import watch_step

    cpdoctor.unpatch()
    model.enable_gradient_checkpointing()
    raised = None
    try:
        with watch_step(model) as w:
            model(hidden_states=x, timestep=torch.tensor([0.5]), **cond)[0].sum().backward()
    except Exception as exc:  # noqa: BLE001 - the user's step raising is what is examined
        raised = type(exc).__name__
    finally:
        model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        if patched:
            cpdoctor.patch()
    return {**summary(w.report), "raised": raised}


def bad_inputs(example, args, patched: bool = False) -> dict:
    """The watcher's bad inputs, in process: no CP, no backward, a raising step, ranks at different steps; and a
    step under gradient checkpointing with the stock ring."""
    from cpdoctor import watch_step
    from cpdoctor.errors import BadInput

    out = {}
    try:
        with watch_step(example.build_model("flux")):
            pass
        out["no_cp"] = {"raised": None}
    except BadInput as exc:
        out["no_cp"] = {"raised": str(exc)}
    from torch.distributed.device_mesh import init_device_mesh

    from cpdoctor.cpu_kernels import cpu_backend

    mesh = init_device_mesh("cpu", (args.dp, args.cp, 1), mesh_dim_names=("dp", "ring", "ulysses"))
    model = example.enable_cp(example.build_model("flux"), mesh, cpu_backend.register())
    cond = example.conditioning(model, mesh["dp"].get_local_rank(), 0)
    x = torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(0))
    with watch_step(model) as w:
        model(hidden_states=x, timestep=torch.tensor([0.5]), **cond)
    out["no_backward"] = summary(w.report)
    try:
        with watch_step(model) as w:
            raise ValueError("the user's step failed")
    except ValueError:
        out["raises"] = summary(w.report)
    out["checkpointing"] = checkpointed_step(model, x, cond, patched)
    with watch_step(model, step=dist.get_rank() % 2) as w:
        model(hidden_states=x, timestep=torch.tensor([0.5]), **cond)[0].sum().backward()
    out["step_count"] = summary(w.report)
    model.zero_grad(set_to_none=True)
    from cpdoctor.examinations.step.runs.first import watch_first_step

    seen = []
    first = watch_first_step(model, seen.append)  # what preflight(model=...) arms: closed by the optimizer step
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(hidden_states=x, timestep=torch.tensor([0.5]), **cond)[0].square().mean().backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=mesh["ring"].get_group())  # sum over CP
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())  # mean over data parallel
            p.grad /= args.dp
    opt.step()
    out["first_step"] = {**summary(first.report), "callback": len(seen)}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("copies")
    p.add_argument("--patch", action="store_true")
    p.add_argument("--families", default="flux,qwen-image")
    p.add_argument("--fsdp", default=None, help="examples/train_cp_fsdp2.py: also its correct and divide-by-world runs")
    a = p.parse_args()
    dist.init_process_group("gloo")
    results: dict = {"variants": {}}
    variants = sorted(f for f in os.listdir(a.copies) if f.endswith(".py"))
    import cpdoctor

    for family in a.families.split(","):
        for filename in variants:
            example = load(os.path.join(a.copies, filename))
            args = example.parser().parse_args(["--family", family, "--steps", "1"])
            stock = filename.startswith("stock")
            if a.patch and not stock:
                cpdoctor.patch()
            try:
                reports = example.run(args)
            finally:
                cpdoctor.unpatch()
            results["variants"][f"{family}/{filename[:-3]}"] = summary(reports[0])
    if a.fsdp:
        fsdp = load(a.fsdp)
        for name, extra in (("correct", []), ("divide_by_world", ["--divide-by-world"])):
            if a.patch:
                cpdoctor.patch()
            try:
                reports = fsdp.run(fsdp.parser().parse_args(["--dp", "2", "--cp", "2", *extra]))
            finally:
                cpdoctor.unpatch()
            results["variants"][f"fsdp2/{name}"] = summary(reports[0])
    if a.patch:
        cpdoctor.patch()  # the first-step case checks the armed watch PASSes a correct step
    results["bad_inputs"] = bad_inputs(load(os.path.join(a.copies, "correct.py")), args, a.patch)
    write_and_leave(results, a.out)


def write_and_leave(results: dict, out: str) -> None:
    """Rank 0 writes the results; every rank leaves at once (no teardown: gloo's rarely aborts with this many
    groups, and the JSON is written)."""
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.barrier()
    print(end="", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
