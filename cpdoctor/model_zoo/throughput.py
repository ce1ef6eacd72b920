"""The time plan of a model examination, next to its memory plan (memory.py): the machine's matmul throughput
measured for the examination's dtypes on one thread (a probe of a few tens of milliseconds), and what it means.

Why: a CPU without native bf16 (an AMD EPYC with AVX2 only) multiplies bf16 matrices 100-250× slower than fp32
(0.3 against 73 GFLOP/s, one thread, measured in issue 22): a bf16 examination of a full-width block that takes
a minute elsewhere runs for hours there. The defects cpdoctor finds do not depend on the dtype, so where the half
dtype is far slower than fp32 the plan says so before anything starts and suggests `--dtype fp32`.

The probe runs only for a half dtype (bf16, fp16) on the CPU: on a GPU the half dtypes are the fast ones, and
fp32 needs no comparison. The estimate is rough (linear layers and attention, forward and backward, at the
measured one-thread rate times the threads a rank gets); it is a plan, not a promise.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from cpdoctor.memo import Memo
from cpdoctor.vocabulary import DType

SLOW_HALF_FACTOR = 8.0
"""A half dtype this many times slower than fp32 is worth a warning: fp32 finds the same defects sooner."""
PROBE_BUDGET_S = 0.025
"""The probe grows its matrices (128, 256, ... 1024) while the next size would stay within this, per dtype."""


@dataclass(frozen=True)
class Throughput:
    """One dtype's measured matmul rate on one thread: n×n @ n×n, the best of two runs."""

    dtype: str
    gflops: float
    size: int


def measure(dtype: str, budget_s: float = PROBE_BUDGET_S) -> Throughput:
    """The CPU's one-thread matmul rate in `dtype`, from the largest square matmul (128 to 1024) whose next size
    would still fit `budget_s` (the smaller ones warm the kernels up)."""
    import torch

    tdtype = DType(dtype).torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # a watched step may call this inside CPU autocast, which would run the fp32 probe in bf16
        with torch.autocast("cpu", enabled=False):
            n = 128
            while True:
                gen = torch.Generator().manual_seed(0)
                a = torch.randn(n, n, generator=gen).to(tdtype)
                b = torch.randn(n, n, generator=gen).to(tdtype)
                first = _timed(a, b)
                best = first if first > budget_s else min(first, _timed(a, b))  # a slow path: measured once is enough
                if n >= 1024 or 8 * best > budget_s:
                    return Throughput(dtype, 2 * n**3 / max(best, 1e-9) / 1e9, n)
                n *= 2
    finally:
        torch.set_num_threads(threads)


def _timed(a: Any, b: Any) -> float:
    start = time.perf_counter()
    a @ b
    return time.perf_counter() - start


FP32_OPTION = "`--dtype fp32` finds the same ones sooner"


def slow_half_warning(dtype: str, half_gflops: float, fp32_gflops: float, suggestion: str = FP32_OPTION) -> str | None:
    """The warning to print before a `dtype` examination when this CPU runs it far slower than fp32; None when not."""
    if not DType(dtype).is_half or fp32_gflops < SLOW_HALF_FACTOR * half_gflops:
        return None
    return (
        f"{dtype} is {fp32_gflops / max(half_gflops, 1e-9):.0f}× slower than fp32 on this CPU ({half_gflops:.3g} against "
        f"{fp32_gflops:.3g} GFLOP/s, one thread, measured now): the defects cpdoctor finds do not depend on the dtype; "
        f"{suggestion}"
    )


MEASURED: Memo[Throughput] = Memo("dtype -> this CPU's one-thread matmul rate (measured once per process)")


def slow_half_here(dtype: str, suggestion: str = FP32_OPTION) -> str | None:
    """`slow_half_warning` for `dtype` on this process's CPU, each rate measured once per process (None for
    fp32/fp64: nothing is measured)."""
    if not DType(dtype).is_half:
        return None
    half, fp32 = (MEASURED.get(d, lambda d=d: measure(d)) for d in (dtype, "fp32"))
    return slow_half_warning(dtype, half.gflops, fp32.gflops, suggestion)


@dataclass(frozen=True)
class TimePlan:
    """The examination's FLOPs (the CP run on each rank, rank 0's no-CP baseline and reference) at the measured
    rates: what it will take here, roughly, and whether the chosen half dtype is the slow part."""

    dtype: str
    reference_dtype: str
    rates: dict[str, Throughput]
    flops_per_rank: float
    flops_single: float
    threads: int

    def seconds(self) -> float:
        rate = {d: t.gflops * 1e9 * self.threads for d, t in self.rates.items()}
        return (self.flops_per_rank + self.flops_single) / rate[self.dtype] + self.flops_single / rate[self.reference_dtype]

    def warning(self) -> str | None:
        return slow_half_warning(self.dtype, self.rates[self.dtype].gflops, self.rates["fp32"].gflops)

    def lines(self) -> list[str]:
        measured = ", ".join(f"{d} {t.gflops:.3g}" for d, t in self.rates.items())
        out = [f"time plan: about {_duration(self.seconds())} ({measured} GFLOP/s on one thread, {self.threads} a rank)"]
        warning = self.warning()
        if warning is not None:
            out.append(f"  warning: {warning}")
        return out


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def flops(sizes: Any, tokens: int) -> float:
    """Forward and backward (3× the forward) of the sliced model over `tokens` of the full sequence's keys:
    every parameter in a matmul once per token, and attention's two products per block."""
    linear = 2 * sizes.params * tokens
    attention = 4 * sizes.blocks * tokens * sizes.tokens * sizes.hidden
    return 3.0 * sizes.batch * (linear + attention)


def time_plan(memory_plan: Any, rates: dict[str, Throughput] | None = None) -> TimePlan | None:
    """The time plan of a model examination with this memory plan (memory.MemoryPlan), measuring the rates it
    needs unless given; None where no probe runs (not a half dtype, or not on the CPU)."""
    sizes = memory_plan.sizes
    if not DType(sizes.dtype).is_half or sizes.device != "cpu":
        return None
    wanted = dict.fromkeys([sizes.dtype, "fp32", memory_plan.reference_dtype])
    rates = rates if rates is not None else {d: measure(d) for d in wanted}
    threads = max(1, (os.cpu_count() or 1) // sizes.world)  # what the launcher gives a rank (unless OMP_NUM_THREADS says)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    local = -(-sizes.tokens // sizes.world)
    return TimePlan(sizes.dtype, memory_plan.reference_dtype, rates, flops(sizes, local), flops(sizes, sizes.tokens), threads)
