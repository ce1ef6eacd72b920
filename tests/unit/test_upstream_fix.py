"""The upstream fix (`--repro`'s fix.diff), made from source text by structure: on the installed diffusers and on
planted snippets of the ring's shape, refused when the structure differs; the diff applies to the text it was made
from and to nothing else; which defects a FAIL's numbers name (no process)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from cpdoctor.compat.diffusers import gathers_mask, passes_rotated_tensors, sends_dkv_to_next
from cpdoctor.compat.upstream_fix import (
    FixRefused,
    SourceFile,
    UpstreamDefect,
    apply_diff,
    dispatch_source,
    make_fix,
    present,
    repo_path,
)
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.attention.upstream import CaseCheck, FixBackends, Verification, defects_of, issue_section, with_section
from cpdoctor.examinations.judging import judge_row
from cpdoctor.report import Finding, TensorRow, Verdict

D, M = UpstreamDefect.DKV_DIRECTION, UpstreamDefect.MASK_NOT_ROTATED
REPO = "src/diffusers/models/attention_dispatch.py"

RING = """
import torch


class TemplatedRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op, backward_op, _parallel_config=None):
        ring_mesh = _parallel_config.context_parallel_config._ring_mesh
        rank = _parallel_config.context_parallel_config._ring_local_rank
        world_size = _parallel_config.context_parallel_config.ring_degree
        next_rank = (rank + 1) % world_size
        kv_buffer = torch.cat([key.flatten(), value.flatten()]).contiguous()
        kv_buffer = funcol.all_gather_tensor(kv_buffer, gather_dim=0, group=ring_mesh.get_group())
        kv_buffer = kv_buffer.chunk(world_size)

        for i in range(world_size):
            if i > 0:
                kv = kv_buffer[next_rank]
                next_rank = (next_rank + 1) % world_size

            out, lse = forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True, _save_ctx=i == 0)
        return out

    @staticmethod
    def backward(ctx, grad_out, *args):
        ring_mesh = ctx._parallel_config.context_parallel_config._ring_mesh
        rank = ctx._parallel_config.context_parallel_config._ring_local_rank
        world_size = ctx._parallel_config.context_parallel_config.ring_degree
        next_ranks = list(range(1, world_size)) + [0]

        for i in range(world_size):
            grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(ctx, grad_out, query=query, key=key, value=value)
            if i < world_size - 1:
                next_grad_kv = funcol.permute_tensor(grad_kv_buffer, next_ranks, group=ring_mesh.get_group())

        grad_kv_buffer = _wait_tensor(funcol.permute_tensor(grad_kv_buffer, next_ranks, group=ring_mesh.get_group()))
        return grad_query, grad_key, grad_value
