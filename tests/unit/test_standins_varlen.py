"""The flash-attn stand-in's varlen entry points keep flash-attn's contract (v2.7.4 flash_attn_interface.py and
csrc/flash_attn/flash_api.cpp): the argument names ring-flash-attn and yunchang build their calls from, LSE
(H, total_q) float32 with one sequence per cu_seqlens span, causal aligned to the bottom right of each
sequence, the checks the real kernel makes; and their numbers match a plain fp64 attention per sequence."""

from __future__ import annotations

import importlib.util
import inspect
import math
import os

import pytest
import torch

from cpdoctor.cpu_kernels import flash_attn_varlen as fv
from cpdoctor.cpu_kernels import standins

H, D = 4, 32
LENGTHS = (5, 17, 42)  # uneven, none a multiple of another
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def installed():
    was = standins.installed()
    standins.install()
    yield
    if not was:
        standins.uninstall()


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lengths, dtype, seed=0, heads=H):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return tuple(torch.randn(total, heads, D, generator=g).to(dtype) for _ in range(4))


def reference(q, k, v, dout, cu_q, cu_k, causal):
    """fp64 attention of each sequence on its own (bottom-right causal), with gradients: out, lse (H, total_q)."""
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[c:d]) / math.sqrt(D)
        if causal:
            sq, sk = b - a, d - c
            keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
            s = s.masked_fill(~keep, float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[c:d]))
    out = torch.cat(outs)
    out.backward(dout.double())
    return out.detach(), torch.cat(lses, -1).detach(), q.grad, k.grad, v.grad


def rel(a, b):
    return float((a.detach().double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_and_backward_match_fp64_per_sequence(dtype, causal):
    q, k, v, dout = packed(LENGTHS, dtype)
    c = cu(LENGTHS)
    out, lse, s_dmask, rng = fv._flash_attn_varlen_forward(q, k, v, c, c, max(LENGTHS), max(LENGTHS), 0.0, D**-0.5, causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (H, sum(LENGTHS)) and lse.dtype == torch.float32
    assert s_dmask.numel() == 0 and rng.shape == (2,) and rng.dtype == torch.int64
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = fv._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, c, c, max(LENGTHS), max(LENGTHS), 0.0, D**-0.5, causal, -1, -1, 0.0, None, False
    )
    assert softmax_d.shape == (H, sum(LENGTHS) + 128 * len(LENGTHS)) and softmax_d.dtype == torch.float32
    ref = reference(q, k, v, dout, c, c, causal)
    assert rel(lse, ref[1]) < 1e-3
    for got, want in zip((out, dq, dk, dv), (ref[0], ref[2], ref[3], ref[4])):
        assert rel(got, want) < TOL[dtype]


def test_queries_shorter_than_keys_are_causal_from_the_bottom_right():
    """llama3's varlen ring passes each rank's q slice with the longer k prefix it needs (cu_seqlens_k ≠ cu_seqlens_q)."""
    lq, lk = (4, 9), (10, 9)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(sum(lq), H, D, generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(sum(lk), H, D, generator=g).bfloat16() for _ in range(2))
    cq, ck = cu(lq), cu(lk)
    out, lse, _, _ = fv._flash_attn_varlen_forward(q, k, v, cq, ck, max(lq), max(lk), 0.0, D**-0.5, True)
    ref = reference(q, k, v, dout, cq, ck, True)
    assert rel(out, ref[0]) < 2e-2 and rel(lse, ref[1]) < 1e-3


def test_a_row_without_keys_has_zero_output_and_infinite_lse():
    """flash-attn's softmax.h: a row whose sum is 0 gets lse = +inf (and out 0): q longer than k under causal."""
    lq, lk = (6,), (2,)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, H, D, generator=g).bfloat16()
    k, v = (torch.randn(2, H, D, generator=g).bfloat16() for _ in range(2))
    out, lse, _, _ = fv._flash_attn_varlen_forward(q, k, v, cu(lq), cu(lk), 6, 2, 0.0, D**-0.5, True)
    assert torch.isposinf(lse[:, :4]).all() and torch.isfinite(lse[:, 4:]).all()
    assert (out[:4] == 0).all()


def test_autograd_function_matches_the_direct_calls():
    q, k, v, dout = packed(LENGTHS, torch.bfloat16, seed=1)
    c = cu(LENGTHS)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse, _ = fv.flash_attn_varlen_func(*leaves, c, c, max(LENGTHS), max(LENGTHS), causal=True, return_attn_probs=True)
    out.backward(dout)
    ref = reference(q, k, v, dout, c, c, True)
    assert rel(out, ref[0]) < 2e-2 and rel(lse, ref[1]) < 1e-3
    for leaf, want in zip(leaves, ref[2:]):
        assert rel(leaf.grad, want) < 2e-2


def test_packed_varlen_entry_points_equal_the_unpacked_one():
    q, k, v, _ = packed(LENGTHS, torch.bfloat16, seed=2)
    c, m = cu(LENGTHS), max(LENGTHS)
    plain = fv.flash_attn_varlen_func(q, k, v, c, c, m, m, causal=True)
    assert torch.equal(fv.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), c, m, causal=True), plain)
    assert torch.equal(fv.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), c, c, m, m, causal=True), plain)


