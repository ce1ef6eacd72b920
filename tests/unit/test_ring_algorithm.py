"""The ring algorithm of cpdoctor.fix.ring and the fixed Ulysses of cpdoctor.fix.ulysses, on W simulated ranks
in one process (no process group).

Each rank is a thread running `ring_forward` / `ring_backward` with an in-memory communicator that has
`GroupComm`'s interface (barriers around a shared slot list), and the CPU block kernel. A hop (`shift`) moves
its data only when it is waited for, reading the sent buffer and writing the receiving one then, as a real
transfer in flight may: a ring that wrote a buffer it was still sending, or read one it was still receiving
into, gets wrong numbers here. Every rank's out, lse, dQ, dK, dV must match an fp64 full-sequence SDPA
reference at W = 2 .. 8, without a mask and with a boolean key mask (rows with no key in a chunk), an additive
one that empties a whole chunk (skipped) and a 4-D mask with a query dimension (sliced, not streamed). A dK/dV
accumulator sent the wrong way round (to rank r+1, like diffusers 0.42.1) is tried too: exact at W = 2, wrong
at W = 3, so these tests can fail. The fixed Ulysses (all-to-all, one fused block, all-to-all back) must match the same reference, out,
lse and gradients through autograd, with and without a key mask of the local length.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cpdoctor.fix import block_kernels, ring, ulysses

B, H, D, S_LOCAL = 2, 2, 16, 24
TOL = 1e-5


class _Hub:
    """What the simulated ranks share: a barrier and one slot per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list[Any] = [None] * world


class _Hop:
    """A shift posted and not yet waited for."""

    def __init__(self, t: torch.Tensor, offset: int, into: torch.Tensor | None) -> None:
        self.t, self.offset, self.into = t, offset, into


