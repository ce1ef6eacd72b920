"""The GPU acceptance run: cpdoctor's CUDA paths on real kernels, in one command, one table, JSON under $OUT.

On the lent H200 (one `device` call from the repo root; `bash benchmarks/gpu_carry.sh` here first, once):
    run(command="bash benchmarks/gpu_acceptance.sh", carry=[".carry"], timeout_s=600)
carry list: [".carry"] alone (ignored by .gitignore): .carry/site.tgz holds diffusers 0.42.1, importlib_metadata
and lazy_importer as plain Python from this machine's venv (~5 MiB; the H200's image has torch 2.11, typer, rich,
pyyaml, huggingface_hub, safetensors, zipp, but no diffusers, and reaches no registry). cpdoctor travels as the
working tree. gpu_carry.sh measures the tracked and untracked files plus .carry (~7 MiB today) and refuses above
48 MiB (the limit is 64 MiB). flash-attn cannot be installed there: every kernel below is torch's own.

Locally (CI, tests/integration/test_gpu_acceptance_dry_run.py):
    python benchmarks/gpu_acceptance.py --dry-run    # every section on the CPU stand-ins, tiny shapes: ~60 s of
                                                     # CPU in all (4 min wall on 2 cores at load 25)

Sections, in order, each with a time budget (s) that caps it and an estimate (s) of what it takes on one H200;
a section that fails or runs out of budget is rows with its error, never an abort. Budgets sum to 520 s, so even
at every cap the whole stays under 10 minutes with the carry unpacked (~5 s) and interpreter start; the estimates
(not yet measured: no GPU has been lent) sum to ~280 s, from ~15-20 s per cpdoctor launch of 2-4 ranks:
  section   budget  H200 est.  what
  verdicts   130      80       diffusers' CP attention (`_native_flash`, `_native_cudnn`, `_native_efficient`) on the
                               real kernels, ranks sharing the GPU (gloo; NCCL with a GPU per rank), bf16, at ring 2,
                               ring 4, Ulysses 2, ring 2 × Ulysses 2, before and after cpdoctor's patch: one suite,
                               one launch per world size (`cpdoctor.run_suite`)
  standins    50      30       the same unpatched checks at ring 2 and Ulysses 2 on the CPU stand-ins (`emulate`), to
                               set their verdicts beside the hardware's
  peers       90      40       torch's `context_parallel` (the peer examination, `check_peer(impl="torch")`, as suite
                               checks: one launch per world size) on the real flash, cuDNN
                               and efficient SDPA kernels at 2 and 3 ranks, S 240; the efficient kernel at 3 ranks,
                               S 240 (80-token blocks) asks whether the LSE-padding crash the README reports from the
                               stand-in reproduces on hardware; at 2 ranks, S 256 (128-token blocks) is its control
  step        60      30       the step examination (`cpdoctor.examine_step`, benchmarks/gpu_step_target.py): a
                               bf16 Flux block (1024 wide, 1088 tokens) at ring 2 on the GPU, watched against one
                               fp64 process
  ring       150      70       the fixed ring (cpdoctor.patch()) against diffusers' ring on `_native_flash`, B1 H24
                               D128 bf16: median fwd+bwd time of the slowest rank and peak CUDA memory of the
                               largest rank (reset per row), 2 and 4 ranks sharing the GPU at S 16k/64k and, with
                               ≥ 2 GPUs, one GPU per rank (NCCL)
  speed       40      20       the fix's block kernels against the single-GPU kernel, TFLOP/s and peak memory
                               (reset per row), S 16k and 64k
With --dry-run every section runs on the CPU with the stand-ins at small shapes: figures that mean nothing,
code that cannot rot. Use only cpdoctor's public API here (check_attention/run_suite/check_peer/examine_step/
patch/unpatch) and the compat helper bench_ring.py uses, so refactors behind it do not break this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BACKENDS = ("_native_flash", "_native_cudnn", "_native_efficient")
LAYOUTS = {"ring 2": (2, 1), "ring 4": (4, 1), "Ulysses 2": (1, 2), "ring 2 × Ulysses 2": (2, 2)}
DRY_LAYOUTS = ("ring 2",)
BUDGET_S = {"verdicts": 130, "standins": 50, "peers": 90, "step": 60, "ring": 150, "speed": 40}
SECTIONS = tuple(BUDGET_S)
RING_BACKEND = "_native_flash"
RING_SHAPE = dict(b=1, h=24, d=128)
DRY_SHAPE = dict(b=1, h=4, d=32)  # the dry run's: bf16 on a CPU without native bf16 is slow (issue 22)


class OverBudget(BaseException):
    """Raised in the main thread when a section's time budget is spent (a BaseException, so no `except
    Exception` inside cpdoctor swallows it)."""


class Section:
    """One section's rows and its time budget: a hard alarm at the budget, and what is left for the next call's
    timeout."""

    def __init__(self, name: str, budget_s: float) -> None:
        self.name, self.budget_s, self.rows = name, budget_s, []
        self.started = time.perf_counter()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def timeout(self, wanted: float) -> float:
        """A per-call timeout that ends inside the budget (cpdoctor's launch and the ring's workers get it)."""
        return max(5.0, min(wanted, self.left() - 3.0))

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append({"section": self.name, **row})


def run_section(name: str, budget_s: float, body: Callable[[Section], None]) -> dict[str, Any]:
    """Run one section under its budget; its error (or the budget running out) becomes a row."""
    section = Section(name, budget_s)

    def alarm(signum, frame):  # noqa: ARG001
        raise OverBudget(f"section {name}: time budget of {budget_s:.0f} s spent")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        body(section)
    except OverBudget as exc:
        section.add({"error": str(exc)})
    except Exception as exc:  # noqa: BLE001 - a section that fails is a row, not an abort
        section.add({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    wall = time.perf_counter() - section.started
    print(f"[{name}] {len(section.rows)} rows in {wall:.0f} s (budget {budget_s:.0f} s)", flush=True)
    return {"budget_s": budget_s, "wall_s": round(wall, 1), "rows": section.rows}


def _worst(finding: dict[str, Any]) -> str:
    tensors = finding.get("tensors") or {}
    if not tensors:
        return "–"
    name, row = max(tensors.items(), key=lambda kv: kv[1]["rel_err"])
    return f"{name} {row['rel_err']:.2g}"


def _layout_name(ring: int, ulysses: int) -> str:
    return next((k for k, v in LAYOUTS.items() if v == (ring, ulysses)), f"ring {ring} × Ulysses {ulysses}")


def _suite(checks: list[dict[str, Any]], tmp: str, name: str) -> Any:
    """A suite of checks as `cpdoctor run FILE` reads it."""
    import yaml

    from cpdoctor.suite import load

    path = os.path.join(tmp, f"{name}.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump({"name": name, "description": "gpu acceptance", "checks": checks}, fh, allow_unicode=True)
    return load(path)


def _run_suite(section: Section, checks: list[dict[str, Any]], name: str, patch: bool) -> dict[str, Any]:
    """One `cpdoctor.run_suite` (one launch per world size) as its JSON report."""
    import cpdoctor

    with tempfile.TemporaryDirectory() as tmp:
        report = cpdoctor.run_suite(_suite(checks, tmp, name), patch=patch, timeout_s=section.timeout(240.0))
    return report.to_dict()


# ---------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------


def attention_checks(layouts: list[str], dry: bool, emulate: bool) -> list[dict[str, Any]]:
    seq = 256 if dry or emulate else 4096
    device = "cpu" if dry or emulate else "cuda"
    return [
        {
            "attention": dict(
                backend=b, ring=LAYOUTS[n][0], ulysses=LAYOUTS[n][1], dtype="bf16", seq=seq, device=device, emulate=dry or emulate
            )
        }
        for b in BACKENDS
        for n in layouts
    ]


def verdicts(section: Section, layouts: list[str], dry: bool) -> None:
    """diffusers' CP attention on the kernels, before and after the patch, one row per backend and layout."""
    t0 = time.perf_counter()
    data = _run_suite(section, attention_checks(layouts, dry, emulate=False), "verdicts", patch=True)
    wall = round(time.perf_counter() - t0, 1)
    before = (data.get("before") or {}).get("findings") or []
    env = data.get("environment", {})
    for i, (check, after) in enumerate(zip(attention_checks(layouts, dry, False), data["findings"])):
        fields = check["attention"]
        b = before[i] if i < len(before) else {}
        section.add({
            "backend": fields["backend"], "layout": _layout_name(fields["ring"], fields["ulysses"]),
            "process_group": env.get("process_group", "–"), "device": env.get("device", "–"),
            "before": b.get("verdict", "–"), "before_worst": _worst(b), "before_diagnosis": b.get("diagnosis", "")[:300],
            "after": after.get("verdict", "–"), "after_worst": _worst(after), "after_diagnosis": after.get("diagnosis", "")[:300],
            "suite_wall_s": wall,
        })  # fmt: skip


def standins(section: Section, layouts: list[str], dry: bool) -> None:
    """The same unpatched checks on the CPU stand-ins, to set beside the verdicts on the real kernels."""
    wanted = [n for n in layouts if n in ("ring 2", "Ulysses 2")] or layouts[:1]
    checks = attention_checks(wanted, dry, emulate=True)
    data = _run_suite(section, checks, "standins", patch=False)
    for check, finding in zip(checks, data["findings"]):
        fields = check["attention"]
        section.add({
            "backend": fields["backend"], "layout": _layout_name(fields["ring"], fields["ulysses"]),
            "verdict": finding.get("verdict", "–"), "worst": _worst(finding), "diagnosis": finding.get("diagnosis", "")[:300],
        })  # fmt: skip


PEER_QUESTION = "efficient, 3 ranks, S 240: does the LSE-padding crash reproduce?"


def peer_checks(dry: bool) -> list[tuple[str, dict[str, Any]]]:
    """(what the row asks, the peer check). 240 tokens over 3 ranks are 80-token blocks, not a multiple of 32."""
    device = "cpu" if dry else "cuda"
    base = dict(impl="torch", variant="allgather", dtype="bf16", device=device, emulate=dry)
    rows = [] if dry else [(f"{k}, 2 ranks, S 240", dict(base, kernel=k, ring=2, seq=240)) for k in ("flash", "cudnn")]
    rows += [(f"{k}, 3 ranks, S 240", dict(base, kernel=k, ring=3, seq=240)) for k in (("flash",) if dry else ("flash", "cudnn"))]
    if not dry:
        rows.append(("efficient, 2 ranks, S 256 (128-token blocks: the control)", dict(base, kernel="efficient", ring=2, seq=256)))
    rows.append((PEER_QUESTION, dict(base, kernel="efficient", ring=3, seq=240)))  # last: a crash there ends its launch
    return rows


def peers(section: Section, dry: bool) -> None:
    """torch's context_parallel on the real SDPA kernels through `cpdoctor.check_peer`'s examination."""
    asked = peer_checks(dry)
    t0 = time.perf_counter()
    data = _run_suite(section, [{"peer": fields} for _, fields in asked], "peers", patch=False)
    wall = round(time.perf_counter() - t0, 1)
    env = data.get("environment", {})
    for (question, fields), finding in zip(asked, data["findings"]):
        section.add({
            "case": question, "kernel": fields["kernel"], "ranks": fields["ring"], "seq": fields["seq"],
            "process_group": env.get("process_group", "–"), "verdict": finding.get("verdict", "–"), "worst": _worst(finding),
            "diagnosis": finding.get("diagnosis", "")[:400], "suite_wall_s": wall,
        })  # fmt: skip


def step(section: Section, dry: bool) -> None:
    """The step examination on a bf16 Flux block: one watched step at ring 2 against one fp64 process."""
    from cpdoctor import api

    target = os.path.join(HERE, "gpu_step_target.py") + ":flux_block_step"
    t0 = time.perf_counter()
    report = api.examine_step(target, nproc=2, device="cpu" if dry else "cuda", reference="fp64", timeout_s=section.timeout(200.0))
    data = report.to_dict()
    for finding in data["findings"]:
        section.add({
            "probe": finding.get("probe", "–"), "verdict": finding.get("verdict", "–"), "diagnosis": finding.get("diagnosis", "")[:400],
            "device": data.get("environment", {}).get("device", "–"), "wall_s": round(time.perf_counter() - t0, 1),
        })  # fmt: skip


def ring_plans(dry: bool, gpus: int) -> list[dict[str, Any]]:
    """(world, placement, sequence lengths, repetitions) of the ring comparison."""
    if dry:
        return [dict(world=2, placement="cpu", seqs=[256], reps=2)]
    plans = [dict(world=2, placement="shared", seqs=[16384, 65536], reps=5), dict(world=4, placement="shared", seqs=[65536], reps=3)]
    if gpus >= 2:
        plans.append(dict(world=min(gpus, 8), placement="per_rank", seqs=[16384, 65536], reps=5))
    return plans


def ring(section: Section, dry: bool, gpus: int) -> None:
    """The fixed ring against diffusers' ring: one row per (world, placement, S)."""
    for plan in ring_plans(dry, gpus):
        t0 = time.perf_counter()
        try:
            ranks = spawn_ring(plan, dry, section.timeout(120.0))
        except Exception as exc:  # noqa: BLE001 - one plan that fails is its rows, the next plan still runs
            for s in plan["seqs"]:
                section.add(
                    {"world": plan["world"], "placement": plan["placement"], "seq": s, "error": f"{type(exc).__name__}: {exc}"[:600]}
                )
            continue
        for s in plan["seqs"]:
            section.add(ring_row(plan, s, ranks, round(time.perf_counter() - t0, 1)))


def ring_row(plan: dict[str, Any], seq: int, ranks: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Slowest rank per repetition (median over repetitions, and the paired ratio), largest rank's peak."""
    key = str(seq)
    row: dict[str, Any] = {"world": plan["world"], "placement": plan["placement"], "seq": seq, "process_group": ranks[0]["pg"]}
    per_rep = {impl: [max(vals) for vals in zip(*(r[key][impl]["times_s"] for r in ranks))] for impl in ("builtin", "patched")}
    for impl in ("builtin", "patched"):
        row[f"{impl}_ms"] = round(1e3 * statistics.median(per_rep[impl]), 3)
        row[f"{impl}_peak_mib"] = round(max(r[key][impl]["peak_bytes"] for r in ranks) / 2**20, 1)
    row["time_x"] = round(statistics.median(p / b for p, b in zip(per_rep["patched"], per_rep["builtin"])), 3)
    row["memory_x"] = round(row["patched_peak_mib"] / row["builtin_peak_mib"], 3) if row["builtin_peak_mib"] else None
    row["reps"] = len(per_rep["builtin"])
    row["wall_s"] = wall
    return row


def kernel_speed(section: Section, dry: bool) -> None:
    """TFLOP/s of each backend's single-GPU kernel against the fix's block kernel doing the same work as 4 KV
    blocks, forward + backward; peak memory reset before every row."""
    for backend in BACKENDS:
        for seq in (256,) if dry else (16384, 65536):
            try:
                section.add(kernel_speed_row(backend, seq, dry))
            except Exception as exc:  # noqa: BLE001 - a kernel that refuses this shape here is a row, not an abort
                section.add({"backend": backend, "seq": seq, "error": f"{type(exc).__name__}: {exc}"[:600]})


def _attention_flops(b: int, h: int, s_q: int, s_k: int, d: int) -> float:
    """Forward + backward of softmax(QKᵀ)V: 4·B·H·Sq·Sk·D forward, 2.5× that backward (FlashAttention's count)."""
    return 4.0 * b * h * s_q * s_k * d * 3.5


def kernel_speed_row(backend: str, seq: int, dry: bool, chunks: int = 4) -> dict[str, Any]:
    import torch

    from cpdoctor.fix import block_kernels

    if dry:
        from cpdoctor.cpu_kernels import standins

        standins.activate()
    device = torch.device("cpu" if dry else "cuda")
    b, h, d = (DRY_SHAPE if dry else RING_SHAPE).values()
    reps = 1 if dry else 3
    kernel = {
        "_native_flash": block_kernels.NativeFlashKernel,
        "_native_cudnn": block_kernels.CudnnKernel,
        "_native_efficient": block_kernels.EfficientKernel,
    }[backend]()
    result: dict[str, Any] = {"backend": backend, "seq": seq}
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # this row's peak, not the maximum of every row before it
        base = torch.cuda.memory_allocated()
    # model layout (B, S, H, D) into the kernel's own layout, as the fixed ring does
    q, k, v, g = (kernel.to_layout(torch.randn(b, seq, h, d, device=device, dtype=torch.bfloat16)).contiguous() for _ in range(4))
    seq_dim, scale = kernel.seq_dim, d**-0.5

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def full() -> None:
        out, lse = kernel.forward(q, k, v, None, scale)
        kernel.backward(g, q, k, v, out, lse, None, scale)

    def blocks() -> None:
        for ks, vs in zip(k.chunk(chunks, dim=seq_dim), v.chunk(chunks, dim=seq_dim)):
            out, lse = kernel.forward(q, ks, vs, None, scale)
            kernel.backward(g, q, ks, vs, out, lse, None, scale)

    for name, fn in (("kernel", full), ("fix blocks", blocks)):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        dt = (time.perf_counter() - t0) / reps
        result[name] = {"s": dt, "tflops": _attention_flops(b, h, seq, seq, d) / dt / 1e12}
    result["ratio"] = result["fix blocks"]["tflops"] / result["kernel"]["tflops"]
    if device.type == "cuda":
        result["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    return result


# ---------------------------------------------------------------------------------------------------------------
# The ring's workers: one process per rank, torchrun's environment, results per rank in a file
# ---------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ring(plan: dict[str, Any], dry: bool, timeout_s: float) -> list[dict[str, Any]]:
    """Run plan["world"] ring workers; every rank's results (RuntimeError with the failing rank's stderr)."""
    world, port = plan["world"], _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(plan, dry=dry, out=tmp)
        procs = []
        for rank in range(world):
            env = dict(
                os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)), PYTHONWARNINGS="ignore",
            )  # fmt: skip
            err = open(os.path.join(tmp, f"err{rank}"), "w+")
            procs.append((subprocess.Popen([sys.executable, __file__, "--ring-worker", json.dumps(spec)], env=env, stderr=err), err))
        deadline = time.monotonic() + timeout_s
        try:
            codes = [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p, _ in procs]
        except subprocess.TimeoutExpired:
            codes = None
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes is None or any(codes):
            failed = next((r for r, (p, _) in enumerate(procs) if p.returncode), 0)
            err = procs[failed][1]
            err.seek(0)
            tail = err.read()[-800:]
            raise RuntimeError(f"timed out after {timeout_s:.0f} s" if codes is None else f"rank {failed} exited {codes[failed]}: {tail}")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as fh:
                results.append(json.load(fh))
        return results


def ring_worker(spec: dict[str, Any]) -> None:
    """One rank: diffusers' ring and the fixed ring, each warmed up, then timed alternately and measured for
    peak memory (CUDA's allocator statistics, reset per measurement; on the CPU, the process's high-water mark
    as bench_ring.py reads it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import cpdoctor
    from cpdoctor.compat.diffusers import dispatch_module, setup_parallel_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if spec["dry"]:
        device, pg = torch.device("cpu"), "gloo"
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        pg = "nccl" if spec["placement"] == "per_rank" else "gloo"  # NCCL refuses two ranks on one GPU
    dist.init_process_group(pg, rank=rank, world_size=world, **({"device_id": device} if pg == "nccl" else {}))
    mesh = init_device_mesh(device.type, (world, 1), mesh_dim_names=("ring", "ulysses"))
    config = setup_parallel_config(world, 1, rank, world, device, mesh)
    dispatch = dispatch_module()
    if spec["dry"]:
        from cpdoctor.cpu_kernels import cpu_backend

        backend = cpu_backend.register()
    else:
        backend = RING_BACKEND
    sys.path.insert(0, HERE)
    from bench_ring import _reset_peak, _status

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    b, h, d = (DRY_SHAPE if spec["dry"] else RING_SHAPE).values()
    results: dict[str, Any] = {"pg": pg}
    for seq in spec["seqs"]:
        local = seq // world
        gen = torch.Generator(device=device).manual_seed(rank)
        q, k, v, g = (torch.randn(b, local, h, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)

        def fwd_bwd(impl: str) -> float:
            if impl == "patched":
                cpdoctor.patch()
            else:
                cpdoctor.unpatch()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            out = dispatch.dispatch_attention_fn(q, k, v, backend=backend, parallel_config=config)
            out.backward(g)
            sync()
            dt = time.perf_counter() - t0
            q.grad = k.grad = v.grad = None
            del out
            return dt

        per: dict[str, Any] = {impl: {"times_s": []} for impl in ("builtin", "patched")}
        for impl in per:
            fwd_bwd(impl)  # warm-up
        for _ in range(spec["reps"]):
            for impl in per:
                per[impl]["times_s"].append(fwd_bwd(impl))
        for impl in per:  # peak memory of one fwd+bwd above what was live before it, reset per measurement
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fwd_bwd(impl)
                per[impl]["peak_bytes"] = torch.cuda.max_memory_allocated() - base
            else:
                _reset_peak()
                base = _status("VmRSS:")
                fwd_bwd(impl)
                per[impl]["peak_bytes"] = _status("VmHWM:") - base
        results[str(seq)] = per
    cpdoctor.unpatch()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Rendering and main
# ---------------------------------------------------------------------------------------------------------------

COLUMNS = {
    "verdicts": ("backend", "layout", "process_group", "before", "before_worst", "after", "after_worst", "suite_wall_s"),
    "standins": ("backend", "layout", "verdict", "worst"),
    "peers": ("case", "process_group", "verdict", "worst", "diagnosis"),
    "step": ("probe", "device", "verdict", "diagnosis", "wall_s"),
    "ring": (
        "world",
        "placement",
        "process_group",
        "seq",
        "builtin_ms",
        "patched_ms",
        "time_x",
        "builtin_peak_mib",
        "patched_peak_mib",
        "memory_x",
    ),
    "speed": ("backend", "seq", "kernel TFLOP/s", "fix blocks TFLOP/s", "ratio", "peak_mib"),
}
TITLES = {
    "verdicts": "diffusers' CP attention on the kernels, bf16, before and after the patch (cpdoctor run, --patch)",
    "standins": "the same unpatched checks on the CPU stand-ins",
    "peers": "torch's context_parallel on the SDPA kernels (cpdoctor check --impl torch), bf16",
    "step": "the step examination on a bf16 Flux block, ring 2 (cpdoctor step)",
    "ring": f"the fixed ring against diffusers' ring, {RING_BACKEND}, B1 H24 D128 bf16 (dry run: the CPU op, H4 D32), fwd+bwd "
    "(time_x, memory_x = fixed / diffusers')",
    "speed": "the fix's block kernels against the single-GPU kernel (fwd + bwd, B1 H24 D128, dry run H4 D32; 4 KV blocks)",
}


def _cell(row: dict[str, Any], col: str) -> str:
    if col in ("kernel TFLOP/s", "fix blocks TFLOP/s"):
        value = (row.get(col.split(" TFLOP")[0]) or {}).get("tflops")
        return "–" if value is None else f"{value:.3g}"
    value = row.get(col)
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)[:90]


def render(sections: dict[str, dict[str, Any]], env: dict[str, Any]) -> str:
    import io

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=io.StringIO(), record=True, width=200, color_system=None)
    console.print(escape(" · ".join(f"{k} {v}" for k, v in env.items())))
    for name, sec in sections.items():
        title = escape(f"[{name}] {TITLES[name]} — {sec['wall_s']:.0f} s of {sec['budget_s']:.0f} s")
        table = Table(title=title, title_justify="left")
        for col in COLUMNS[name]:
            table.add_column(col)
        for row in sec["rows"]:
            if "error" in row:
                known = [_cell(row, c) for c in COLUMNS[name][:-1]]
                table.add_row(*(escape(c) for c in known), escape("error: " + row["error"][:120]))
            else:
                table.add_row(*(escape(_cell(row, c)) for c in COLUMNS[name]))
        console.print(table)
    return console.export_text()


def environment(dry: bool, gpus: int) -> dict[str, Any]:
    import platform

    import torch

    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError as exc:
        diffusers_version = f"not importable: {exc}"
    return {
        "mode": "dry run on CPU stand-ins" if dry else f"{gpus} × {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers_version,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "launch": "gloo on CPU"
        if dry
        else ("NCCL with a GPU per rank where they suffice, else gloo" if gpus >= 2 else "gloo, ranks sharing the GPU"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, kernel stand-ins, small shapes: checks the script, not the hardware")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_acceptance.json and .txt go")
    parser.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS, help="a subset of the sections, in order")
    parser.add_argument("--layouts", nargs="*", default=None, help="verdicts' layouts, a subset of: " + ", ".join(LAYOUTS))
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    parser.add_argument("--ring-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ring_worker:
        ring_worker(json.loads(args.ring_worker))
        return 0
    dry = args.dry_run
    import torch

    if not dry and not torch.cuda.is_available():
        print("gpu_acceptance: no CUDA device here; use --dry-run on a CPU", file=sys.stderr)
        return 2
    if dry:
        os.environ["CPDOCTOR_ACCEPTANCE_DRY"] = "1"  # the step target's ranks read it: the tiny Flux on the CPU op
    gpus = 0 if dry else torch.cuda.device_count()
    layouts = args.layouts or list(DRY_LAYOUTS if dry else LAYOUTS)
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {list(LAYOUTS)}")
    bodies: dict[str, Callable[[Section], None]] = {
        "verdicts": lambda s: verdicts(s, layouts, dry),
        "standins": lambda s: standins(s, layouts, dry),
        "peers": lambda s: peers(s, dry),
        "step": lambda s: step(s, dry),
        "ring": lambda s: ring(s, dry, gpus),
        "speed": lambda s: kernel_speed(s, dry),
    }
    env = environment(dry, gpus)
    started = time.perf_counter()
    sections = {name: run_section(name, BUDGET_S[name] * args.budget_scale, bodies[name]) for name in SECTIONS if name in args.sections}
    env["wall_s"] = round(time.perf_counter() - started, 1)
    text = render(sections, env)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_acceptance.json"), "w") as fh:
        json.dump({"environment": env, "sections": sections}, fh, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_acceptance.txt"), "w") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
