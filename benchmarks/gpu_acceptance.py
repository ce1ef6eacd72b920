"""The GPU acceptance run: cpdoctor's CUDA paths on real kernels, in one command, one table, JSON under $OUT.

    bash benchmarks/gpu_acceptance.sh                # on a machine with NVIDIA GPUs (the lent H200: see the .sh)
    python benchmarks/gpu_acceptance.py --dry-run    # CI, on CPU: the same code paths on the kernel stand-ins

What it runs (bf16):
1. launch: the spawned launch on CUDA devices — NCCL when every rank has a GPU of its own, gloo with the ranks
   sharing one GPU otherwise — and which process group each examination got;
2. the CP code of `_native_flash`, `_native_cudnn` and `_native_efficient` on the real kernels at ring 2,
   ring 4, Ulysses 2 and ring 2 × Ulysses 2, before and after cpdoctor's patch (`cpdoctor check --patch`);
3. stand-ins against hardware: the same unpatched check with `--emulate` on the CPU, so the stand-ins'
   verdicts and error signatures can be compared with the real kernels';
4. speed: the fix's block kernels (what the fixed ring runs per KV chunk, forward + backward from explicit
   out/lse) against the backend's own single-GPU kernel, in TFLOP/s, at S 16k and 64k; and, with ≥ 2 GPUs, the
   fixed ring's step time and peak memory against diffusers' ring at those lengths.
With --dry-run every examination runs on the CPU with `emulate=True` at a small shape, and the speed section
times the CPU stand-ins at S 512 (figures that mean nothing, code that cannot rot).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

BACKENDS = ("_native_flash", "_native_cudnn", "_native_efficient")
LAYOUTS = {"ring 2": (2, 1), "ring 4": (4, 1), "Ulysses 2": (1, 2), "ring 2 × Ulysses 2": (2, 2)}


def _worst(finding: dict[str, Any]) -> str:
    tensors = finding.get("tensors") or {}
    if not tensors:
        return "–"
    name, row = max(tensors.items(), key=lambda kv: kv[1]["rel_err"])
    return f"{name} {row['rel_err']:.2g}"


def examine(backend: str, ring: int, ulysses: int, dry: bool, seq: int, timeout: float) -> dict[str, Any]:
    """`cpdoctor check --patch` of one layout: verdicts and worst errors before and after, the process group."""
    import cpdoctor
    from cpdoctor.errors import BadInput, CannotExamine

    device = "cpu" if dry else "cuda"
    t0 = time.perf_counter()
    try:
        report = cpdoctor.check_attention(
            ring=ring, ulysses=ulysses, backend=backend, dtype="bf16", seq=seq, device=device, patch=True, emulate=dry, timeout_s=timeout
        )
    except (BadInput, CannotExamine) as exc:
        return {"backend": backend, "ring": ring, "ulysses": ulysses, "error": str(exc), "wall_s": time.perf_counter() - t0}
    data = report.to_dict()
    before = data.get("before", {}).get("findings", [{}])[0]
    after = data["findings"][0]
    return {
        "backend": backend,
        "ring": ring,
        "ulysses": ulysses,
        "process_group": data["environment"].get("process_group", "–"),
        "before": before.get("verdict", "–"),
        "before_worst": _worst(before),
        "before_diagnosis": before.get("diagnosis", ""),
        "after": after["verdict"],
        "after_worst": _worst(after),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def standin_agreement(backend: str, ring: int, ulysses: int, seq: int, timeout: float) -> dict[str, Any]:
    """The unpatched check on the CPU stand-ins, to set beside the same check on the real kernels."""
    import cpdoctor

    report = cpdoctor.check_attention(
        ring=ring, ulysses=ulysses, backend=backend, dtype="bf16", seq=seq, device="cpu", emulate=True, timeout_s=timeout
    )
    finding = report.to_dict()["findings"][0]
    return {"verdict": finding["verdict"], "worst": _worst(finding)}


def _attention_flops(b: int, h: int, s_q: int, s_k: int, d: int) -> float:
    """Forward + backward of softmax(QKᵀ)V: 4·B·H·Sq·Sk·D forward, 2.5× that backward (FlashAttention's count)."""
    return 4.0 * b * h * s_q * s_k * d * 3.5


def kernel_speed(backend: str, seq: int, dry: bool, chunks: int = 4, reps: int = 3) -> dict[str, Any]:
    """TFLOP/s of the backend's single-GPU kernel on the full sequence against the fix's block kernel doing the
    same work as `chunks` KV blocks (what the fixed ring runs per rank), forward + backward."""
    import torch

    from cpdoctor.fix import kernels

    if dry:
        from cpdoctor.kernels import standins

        standins.activate()
    device = torch.device("cpu" if dry else "cuda")
    b, h, d = 1, 24, 128
    kernel = {
        "_native_flash": kernels.NativeFlashKernel,
        "_native_cudnn": kernels.CudnnKernel,
        "_native_efficient": kernels.EfficientKernel,
    }[backend]()
    # model layout (B, S, H, D) into the kernel's own layout, as the fixed ring does
    q, k, v, g = (kernel.to_layout(torch.randn(b, seq, h, d, device=device, dtype=torch.bfloat16)).contiguous() for _ in range(4))
    seq_dim = kernel.seq_dim
    scale = d**-0.5

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

    result: dict[str, Any] = {"backend": backend, "seq": seq}
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
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def render(rows: list[dict], agreement: dict, speed: list[dict], env: dict) -> str:
    import io

    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), record=True, width=160, color_system=None)
    console.print(" · ".join(f"{k} {v}" for k, v in env.items()))
    table = Table(title="CP attention on the kernels (cpdoctor check --patch, bf16)", title_justify="left")
    for col in ("backend", "layout", "pg", "before", "before: worst", "after", "after: worst", "stand-ins (before)", "s"):
        table.add_column(col)
    for r in rows:
        layout = next(k for k, v in LAYOUTS.items() if v == (r["ring"], r["ulysses"]))
        if "error" in r:
            table.add_row(r["backend"], layout, "–", "–", r["error"][:60], "–", "–", "–", f"{r['wall_s']:.0f}")
            continue
        agree = agreement.get(f"{r['backend']} {layout}")
        table.add_row(
            r["backend"], layout, r["process_group"], r["before"], r["before_worst"], r["after"], r["after_worst"],
            f"{agree['verdict']} {agree['worst']}" if agree else "–", f"{r['wall_s']:.0f}",
        )  # fmt: skip
    console.print(table)
    perf = Table(title="the fix's block kernels against the single-GPU kernel (fwd + bwd, B1 H24 D128, 4 KV blocks)", title_justify="left")
    for col in ("backend", "S", "kernel TFLOP/s", "fix blocks TFLOP/s", "ratio"):
        perf.add_column(col)
    for s in speed:
        if "error" in s:
            perf.add_row(s["backend"], str(s["seq"]), s["error"][:60], "–", "–")
        else:
            perf.add_row(
                s["backend"], str(s["seq"]), f"{s['kernel']['tflops']:.3g}", f"{s['fix blocks']['tflops']:.3g}", f"{s['ratio']:.2f}"
            )
    console.print(perf)
    return console.export_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, kernel stand-ins, small shapes: checks the script, not the hardware")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where gpu_acceptance.json and .txt go")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), help="a subset of: " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    dry = args.dry_run
    import torch

    if not dry and not torch.cuda.is_available():
        print("gpu_acceptance: no CUDA device here; use --dry-run on a CPU", file=sys.stderr)
        return 2
    gpus = 0 if dry else torch.cuda.device_count()
    env = {
        "mode": "dry run on CPU stand-ins" if dry else f"{gpus} × {torch.cuda.get_device_name(0)}",
        "torch": torch.__version__,
        "launch": "NCCL, one GPU per rank" if gpus >= 4 else ("gloo, ranks sharing the GPU(s)" if gpus else "gloo on CPU"),
    }
    seq = 256 if dry else 4096
    rows, agreement, speed = [], {}, []
    for backend in BACKENDS:
        for name in args.layouts:
            ring, ulysses = LAYOUTS[name]
            rows.append(examine(backend, ring, ulysses, dry, seq, args.timeout))
            if not dry and rows[-1].get("before") not in (None, "UNSUPPORTED") and name in ("ring 2", "Ulysses 2"):
                agreement[f"{backend} {name}"] = standin_agreement(backend, ring, ulysses, 512, args.timeout)
    for backend in BACKENDS:
        for s in (512,) if dry else (16384, 65536):
            try:
                speed.append(kernel_speed(backend, s, dry))
            except Exception as exc:  # noqa: BLE001 - a kernel that refuses this shape here is a row, not an abort
                speed.append({"backend": backend, "seq": s, "error": f"{type(exc).__name__}: {exc}"})
    text = render(rows, agreement, speed, env)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_acceptance.json"), "w") as fh:
        json.dump({"environment": env, "examinations": rows, "standins": agreement, "speed": speed}, fh, indent=1)
    with open(os.path.join(args.out, "gpu_acceptance.txt"), "w") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
