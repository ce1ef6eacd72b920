"""Numbers, not opinions: how a probe measures a CP result against its reference, and the typed record of what
rank 0 measured for one case (judged later, in the parent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cpdoctor.errors import Unsupported
from cpdoctor.launch.jobs import CaseNumbers
from cpdoctor.report.environment import AttentionBackend, Environment, Launch, Software
from cpdoctor.report.numbers import Comparison, TensorRow
from cpdoctor.vocabulary import DType

if TYPE_CHECKING:
    from cpdoctor.examinations.request import LayoutRequest
    from cpdoctor.launch.context import DistContext


@dataclass
class Measurement(CaseNumbers):
    """What rank 0 measured for one case of an attention-shaped examination: a row per tensor, or why nothing
    could be measured. `facts` is what the examination established about the backend (compat.backends.
    BackendFacts for diffusers' backends); `baseline_error` says why the no-CP baseline could not run."""

    backend: str
    facts: Any = None
    environment: Environment = field(default_factory=Environment)
    tensors: dict[str, TensorRow] = field(default_factory=dict)
    unsupported: Unsupported | None = None
    baseline_error: str | None = None
    rng_advanced: bool = False
    """The CP forward and backward moved the device's random generator (a backend op forcing dropout > 0)."""


def torch_dtype(name: str) -> Any:
    """The torch dtype of a dtype's name or member (vocabulary.DType)."""
    return DType(name).torch


def compare(x: Any, ref: Any) -> Comparison:
    """Relative L2 error, max abs error and non-finite count of `x` against the fp64 `ref`."""
    import torch

    xd = x.double()
    ref = ref.double()
    finite = torch.isfinite(xd)
    diff = torch.where(finite, xd - ref, torch.zeros_like(ref))
    denom = ref.norm().item() or 1.0
    return Comparison(
        rel_err=diff.norm().item() / denom if bool(finite.all()) else float("inf"),
        max_abs=diff.abs().max().item() if diff.numel() else 0.0,
        nonfinite=int((~finite).sum().item()),
    )


def sharded_row(shards: list[Any], order: list[int], refs: list[Any], whole_ref: Any, dim: int, baseline: float | None) -> TensorRow:
    """The row of one tensor that every rank holds a shard of: `shards[r]` is rank r's, `order` the ranks in
    sequence order, `refs[r]` the reference of rank r's shard; the whole is compared after concatenating along
    `dim`. The worst rank is the one with the largest error."""
    import torch

    per_rank = [compare(s, r).rel_err for s, r in zip(shards, refs)]
    whole = compare(torch.cat([shards[r] for r in order], dim=dim), whole_ref)
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r])
    return TensorRow.of(whole, worst_rank=worst, per_rank_rel_err=tuple(per_rank), baseline_rel_err=baseline)


def rank_environment(ctx: DistContext, backend: str, req: LayoutRequest, emulated: str | None = None) -> Environment:
    """The environment line of a report, as rank 0 saw it."""
    import platform

    import torch

    from cpdoctor.compat import diffusers as compat

    device = str(ctx.device)
    if ctx.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(ctx.device)})"
    return Environment(
        # a plain str: torch's TorchVersion would make the parent import torch to unpickle it
        Software(torch=str(torch.__version__), diffusers=compat.diffusers_version(), python=platform.python_version()),
        Launch(device, ctx.pg_backend, ctx.world_size, req.ring, req.ulysses, dtype=req.dtype, emulated=emulated or None),
        AttentionBackend(backend),
    )
