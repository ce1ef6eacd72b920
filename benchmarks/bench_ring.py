"""cpdoctor's fixed ring attention vs diffusers' built-in ring (and ring-flash-attn's ring, memory only): wall time
and peak memory per rank, side by side in one run.

Same backend (cpdoctor_cpu: torch's fused CPU flash kernel), same shapes (B1 H8 D64, sequence S split over the
ring), same processes: every timed repetition runs each implementation back to back (alternating), forward
then backward, on every rank, between barriers; the slowest rank counts. Use diffusers 0.42.1, whose built-in
ring is correct at ring 2 (at ring ≥ 3 it computes wrong dK/dV, but its cost is still the cost of that
algorithm).

Implementations ("impls"):
- builtin:          diffusers' TemplatedRingAttention (all-gathers K/V for the forward and again for the backward);
- patched:          cpdoctor.fix.ring.RingAttention as `cpdoctor.patch()` puts it in (K/V streamed hop by hop);
- gathered:         with --gathered REV, the fixed ring as it was at git revision REV (K/V all-gathered), loaded from
                    git into the workers: the measurement that decided whether the gathered variant stays;
- ring_flash_attn:  ring-flash-attn 0.1.8's `ring_flash_attn_func` on cpdoctor's flash-attn stand-in (the peer
                    to beat, memory only: the stand-in's speed means nothing), in the bf16 runs only (flash-attn
                    refuses fp32).

Passes, each in fresh worker processes, every impl warmed up first at S 512:
- time:    median of --reps fwd / bwd wall times per impl, then one instrumented fwd+bwd per impl ("pieces"):
           time inside the attention kernels, time blocked waiting for communication, the rest;
- memory:  peak process memory during one fwd+bwd above the memory before it: /proc/self/clear_refs ("5"
           resets the high-water mark) then VmHWM − VmRSS. Workers run with MALLOC_MMAP_THRESHOLD_=65536 so
           glibc serves every tensor-sized block by mmap and returns it on free: RSS then follows the live
           torch allocations (checked: a 4+8 MB allocation pattern reads 11.9 MB). torch has no CPU allocator
           statistics, and tracemalloc does not see its allocations.
The ideal per-rank time ("ideal", time pass only) is the same fused kernel called once by every rank, with no
communication, on the rank's share of the total work: its S/W queries against all S keys, forward and
backward, alternated with the others in the same processes (so it shares the cores exactly as they do).

Rows: ring 4 and ring 8 at S 16384 in fp32 AND bf16 (ring 8: memory only), ring 2 and ring 4 at S 4096 / 16384
in fp32; every time and memory figure is the median of --reps repetitions (≥ 5) with its [min, max] spread.

Usage: python benchmarks/bench_ring.py [--seqs 4096 16384] [--ring4-seqs 4096 16384] [--ring8-seqs 16384]
       [--bf16-ring4-seqs 16384] [--bf16-ring8-seqs 16384] [--peer-rings 4 8] [--ulysses-seqs] [--gathered REV]
       [--reps 5] [--out FILE]
Writes benchmarks/results/ring_cpu.json (with the machine, versions, load average and the command) and prints
a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import run_record  # noqa: E402 - benchmarks/ is on sys.path when run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
B, H, D = 1, 8, 64
WARMUP_SEQ = 512


@dataclass(frozen=True)
class Run:
    """One launch of `world` workers: which passes, sequence lengths, impls and dtype."""

    layout: str  # "ring" or "ulysses"
    world: int
    seqs: list[int]
    passes: tuple[str, ...]  # "time", "memory"
    impls: tuple[str, ...]
    dtype: str = "fp32"


# ----------------------------------------------------------------------------------------------------------
# Worker (one rank)
# ----------------------------------------------------------------------------------------------------------


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


class _Timers:
    """Wall time spent inside wrapped callables (kernels, communication waits)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t0

        timed.__name__ = getattr(fn, "__name__", attr)
        setattr(obj, attr, timed)