"""


def planted(text: str = RING) -> SourceFile:
    return SourceFile("/planted/attention_dispatch.py", REPO, text)


def test_direction_fix_sends_the_accumulator_to_the_previous_rank():
    fix = make_fix(planted(), (D,))
    assert fix.diff.startswith(f"--- a/{REPO}\n+++ b/{REPO}\n")
    removed = [ln[1:].strip() for ln in fix.diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    added = [ln[1:].strip() for ln in fix.diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    assert removed == ["next_ranks = list(range(1, world_size)) + [0]"]
    assert added[-1] == "next_ranks = [world_size - 1] + list(range(world_size - 1))" and added[0].startswith("#")
    assert sends_dkv_to_next(RING) and not sends_dkv_to_next(fix.patched)
    # the permutation it writes: rank m sends to m - 1 (permute_tensor's src_dst[m] == n means m sends to n)
    world_size = 4
    assert eval("[world_size - 1] + list(range(world_size - 1))") == [(m - 1) % world_size for m in range(world_size)]


def test_mask_fix_rotates_the_mask_with_its_keys_in_forward_and_backward():
    fix = make_fix(planted(), (M,))
    assert not gathers_mask(RING) and gathers_mask(fix.patched)
    tree = ast.parse(fix.patched)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef))
    forward, backward = (next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name) for name in ("forward", "backward"))
    assert "attn_mask = attn_masks[(rank + i) % world_size]" in ast.unparse(forward)
    assert "ctx.attn_mask = ctx.ring_attn_masks[(rank + i) % world_size]" in ast.unparse(backward)
    # the mask is chosen before the op is called with it, inside the ring loop
    loop = next(n for n in forward.body if isinstance(n, ast.For))
    chosen = next(k for k, n in enumerate(loop.body) if "attn_masks[" in ast.unparse(n))
    called = next(k for k, n in enumerate(loop.body) if "forward_op(" in ast.unparse(n))
    assert chosen < called
    assert "all_gather_tensor(attn_mask.contiguous(), gather_dim=0, group=ring_mesh.get_group())" in fix.diff


def test_the_diff_applies_to_its_own_source_only():
    source = planted()
    fix = make_fix(source, (D, M))
    assert apply_diff(source.text, fix.diff) == fix.patched
    with pytest.raises(ValueError):
        apply_diff(source.text.replace("next_ranks = list(range(1, world_size)) + [0]", "next_ranks = other"), fix.diff)


@pytest.mark.parametrize(
    ("change", "defects", "reason"),
    [
        (("class TemplatedRingAttention", "class RingAttention"), (D,), "no class TemplatedRingAttention"),
        (
            ("next_ranks = list(range(1, world_size)) + [0]", "next_ranks = [world_size - 1] + list(range(world_size - 1))"),
            (D,),
            "does not send",
        ),
        (
            ("        grad_kv_buffer = _wait_tensor(funcol.permute_tensor(grad_kv_buffer, next_ranks, group=ring_mesh.get_group()))\n", ""),
            (D,),
            "no final hop",
        ),
        (("for i in range(world_size):", "for i in ring_steps:"), (M,), "no ring loop"),
        (
            (
                "all_gather_tensor(kv_buffer, gather_dim=0, group=ring_mesh.get_group())",
                "all_gather_tensor(kv_buffer, 0, ring_mesh.get_group())",
            ),
            (M,),
            "all-gather",
        ),
    ],
)
def test_a_structure_the_fix_does_not_know_is_refused_with_the_reason(change, defects, reason):
    old, new = change
    assert old in RING
    with pytest.raises(FixRefused, match=reason):
        make_fix(planted(RING.replace(old, new)), defects)


def test_a_ring_that_already_gathers_its_mask_is_refused():
    gathered = RING.replace(
        "        kv_buffer = kv_buffer.chunk(world_size)\n",
        "        kv_buffer = kv_buffer.chunk(world_size)\n        masks = funcol.all_gather_tensor(attn_mask, gather_dim=0, group=g)\n",
        1,
    )
    with pytest.raises(FixRefused, match="already gathers the mask"):
        make_fix(planted(gathered), (M,))


def test_stale_kv_is_seen_and_refused_with_why():
    stale = RING.replace("ctx.backward_op(ctx, grad_out, query=query, key=key, value=value)", "ctx.backward_op(ctx, grad_out)")
    assert stale != RING
    assert present(planted(stale), UpstreamDefect.STALE_KV) and not present(planted(), UpstreamDefect.STALE_KV)
    with pytest.raises(FixRefused, match="no minimal fix in the ring") as refused:
        make_fix(planted(stale), (UpstreamDefect.STALE_KV,))
    assert "upgrade to diffusers 0.40.0 or later" in str(refused.value)  # the release that fixed it (docs/FACTS.md)


def _patched_ring(text: str) -> type:
    """The patched source's TemplatedRingAttention class, executed alone (it needs torch and funcol at call
    time), with the K/V all-gather answered locally (no process group)."""
    import types

    import torch

    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "TemplatedRingAttention")
    namespace = {
        "torch": torch,
        "funcol": types.SimpleNamespace(all_gather_tensor=lambda t, gather_dim, group: torch.cat([t, t], dim=gather_dim)),
    }
    code = "from __future__ import annotations\n" + ast.get_source_segment(text, cls)
    exec(compile(code, "attention_dispatch.py", "exec"), namespace)  # noqa: S102 - the patched class under test
    return namespace["TemplatedRingAttention"]


def test_the_mask_fix_refuses_a_mask_it_cannot_rotate_with_a_message():
    """The patched ring takes a key-only mask (B, 1, 1, S_local) and refuses one over query positions, in its
    own words, before its ring loop runs an op."""
    pytest.importorskip("diffusers")
    import types

    import torch

    from cpdoctor.compat.upstream_fix import MASK_MESSAGE

    source = dispatch_source()
    if not present(source, M):
        pytest.skip("the installed ring has no unrotated mask to fix")
    ring = _patched_ring(make_fix(source, (M,)).patched)
    cp = types.SimpleNamespace(_ring_mesh=types.SimpleNamespace(get_group=lambda: None), _ring_local_rank=0, ring_degree=2)
    config = types.SimpleNamespace(context_parallel_config=cp)
    b, s_local, h, d = 2, 8, 2, 4
    q = k = v = torch.zeros(b, s_local, h, d)

    class OpReached(Exception):
        pass

    def forward_op(*args, **kwargs):
        raise OpReached

    def run(mask):
        ctx = types.SimpleNamespace()
        ring.forward(ctx, q, k, v, mask, 0.0, False, None, False, False, forward_op, None, config)

    with pytest.raises(OpReached):
        run(torch.ones(b, 1, 1, s_local, dtype=torch.bool))  # the shape it supports reaches the op
    with pytest.raises(OpReached):
        run(torch.ones(b, h, 1, s_local, dtype=torch.bool))
    for shape in ((b, 1, s_local, s_local), (b, 1, 2 * s_local, 2 * s_local), (b, s_local), (b, 1, 1, 2 * s_local)):
        with pytest.raises(ValueError) as refused:
            run(torch.ones(*shape, dtype=torch.bool))
        said = str(refused.value)
        assert said.startswith(MASK_MESSAGE[0]) and f"got {shape} with {s_local} local keys" in said, said


def test_double_transpose_drops_the_second_transpose_of_saved_k_v():
    op = """
    def {name}(ctx, grad_out, *args, **kwargs):
        query, key, value, out, lse, cum_seq_q, cum_seq_k, philox_seed, philox_offset = ctx.saved_tensors

        grad_out = grad_out.transpose(1, 2).contiguous()
        key = key.transpose(1, 2).contiguous()
        value = value.transpose(1, 2).contiguous()

        return kernel(grad_out, query, key, value, out, lse)
    """
    text = "".join(textwrap.dedent(op.format(name=n)) for n in ("_cudnn_attention_backward_op", "_native_flash_attention_backward_op"))
    fix = make_fix(planted(text), (UpstreamDefect.DOUBLE_TRANSPOSE,))
    removed = [ln[1:].strip() for ln in fix.diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ["key = key.transpose(1, 2).contiguous()", "value = value.transpose(1, 2).contiguous()"] * 2
    # an op that also transposes its query again is the layout-aware form: not the defect
    layout_aware = text.replace("    grad_out = grad_out", "    query = query.transpose(1, 2).contiguous()\n    grad_out = grad_out")
    assert layout_aware != text
    with pytest.raises(FixRefused, match="structure differs"):
        make_fix(planted(layout_aware), (UpstreamDefect.DOUBLE_TRANSPOSE,))


def test_repo_path_is_the_package_path_under_src():
    assert repo_path("/site/diffusers/models/attention_dispatch.py", "/site/diffusers") == REPO


def test_the_installed_source_gets_a_diff_exactly_where_it_shows_the_defect():
    """Whatever release is installed: a fix is offered for a defect exactly when the source shows it, and the
    patched file no longer does."""
    pytest.importorskip("diffusers")
    source = dispatch_source()
    assert source.repo_path == REPO and "class TemplatedRingAttention" in source.text
    for defect in (D, M):
        if present(source, defect):
            fix = make_fix(source, (defect,))
            assert apply_diff(source.text, fix.diff) == fix.patched
            assert not present(SourceFile(source.path, REPO, fix.patched), defect)
    ring = source.text[source.text.index("class TemplatedRingAttention") :]
    ring = ring[: ring.index("\nclass ")]
    assert present(source, M) is not gathers_mask(ring)
    has_final_hop = "One final rotation" in ring or ring.count("permute_tensor(") >= 2
    assert present(source, D) is (sends_dkv_to_next(ring) and has_final_hop)
    assert present(source, UpstreamDefect.STALE_KV) is not passes_rotated_tensors(ring)


def _finding(req: AttentionRequest, **errors: float) -> Finding:
    tensors = {}
    for name in ("out", "dq", "dk", "dv"):
        err = errors.get(name, 4e-7)
        tensors[name] = judge_row(
            TensorRow(err, err, 0, worst_rank=0, per_rank_rel_err=(err,) * req.world_size, baseline_rel_err=4e-7), "fp32"
        )
    return Finding("x", Verdict.FAIL, "", tensors=tensors)


def test_the_defects_a_fail_names():
    ring3 = AttentionRequest(ring=3, seq=513)
    assert defects_of(ring3, _finding(ring3, dk=1.16, dv=0.93)) == (D,)
    masked = AttentionRequest(ring=3, seq=513, mask_pad=40)
    fail = _finding(masked, out=0.35, dq=0.35, dk=1.17, dv=0.96)
    assert defects_of(masked, fail) == (M,)  # the diagnosis names the mask only ...
    assert defects_of(masked, fail, has=lambda d: d is not UpstreamDefect.STALE_KV) == (D, M)  # ring 3 runs through the direction
    assert UpstreamDefect.STALE_KV in defects_of(masked, fail, has=lambda d: True)
    assert defects_of(masked, fail, has=lambda d: False) == (M,)
    ring2 = AttentionRequest(ring=2, seq=512)
    assert defects_of(ring2, _finding(ring2, dq=2.19, dk=1.7, dv=1.5), has=lambda d: True) == (UpstreamDefect.STALE_KV,)


def test_issue_section_carries_the_diff_and_the_before_after_table():
    fix = make_fix(planted(), (D,))
    v = Verification(
        True, "fix verified", {"out": 4e-7, "dq": 4.6e-7, "dk": 1.16, "dv": 0.93}, {"out": 4e-7, "dq": 4.6e-7, "dk": 4.1e-7, "dv": 3.9e-7}
    )
    v.cases = [CaseCheck(3, 1, 0, Verdict.PASS, {"out": 4e-7, "dq": 4e-7, "dk": 4e-7, "dv": 4e-7}, {"dk": 1.16})]
    section = issue_section(fix, v, AttentionRequest(ring=3, seq=513))
    assert "```diff\n--- a/src/diffusers" in section and "| dK | 1.16 | 4.1e-07 |" in section and "| ring 3 | PASS |" in section
    issue = with_section("### Logs\nx\n### System Info\ny\n", section)
    assert issue.index("### Logs") < issue.index("### Proposed fix") < issue.index("### System Info")
    v.verified, v.reason = False, "on the patched copy ring 4 still does not PASS"
    assert "Not verified: on the patched copy ring 4" in issue_section(fix, v, {})


def test_the_cases_a_fix_is_verified_on():
    from cpdoctor.examinations.attention.upstream import _cases

    ring3 = AttentionRequest(ring=3, seq=513)
    layouts = [(c.ring, c.ulysses, c.mask_pad) for c in _cases(ring3, (D,))]
    assert layouts == [(3, 1, 0), (2, 1, 0), (4, 1, 0), (1, 2, 0)]  # the FAIL's own case first, ring 2-4, the guard
    masked = AttentionRequest(ring=3, seq=513, mask_pad=40)
    layouts = [(c.ring, c.ulysses, c.mask_pad) for c in _cases(masked, (M,))]
    assert layouts == [(3, 1, 40), (2, 1, 0), (1, 2, 0)]
    # the mask fix: the FAIL's own case again on every other backend it is verified on (stand-ins in bf16)
    backends = FixBackends((("cpdoctor_cpu", False), ("_native_cudnn", True)), (("flash", "its CP path takes no mask"),))
    extra = [(c.backend, c.emulate, c.dtype, c.mask_pad) for c in _cases(masked, (M,), backends)][3:]
    assert extra == [("_native_cudnn", True, "bf16", 40)]


def test_the_backends_the_mask_fix_is_verified_on(monkeypatch):
    """On a CPU: the FAIL's own, the CPU backend and each stand-in backend whose CP path takes a mask (read in
    diffusers' own code); every other CP backend is listed with diffusers' reason; on a GPU the FAIL's own only."""
    pytest.importorskip("diffusers")
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.attention.upstream import _backend_lines, fix_backends

    on_cpu = fix_backends("cpdoctor_cpu", False, on_cpu=True)
    assert on_cpu.verified[0] == ("cpdoctor_cpu", False)
    for name in ("_native_flash", "_native_cudnn", "flash"):
        refusal = compat.ring_mask_refusal(name)
        assert ((name, True) in on_cpu.verified) is (refusal is None)
        assert any(n == name and refusal.message.rstrip(".") in why for n, why in on_cpu.not_verified) is (refusal is not None)
    named = {n for n, _ in on_cpu.verified} | {n for n, _ in on_cpu.not_verified}
    cp = {n for n in compat.registered_backend_names() if compat.is_cp_registered(n)}
    assert cp <= named and len(named) == len(on_cpu.verified) + len(on_cpu.not_verified)
    on_gpu = fix_backends("_native_cudnn", False, on_cpu=False)
    assert on_gpu.verified == (("_native_cudnn", False),)
    lines = "\n".join(_backend_lines(on_cpu))
    assert "The mask part was verified on: `cpdoctor_cpu`" in lines and "Not verified on:" in lines
    # without a mask (the checkpointing fix) a backend that refuses masks is verified too; one without an LSE never
    unmasked = fix_backends("cpdoctor_cpu", False, on_cpu=True, masked=False)
    for name in ("_native_flash", "_native_cudnn", "flash"):
        refusal = compat.ring_mask_refusal(name)
        assert ((name, True) in unmasked.verified) is (refusal is None or not refusal.no_lse)
    assert "The fix was verified on: `cpdoctor_cpu`" in "\n".join(_backend_lines(unmasked))


