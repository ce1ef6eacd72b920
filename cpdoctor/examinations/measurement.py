"""Numbers, not opinions: how a probe measures a CP result against its reference, and the typed record of
what rank 0 measured for one case (judged later, in the parent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Measurement:
    """What rank 0 measured for one case. `tensors` maps a tensor name to its row (rel_err, max_abs,
    nonfinite, worst_rank, per_rank_rel_err, baseline_rel_err); `unsupported` says why nothing could be
    measured; `details` holds what one examination adds (the model's parameters, its op-level cross-checks)."""

    backend: str
    facts: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    unsupported: str | None = None
    baseline_error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def compare(x: Any, ref: Any) -> dict[str, float]:
    """Relative L2 error, max abs error and non-finite count of `x` against the fp64 `ref`."""
    import torch

    xd = x.double()
    ref = ref.double()
    finite = torch.isfinite(xd)
    diff = torch.where(finite, xd - ref, torch.zeros_like(ref))
    denom = ref.norm().item() or 1.0
    return {
        "rel_err": diff.norm().item() / denom if bool(finite.all()) else float("inf"),
        "max_abs": diff.abs().max().item() if diff.numel() else 0.0,
        "nonfinite": int((~finite).sum().item()),
    }


def rank_environment(ctx: Any, backend: str, req: Any) -> dict[str, Any]:
    """The environment line of a report, as rank 0 saw it."""
    import platform

    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.judging import emulation_note

    device = str(ctx.device)
    if ctx.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(ctx.device)})"
    return {
        "torch": torch.__version__,
        "diffusers": compat.diffusers_version(),
        "python": platform.python_version(),
        "device": device,
        "process_group": ctx.pg_backend,
        "world_size": ctx.world_size,
        "ring": req.ring,
        "ulysses": req.ulysses,
        "backend": backend,
        "dtype": req.dtype,
        **({"emulated": emulation_note(backend)} if getattr(req, "emulate", False) else {}),
    }