def _import_ring_flash_attn():
    """(ring_flash_attn, None) on the flash-attn stand-in (activated here, before anything imports diffusers), or
    (None, why not). Its HF adapter module fails to import under transformers 5.x (docs/FACTS.md, "Peers' CP
    attention on CPU") and `import ring_flash_attn` reaches it: when that is the failure, that one submodule is
    stubbed (the ring functions do not use it) and the import tried again."""
    import importlib
    import importlib.util
    import traceback
    import types

    from cpdoctor.cpu_kernels import standins

    standins.activate()
    if importlib.util.find_spec("ring_flash_attn") is None:
        return None, "not installed"
    try:
        return importlib.import_module("ring_flash_attn"), None
    except ImportError as exc:
        if not any("hf_adapter" in frame.filename for frame in traceback.extract_tb(exc.__traceback__)):
            return None, f"cannot import: {type(exc).__name__}: {exc}"
    for name in [n for n in sys.modules if n.split(".")[0] == "ring_flash_attn"]:
        del sys.modules[name]
    stub = types.ModuleType("ring_flash_attn.adapters")
    stub.substitute_hf_flash_attn = stub.update_ring_flash_attn_params = None
    sys.modules["ring_flash_attn.adapters"] = stub
    try:
        return importlib.import_module("ring_flash_attn"), None
    except ImportError as exc:
        return None, f"cannot import: {type(exc).__name__}: {exc}"