def test_a_backend_that_refuses_a_mask_says_so_in_its_own_code(monkeypatch):
    from cpdoctor.compat import diffusers as compat

    def refusing(query, key, value, attn_mask=None, return_lse=False, _parallel_config=None):
        if attn_mask is not None:
            raise ValueError("`attn_mask` is not supported for this kernel.")
        return query

    def no_lse(query, key, value, attn_mask=None, return_lse=False, _parallel_config=None):
        if return_lse:
            raise ValueError("no LSE here")
        if attn_mask is not None and query is None:
            raise ValueError("not a refusal of the mask alone")
        return query

    expected_refusals = (
        (refusing, compat.BackendRefusal(False, "`attn_mask` is not supported for this kernel.")),
        (no_lse, compat.BackendRefusal(True, "no LSE here")),
    )
    for fn, expected in expected_refusals:
        monkeypatch.setattr(compat, "backend_function", lambda name, fn=fn: fn)
        assert compat.ring_mask_refusal("x") == expected


@pytest.mark.parametrize(
    ("returncode", "stdout", "reason"),
    [
        (0, "   out 4.1e-07 1 2 3\n    dk 4.2e-07 1 2 3\nNOT REPRODUCED: every tensor within tolerance\n", ""),
        (0, "    dk 1.16 1 2 3\nREPRODUCED: dk outside tolerance\n", "still reproduces"),
        (1, "", "exited 1"),
        (None, "", "ran past"),
    ],
)
def test_the_repro_on_the_patched_copy_decides(monkeypatch, returncode, stdout, reason):
    from cpdoctor.examinations.attention import upstream
    from cpdoctor.launch import script

    monkeypatch.setattr(script, "run_under_torchrun", lambda *a, **k: script.ScriptRun(returncode, stdout, "Traceback\nValueError: x"))
    result = Verification(False, "", {"dk": 1.16})
    upstream._run_repro(result, "repro.py", 3, "/nowhere", 60.0)
    assert (reason in result.reason) if reason else result.reason == ""
    if not reason:
        assert result.repro_after == {"out": 4.1e-07, "dk": 4.2e-07}


