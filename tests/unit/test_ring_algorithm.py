"""The ring algorithm of cpdoctor.fix.ring and the fixed Ulysses of cpdoctor.fix.ulysses, on W simulated ranks
in one process (no process group).

Each rank is a thread running `ring_forward` / `ring_backward` with an in-memory communicator that has
`GroupComm`'s interface (barriers around a shared slot list), and the CPU block kernel. Every rank's out, lse,
dQ, dK, dV must match an fp64 full-sequence SDPA reference, for both dK/dV strategies, at W = 2, 3, 4, with
and without key masks (one of which empties a whole chunk). A dK/dV accumulator sent the wrong way round
(to rank r+1, like diffusers 0.42.1) is written here too: exact at W = 2, wrong at W = 3, so these tests can
fail. The fixed Ulysses (all-to-all, one fused block, all-to-all back) must match the same reference, out,
lse and gradients through autograd, with and without a key mask of the local length.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpdoctor.fix import kernels, ring, ulysses

B, H, D, S_LOCAL = 2, 2, 16, 24
TOL = 1e-5


class _Hub:
    """What the simulated ranks share: a barrier and one slot per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list[Any] = [None] * world


class ThreadComm:
    """`GroupComm`'s interface over threads: every call is a collective all W threads make in the same order.
    Transfers complete at once (`wait` is the identity); `calls` counts them per kind."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.calls: dict[str, int] = {}

    def _post(self, kind: str, slot: int, value: torch.Tensor) -> list[torch.Tensor]:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.hub.barrier.wait()  # nobody still reading the previous collective's slots
        self.hub.slots[slot] = value
        self.hub.barrier.wait()
        return list(self.hub.slots)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._post("all_gather", self.rank, flat.clone()))

    def shift(self, t: torch.Tensor, offset: int) -> torch.Tensor:
        return self._post("shift", (self.rank + offset) % self.world, t.clone())[self.rank]

    def all_to_all(self, flat: torch.Tensor) -> torch.Tensor:
        parts = self._post("all_to_all", self.rank, flat.clone())
        return torch.cat([p.view(self.world, -1)[self.rank] for p in parts])

    def reduce_scatter(self, flat: torch.Tensor) -> torch.Tensor:
        parts = self._post("reduce_scatter", self.rank, flat.clone())
        return torch.stack([p.view(self.world, -1)[self.rank] for p in parts]).sum(0)

    def wait(self, t: torch.Tensor) -> torch.Tensor:
        return t


def run_ranks(world: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """fn(comm) on `world` threads, one per rank; their results in rank order (the first error re-raised)."""
    hub = _Hub(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(hub, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results


def make_inputs(world: int, mask: str | None, seed: int = 0, heads: int = H) -> dict[str, Any]:
    """Full-sequence q, k, v, dout (model layout) and a key mask (B, S) True = attend, or None."""
    g = torch.Generator().manual_seed(seed)
    s = world * S_LOCAL
    q, k, v, dout = (torch.randn(B, s, heads, D, generator=g) for _ in range(4))
    keep = None
    if mask == "pad":  # batch 0: the last chunk and 5 more keys masked (a chunk emptied for one batch row)
        keep = torch.ones(B, s, dtype=torch.bool)
        keep[0, -S_LOCAL - 5 :] = False
        keep[1, -3:] = False
    elif mask == "whole_chunk":  # the last chunk masked for everyone: skipped
        keep = torch.ones(B, s, dtype=torch.bool)
        keep[:, -S_LOCAL:] = False
    return {"q": q, "k": k, "v": v, "dout": dout, "keep": keep, "mask_form": "additive" if mask == "whole_chunk" else "bool"}


def reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """fp64 SDPA over the whole sequence: out, lse (B, S, H), dq, dk, dv."""
    q, k, v = (inp[n].double().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    keep = inp["keep"]
    bias = None
    if keep is not None:
        bias = torch.zeros(B, 1, 1, keep.shape[1], dtype=torch.float64).masked_fill(~keep[:, None, None], float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out.backward(inp["dout"].double().transpose(1, 2))
    scores = q.detach() @ k.detach().transpose(-1, -2) * D**-0.5
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return {"out": t(out.detach()), "lse": t(lse), "dq": t(q.grad), "dk": t(k.grad), "dv": t(v.grad)}


def run_ring(world: int, inp: dict[str, Any], dkv: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, int]]]:
    """Every rank's forward and backward; the shards concatenated, and every rank's collective counts."""
    kernel = kernels.CpuFlashKernel()
    scale = D**-0.5
    mask_form = inp["mask_form"]

    def rank_fn(comm: ThreadComm) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        local = slice(comm.rank * S_LOCAL, (comm.rank + 1) * S_LOCAL)
        q, k, v, dout = (inp[n][:, local].contiguous() for n in ("q", "k", "v", "dout"))
        keep = inp["keep"]
        attn_mask = None
        if keep is not None:
            # each rank holds only its keys' mask (the ring gathers the rest): boolean (B, S_local) for "pad",
            # additive (B, 1, 1, S_local) for "whole_chunk" (both forms reach the ring in diffusers)
            attn_mask = keep[:, local]
            if mask_form == "additive":
                attn_mask = torch.zeros(B, 1, 1, S_LOCAL).masked_fill(~attn_mask[:, None, None], float("-inf"))
        masks = ring.ChunkMasks(attn_mask, S_LOCAL, comm)
        out, lse = ring.ring_forward(q, k, v, masks, kernel, comm, scale, torch.float32)
        dq, dk, dv = ring.ring_backward(dout, q, k, v, out, lse, masks, kernel, comm, scale, torch.float32, dkv)
        return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, comm.calls

    per_rank = run_ranks(world, rank_fn)
    got = {n: torch.cat([r[0][n] for r in per_rank], dim=1) for n in per_rank[0][0]}
    return got, [r[1] for r in per_rank]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def errors(world: int, mask: str | None, dkv: Any) -> dict[str, float]:
    inp = make_inputs(world, mask, seed=world)
    got, _ = run_ring(world, inp, dkv)
    ref = reference(inp)
    errs = {n: rel_err(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    finite = torch.isfinite(ref["lse"])  # rows of batch 0 have no key in the masked chunk: lse −inf there too
    errs["lse"] = rel_err(got["lse"][finite], ref["lse"][finite])
    return errs


@pytest.mark.parametrize("dkv", list(ring.DkvStrategy))
@pytest.mark.parametrize("mask", [None, "pad", "whole_chunk"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_is_exact(world: int, mask: str | None, dkv: ring.DkvStrategy) -> None:
    errs = errors(world, mask, dkv)
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("world", [1, 3])
def test_collectives_per_strategy(world: int) -> None:
    """Forward: one all-gather of K/V. Backward: one more, then W hops of the accumulator (the ring) or one
    reduce-scatter, on every rank: nothing else is communicated."""
    inp = make_inputs(world, None)
    _, calls = run_ring(world, inp, ring.DkvStrategy.RING)
    assert calls == [{"all_gather": 2, "shift": world}] * world or world == 1
    _, calls = run_ring(world, inp, ring.DkvStrategy.REDUCE_SCATTER)
    assert calls == [{"all_gather": 2, "reduce_scatter": 1}] * world or world == 1


class AccumulatorToNextRank:
    """The wrong direction (diffusers 0.42.1's `next_ranks = list(range(1, W)) + [0]`): chunk j's
    accumulator goes to rank r+1, which holds chunk j+2 next, not chunk j+1. Right only when W = 2."""

    def __init__(self, comm: ThreadComm, kv: ring.PackedKV, dtype: torch.dtype, device: torch.device) -> None:
        self.comm, self.kv, self.dtype, self.device = comm, kv, dtype, device
        self.pending: torch.Tensor | None = None

    def add(self, i: int, j: int, dk: torch.Tensor | None, dv: torch.Tensor | None) -> None:
        if i == 0:
            acc = torch.empty(self.kv.numel, dtype=self.dtype, device=self.device)
            self.kv.store(acc, dk, dv)
        else:
            acc = self.comm.wait(self.pending)
            self.kv.accumulate(acc, dk, dv)
        self.pending = self.comm.shift(acc, +1)

    def result(self) -> torch.Tensor:
        return self.comm.wait(self.pending)


def test_wrong_direction_is_caught_at_three_ranks() -> None:
    at2 = errors(2, None, AccumulatorToNextRank)
    assert max(at2.values()) < TOL, at2
    at3 = errors(3, None, AccumulatorToNextRank)
    assert at3["out"] < TOL and at3["dq"] < TOL, at3  # forward and dQ never travel
    assert at3["dk"] > 0.1 and at3["dv"] > 0.1, at3


# --------------------------------------------------------------------------------------------------------
# The fixed Ulysses
# --------------------------------------------------------------------------------------------------------


def run_ulysses(world: int, inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every rank's `_FixedUlysses` forward (out, lse) and autograd backward; the shards concatenated."""
    kernel = kernels.CpuFlashKernel()

    def rank_fn(comm: ThreadComm) -> dict[str, torch.Tensor]:
        local = slice(comm.rank * S_LOCAL, (comm.rank + 1) * S_LOCAL)
        q, k, v = (inp[n][:, local].clone().requires_grad_(True) for n in ("q", "k", "v"))
        keep = inp["keep"]
        attn_mask = None if keep is None else keep[:, local]  # this rank's keys only: Ulysses gathers the rest
        out, lse = ulysses._FixedUlysses.apply(q, k, v, attn_mask, kernel, D**-0.5, True, comm)
        out.backward(inp["dout"][:, local])
        return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}

    per_rank = run_ranks(world, rank_fn)
    return {n: torch.cat([r[n] for r in per_rank], dim=1) for n in per_rank[0]}


