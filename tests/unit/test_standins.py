"""The CUDA kernels' CPU stand-ins keep the real contract: outputs, LSE and RNG tensors shaped as torch's meta
registrations say, numerics of exact attention, the dtypes and shapes the real kernels refuse, the RNG advance."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest
import torch

from cpdoctor.cpu_kernels import standins

B, H, S, D = 2, 4, 40, 64  # S not a multiple of 32: the efficient kernel's LSE padding shows


@pytest.fixture(scope="module", autouse=True)
def installed():
    was = standins.installed()
    standins.install()
    yield
    if not was:
        standins.uninstall()


def qkv(dtype, layout="bhsd", seed=0, heads_kv=H):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    kv_shape = (B, heads_kv, S, D) if layout == "bhsd" else (B, S, heads_kv, D)
    return (
        torch.randn(shape, generator=g).to(dtype),
        torch.randn(kv_shape, generator=g).to(dtype),
        torch.randn(kv_shape, generator=g).to(dtype),
    )


def reference(q, k, v, bias=None):
    """fp64 SDPA (math) with gradients for a random upstream gradient; bhsd."""
    q, k, v = (x.double().requires_grad_(True) for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out.backward(dout)
    lse = torch.logsumexp((q @ k.transpose(-1, -2)) / D**0.5 + (0 if bias is None else bias.double()), dim=-1)
    return out.detach(), lse.detach(), dout, q.grad, k.grad, v.grad


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def shapes(result):
    return [None if not isinstance(x, torch.Tensor) else (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in result]


def meta(op, *args, **kwargs):
    to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    return op(*(to_meta(a) for a in args), **{k: to_meta(v) for k, v in kwargs.items()})


def same_contract(real, fake):
    assert len(real) == len(fake)
    for r, f in zip(real, fake, strict=True):
        if isinstance(f, torch.Tensor):
            assert isinstance(r, torch.Tensor) and tuple(r.shape) == tuple(f.shape) and r.dtype == f.dtype, (shapes(real), shapes(fake))
        elif f is None:
            assert r is None
        else:
            assert r == f


# ---- aten flash --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_forward_backward_contract_and_numerics(dtype):
    q, k, v = qkv(dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention
    res = op(q, k, v, 0.0, False, False, scale=None)
    same_contract(res, meta(op, q, k, v, 0.0, False, False, scale=None))
    out, lse = res[0], res[1]
    ref_out, ref_lse, dout, dq, dk, dv = reference(q, k, v)
    assert rel(out, ref_out) < tol(dtype) and rel(lse, ref_lse) < 1e-3
    bop = torch.ops.aten._scaled_dot_product_flash_attention_backward
    args = (dout.to(dtype), q, k, v, out, lse, res[2], res[3], res[4], res[5], 0.0, False, res[6], res[7])
    grads = bop(*args, scale=None)
    same_contract(grads, meta(bop, *args, scale=None))
    for g, r in zip(grads, (dq, dk, dv), strict=True):
        assert rel(g, r) < tol(dtype)


def test_flash_refuses_fp32_and_bad_heads():
    q, k, v = qkv(torch.float32)
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    q, k, v = qkv(torch.bfloat16)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
    # K/V handed to the backward in (B, S, H, D) while the query is (B, H, S, D): what a double transpose does
    with pytest.raises(RuntimeError, match="Number of heads in key/value must divide number of heads in query"):
        torch.ops.aten._scaled_dot_product_flash_attention_backward(
            res[0],
            q,
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
            res[0],
            res[1],
            None,
            None,
            S,
            S,
            0.0,
            False,
            res[6],
            res[7],
        )


def test_flash_gqa_accepted():
    q, k, v = qkv(torch.bfloat16, heads_kv=2)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
    ref = reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))[0]
    assert rel(out, ref) < 2e-2


def test_flash_dropout_advances_rng_deterministically():
    q, k, v = qkv(torch.bfloat16)
    op = torch.ops.aten._scaled_dot_product_flash_attention
    state = torch.get_rng_state()
    op(q, k, v, 0.0)
    assert torch.equal(state, torch.get_rng_state()), "dropout 0 must not touch the generator"
    a = op(q, k, v, 0.5)
    after = torch.get_rng_state()
    assert not torch.equal(state, after), "dropout > 0 advances the generator"
    torch.set_rng_state(state)
    b = op(q, k, v, 0.5)
    assert torch.equal(after, torch.get_rng_state()) and torch.equal(a[0], b[0]) and torch.equal(a[6], b[6])
    c = op(q, k, v, 1e-30)  # keeps every element (uint8 threshold 255), as on the GPU, and still advances
    assert not torch.equal(after, torch.get_rng_state())
    assert rel(c[0], op(q, k, v, 0.0)[0]) == 0.0
    assert rel(a[0], c[0]) > 0.1
    # the backward replays the forward's mask from the returned seed/offset
    dout = torch.randn_like(q)
    g1 = torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, a[0], a[1], None, None, S, S, 0.5, False, a[6], a[7])
    g2 = torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, a[0], a[1], None, None, S, S, 0.5, False, a[6], a[7])
    assert all(torch.equal(x, y) for x, y in zip(g1, g2, strict=True))


# ---- cuDNN -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True])
def test_cudnn_contract_and_numerics(with_mask):
    dtype = torch.bfloat16
    q, k, v = qkv(dtype)
    bias = None
    if with_mask:
        keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
        keep[..., -3:] = False
        bias = keep
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    res = op(q, k, v, bias, True, 0.0, False, False, scale=None)
    same_contract(res, meta(op, q, k, v, bias, True, 0.0, False, False, scale=None))
    add = None if bias is None else torch.zeros(bias.shape).masked_fill(~bias, float("-inf"))
    ref_out, ref_lse, dout, dq, dk, dv = reference(q, k, v, add)
    assert rel(res[0], ref_out) < tol(dtype) and rel(res[1].squeeze(-1), ref_lse) < 1e-3
    bop = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    args = (dout.to(dtype), q, k, v, res[0], res[1], res[6], res[7], bias, res[2], res[3], res[4], res[5], 0.0, False)
    grads = bop(*args, scale=None)
    same_contract(grads, meta(bop, *args, scale=None))
    for g, r in zip(grads, (dq, dk, dv), strict=True):
        assert rel(g, r) < tol(dtype)


def test_cudnn_without_lse_and_refusals():
    q, k, v = qkv(torch.bfloat16)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)
    assert res[1] is None, "compute_log_sumexp=False: no LSE, which a backward then lacks"
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        torch.ops.aten._scaled_dot_product_cudnn_attention(*qkv(torch.float32), None, True)
    with pytest.raises(RuntimeError, match="GQA"):
        torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            res[0],
            q,
            k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(),
            res[0],
            torch.zeros(B, H, S, 1),
            res[6],
            res[7],
            None,
            None,
            None,
            S,
            S,
            0.0,
            False,
        )


# ---- memory-efficient --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efficient_contract_lse_padding_and_numerics(dtype):
    q, k, v = qkv(dtype)
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    res = op(q, k, v, None, True, 0.0, False, scale=None)
    same_contract(res, meta(op, q, k, v, None, True, 0.0, False, scale=None))
    assert res[1].shape[-1] == 64  # 40 queries, padded to a multiple of 32
    assert op(q, k, v, None, False)[1].shape[-1] == 0
    ref_out, ref_lse, dout, dq, dk, dv = reference(q, k, v)
    assert rel(res[0], ref_out) < tol(dtype) and rel(res[1][..., :S], ref_lse) < 1e-4
    bop = torch.ops.aten._scaled_dot_product_efficient_attention_backward
    grads = bop(dout.to(dtype), q, k, v, None, res[0], res[1], res[2], res[3], 0.0, [True, True, True, False], False, scale=None)
    fake = meta(bop, dout.to(dtype), q, k, v, None, res[0], res[1], res[2], res[3], 0.0, [True, True, True, False], False, scale=None)
    same_contract(grads, fake)
    for g, r in zip(grads[:3], (dq, dk, dv), strict=True):
        assert rel(g, r) < tol(dtype)


def test_efficient_attention_forward_backward_bshd():
    dtype = torch.float32
    q, k, v = qkv(dtype, layout="bshd")
    op = torch.ops.aten._efficient_attention_forward
    args = (q, k, v, None, None, None, None, None, 0.0, 0, True)
    res = op(*args, scale=None)
    same_contract(res, meta(op, *args, scale=None))
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ref_out, ref_lse, dout, dq, dk, dv = reference(t(q), t(k), t(v))
    assert rel(t(res[0]), ref_out) < 1e-5
    bop = torch.ops.aten._efficient_attention_backward
    bargs = (t(dout).to(dtype).contiguous(), q, k, v, None, res[0], None, None, S, S, res[1], 0.0, res[2], res[3], 0, False)
    grads = bop(*bargs, scale=None)
    same_contract(grads, meta(bop, *bargs, scale=None))
    for g, r in zip(grads[:3], (dq, dk, dv), strict=True):
        assert rel(t(g), r) < 1e-5
    state = torch.get_rng_state()
    op(q, k, v, None, None, None, None, None, 0.3, 0, True)
    assert not torch.equal(state, torch.get_rng_state())


# ---- flash-attn 2 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fai():
    """flash_attn_interface of the stand-in, loaded from its file (the package itself is only put on sys.path by
    an emulating rank, so this test process keeps flash-attn absent for everything else)."""
    path = os.path.join(standins.flash_attn_path(), "flash_attn", "flash_attn_interface.py")
    spec = importlib.util.spec_from_file_location("_cpdoctor_test_flash_attn_interface", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flash_attn_version_is_visible_to_importlib():
    dists = [d for d in importlib.metadata.distributions(path=[standins.flash_attn_path()]) if d.metadata["Name"] == "flash_attn"]
    assert [d.version for d in dists] == [standins.FLASH_ATTN_VERSION]
    from packaging.version import parse

    assert parse(dists[0].version) >= parse("2.6.3")  # diffusers' _REQUIRED_FLASH_VERSION


def test_flash_attn_signatures_follow_flash_attn(fai):
    import inspect

    fwd = list(inspect.signature(fai._flash_attn_forward).parameters)
    assert fwd == [
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "return_softmax",
    ]
    bwd = list(inspect.signature(fai._flash_attn_backward).parameters)
    assert bwd[:6] == ["dout", "q", "k", "v", "out", "softmax_lse"] and bwd[-1] == "rng_state" and len(bwd) == 18


def test_flash_attn_forward_backward(fai):
    dtype = torch.bfloat16
    q, k, v = qkv(dtype, layout="bshd")
    out, lse, s_dmask, rng_state = fai._flash_attn_forward(q, k, v, 0.0, D**-0.5, False, -1, -1, 0.0, None, False)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32
    assert s_dmask.shape == (0,) and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ref_out, ref_lse, dout, rq, rk, rv = reference(t(q), t(k), t(v))
    assert rel(t(out), ref_out) < 2e-2 and rel(lse, ref_lse) < 1e-3
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = fai._flash_attn_backward(
        t(dout).to(dtype), q, k, v, out, lse, dq, dk, dv, 0.0, D**-0.5, False, -1, -1, 0.0, None, False, rng_state
    )
    assert softmax_d.shape == (B, H, 128) and softmax_d.dtype == torch.float32
    for g, r in zip((dq, dk, dv), (rq, rk, rv), strict=True):
        assert rel(t(g), r) < 2e-2
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        fai._flash_attn_forward(q.float(), k.float(), v.float(), 0.0, D**-0.5, False, -1, -1, 0.0, None, False)
    with pytest.raises(RuntimeError, match="return_softmax is only supported when p_dropout > 0.0"):
        fai._flash_attn_forward(q, k, v, 0.0, D**-0.5, False, -1, -1, 0.0, None, True)


def test_flash_attn_forced_dropout_advances_rng(fai):
    """diffusers 0.39.0's flash op forces dropout 1e-30 to get an LSE: nothing is dropped, the generator moves."""
    q, k, v = qkv(torch.bfloat16, layout="bshd")
    state = torch.get_rng_state()
    plain = fai._flash_attn_forward(q, k, v, 0.0, D**-0.5, False, -1, -1, 0.0, None, False)
    assert torch.equal(state, torch.get_rng_state())
    forced = fai._flash_attn_forward(q, k, v, 1e-30, D**-0.5, False, -1, -1, 0.0, None, True)
    assert not torch.equal(state, torch.get_rng_state())
    assert torch.equal(plain[0], forced[0]) and forced[2].shape == (B, H, 128, 128)


