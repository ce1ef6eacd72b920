"""cpdoctor's fixed ring attention vs diffusers' built-in ring (and its fixed Ulysses vs diffusers' Ulysses): wall
time and peak memory per rank.

Same backend (cpdoctor_cpu: torch's fused CPU flash kernel), same shapes (B1 H8 D64 fp32, sequence S split
over the ring), same processes: every timed repetition runs the built-in ring and the patched ring back to
back (alternating), forward then backward, on every rank, between barriers; the slowest rank counts.
Use diffusers 0.42.1, whose built-in ring is correct at ring 2 (at ring 4 it computes wrong dK/dV, but
its cost is still the cost of that algorithm).

Three passes, each in fresh worker processes:
- time:    median of --reps fwd / bwd wall times per implementation;
- pieces:  one instrumented fwd+bwd per implementation: time inside the attention kernels, time blocked
           waiting for collectives (communication not hidden behind compute), the rest (layout copies,
           merge, accumulation);
- memory:  peak process memory during one fwd+bwd above the memory before it: /proc/self/clear_refs ("5"
           resets the high-water mark) then VmHWM − VmRSS. Workers run with MALLOC_MMAP_THRESHOLD_=65536 so
           glibc serves every tensor-sized block by mmap and returns it on free: RSS then follows the live
           torch allocations (checked: a 4+8 MB allocation pattern reads 11.9 MB). torch has no CPU allocator
           statistics, and tracemalloc does not see its allocations.
The ideal per-rank time is the same fused kernel run once in one process (one thread, like one rank) on
the rank's share of the total work: its S/W queries against all S keys, forward and backward.

Usage: python benchmarks/bench_ring.py [--seqs 512 4096 16384] [--ring4-seqs 4096] [--ulysses-seqs 2048 8192] [--reps 3]
Writes benchmarks/results/ring_cpu.json and prints a table.
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

HERE = os.path.dirname(os.path.abspath(__file__))
B, H, D = 1, 8, 64
IMPLS = ("builtin", "patched")


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
    """Wall time spent inside wrapped callables (kernels, collective waits)."""

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


def worker(spec: dict) -> None:
    import gc

    import torch
    import torch.distributed as dist

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix import comm, kernels, patch
    from cpdoctor.kernels import cpu_backend
    from cpdoctor.launch.context import DistContext

    ctx = DistContext.join(600)
    world, mode = ctx.world_size, spec["mode"]
    name = cpu_backend.register()
    ring_deg, ulysses_deg = (1, world) if spec.get("layout") == "ulysses" else (world, 1)
    mesh = ctx.cp_mesh(ring_deg, ulysses_deg)
    config = compat.setup_parallel_config(ring_deg, ulysses_deg, ctx.rank, world, ctx.device, mesh)
    dispatch = compat.dispatch_module()
    timers = _Timers()
    if mode == "pieces":
        # the patched ring: its kernel calls and its collective waits
        timers.wrap(kernels.CpuFlashKernel, "forward", "patched:kernel_fwd")
        timers.wrap(kernels.CpuFlashKernel, "backward", "patched:kernel_bwd")
        timers.wrap(comm.GroupComm, "wait", "patched:comm_wait")
        # the built-in ring: the ops it is handed (kernel + their layout copies) and its collective waits
        timers.wrap(cpu_backend, "forward_op", "builtin:op_fwd")
        timers.wrap(cpu_backend, "backward_op", "builtin:op_bwd")
        timers.wrap(dispatch, "_wait_tensor", "builtin:comm_wait")
        # kernel selection compares against cpu_backend.forward_op: it is the wrapper now, which is fine
    results: dict = {}
    for seq in spec["seqs"]:
        local = seq // world
        gen = torch.Generator().manual_seed(ctx.rank)
        q, k, v, g = (torch.randn(B, local, H, D, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)

        def fwd_bwd(record: dict | None = None) -> None:
            dist.barrier()
            t0 = time.perf_counter()
            out = dispatch.dispatch_attention_fn(q, k, v, backend=name, parallel_config=config)
            t1 = time.perf_counter()
            out.backward(g)
            t2 = time.perf_counter()
            dist.barrier()
            q.grad = k.grad = v.grad = None
            if record is not None:
                record.setdefault("fwd", []).append(t1 - t0)
                record.setdefault("bwd", []).append(t2 - t1)

        per: dict = {impl: {} for impl in IMPLS}
        for impl in IMPLS:  # warm-up
            patch.set_patched(impl == "patched", dkv=spec["dkv"])
            fwd_bwd()
        if mode == "time":
            for _ in range(spec["reps"]):
                for impl in IMPLS:
                    patch.set_patched(impl == "patched", dkv=spec["dkv"])
                    fwd_bwd(per[impl])
        elif mode == "pieces":
            for impl in IMPLS:
                patch.set_patched(impl == "patched", dkv=spec["dkv"])
                timers.totals.clear()
                rec: dict = {}
                fwd_bwd(rec)
                per[impl] = {
                    "fwd": rec["fwd"],
                    "bwd": rec["bwd"],
                    **{k.split(":")[1]: v for k, v in timers.totals.items() if k.startswith(impl)},
                }
        else:  # memory
            for impl in IMPLS:
                patch.set_patched(impl == "patched", dkv=spec["dkv"])
                gc.collect()
                _reset_peak()
                base = _status("VmRSS:")
                fwd_bwd()
                per[impl] = {"peak_bytes": _status("VmHWM:") - base}
        results[seq] = per
    patch.set_patched(False)
    gathered = ctx.gather_to_root(results)
    if ctx.rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(gathered, fh)
    ctx.close()


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


def ideal(seq: int, world: int, reps: int) -> dict:
    """One rank's share of the total work (S/W queries × S keys) in one fused call, one thread."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, seq // world, D, generator=gen)
    k, v = (torch.randn(B, H, seq, D, generator=gen) for _ in range(2))
    g = torch.randn_like(q)
    fwd, bwd = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
        t1 = time.perf_counter()
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, False)
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"fwd": statistics.median(fwd), "bwd": statistics.median(bwd)}