def _load_gathered(path: str):
    """The fixed ring of an earlier revision (its source written to `path` by the parent) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpdoctor.fix._ring_gathered", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(spec: dict) -> None:
    import gc

    impls = list(spec["impls"])
    rfa = rfa_error = None
    if "ring_flash_attn" in impls:  # before diffusers is imported
        rfa, rfa_error = _import_ring_flash_attn()
        if rfa is None:
            impls.remove("ring_flash_attn")

    import torch
    import torch.distributed as dist

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix import block_kernels, comm, patch
    from cpdoctor.fix.ring import RingAttention
    from cpdoctor.launch.context import DistContext

    ctx = DistContext.join(600)
    world = ctx.world_size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    name = cpu_backend.register()
    ring_deg, ulysses_deg = (1, world) if spec["layout"] == "ulysses" else (world, 1)
    mesh = ctx.cp_mesh(ring_deg, ulysses_deg)
    config = compat.setup_parallel_config(ring_deg, ulysses_deg, ctx.rank, world, ctx.device, mesh)
    dispatch = compat.dispatch_module()
    gathered = _load_gathered(spec["gathered_source"]).RingAttention if "gathered" in impls else None

    def use(impl: str) -> None:
        """diffusers' ring, the fix, or the earlier fix in place (the patch module only ever sees its own class)."""
        if dispatch.TemplatedRingAttention is gathered:
            dispatch.TemplatedRingAttention = RingAttention
        patch.set_patched(impl in ("patched", "gathered"))
        if impl == "gathered":
            dispatch.TemplatedRingAttention = gathered

    results: dict = {"ring_flash_attn_error": rfa_error}
    for step, seq in enumerate([WARMUP_SEQ, *spec["seqs"]]):
        local = seq // world
        gen = torch.Generator().manual_seed(ctx.rank)
        q, k, v, g = (torch.randn(B, local, H, D, generator=gen).to(dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)

        def fwd_bwd(impl: str, record: dict | None = None) -> None:
            if impl == "ideal":
                ideal_fwd_bwd(record)
                return
            if impl != "ring_flash_attn":
                use(impl)
            dist.barrier()
            t0 = time.perf_counter()
            if impl == "ring_flash_attn":
                out = rfa.ring_flash_attn_func(q, k, v, causal=False, group=dist.group.WORLD)
            else:
                out = dispatch.dispatch_attention_fn(q, k, v, backend=name, parallel_config=config)
            t1 = time.perf_counter()
            out.backward(g)
            t2 = time.perf_counter()
            dist.barrier()
            q.grad = k.grad = v.grad = None
            del out
            if record is not None:
                record.setdefault("fwd", []).append(t1 - t0)
                record.setdefault("bwd", []).append(t2 - t1)

        def ideal_fwd_bwd(record: dict | None) -> None:
            """This rank's S/W queries against all S keys in one fused call each way, no communication."""
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            qi, gi = (x.detach().transpose(1, 2).contiguous() for x in (q, g))
            ki, vi = (torch.randn(B, H, seq, D, generator=gen).to(dtype) for _ in range(2))
            dist.barrier()
            t0 = time.perf_counter()
            out, lse = flash(qi, ki, vi, 0.0, False)
            t1 = time.perf_counter()
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(gi, qi, ki, vi, out, lse, 0.0, False)
            t2 = time.perf_counter()
            dist.barrier()
            if record is not None:
                record.setdefault("fwd", []).append(t1 - t0)
                record.setdefault("bwd", []).append(t2 - t1)

        # the stand-in's speed means nothing: ring-flash-attn is measured for memory only
        timed = [*(i for i in impls if i != "ring_flash_attn"), "ideal"] if spec["mode"] == "time" else impls
        if step == 0:
            for impl in timed:
                fwd_bwd(impl)
            continue
        per: dict = {impl: {} for impl in timed}
        if spec["mode"] == "time":
            for _ in range(spec["reps"]):
                for impl in timed:
                    fwd_bwd(impl, per[impl])
            for impl in (i for i in impls if i != "ring_flash_attn"):
                timers = _Timers()
                with _instrumented(timers, block_kernels, comm, cpu_backend, dispatch):
                    rec: dict = {}
                    fwd_bwd(impl, rec)
                per[impl]["pieces"] = {"fwd": rec["fwd"][0], "bwd": rec["bwd"][0], **timers.totals}
        else:  # memory, alternating like the time pass: one peak per repetition
            for _ in range(spec["reps"]):
                for impl in impls:
                    gc.collect()
                    _reset_peak()
                    base = _status("VmRSS:")
                    fwd_bwd(impl)
                    per[impl].setdefault("peak_bytes", []).append(_status("VmHWM:") - base)
        results[str(seq)] = per
    use("builtin")
    gathered_results = ctx.gather_to_root(results)
    if ctx.rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(gathered_results, fh)
    ctx.close()


class _instrumented:
    """Timers around the fix's kernel calls and communication waits, and around the ops the built-in ring is
    handed (kernel + their layout copies) and its collective waits; removed on exit."""

    def __init__(self, timers: _Timers, block_kernels, comm, cpu_backend, dispatch) -> None:
        self.targets = [
            (block_kernels.CpuFlashKernel, "forward", "kernel_fwd"),
            (block_kernels.CpuFlashKernel, "backward", "kernel_bwd"),
            (comm.GroupComm, "wait", "comm_wait"),
            (cpu_backend, "forward_op", "op_fwd"),
            (cpu_backend, "backward_op", "op_bwd"),
            (dispatch, "_wait_tensor", "comm_wait"),
        ]
        self.timers = timers
        self.saved: list = []

    def __enter__(self) -> None:
        for obj, attr, label in self.targets:
            self.saved.append((obj, attr, obj.__dict__[attr]))
            self.timers.wrap(obj, attr, label)

    def __exit__(self, *exc) -> None:
        for obj, attr, original in self.saved:
            setattr(obj, attr, original)


# ----------------------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------------------


def spawn(world: int, spec: dict, extra_env: dict | None = None) -> list[dict]:
    """Run `world` workers of this script with torchrun's environment; rank 0's gathered results."""
    from cpdoctor.launch.spawn import free_port, rank_environment

    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, out=os.path.join(tmp, "out.json"))
        threads = str(max(1, (os.cpu_count() or 1) // world))
        procs = []
        for rank in range(world):
            env = rank_environment(rank, world, port, OMP_NUM_THREADS=threads, PYTHONWARNINGS="ignore::FutureWarning", **(extra_env or {}))
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        with open(spec["out"]) as fh:
            return json.load(fh)


def per_rep(timing: list, key: str, impl: str, part: str) -> list[float]:
    """Per repetition, the slowest rank's time of `part` ("fwd", "bwd" or "total")."""
    per_rank = [r[key][impl] for r in timing]
    if part == "total":
        return [max(f + b for f, b in ranks) for ranks in zip(*(zip(p["fwd"], p["bwd"]) for p in per_rank))]
    return [max(vals) for vals in zip(*(p[part] for p in per_rank))]


def ratios(timing: list, key: str, impl: str, other: str, part: str) -> list[float]:
    """Per repetition, impl / other, each pair measured back to back."""
    return [a / b for a, b in zip(per_rep(timing, key, impl, part), per_rep(timing, key, other, part))]


def paired(timing: list, key: str, impl: str, other: str, part: str) -> float:
    """Median over repetitions of impl / other, each pair measured back to back: robust to a load that drifts
    over the run (other engineers share these cores), which a ratio of medians is not."""
    return statistics.median(ratios(timing, key, impl, other, part))


def peaks_mib(memory: list, key: str, impl: str) -> list[float]:
    """Per repetition, the largest rank's peak in MiB."""
    return [max(vals) / 2**20 for vals in zip(*(r[key][impl]["peak_bytes"] for r in memory))]


def spread(values: list[float]) -> list[float]:
    """[min, max] over the repetitions."""
    return [min(values), max(values)]


def summarise(run: Run, timing: list | None, memory: list | None) -> list[dict]:
    """One row per sequence length: per impl its times (slowest rank, median over repetitions), pieces (rank 0)
    and peak memory (largest rank); every impl's ratios to the built-in ring (`*_x`: paired per repetition) and
    its backward over the ideal's (paired too); the ideal."""
    rows = []
    for seq in run.seqs:
        key = str(seq)
        row: dict = {"layout": run.layout, "world": run.world, "seq": seq, "dtype": run.dtype}
        source = memory or timing
        impls = [i for i in source[0][key] if i != "ideal"]
        for impl in impls:
            cell: dict = {}
            if timing and impl in timing[0][key]:
                for part in ("fwd", "bwd", "total"):
                    cell[f"{part}_s"] = statistics.median(per_rep(timing, key, impl, part))
                cell["total_s_spread"] = spread(per_rep(timing, key, impl, "total"))
                cell["pieces_rank0_s"] = timing[0][key][impl]["pieces"]
            if memory:
                peaks = peaks_mib(memory, key, impl)
                cell["peak_mib"] = statistics.median(peaks)
                cell["peak_mib_spread"] = spread(peaks)
            row[impl] = cell
        if timing:
            row["ideal"] = {f"{part}_s": statistics.median(per_rep(timing, key, "ideal", part)) for part in ("fwd", "bwd")}
        for impl in impls:
            timed = timing and impl in timing[0][key]
            if timed:
                row[f"{impl}_bwd_over_ideal"] = paired(timing, key, impl, "ideal", "bwd")
            if impl == "builtin":
                continue
            if timed:
                row[f"{impl}_time_x"] = paired(timing, key, impl, "builtin", "total")
                row[f"{impl}_time_x_spread"] = spread(ratios(timing, key, impl, "builtin", "total"))
                for part in ("fwd", "bwd"):
                    row[f"{impl}_{part}_x"] = paired(timing, key, impl, "builtin", part)
            if memory:
                mem = [a / b for a, b in zip(peaks_mib(memory, key, impl), peaks_mib(memory, key, "builtin"))]
                row[f"{impl}_memory_x"] = statistics.median(mem)
                row[f"{impl}_memory_x_spread"] = spread(mem)
        rows.append(row)
    return rows


def measure(run: Run, reps: int, gathered_source: str | None) -> tuple[list[dict], str | None]:
    spec = {"seqs": run.seqs, "reps": reps, "layout": run.layout, "impls": list(run.impls), "dtype": run.dtype}
    spec["gathered_source"] = gathered_source
    timing = spawn(run.world, dict(spec, mode="time")) if "time" in run.passes else None
    memory = spawn(run.world, dict(spec, mode="memory"), {"MALLOC_MMAP_THRESHOLD_": "65536"}) if "memory" in run.passes else None
    error = (memory or timing)[0]["ring_flash_attn_error"]
    return summarise(run, timing, memory), error


def gathered_source_of(rev: str, tmp: str) -> str:
    """ring.py at git revision `rev`, written to a file the workers import."""
    source = subprocess.run(["git", "show", f"{rev}:cpdoctor/fix/ring.py"], cwd=HERE, check=True, capture_output=True, text=True).stdout
    path = os.path.join(tmp, "ring_gathered.py")
    with open(path, "w") as fh:
        fh.write(source)
    return path


def revision() -> str | None:
    """The git revision measured (with "+dirty" when the tree had changes)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, check=True, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def print_table(rows: list[dict]) -> None:
    others = [i for i in ("patched", "gathered", "ring_flash_attn") if any(i in r for r in rows)]
    head = f"{'layout':>9} {'S':>6} {'dtype':>5} | {'built-in s':>10} {'built-in MiB':>12} {'bwd/ideal':>9} |"
    for impl in others:
        head += f" {impl[:12] + ' time×':>18} {'mem×':>6} {'bwd/ideal':>9} |"
    print(head)
    for r in rows:
        b = r["builtin"]
        line = f"{r['layout'] + ' ' + str(r['world']):>9} {r['seq']:>6} {r['dtype']:>5} | {fmt(b.get('total_s'), '.3f'):>10} {fmt(b.get('peak_mib'), '.1f'):>12} {fmt(r.get('builtin_bwd_over_ideal')):>9} |"
        for impl in others:
            line += f" {fmt(r.get(f'{impl}_time_x')):>18} {fmt(r.get(f'{impl}_memory_x')):>6} {fmt(r.get(f'{impl}_bwd_over_ideal')):>9} |"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seqs", type=int, nargs="*", default=[4096, 16384], help="ring 2: time and memory")
    parser.add_argument("--ring4-seqs", type=int, nargs="*", default=[4096, 16384], help="ring 4: time and memory")
    parser.add_argument("--ring8-seqs", type=int, nargs="*", default=[16384], help="ring 8: memory only (8 ranks share the cores)")
    parser.add_argument("--bf16-ring4-seqs", type=int, nargs="*", default=[16384], help="ring 4 in bf16: time and memory")
    parser.add_argument("--bf16-ring8-seqs", type=int, nargs="*", default=[16384], help="ring 8 in bf16: memory only")
    parser.add_argument(
        "--peer-rings", type=int, nargs="*", default=[4, 8], help="add ring-flash-attn's ring (memory) to the bf16 runs at these rings"
    )
    parser.add_argument(
        "--ulysses-seqs", type=int, nargs="*", default=[], help="Ulysses 2: diffusers' TemplatedUlyssesAttention vs cpdoctor's"
    )
    parser.add_argument("--gathered", default=None, metavar="REV", help="also measure the fixed ring of git revision REV")
    parser.add_argument(
        "--passes", nargs="+", choices=("time", "memory"), default=["time", "memory"], help="which passes to run (default both)"
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions of every time and memory measurement")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ring_cpu.json"))
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    import diffusers
    import torch

    fixes = ("patched", "gathered") if args.gathered else ("patched",)
    both = tuple(args.passes)
    mem = ("memory",) if "memory" in args.passes else ()

    def bf16(world: int) -> tuple[str, ...]:
        return ("builtin", *fixes, *(("ring_flash_attn",) if world in args.peer_rings else ()))

    runs = [
        Run("ring", 4, args.ring4_seqs, both, ("builtin", *fixes)),
        Run("ring", 4, args.bf16_ring4_seqs, both, bf16(4), "bf16"),
        Run("ring", 8, args.ring8_seqs, mem, ("builtin", *fixes)),
        Run("ring", 8, args.bf16_ring8_seqs, mem, bf16(8), "bf16"),
        Run("ring", 2, args.seqs, both, ("builtin", *fixes)),
        Run("ulysses", 2, args.ulysses_seqs, both, ("builtin", "patched")),
    ]
    rows: list[dict] = []
    rfa_error = None
    load_before = os.getloadavg()
    started = time.perf_counter()

    def write(complete: bool) -> dict:
        """The JSON so far: rewritten after every run, so a run cut short keeps the rows it finished."""
        doc = {
            "what": "fwd+bwd per rank, cpdoctor_cpu backend, B1 H8 D64; builtin = diffusers' TemplatedRingAttention (layout "
            "ring) or TemplatedUlyssesAttention (layout ulysses); patched = cpdoctor.fix.ring.RingAttention (K/V streamed) or "
            "cpdoctor.fix.ulysses.UlyssesAttention; gathered = the fixed ring of revision `gathered_revision` (K/V all-gathered); "
            "ring_flash_attn = ring-flash-attn's ring_flash_attn_func on cpdoctor's flash-attn stand-in. *_x = impl / builtin.",
            "complete": complete,
            "gathered_revision": args.gathered,
            "ring_flash_attn": rfa_error or ("measured" if any("ring_flash_attn" in r for r in rows) else "not in this run"),
            "reps": args.reps,
            "spread": "*_spread = [min, max] over the repetitions; a *_x_spread is over the per-repetition ratios",
            "wall_s": time.perf_counter() - started,
            "machine": run_record.machine(),
            "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "python": platform.python_version(),
            "cpdoctor_revision": revision(),
            "command": " ".join(["python", "benchmarks/bench_ring.py", *sys.argv[1:]]),
            "rows": rows,
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        return doc

    with tempfile.TemporaryDirectory() as tmp:
        source = gathered_source_of(args.gathered, tmp) if args.gathered else None
        for run in runs:
            if not run.seqs or not run.passes:
                continue
            t0 = time.perf_counter()
            got, error = measure(run, args.reps, source)
            rows.extend(got)
            rfa_error = rfa_error or error
            write(complete=False)
            print(f"{run.layout} {run.world} {run.dtype} {run.passes}: {time.perf_counter() - t0:.0f} s", flush=True)
    doc = write(complete=True)
    print_table(rows)
    if rfa_error:
        print(f"ring-flash-attn: {rfa_error}")
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
