"""The memory plan of a model examination, as pure arithmetic (no torch): what each rank and rank 0 will hold,
on the device that holds it, before anything launches; whether it fits; the most blocks that fit.

What a model examination holds (cpdoctor/examinations/model/probe.py):
- every rank, CP run: the sliced model in the probe dtype (weights), its parameter gradients (same dtype),
  the flat fp32 gradient vector (4 bytes a parameter, all-reduced in place; rank 0 keeps it in its process),
  and the activations of its 1/W share of the tokens;
- rank 0 afterwards, one at a time: the no-CP baseline (same model, same dtype, all tokens) and the reference
  (the same model in fp64, or fp32 where fp64 does not fit, all tokens), while it keeps the CP and baseline
  flat gradients (2 × 4 bytes a parameter);
- every process: the Python interpreter with torch and diffusers imported (PROCESS_OVERHEAD).
On CPU every rank shares the host's memory; on CUDA each rank has its own device and the reference sits on
rank 0's.

Activations are an estimate: ACT_ELEMENTS_PER_TOKEN values of width `hidden` saved for backward per token and
block (norms, q/k/v, attention out, the 4× MLP and its activation, modulations), plus the embedders' and
output layers' share (one block's worth).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cpdoctor.vocabulary import DType

GiB = 1024**3
ACT_ELEMENTS_PER_TOKEN = 24
PROCESS_OVERHEAD = int(0.6 * GiB)
"""Resident memory of a rank before any model: Python, torch, diffusers, gloo (measured ~0.5 GiB here)."""
HEADROOM = 0.9
"""The share of the available memory a plan may use."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the plan needs to know of the sliced model and the examination."""

    params: int  # parameters of the sliced model
    blocks: int  # blocks kept, all stacks together
    tokens: int  # image + text tokens (full sequence)
    hidden: int  # width of a block's tokens
    batch: int
    dtype: str  # probe dtype: fp32, bf16, fp16
    world: int  # ring × ulysses
    device: str  # "cpu" or "cuda"


@dataclasses.dataclass(frozen=True)
class Part:
    weights: int
    grads: int
    activations: int
    other: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.activations + self.other

    def to_jsonable(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    sizes: Sizes
    per_rank: Part  # one rank's CP run
    baseline: Part  # rank 0: the no-CP run
    reference: Part  # rank 0: the reference
    reference_dtype: str
    rank0_peak: int
    device_peak: int  # on the device that holds the most: the host (CPU) or rank 0's GPU
    available: int | None  # bytes available on that device, None when unknown
    blocks_by_stack: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.available is None or self.device_peak <= HEADROOM * self.available

    def to_jsonable(self) -> dict[str, Any]:
        return {
            "device": self.sizes.device,
            "dtype": self.sizes.dtype,
            "reference_dtype": self.reference_dtype,
            "parameters": self.sizes.params,
            "blocks": dict(self.blocks_by_stack),
            "tokens": self.sizes.tokens,
            "world": self.sizes.world,
            "per_rank": self.per_rank.to_jsonable(),
            "rank0_baseline": self.baseline.to_jsonable(),
            "rank0_reference": self.reference.to_jsonable(),
            "rank0_peak": self.rank0_peak,
            "device_peak": self.device_peak,
            "available": self.available,
            "fits": self.fits,
        }

    def lines(self) -> list[str]:
        """The plan as a few lines for a human."""
        s = self.sizes
        blocks = ", ".join(f"{k} {v}" for k, v in self.blocks_by_stack.items()) or f"{s.blocks} blocks"
        where = "host memory (all ranks share it)" if s.device == "cpu" else "each rank's GPU (the reference on rank 0's)"
        avail = "unknown" if self.available is None else gib(self.available)
        return [
            f"memory plan: {s.params / 1e6:.1f}M parameters ({blocks}), {s.tokens} tokens, {s.world} ranks, on {where}",
            f"  per rank ({s.dtype}):  weights {gib(self.per_rank.weights)}, grads {gib(self.per_rank.grads + self.per_rank.other)}, activations {gib(self.per_rank.activations)}",
            f"  rank 0, no-CP baseline ({s.dtype}): {gib(self.baseline.total)}; reference ({self.reference_dtype}): weights {gib(self.reference.weights)}, "
            f"grads {gib(self.reference.grads)}, activations {gib(self.reference.activations)}",
            f"  peak {gib(self.device_peak)} of {avail} available" + ("" if self.fits else "  — does not fit"),
        ]


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def activations(sizes: Sizes, dtype: str, tokens: int) -> int:
    return (sizes.blocks + 1) * ACT_ELEMENTS_PER_TOKEN * sizes.batch * tokens * sizes.hidden * DType(dtype).bytes


def cp_rank(sizes: Sizes) -> Part:
    b = DType(sizes.dtype).bytes
    local = -(-sizes.tokens // sizes.world)
    return Part(sizes.params * b, sizes.params * b, activations(sizes, sizes.dtype, local), other=4 * sizes.params)


def single(sizes: Sizes, dtype: str) -> Part:
    """One process, all tokens, in `dtype` (the baseline, or the reference), with its flat fp32 gradients."""
    b = DType(dtype).bytes
    return Part(sizes.params * b, sizes.params * b, activations(sizes, dtype, sizes.tokens), other=4 * sizes.params)


def plan(
    sizes: Sizes, available: int | None, blocks_by_stack: dict[str, int] | None = None, reference_dtype: str | None = None
) -> MemoryPlan:
    """The plan at these sizes; the reference in fp64 when that fits, else fp32 (unless `reference_dtype`)."""
    for ref_dtype in [reference_dtype] if reference_dtype else DType.references():
        per_rank = cp_rank(sizes)
        base = single(sizes, sizes.dtype)
        ref = single(sizes, ref_dtype)
        kept = 2 * 4 * sizes.params  # rank 0 keeps the CP and baseline flat gradients
        rank0 = PROCESS_OVERHEAD + max(per_rank.total, base.total + kept, ref.total + kept)
        if sizes.device == "cpu":
            others = (sizes.world - 1) * PROCESS_OVERHEAD
            device_peak = max(sizes.world * (PROCESS_OVERHEAD + per_rank.total), rank0 + others)
        else:
            device_peak = rank0 - PROCESS_OVERHEAD
        p = MemoryPlan(sizes, per_rank, base, ref, ref_dtype, rank0, device_peak, available, dict(blocks_by_stack or {}))
        if p.fits:
            return p
    return p


def most_blocks(plan_for: Any, depth: int) -> int:
    """The largest n in 1..depth whose plan (`plan_for(n)`) fits, 0 when none does. Plans grow with n."""
    lo, hi = 0, depth
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan_for(mid).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo


def available_host_memory(meminfo: str | None = None) -> int | None:
    """MemAvailable of /proc/meminfo (psutil when installed), in bytes; None when unknown."""
    if meminfo is None:
        try:
            import psutil  # type: ignore[import-not-found]

            return int(psutil.virtual_memory().available)
        except ImportError:
            pass
        try:
            with open("/proc/meminfo", encoding="ascii") as fh:
                meminfo = fh.read()
        except OSError:
            return None
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * 1024
    return None


def available_memory(device: object) -> int | None:
    """Free memory where a computation on `device` runs, in bytes: the CUDA device's free memory, or the host's
    MemAvailable; None when unknown (never a refusal then)."""
    if str(device).startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info(torch.device(str(device)))[0])
        except (RuntimeError, AssertionError):  # no CUDA context here: unknown
            return None
    return available_host_memory()