def test_flash_attn_func_autograd(fai):
    q, k, v = (x.requires_grad_(True) for x in qkv(torch.bfloat16, layout="bshd"))
    out = fai.flash_attn_func(q, k, v)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_install_is_idempotent_and_needs_no_diffusers():
    assert standins.install() == standins.install()
    import subprocess
    import sys

    source = open(standins.__file__).read()
    assert "import diffusers" not in source and "from diffusers" not in source
    # nor through another module: a fresh interpreter (this one has diffusers loaded by other tests)
    code = "import sys; from cpdoctor.cpu_kernels import standins; standins.install(); print('diffusers' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["False"], run.stderr


def test_emulate_request_and_report_wording():
    from cpdoctor import api
    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.attention import judge

    req = api.build_request(backend="flash", dtype="bf16", emulate=True)
    assert req.emulate is True and api.build_request().emulate is False
    with pytest.raises(BadInput):
        api.build_request(emulate="yes")
    assert judge.describe(req).endswith(" emulated")
    assert judge.check_command(req).endswith("--emulate")
    note = judge.emulation_note("flash")
    assert "emulated on CPU" in note and "not examined: the CUDA kernel itself" in note


def test_suite_groups_never_mix_emulated_and_plain_checks(monkeypatch):
    """Stand-ins are installed per process: an emulated check and a plain one of the same world size run in two
    launches."""
    from cpdoctor import api
    from cpdoctor.examinations import runner

    launched = []

    def fake_run_cases(kind, cases, world_size, device, timeout_s, on_tick=None):
        launched.append([c.request.emulate for c in cases])
        raise RuntimeError("stop")

    monkeypatch.setattr(runner, "run_cases", fake_run_cases)
    from cpdoctor.suite import Suite

    suite = Suite(
        "t", "", "t.yaml", [("attention", {"ring": 2}), ("attention", {"ring": 2, "emulate": True, "backend": "flash", "dtype": "bf16"})]
    )
    with pytest.raises(RuntimeError, match="stop"):
        api.run_suite(suite)
    assert launched and all(len(set(group)) == 1 for group in launched)