class ThreadComm:
    """`GroupComm`'s interface over threads: every call is a collective all W threads make in the same order.
    Collectives complete at once; a hop moves its data when waited for. `calls` counts them per kind; `sent`
    records the storage of every buffer a hop sent (how many chunk buffers the ring keeps)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.calls: dict[str, int] = {}
        self.sent: list[int] = []

    def _post(self, kind: str, slot: int, value: torch.Tensor) -> list[torch.Tensor]:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.hub.barrier.wait()  # nobody still reading the previous collective's slots
        self.hub.slots[slot] = value
        self.hub.barrier.wait()
        return list(self.hub.slots)

    def all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._post("all_gather", self.rank, flat.clone()))

    def shift(self, t: torch.Tensor, offset: int, into: torch.Tensor | None = None) -> torch.Tensor | _Hop:
        if self.world == 1:  # like GroupComm: nothing is communicated
            return t
        assert into is None or (into.shape == t.shape and into.untyped_storage().data_ptr() != t.untyped_storage().data_ptr())
        self.sent.append(t.untyped_storage().data_ptr())
        return _Hop(t, offset, into)

    def all_to_all(self, flat: torch.Tensor) -> torch.Tensor:
        parts = self._post("all_to_all", self.rank, flat.clone())
        return torch.cat([p.view(self.world, -1)[self.rank] for p in parts])

    def wait(self, t: torch.Tensor | _Hop) -> torch.Tensor:
        if not isinstance(t, _Hop):
            return t
        got = self._post("shift", (self.rank + t.offset) % self.world, t.t.clone())[self.rank]
        received = torch.empty_like(got) if t.into is None else t.into
        return received.copy_(got)


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
    """Full-sequence q, k, v, dout (model layout) and a mask: `keep` (B, S) True = attend for a key mask, or
    `keep_rows` (B, 1, S, S) for a mask with a query dimension; None without a mask."""
    g = torch.Generator().manual_seed(seed)
    s = world * S_LOCAL
    q, k, v, dout = (torch.randn(B, s, heads, D, generator=g) for _ in range(4))
    keep = keep_rows = None
    if mask == "pad":  # batch 0: the last chunk and 5 more keys masked (a chunk emptied for one batch row)
        keep = torch.ones(B, s, dtype=torch.bool)
        keep[0, -S_LOCAL - 5 :] = False
        keep[1, -3:] = False
    elif mask == "whole_chunk":  # the last chunk masked for everyone: skipped
        keep = torch.ones(B, s, dtype=torch.bool)
        keep[:, -S_LOCAL:] = False
    elif mask == "rows":  # random per query row, every row keeps its own key; some rows lose a whole chunk
        keep_rows = (torch.rand(B, 1, s, s, generator=g) < 0.6) | torch.eye(s, dtype=torch.bool)
        keep_rows[0, :, : S_LOCAL // 2, S_LOCAL:] = False
    return {
        "q": q,
        "k": k,
        "v": v,
        "dout": dout,
        "keep": keep,
        "keep_rows": keep_rows,
        "mask_form": "additive" if mask == "whole_chunk" else "bool",
    }


def reference(inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """fp64 SDPA over the whole sequence: out, lse (B, S, H), dq, dk, dv."""
    q, k, v = (inp[n].double().transpose(1, 2).requires_grad_(True) for n in ("q", "k", "v"))
    keep = inp["keep"][:, None, None] if inp["keep"] is not None else inp["keep_rows"]
    bias = None
    if keep is not None:
        bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out.backward(inp["dout"].double().transpose(1, 2))
    scores = q.detach() @ k.detach().transpose(-1, -2) * D**-0.5
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return {"out": t(out.detach()), "lse": t(lse), "dq": t(q.grad), "dk": t(k.grad), "dv": t(v.grad)}


def rank_mask(inp: dict[str, Any], local: slice) -> torch.Tensor | None:
    """What rank `local` is handed: its keys' mask only (the ring streams the rest with the keys), boolean
    (B, S_local) or additive (B, 1, 1, S_local) (both reach the ring in diffusers); or its query rows of a
    mask over every key."""
    if inp["keep_rows"] is not None:
        return inp["keep_rows"][:, :, local]
    keep = inp["keep"]
    if keep is None:
        return None
    if inp["mask_form"] == "additive":
        return torch.zeros(B, 1, 1, S_LOCAL).masked_fill(~keep[:, local][:, None, None], float("-inf"))
    return keep[:, local]


def run_ring(world: int, inp: dict[str, Any], passes: list[slice] | None = None) -> tuple[dict[str, torch.Tensor], list[ThreadComm]]:
    """Every rank's forward and backward; the shards concatenated, and every rank's communicator after the
    forward (`fwd_sent`: the buffers its forward sent) and the backward. With `passes`, the ring runs once per
    group of heads (`forward_in_passes` / `backward_in_passes`)."""
    kernel = block_kernels.CpuFlashKernel()
    scale = D**-0.5

    def rank_fn(comm: ThreadComm) -> tuple[dict[str, torch.Tensor], ThreadComm]:
        local = slice(comm.rank * S_LOCAL, (comm.rank + 1) * S_LOCAL)
        q, k, v, dout = (inp[n][:, local].contiguous() for n in ("q", "k", "v", "dout"))
        masks = ring.ChunkMasks(rank_mask(inp, local), S_LOCAL, comm)
        setup = ring.RingSetup(masks, kernel, comm, scale, torch.float32)
        if passes is None:
            out, lse = ring.ring_forward(q, k, v, setup)
            comm.fwd_sent = list(comm.sent)
            dq, dk, dv = ring.ring_backward(dout, q, k, v, out, lse, setup)
        else:
            out, lse = ring.forward_in_passes(passes, q, k, v, setup)
            comm.fwd_sent = list(comm.sent)
            dq, dk, dv = ring.backward_in_passes(passes, dout, q, k, v, out, lse, setup, torch.float32)
        return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, comm

    per_rank = run_ranks(world, rank_fn)
    got = {n: torch.cat([r[0][n] for r in per_rank], dim=1) for n in per_rank[0][0]}
    return got, [r[1] for r in per_rank]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).norm() / ref.norm())


def errors(world: int, mask: str | None) -> dict[str, float]:
    inp = make_inputs(world, mask, seed=world)
    got, _ = run_ring(world, inp)
    ref = reference(inp)
    errs = {n: rel_err(got[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
    finite = torch.isfinite(ref["lse"])  # rows of batch 0 have no key in the masked chunk: lse −inf there too
    errs["lse"] = rel_err(got["lse"][finite], ref["lse"][finite])
    return errs


MASKS = [None, "pad", "whole_chunk", "rows"]


@pytest.mark.parametrize(
    "world,mask",
    [(w, m) for w in range(1, 9) for m in MASKS if (w, m) != (1, "whole_chunk")],  # one chunk, all masked: no reference
)
def test_ring_is_exact(world: int, mask: str | None) -> None:
    errs = errors(world, mask)
    assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("mask", [None, "pad"])
@pytest.mark.parametrize("world", [1, 2, 5])
def test_ring_streams_hop_by_hop(world: int, mask: str | None) -> None:
    """Nothing but hops (the key mask travels inside the K/V buffer): W−1 in forward, W−1 of K/V and W of the
    dK/dV accumulator in backward, on every rank; two K/V buffers whatever W is, none at all with one rank."""
    inp = make_inputs(world, mask)
    _, comms = run_ring(world, inp)
    hops = {"shift": 3 * world - 2} if world > 1 else {}
    assert [c.calls for c in comms] == [hops] * world
    for c in comms:
        assert len(set(c.fwd_sent)) == min(world - 1, 2)
        assert len(set(c.sent[len(c.fwd_sent) :])) == (min(2 * world - 1, 4) if world > 1 else 0)  # backward: 2 K/V + 2 dK/dV buffers


def test_wrong_direction_is_caught_at_three_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dK/dV accumulator sent to rank r+1 (diffusers 0.42.1's `next_ranks = list(range(1, W)) + [0]`)
    reaches rank r+1, which holds chunk j+2 next, not chunk j: right only when W = 2."""
    monkeypatch.setattr(ring.DkvRing, "toward", +1)
    at2 = errors(2, None)
    assert max(at2.values()) < TOL, at2
    at3 = errors(3, None)
    assert at3["out"] < TOL and at3["dq"] < TOL, at3  # forward and dQ never travel
    assert at3["dk"] > 0.1 and at3["dv"] > 0.1, at3