def summarise(
    world: int, seqs: list[int], timing: list, pieces: list, memory: list, reps: int, method: str, layout: str = "ring"
) -> list[dict]:
    rows = []
    for seq in seqs:
        key = str(seq)

        def slowest(impl: str, part: str) -> float:
            # per repetition the slowest rank, then the median over repetitions
            per_rank = [r[key][impl][part] for r in timing]
            return statistics.median(max(vals) for vals in zip(*per_rank))

        row: dict = {"layout": layout, "world": world, "ring": world if layout == "ring" else 1, "seq": seq, "dkv_method": method}
        for impl in IMPLS:
            row[impl] = {
                "fwd_s": slowest(impl, "fwd"),
                "bwd_s": slowest(impl, "bwd"),
                "peak_mib": max(r[key][impl]["peak_bytes"] for r in memory) / 2**20,
                "pieces_rank0_s": {k: v[0] if isinstance(v, list) else v for k, v in pieces[0][key][impl].items()},
            }
            row[impl]["total_s"] = row[impl]["fwd_s"] + row[impl]["bwd_s"]
        # ranks beyond the core count share cores: a rank can at best get cores/world of one core's time
        share = max(1.0, world / (os.cpu_count() or 1))
        single = ideal(seq, world, max(1, reps if seq <= 4096 else 1))
        row["ideal"] = {
            "fwd": single["fwd"] * share,
            "bwd": single["bwd"] * share,
            "single_process_fwd": single["fwd"],
            "single_process_bwd": single["bwd"],
            "core_share_factor": share,
        }
        p, b = row["patched"], row["builtin"]
        row["ratio_time"] = p["total_s"] / b["total_s"]
        row["ratio_fwd"] = p["fwd_s"] / b["fwd_s"]
        row["ratio_bwd"] = p["bwd_s"] / b["bwd_s"]
        row["ratio_peak_mem"] = p["peak_mib"] / b["peak_mib"]
        row["patched_bwd_over_ideal"] = p["bwd_s"] / row["ideal"]["bwd"]
        row["builtin_bwd_over_ideal"] = b["bwd_s"] / row["ideal"]["bwd"]
        row["patched_fwd_over_ideal"] = p["fwd_s"] / row["ideal"]["fwd"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seqs", type=int, nargs="*", default=[512, 4096, 16384])
    parser.add_argument("--ring4-seqs", type=int, nargs="*", default=[4096])
    parser.add_argument(
        "--ulysses-seqs", type=int, nargs="*", default=[2048, 8192], help="Ulysses 2: diffusers' TemplatedUlyssesAttention vs cpdoctor's"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compare-dkv", action=argparse.BooleanOptionalAction, default=True, help="also measure the other dK/dV strategy")
    parser.add_argument("--compare-max-seq", type=int, default=4096)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ring_cpu.json"))
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    import diffusers
    import torch

    from cpdoctor.fix import ring

    rows, alternative = [], []
    default = ring.RingAttention.dkv.value  # the strategy patch.apply() chooses when not told
    other = [s.value for s in ring.DkvStrategy if s.value != default]
    runs = [(default, "ring", 2, args.seqs), (default, "ring", 4, args.ring4_seqs), (default, "ulysses", 2, args.ulysses_seqs)]
    if args.compare_dkv:  # the alternative only where it is cheap to measure
        runs += [
            (m, "ring", w, [s for s in seqs if s <= args.compare_max_seq])
            for m in other
            for w, seqs in ((2, args.seqs), (4, args.ring4_seqs))
        ]
    for method, layout, world, seqs in runs:
        if not seqs:
            continue
        spec = {"seqs": seqs, "reps": args.reps, "dkv": method, "layout": layout}  # the workers patch with dkv=method
        timing = spawn(world, dict(spec, mode="time"))
        pieces = spawn(world, dict(spec, mode="pieces"))
        memory = spawn(world, dict(spec, mode="memory"), {"MALLOC_MMAP_THRESHOLD_": "65536"})
        (rows if method == default else alternative).extend(summarise(world, seqs, timing, pieces, memory, args.reps, method, layout))
    doc = {
        "what": "fwd+bwd per rank, cpdoctor_cpu backend, B1 H8 D64 fp32; built-in = diffusers' TemplatedRingAttention "
        "(layout ring) or TemplatedUlyssesAttention (layout ulysses), patched = cpdoctor.fix.ring.RingAttention or "
        "cpdoctor.fix.ulysses.UlyssesAttention",
        "dkv_method": default,
        "reps": args.reps,
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads_per_rank": {str(w): max(1, (os.cpu_count() or 1) // w) for w in (2, 4)},
        "rows": rows,
        "alternative_dkv_rows": alternative,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    for title, table in (("default dK/dV strategy: " + default, rows), ("alternative dK/dV strategy", alternative)):
        if not table:
            continue
        print(title)
        print(
            f"{'layout':>9} {'S':>6} {'dK/dV':>14} | {'built-in s':>10} {'patched s':>10} {'time ×':>7} | {'fwd ×':>6} {'bwd ×':>6} | "
            f"{'built-in MiB':>12} {'patched MiB':>11} {'mem ×':>6} | {'bwd/ideal':>9} {'(built-in)':>10}"
        )
        for r in table:
            print(
                f"{r['layout'] + ' ' + str(r['world']):>9} {r['seq']:>6} {r['dkv_method']:>14} | {r['builtin']['total_s']:>10.4f} {r['patched']['total_s']:>10.4f} {r['ratio_time']:>7.3f} | "
                f"{r['ratio_fwd']:>6.3f} {r['ratio_bwd']:>6.3f} | {r['builtin']['peak_mib']:>12.1f} {r['patched']['peak_mib']:>11.1f} "
                f"{r['ratio_peak_mem']:>6.3f} | {r['patched_bwd_over_ideal']:>9.2f} {r['builtin_bwd_over_ideal']:>10.2f}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
