"""A peer's CP attention on sequence shards vs the full sequence: numbers only.

Every rank builds the same full inputs from the seed, takes its tokens in the peer's own layout (layouts.py;
PyTorch's context_parallel shards them itself), runs the peer forward and backward through its adapter, and
returns its out, dQ, dK, dV (and LSE where the peer returns one) in its own token order. Rank 0 computes once
the fp64 reference on the full sequence (per packed sequence for varlen) and the same block kernel's error
without CP (the baseline the tolerance is built from), puts every rank's results back by token index and
measures them. On a CPU the CUDA kernels are cpdoctor's stand-ins (cpu_kernels/standins.py), and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.packages import installed_version
from cpdoctor.errors import CannotExamine
from cpdoctor.examinations.measurement import Measurement, compare, torch_dtype
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.launch.jobs import Case, RankResult
from cpdoctor.peer_impls.base import PeerOutputs, RunShape, Shim
from cpdoctor.peer_impls.layouts import cu_seqlens, token_indices, varlen_lengths
from cpdoctor.peer_impls.source import package_root
from cpdoctor.report.environment import Environment, Launch, PeerLayout, Software
from cpdoctor.report.numbers import TensorRow

if TYPE_CHECKING:
    from cpdoctor.launch.context import DistContext

TENSORS = ("out", "lse", "dq", "dk", "dv")
VARLEN_SEQUENCES = 3
"""How many packed sequences a varlen request splits its tokens into (uneven lengths: boundaries inside shards)."""


@dataclass(frozen=True)
class PeerFacts:
    """What the examination established about the peer as it ran (the finding's evidence)."""

    impl: str
    version: str
    variant: str
    kernel: str
    layout: str
    exposes_lse: bool
    emulated: bool
    shims: tuple[Shim, ...] = ()
    cu_seqlens: tuple[int, ...] = ()


@dataclass
class PeerRankResult(RankResult):
    """One rank's results in its own token order (CPU tensors)."""

    rank: int
    outputs: PeerOutputs
    emulated: bool = False


@dataclass
class Inputs:
    """The full inputs, identical on every rank: (B, S, H, D) (varlen: (1, total, H, D) and cu_seqlens)."""

    q: Any
    k: Any
    v: Any
    dout: Any
    cu_seqlens: Any = None


def make_inputs(req: PeerRequest, device: Any = None) -> Inputs:
    import torch

    gen = torch.Generator().manual_seed(req.seed)
    varlen = req.the_variant.varlen
    shape = (1, req.batch * req.seq, req.heads, req.head_dim) if varlen else (req.batch, req.seq, req.heads, req.head_dim)
    dtype = torch_dtype(req.dtype)
    q, k, v, dout = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(4))
    cu = None
    if varlen:
        cu = torch.tensor(cu_seqlens(varlen_lengths(req.batch * req.seq, VARLEN_SEQUENCES)), dtype=torch.int32, device=device)
    return Inputs(q, k, v, dout, cu)


def run_shape(req: PeerRequest, rank: int) -> RunShape:
    return RunShape(req.ring, req.ulysses, rank, req.causal, req.variant, req.kernel)


def indices(req: PeerRequest, rank: int) -> list[int]:
    seq = req.batch * req.seq if req.the_variant.varlen else req.seq
    return token_indices(req.layout, seq, req.ring, req.ulysses, rank)