def test_gqa_heads_of_k_divide_heads_of_q():
    q, _, _, dout = packed(LENGTHS, torch.bfloat16, seed=5)
    _, k, v, _ = packed(LENGTHS, torch.bfloat16, seed=6, heads=2)
    c = cu(LENGTHS)
    out, lse, _, _ = fv._flash_attn_varlen_forward(q, k, v, c, c, max(LENGTHS), max(LENGTHS), 0.0, D**-0.5, False)
    rep = lambda x: x.repeat_interleave(2, dim=1)  # noqa: E731
    assert rel(out, reference(q, rep(k), rep(v), dout, c, c, False)[0]) < 2e-2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda a: {**a, "q": a["q"].float(), "k": a["k"].float(), "v": a["v"].float()},
            "FlashAttention only support fp16 and bf16 data type",
        ),
        (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "cu_seqlens_q must have dtype int32"),
        (lambda a: {**a, "q": a["q"][None]}, "q must have shape (total_q, num_heads, head_size)"),
        (lambda a: {**a, "k": a["k"][:, :3], "v": a["v"][:, :3]}, "Number of heads in key/value must divide number of heads in query"),
    ],
)
def test_the_real_kernels_checks(change, message):
    q, k, v, _ = packed(LENGTHS, torch.bfloat16)
    c = cu(LENGTHS)
    args = dict(
        q=q, k=k, v=v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=42, max_seqlen_k=42, dropout_p=0.0, softmax_scale=D**-0.5, causal=False
    )
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fv._flash_attn_varlen_forward(**change(args))


def test_argument_names_are_flash_attns():
    """ring-flash-attn and yunchang build their calls from `inspect.getfullargspec` of these functions, so the names
    (and their order) are the contract: flash-attn v2.7.4's."""
    assert inspect.getfullargspec(fv._flash_attn_varlen_forward).args == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
        "window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax", "block_table", "leftpad_k", "seqused_k",
        "zero_tensors",
    ]  # fmt: skip
    assert inspect.getfullargspec(fv._flash_attn_varlen_backward).args == [
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
        "rng_state", "zero_tensors",
    ]  # fmt: skip


def test_the_interface_reexports_what_the_peers_import():
    """ring-flash-attn 0.1.8 and yunchang 0.6.4 import these names from flash_attn.flash_attn_interface."""
    path = os.path.join(standins.flash_attn_path(), "flash_attn", "flash_attn_interface.py")
    spec = importlib.util.spec_from_file_location("_cpdoctor_test_varlen_interface", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward", "_flash_attn_varlen_backward", "flash_attn_func",
                 "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func"):  # fmt: skip
        assert callable(getattr(module, name)), name
    q, k, v, _ = (x.view(1, sum(LENGTHS), H, D) for x in packed(LENGTHS, torch.bfloat16, seed=7))
    assert torch.equal(module.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2)), module.flash_attn_func(q, k, v))


def test_inert_without_emulation():
    q, k, v, _ = packed(LENGTHS, torch.bfloat16)
    c = cu(LENGTHS)
    standins.uninstall()
    try:
        with pytest.raises(RuntimeError, match="must be on CUDA"):
            fv._flash_attn_varlen_forward(q, k, v, c, c, 42, 42, 0.0, D**-0.5, False)
    finally:
        standins.install()