@pytest.mark.parametrize("mask", [None, "pad", "rows"])
def test_passes_over_heads_are_bit_identical(mask: str | None) -> None:
    """The ring run head group by head group gives exactly the one-pass results (heads are independent), with
    W−1 forward hops and 2W−1 backward hops per pass."""
    world, heads = 3, 4
    inp = make_inputs(world, mask, seed=7, heads=heads)
    whole, _ = run_ring(world, inp)
    passes = [slice(0, 2), slice(2, 4)]
    split, comms = run_ring(world, inp, passes)
    for name in whole:
        assert torch.equal(whole[name], split[name]), name
    assert [c.calls for c in comms] == [{"shift": len(passes) * (3 * world - 2)}] * world
    ref = reference(inp)
    assert rel_err(split["dk"], ref["dk"]) < TOL


class _Place:
    """A ring position (what `head_passes` reads of a communicator)."""

    def __init__(self, world: int) -> None:
        self.rank, self.world = 0, world


@pytest.mark.parametrize(
    "heads,seq,dim,dtype,world,slots,mask_heads,expected",
    [
        (8, 4096, 64, torch.bfloat16, 4, 1, 1, 4),  # the benchmark's shape on a CPU rank: quarters
        (8, 2048, 64, torch.bfloat16, 8, 1, 1, 4),  # 1 MiB of K/V per pass: still worth a pass
        (8, 1024, 64, torch.bfloat16, 8, 1, 1, 2),  # halves keep ≥ 1 MiB per pass, quarters would not
        (6, 4096, 64, torch.float32, 4, 1, 1, 3),  # the most passes that divide the heads
        (24, 1152, 128, torch.bfloat16, 4, 132, 1, 1),  # FLUX at 1024² on a 132-SM GPU: a pass must fill it
        (40, 18944, 128, torch.bfloat16, 4, 132, 1, 4),  # a long video sequence on the same GPU
        (8, 4096, 64, torch.bfloat16, 1, 1, 1, 1),  # a ring of one: nothing in flight
        (8, 4096, 64, torch.bfloat16, 4, 1, 8, 1),  # a per-head mask stays whole
        (8, 24, 16, torch.float32, 4, 1, 1, 1),  # tiny: hops' latency, not memory
    ],
)
def test_head_passes_split_only_where_memory_is_worth_it(
    monkeypatch: pytest.MonkeyPatch,
    heads: int,
    seq: int,
    dim: int,
    dtype: torch.dtype,
    world: int,
    slots: int,
    mask_heads: int,
    expected: int,
) -> None:
    monkeypatch.setattr(ring, "_parallel_slots", lambda device: slots)
    q = torch.empty(1, seq, heads, dim, dtype=dtype, device="meta")
    mask = torch.ones(1, mask_heads, 1, seq, dtype=torch.bool) if mask_heads > 1 else None
    masks = ring.ChunkMasks(mask, seq, _Place(world))
    passes = ring.head_passes(q, q, masks, _Place(world))
    assert len(passes) == expected
    covered = [h for p in passes for h in range(heads)[p]]
    assert covered == list(range(heads))