def run_rank(case: Case, ctx: DistContext) -> PeerRankResult:
    """This rank's out/LSE/dQ/dK/dV through the peer's CP attention."""
    import torch

    from cpdoctor.cpu_kernels import standins

    req: PeerRequest = case.request  # validated where it was built (PeerRequest.of)
    emulated = ctx.device.type == "cpu"
    if emulated:
        standins.activate()
    elif req.the_kernel.package and package_root(req.the_kernel.package) is None:
        raise CannotExamine(
            f"{req.impl} calls {req.the_kernel.package} on a GPU and it is not installed here: pip install flash-attn, "
            "or emulate=True to run on CPU ranks through cpdoctor's stand-in"
        )
    peer = req.adapter
    inputs = make_inputs(req, ctx.device)
    idx = torch.tensor(indices(req, ctx.rank), device=ctx.device)
    shape = run_shape(req, ctx.rank)
    if peer.spec.shards_itself:
        mesh = ctx.cp_mesh(req.world_size, 1)["ring"]
        got: PeerOutputs = peer.run(shape, inputs.q, inputs.k, inputs.v, inputs.dout, mesh=mesh)  # it shards itself
    else:
        q, k, v, dout = (x.index_select(1, idx).contiguous() for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
        got = peer.run(shape, q, k, v, dout, extra=inputs.cu_seqlens)
    return PeerRankResult(ctx.rank, got.cpu(), emulated)


def reference(inputs: Inputs, causal: bool, scale: float | None = None) -> dict[str, Any]:
    """Exact attention in fp64 on the full sequence (block-diagonal over packed sequences for varlen): out,
    LSE (B, H, S) and the gradients, in the inputs' (B, S, H, D) layout."""
    import math

    import torch

    q, k, v = (t.detach().double().cpu().transpose(1, 2).requires_grad_(True) for t in (inputs.q, inputs.k, inputs.v))
    s = q.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    allowed = torch.ones(s, s, dtype=torch.bool)
    if inputs.cu_seqlens is not None:
        seq_id = torch.repeat_interleave(
            torch.arange(len(inputs.cu_seqlens) - 1), (inputs.cu_seqlens[1:] - inputs.cu_seqlens[:-1]).cpu().long()
        )
        allowed = seq_id[:, None] == seq_id[None, :]
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(inputs.dout.double().cpu().transpose(1, 2))
    t = lambda x: x.detach().transpose(1, 2)  # noqa: E731
    return {"out": t(out), "lse": lse.detach(), "dq": t(q.grad), "dk": t(k.grad), "dv": t(v.grad)}


def gathered_row(shards: list[Any], idx: list[Any], ref: Any, dim: int, baseline: float | None) -> TensorRow:
    """One tensor's row: every rank's shard against the reference at its own token indices, and the whole put
    back together by token index."""
    import torch

    whole = torch.full_like(ref, float("nan"))
    per_rank = []
    for shard, i in zip(shards, idx):
        whole.index_copy_(dim, i, shard.double())
        per_rank.append(compare(shard, ref.index_select(dim, i)).rel_err)
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r])
    return TensorRow.of(compare(whole, ref), worst_rank=worst, per_rank_rel_err=tuple(per_rank), baseline_rel_err=baseline)


def evaluate(case: Case, results: list[PeerRankResult], ctx: DistContext) -> Measurement:
    """On rank 0: every rank's results against the fp64 reference, gathered by token index, and the same kernel's
    error without CP."""
    import torch

    req: PeerRequest = case.request
    inputs = make_inputs(req, ctx.device)
    ref = reference(inputs, req.causal)
    exposes = req.the_variant.exposes_lse and all(r.outputs.lse is not None for r in results)
    facts = PeerFacts(
        impl=req.impl,
        version=installed_version(req.adapter.spec.distribution),
        variant=req.variant,
        kernel=req.kernel,
        layout=req.layout.value,
        exposes_lse=exposes,
        emulated=any(r.emulated for r in results),
        shims=tuple({s.name: s for r in results for s in r.outputs.shims}.values()),
        cu_seqlens=tuple(int(x) for x in inputs.cu_seqlens.tolist()) if inputs.cu_seqlens is not None else (),
    )
    result = Measurement(req.impl, facts, environment(ctx, req, facts))
    baseline: dict[str, float | None] = dict.fromkeys(TENSORS)
    # without a baseline the tolerance is the dtype's alone
    tried = Attempt.of(
        lambda: req.adapter.single_process(run_shape(req, 0), inputs.q, inputs.k, inputs.v, inputs.dout, extra=inputs.cu_seqlens).cpu()
    )
    if tried.ok:
        base = tried.value
        baseline = {n: None if base.tensor(n) is None else compare(base.tensor(n), ref[n]).rel_err for n in TENSORS}
    result.baseline_error = tried.why()
    idx = [torch.tensor(indices(req, r.rank)) for r in results]
    names = [n for n in TENSORS if n != "lse" or exposes]
    for name in names:
        dim = -1 if name == "lse" else 1
        shards = [r.outputs.tensor(name) for r in results]
        result.tensors[name] = gathered_row(shards, idx, ref[name], dim, baseline[name])
    return result


def environment(ctx: DistContext, req: PeerRequest, facts: PeerFacts) -> Environment:
    """The report's environment line, as rank 0 saw it (no diffusers import: peers do not need it)."""
    import platform

    import torch

    emulated = "CUDA kernels emulated on CPU by cpdoctor's stand-ins" if facts.emulated else None
    return Environment(
        # a plain str: torch's TorchVersion would make the parent import torch to unpickle it
        Software(torch=str(torch.__version__), python=platform.python_version()),
        Launch(str(ctx.device), ctx.pg_backend, ctx.world_size, req.ring, req.ulysses, dtype=req.dtype, emulated=emulated),
        peer=PeerLayout(f"{req.impl} {facts.version}", req.variant, req.kernel, facts.layout),
    )
