"""The time plan next to the memory plan (model_zoo/throughput.py): the slow-half-dtype warning from measured rates
(injected here: the probe's numbers of issue 22's AMD EPYC, and of a CPU with native bf16), and where no probe
runs at all."""

from __future__ import annotations

import pytest

from cpdoctor.model_zoo import memory, throughput
from cpdoctor.model_zoo.throughput import Throughput, slow_half_warning, time_plan


def _memory_plan(dtype: str = "bf16", device: str = "cpu") -> memory.MemoryPlan:
    sizes = memory.Sizes(params=340_000_000, blocks=1, tokens=320, hidden=3072, batch=1, dtype=dtype, world=2, device=device)
    return memory.plan(sizes, available=None)


def _rates(half: float, fp32: float, fp64: float = 20.0, dtype: str = "bf16") -> dict[str, Throughput]:
    return {dtype: Throughput(dtype, half, 1024), "fp32": Throughput("fp32", fp32, 1024), "fp64": Throughput("fp64", fp64, 1024)}


def test_a_half_dtype_far_slower_than_fp32_is_warned_about_with_both_rates():
    """Issue 22's EPYC (AVX2, no native bf16): 0.3 against 73 GFLOP/s on one thread."""
    warning = slow_half_warning("bf16", 0.3, 73.0)
    assert warning is not None and "0.3 against 73 GFLOP/s" in warning and "--dtype fp32" in warning
    assert "243× slower" in warning


def test_a_half_dtype_at_a_normal_rate_is_not_warned_about():
    assert slow_half_warning("bf16", 60.0, 73.0) is None  # native bf16: as fast as fp32
    assert slow_half_warning("fp16", 10.0, 73.0) is None  # 7× slower: below the threshold
    assert slow_half_warning("fp32", 0.3, 73.0) is None  # fp32 itself is never the slow half dtype


def test_the_time_plan_prints_the_warning_only_where_the_half_dtype_is_slow():
    slow = time_plan(_memory_plan(), _rates(0.3, 73.0))
    assert slow is not None and any(line.startswith("  warning: bf16 is 243× slower") for line in slow.lines())
    normal = time_plan(_memory_plan(), _rates(60.0, 73.0))
    assert normal is not None and not any("warning" in line for line in normal.lines())
    assert slow.seconds() > 100 * normal.seconds() / 2  # the estimate follows the measured rate


def test_no_probe_runs_outside_a_half_dtype_on_the_cpu(monkeypatch):
    def no_probe(dtype: str, budget_s: float = 0.0) -> Throughput:
        raise AssertionError("the probe ran")

    monkeypatch.setattr(throughput, "measure", no_probe)
    assert time_plan(_memory_plan("fp32")) is None
    assert time_plan(_memory_plan("bf16", device="cuda")) is None
    with pytest.raises(AssertionError, match="the probe ran"):
        time_plan(_memory_plan("bf16"))


def test_the_probe_measures_a_rate_quickly():
    """The real probe, once, on this machine: a positive rate from a size it could afford (torch is imported here)."""
    import time

    import torch  # noqa: F401 - imported before the clock starts

    start = time.perf_counter()
    rate = throughput.measure("fp32")
    assert rate.gflops > 0 and 128 <= rate.size <= 1024
    assert time.perf_counter() - start < 5  # ~50 ms on an idle machine; generous for a loaded one


def test_a_watched_step_in_bf16_on_a_slow_cpu_is_advised_once_and_fp32_or_cuda_never(monkeypatch):
    """The step's side (examinations/step/watcher/watch.py): the rates are measured once per process (a pre-filled memo
    stands in for a CPU without native bf16), the warning names the dtype and says what to do in a step."""
    import torch

    from cpdoctor.examinations.step.watcher import watch
    from cpdoctor.launch import progress

    said: list[str] = []
    monkeypatch.setattr(progress, "advise", said.append)
    monkeypatch.setattr(throughput, "measure", lambda d: pytest.fail("measured again"))
    throughput.MEASURED.clear()
    throughput.MEASURED.get("bf16", lambda: Throughput("bf16", 0.3, 1024))
    throughput.MEASURED.get("fp32", lambda: Throughput("fp32", 73.0, 1024))
    try:
        watch.advise_slow_half("fp32", "cpu")
        watch.advise_slow_half("bf16", "cuda")
        assert said == []
        watch.advise_slow_half("bf16", torch.device("cpu"))
        assert len(said) == 1 and said[0].startswith("the watched step computes in bf16: bf16 is 243× slower than fp32")
        assert said[0].endswith("build the model in fp32 (or leave autocast off) for the examination: it finds the same ones sooner")
    finally:
        throughput.MEASURED.clear()


def test_autocast_entered_here_is_seen_as_the_step_dtype():
    import torch

    from cpdoctor.examinations.step.watcher.watch import autocast_dtypes, compute_dtype

    model = torch.nn.Linear(2, 2)
    assert autocast_dtypes() == [] and compute_dtype(model, autocast_dtypes()) == "fp32"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(model, autocast_dtypes()) == "bf16"


def test_the_probe_measures_its_own_dtype_inside_cpu_autocast(monkeypatch):
    """A watched step may probe inside `torch.autocast("cpu", bf16)`: the fp32 rate must still be fp32's."""
    import torch

    computed = []
    monkeypatch.setattr(throughput, "_timed", lambda a, b: computed.append((a @ b).dtype) or 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        throughput.measure("fp32")
    assert computed == [torch.float32]