@pytest.mark.parametrize("mask", [None, "pad"])
@pytest.mark.parametrize("world", [2, 4])
def test_fixed_ulysses_is_exact(world: int, mask: str | None) -> None:
    inp = make_inputs(world, mask, seed=10 + world, heads=4)
    got, ref = run_ulysses(world, inp), reference(inp)
    errs = {n: rel_err(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    finite = torch.isfinite(ref["lse"])
    errs["lse"] = rel_err(got["lse"][finite], ref["lse"][finite])
    assert max(errs.values()) < TOL, errs


def test_all_to_all_round_trip_moves_heads_and_sequence() -> None:
    """heads_to_sequence gives rank r heads [r·H/W, (r+1)·H/W) of the whole sequence, in rank order;
    sequence_to_heads undoes it (also for an LSE with a trailing 1)."""
    world, heads = 2, 4
    for last in (3, 1):
        full = torch.arange(B * world * S_LOCAL * heads * last, dtype=torch.float32).view(B, world * S_LOCAL, heads, last)

        def rank_fn(comm: ThreadComm, full: torch.Tensor = full) -> tuple[torch.Tensor, torch.Tensor]:
            local = full[:, comm.rank * S_LOCAL : (comm.rank + 1) * S_LOCAL]
            spread = ulysses.heads_to_sequence(local, comm)
            return spread, ulysses.sequence_to_heads(spread, comm)

        for rank, (spread, back) in enumerate(run_ranks(world, rank_fn)):
            h = heads // world
            assert torch.equal(spread, full[:, :, rank * h : (rank + 1) * h])
            assert torch.equal(back, full[:, rank * S_LOCAL : (rank + 1) * S_LOCAL])


class _RecordingOriginal:
    """Stands where diffusers' TemplatedUlyssesAttention would: records what was handed to it."""

    calls: list[tuple] = []

    @classmethod
    def apply(cls, *args: Any) -> str:
        cls.calls.append(args)
        return "original"


@pytest.mark.parametrize("why", ["no fused kernel", "dropout"])
def test_fixed_ulysses_steps_aside(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Without a fused block kernel (exact fp32 math at the full length would be O(S²)) or with dropout, the
    original class runs, with exactly the arguments diffusers passed."""
    from cpdoctor.kernels import cpu_backend

    monkeypatch.setattr(ulysses.UlyssesAttention, "original", _RecordingOriginal)
    _RecordingOriginal.calls = []
    q = torch.zeros(1, 4, 2, 8)
    op = (lambda *a, **k: None) if why == "no fused kernel" else cpu_backend.forward_op
    dropout = 0.1 if why == "dropout" else 0.0
    args = (q, q, q, None, dropout, False, None, False, False, op, None, None)
    assert ulysses.UlyssesAttention.apply(*args) == "original"
    assert len(_RecordingOriginal.calls) == 1 and _RecordingOriginal.calls[0][4] == dropout


def test_fixed_ulysses_runs_for_a_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend with a fused block kernel (cpdoctor_cpu here) goes through the fixed path, never the original."""
    from cpdoctor.fix.comm import GroupComm
    from cpdoctor.kernels import cpu_backend

    monkeypatch.setattr(ulysses.UlyssesAttention, "original", _RecordingOriginal)
    monkeypatch.setattr(GroupComm, "ulysses", classmethod(lambda cls, pc: None))  # no process group in a unit test
    _RecordingOriginal.calls = []
    q = torch.randn(1, 4, 2, 8)
    out = ulysses.UlyssesAttention.apply(q, q, q, None, 0.0, False, None, False, False, cpu_backend.forward_op, None, None)
    assert _RecordingOriginal.calls == []
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, q, q))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)
