"""The model-level verdict fed with numbers: its own tensors, the worst parameter, and the op-level
cross-check at the same layout (no process, no diffusers)."""

from __future__ import annotations

import pytest

from cpdoctor.examinations.attention.judge import RoutingFacts
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.measurement import Measurement
from cpdoctor.examinations.model.judge import model_finding
from cpdoctor.examinations.model.probe import ModelInfo, ModelMeasurement, OpLevel
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.report import BlockRow, ParamRow, TensorRow, Verdict


def row(err: float, base: float, world: int = 2, per_rank: bool = True) -> TensorRow:
    return TensorRow(err, err, 0, worst_rank=0, per_rank_rel_err=(err,) * world if per_rank else (), baseline_rel_err=base)


def op(ring: int, **errors: float) -> OpLevel:
    tensors = {n: row(errors.get(n, 4e-7), 4e-7, ring) for n in ("out", "dq", "dk", "dv")}
    return OpLevel(AttentionRequest(ring=ring), Measurement("cpdoctor_cpu", RoutingFacts(routes_cp=True), {}, tensors))


def measured(out: float, grads: float, base: float, *ops: OpLevel) -> ModelMeasurement:
    return ModelMeasurement(
        "cpdoctor_cpu",
        None,
        {},
        {"out": row(out, base), "grads": row(grads, base, per_rank=False)},
        model=ModelInfo("flux", "FluxTransformer2DModel", "tiny config", parameter_tensors=1),
        params={"w": ParamRow(grads, grads, 0, 10, 1.0, base)},
        op_level=list(ops),
    )


def test_exact_model_and_op_pass():
    f = model_finding(ModelRequest(ring=2, height=64, width=64, text_len=8), measured(1.7e-7, 1.7e-7, 1.6e-7, op(2)))
    assert f.verdict == Verdict.PASS and "match the single-process fp64 model" in f.diagnosis


def test_backward_wrong_names_the_op_level_stale_kv():
    f = model_finding(
        ModelRequest(ring=2, height=64, width=64, text_len=8), measured(1.7e-7, 7.5e-2, 1.6e-7, op(2, dq=2.19, dk=1.7, dv=1.5))
    )
    assert f.verdict == Verdict.FAIL
    assert "forward exact" in f.diagnosis and "`cpdoctor check --ring 2`" in f.diagnosis and "stale iteration-0" in f.diagnosis


def test_noise_does_not_hide_a_wrong_attention_op():
    """bf16 full-width Flux: the model's own no-CP error is large, the defect sits inside it for one step, but
    the op at the same layout is wrong: that is corruption, and the verdict says so."""
    req = ModelRequest(ring=2, dtype="bf16", height=256, width=256, text_len=64)
    f = model_finding(req, measured(3e-3, 7.2e-2, 7e-2, op(2, dq=2.19, dk=1.7, dv=1.5)))
    assert f.verdict == Verdict.FAIL
    assert "noise hides" in f.diagnosis and "stale iteration-0" in f.diagnosis and "--dtype fp32" in f.remedy
    assert all(t.verdict == Verdict.PASS for t in f.tensors.values())  # the model's own numbers are within tolerance


def test_model_path_defect_when_the_op_passes():
    f = model_finding(ModelRequest(ring=2, height=64, width=64, text_len=8), measured(1e-2, 1e-2, 1.6e-7, op(2)))
    assert f.verdict == Verdict.FAIL and "the defect lies in the model's CP path" in f.diagnosis


def test_a_class_without_gradient_checkpointing_is_bad_input_for_checkpointing():
    """`cpdoctor model ... --checkpointing` goes through the class's own enable_gradient_checkpointing(), which
    ModelMixin refuses unless the class says it supports it: refused before any process starts."""
    from types import SimpleNamespace

    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.model.prepare import check_model_takes
    from cpdoctor.examinations.model.request import ModelRequest

    class NoCheckpointing:
        _supports_gradient_checkpointing = False

        def enable_gradient_checkpointing(self) -> None: ...

    spec = SimpleNamespace(short_name="x", class_name="NoCheckpointing", cls=NoCheckpointing)
    with pytest.raises(BadInput, match="does not support gradient checkpointing"):
        check_model_takes(ModelRequest(model="x", ring=2, checkpointing=True), spec, 8, 2)
    check_model_takes(ModelRequest(model="x", ring=2), spec, 8, 2)  # without --checkpointing nothing is asked


def block(name: str, out: float, grad: float) -> BlockRow:
    return BlockRow(name, out, grad, 0, 5e-8, 1e-7)


def test_the_first_bad_block_is_where_the_error_enters_forward_or_backward():
    """A wrong output spreads forward, a wrong gradient alone backward: a backward defect in block 2 of 4 makes
    the input gradients of blocks 0-2 wrong and is named at block 2, not at block 0; a forward defect in block 1
    makes every later output and every gradient wrong and is named at block 1."""
    from cpdoctor.examinations.model.judge import first_bad_block, judge_blocks

    backward = judge_blocks([block("b.0", 5e-8, 0.3), block("b.1", 5e-8, 0.3), block("b.2", 5e-8, 0.2), block("b.3", 5e-8, 1e-7)], "fp32")
    assert [b.verdict for b in backward] == [Verdict.FAIL] * 3 + [Verdict.PASS]
    assert first_bad_block(backward).name == "b.2"
    forward = judge_blocks([block("b.0", 5e-8, 0.3), block("b.1", 0.1, 0.3), block("b.2", 0.2, 0.3), block("b.3", 0.2, 0.2)], "fp32")
    assert first_bad_block(forward).name == "b.1"
    assert first_bad_block(judge_blocks([block("b.0", 5e-8, 1e-7)], "fp32")) is None


def test_a_sequence_joined_from_two_split_streams_is_put_back_stream_by_stream():
    """Flux2 joins text and image before its single-stream blocks: each rank holds [its text shard, its image shard],
    which one contiguous concatenation puts in the wrong order (rel err ~1); put back stream by stream it is exact."""
    import torch

    from cpdoctor.examinations.measurement import compare
    from cpdoctor.examinations.model.blocks import assemble

    torch.manual_seed(0)
    text, image = torch.randn(1, 8, 4), torch.randn(1, 32, 4)
    whole = torch.cat([text, image], dim=1)
    shards = [torch.cat([t, i], dim=1) for t, i in zip(text.chunk(2, dim=1), image.chunk(2, dim=1))]
    plain = assemble(shards, whole)
    assert compare(plain.double().reshape(-1), whole.double().reshape(-1)).rel_err > 0.1
    joined = assemble(shards, whole, segments=frozenset({4, 16, 20}))
    assert torch.equal(joined, whole)
    contiguous = list(whole.chunk(2, dim=1))  # a plain split stays a plain concatenation with the same segments known
    assert torch.equal(assemble(contiguous, whole, segments=frozenset({4, 16, 20})), whole)