S = UpstreamDefect.SAVED_PER_STEP
UNPACKED_TWICE = (
    'Traceback (most recent call last):\n  File "/site/diffusers/models/attention_dispatch.py", line 2506, in backward\n'
    "    grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(\n"
    "torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Unpack is being triggered for a tensor that was "
    "already unpacked once. If you are calling ctx.saved_tensors in backward, make sure to do so only once."
)


def test_saved_once_fix_unpacks_once_and_hands_the_op_a_view_of_the_ctx():
    fix = make_fix(planted(), (S,))
    tree = ast.parse(fix.patched)
    names = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert names == ["_RingBackwardCtx", "TemplatedRingAttention"]  # the view's class just before the ring's
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TemplatedRingAttention")
    backward = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "backward")
    text = ast.unparse(backward)
    assert text.count("ctx.saved_tensors") == 1 and "op_ctx = _RingBackwardCtx(ctx, saved_tensors)" in text
    assert "ctx.backward_op(op_ctx, grad_out, query=query, key=key, value=value)" in text
    loop = next(n for n in backward.body if isinstance(n, ast.For))
    assert "saved_tensors" not in ast.unparse(loop).replace("op_ctx", "")  # unpacked before the ring loop
    # the forward and every backend op are untouched: only the ring's backward and the new class change
    removed = [ln[1:].strip() for ln in fix.diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert removed == ["grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(ctx, grad_out, query=query, key=key, value=value)"]


def test_the_view_reads_and_writes_through_to_the_ctx_but_holds_the_tensors_unpacked_once():
    from cpdoctor.compat.upstream_fix import RING_CTX_SOURCE

    namespace: dict = {}
    exec(RING_CTX_SOURCE, namespace)  # noqa: S102 - the class the diff adds
    ctx = type("Ctx", (), {})()
    ctx.attn_mask, ctx.scale = "mask", 0.5
    view = namespace["_RingBackwardCtx"](ctx, ("q", "k", "v"))
    assert view.saved_tensors == ("q", "k", "v") and view.attn_mask == "mask" and view.scale == 0.5
    view.max_q = 7  # an op that writes to its ctx writes to the autograd ctx
    ctx.attn_mask = "the chunk's mask"  # and sees what the ring sets on the ctx at each step
    assert ctx.max_q == 7 and view.attn_mask == "the chunk's mask" and not hasattr(ctx, "saved_tensors")


def test_saved_once_fix_rewrites_the_rings_own_unpack_and_refuses_other_shapes():
    own_unpack = RING.replace(
        "        for i in range(world_size):\n            grad_query_op",
        "        query, key, value, *_ = ctx.saved_tensors\n        for i in range(world_size):\n            grad_query_op",
    )
    assert own_unpack != RING
    fix = make_fix(planted(own_unpack), (S,))
    backward = ast.unparse(next(n for n in ast.walk(ast.parse(fix.patched)) if isinstance(n, ast.FunctionDef) and n.name == "backward"))
    assert "query, key, value, *_ = saved_tensors" in backward and backward.count("ctx.saved_tensors") == 1
    in_loop = RING.replace(
        "            grad_query_op, grad_key_op", "            q = ctx.saved_tensors[0]\n            grad_query_op, grad_key_op"
    )
    with pytest.raises(FixRefused, match="reads ctx.saved_tensors itself"):
        make_fix(planted(in_loop), (S,))
    no_ctx = RING.replace("ctx.backward_op(ctx, grad_out,", "ctx.backward_op(other, grad_out,")
    with pytest.raises(FixRefused, match="autograd ctx as its first argument"):
        make_fix(planted(no_ctx), (S,))
    with pytest.raises(FixRefused, match="already has a class _RingBackwardCtx"):
        make_fix(planted(fix.patched), (S,))


def test_the_installed_ring_backward_gets_the_saved_once_fix():
    pytest.importorskip("diffusers")
    source = dispatch_source()
    assert present(source, S)  # every release with ring CP hands its op the autograd ctx once per ring step
    fix = make_fix(source, (S,))
    assert apply_diff(source.text, fix.diff) == fix.patched and not present(SourceFile(source.path, REPO, fix.patched), S)


def test_the_defects_behind_the_rings_crash_under_checkpointing():
    from cpdoctor.report.findings import FailureEvidence

    ring2 = AttentionRequest(ring=2, checkpointing=True)
    crash = Finding("x", Verdict.CRASH, "rank 0 raised", failure=FailureEvidence(tracebacks={0: UNPACKED_TWICE, 1: UNPACKED_TWICE}))
    assert defects_of(ring2, crash) == (S,)
    # the verification runs ring 3 and 4 with checkpointing: the direction fix joins where the source shows it
    assert defects_of(ring2, crash, has=lambda d: d is D) == (D, S)
    assert UpstreamDefect.STALE_KV in defects_of(ring2, crash, has=lambda d: d is UpstreamDefect.STALE_KV)  # refused: no diff
    other = Finding("x", Verdict.CRASH, "rank 0 raised", failure=FailureEvidence(tracebacks={0: "RuntimeError: something else"}))
    assert defects_of(ring2, other, has=lambda d: True) == ()
    assert defects_of(AttentionRequest(ring=2), crash, has=lambda d: True) == ()  # not a checkpointing run


def test_the_cases_the_saved_once_fix_is_verified_on():
    from cpdoctor.examinations.attention.upstream import _cases

    ring2 = AttentionRequest(ring=2, checkpointing=True)
    cases = [(c.ring, c.ulysses, c.checkpointing) for c in _cases(ring2, (D, S))]
    assert cases[0] == (2, 1, True)  # the crash's own case first
    for ring in (2, 3, 4):
        assert (ring, 1, True) in cases and (ring, 1, False) in cases  # with and without checkpointing
    assert (1, 2, True) in cases and (1, 2, False) in cases and len(cases) == len(set(cases)) == 8
    alone = [(c.ring, c.ulysses, c.checkpointing) for c in _cases(ring2, (S,))]
    assert alone == [(2, 1, True), (2, 1, False), (1, 2, True), (1, 2, False)]
    backends = FixBackends((("cpdoctor_cpu", False), ("_native_flash", True)), (), masked=False)
    extra = [(c.backend, c.emulate, c.dtype, c.checkpointing) for c in _cases(ring2, (S,), backends)][4:]
    assert extra == [("_native_flash", True, "bf16", True)]  # the crash's own case through each other backend