def test_packing_keeps_dtypes_and_alignment() -> None:
    """K, V (bf16) and an fp32 / bool mask share one byte buffer: every part comes back bit for bit, aligned."""
    parts = [torch.randn(2, 3, 5, 7).bfloat16(), torch.randn(2, 3, 5, 7).bfloat16(), torch.randn(2, 1, 1, 5), torch.rand(2, 1, 1, 5) < 0.5]
    packing = ring.Packing([(t.shape, t.dtype) for t in parts])
    back = packing.unpack(packing.pack(parts, torch.device("cpu")))
    for a, b in zip(parts, back):
        assert b.dtype == a.dtype and torch.equal(a, b) and b.is_contiguous() and b.data_ptr() % ring.Packing.ALIGN == 0


# --------------------------------------------------------------------------------------------------------
# The fixed Ulysses
# --------------------------------------------------------------------------------------------------------


def run_ulysses(world: int, inp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every rank's `_FixedUlysses` forward (out, lse) and autograd backward; the shards concatenated."""
    kernel = block_kernels.CpuFlashKernel()

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
    from cpdoctor.cpu_kernels import cpu_backend

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
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix.comm import GroupComm

    monkeypatch.setattr(ulysses.UlyssesAttention, "original", _RecordingOriginal)
    monkeypatch.setattr(GroupComm, "ulysses", classmethod(lambda cls, pc: None))  # no process group in a unit test
    _RecordingOriginal.calls = []
    q = torch.randn(1, 4, 2, 8)
    out = ulysses.UlyssesAttention.apply(q, q, q, None, 0.0, False, None, False, False, cpu_backend.forward_op, None, None)
    assert _RecordingOriginal.calls == []
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, q, q))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)


def test_a_key_mask_over_every_key_of_the_ring_is_refused_not_sliced():
    """A key mask the plan left whole (diffusers 0.37.0's Qwen-Image builds [text mask, image ones] over the full
    sequence while each rank holds [its text, its image]): slicing it rank by rank would mask the wrong keys
    silently (out rel err 0.0037 measured), so the ring refuses it; a ring of one takes it, and a mask with a query
    dimension over every key is still sliced (test_ring_is_exact's "rows")."""
    whole = torch.ones(1, 2 * S_LOCAL, dtype=torch.bool)
    with pytest.raises(ValueError, match="did not split it with the keys"):
        ring.ChunkMasks(whole, S_LOCAL, ThreadComm(_Hub(2), 0))
    assert ring.ChunkMasks(whole[:, :S_LOCAL], S_LOCAL, ThreadComm(_Hub(1), 0)).present