@pytest.mark.parametrize("kernel_name", ["NativeFlashKernel", "CudnnKernel", "EfficientKernel", "FlashAttnKernel"])
@pytest.mark.parametrize("masked", [False, True])
def test_the_fix_block_kernels_run_on_the_standins(kernel_name, masked, fai):
    """cpdoctor.fix's CUDA block kernels, called as the fixed ring calls them (model layout in, the kernel's own
    layout and LSE convention), agree with its exact fp32 math kernel."""
    from cpdoctor.fix import block_kernels

    if kernel_name == "FlashAttnKernel":
        kernel = block_kernels.FlashAttnKernel(fai._flash_attn_forward, fai._flash_attn_backward, "flash-attn stand-in")
    else:
        kernel = getattr(block_kernels, kernel_name)()
    takes_mask = kernel_name in ("CudnnKernel", "EfficientKernel")
    if masked and not takes_mask:
        pytest.skip("this kernel takes no mask (the ring refuses one for it)")
    dtype = torch.bfloat16
    q, k, v = qkv(dtype, layout="bshd", seed=3)  # model layout (B, S, H, D)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    mask = None
    if masked:
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[..., -3:] = False
    scale = block_kernels.default_scale(D, None)
    math = block_kernels.MathKernel()
    ref_out, ref_lse = math.forward(*(x.transpose(1, 2) for x in (q, k, v)), mask, scale)
    ref_grads = math.backward(*(x.transpose(1, 2) for x in (dout, q, k, v, ref_out.transpose(1, 2))), ref_lse, mask, scale)
    lay = kernel.to_layout
    out, lse = kernel.forward(lay(q), lay(k), lay(v), mask, scale)
    model_out = lay(out)
    assert rel(model_out, ref_out.transpose(1, 2)) < 2e-2
    assert rel(kernel.lse_to_layout(lse), ref_lse.transpose(1, 2)) < 1e-3
    grads = kernel.backward(lay(dout), lay(q), lay(k), lay(v), out, lse, mask, scale)
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel(lay(g), r.transpose(1, 2)) < 2e-2


def test_flash_attn_standin_is_inert_without_emulation(fai):
    q, k, v = qkv(torch.bfloat16, layout="bshd")
    standins.uninstall()
    try:
        with pytest.raises(RuntimeError, match="must be on CUDA"):
            fai._flash_attn_forward(q, k, v, 0.0, D**-0.5, False, -1, -1, 0.0, None, False)
    finally:
        standins.install()
