"""The vocabulary (cpdoctor/vocabulary.py): one spelling of dtypes, devices and a peer's implementation, variants
and kernels; requests hold the members, typer lists them in `--help` and refuses any other word (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cpdoctor.cli import app
from cpdoctor.errors import BadInput, Unsupported, UnsupportedKind
from cpdoctor.examinations import registry
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.report.serialize import to_jsonable
from cpdoctor.vocabulary import Device, DType, Impl, Kernel, Kind, Variant

runner = CliRunner()


def test_a_member_is_its_string_in_messages_json_and_comparisons():
    assert DType.BF16 == "bf16" and f"{DType.BF16}" == "bf16" and str(Impl.RING_FLASH_ATTN) == "ring-flash-attn"
    assert json.dumps(to_jsonable({"dtype": DType.FP16, "device": Device.CPU})) == '{"dtype": "fp16", "device": "cpu"}'
    assert {"bf16": 1}[DType.BF16] == 1  # tables keyed by the old strings still find a member


def test_dtypes_carry_their_numbers():
    assert DType.FP32.eps == 2.0**-23 and DType.BF16.eps == 2.0**-7 and DType.FP16.eps == 2.0**-10
    assert [d.bytes for d in (DType.FP64, DType.FP32, DType.BF16, DType.FP16)] == [8, 4, 2, 2]
    assert DType.FP32.grad_tolerance == 1e-4 and DType.BF16.grad_tolerance == 3e-2
    assert DType.examined() == (DType.FP32, DType.BF16, DType.FP16) and DType.references() == (DType.FP64, DType.FP32)
    torch = pytest.importorskip("torch")
    assert DType.BF16.torch is torch.bfloat16 and DType.of_torch(torch.float16) is DType.FP16 and DType.of_torch("float64") is DType.FP64


def test_requests_hold_members_built_once_with_their_defaults():
    req = AttentionRequest.of(ulysses=2, dtype="bf16", device="cpu")
    assert req.dtype is DType.BF16 and req.device is Device.CPU and (req.ring, req.ulysses, req.seq) == (1, 2, 512)
    assert AttentionRequest.of(ring=3).seq == 513 and req.kind is Kind.ATTENTION
    peer = PeerRequest.of(impl="torch", causal=True)
    assert peer.impl is Impl.TORCH and peer.variant is Variant.ALLGATHER and peer.kernel is Kernel.FLASH and peer.ring == 2
    with pytest.raises(BadInput, match="unknown dtype 'fp8'"):
        AttentionRequest.of(dtype="fp8")
    with pytest.raises(BadInput, match="torch has no variant 'zigzag'"):
        PeerRequest.of(impl="torch", variant="zigzag")
    for kind in (Kind.MODEL, Kind.ATTENTION, Kind.PEER):  # the registry's builders share the dataclasses' defaults
        extra = {"model": "flux"} if kind is Kind.MODEL else {"impl": "yunchang"} if kind is Kind.PEER else {}
        built = registry.get(kind).build_request(ulysses=2, ring=None, **extra)
        assert (built.ring, built.ulysses, built.kind) == (1, 2, kind)


def test_peer_ranks_get_members_and_refusals_are_typed():
    from cpdoctor.examinations.peer.probe import run_shape

    req = PeerRequest.of(impl="ring-flash-attn", variant="zigzag", causal=True)
    shape = run_shape(req, 0)
    assert shape.variant is Variant.ZIGZAG and shape.kernel is Kernel.FA
    peer = req.adapter
    why = peer.refusal(req.the_variant, req.the_kernel, True, DType.FP32, 2, 1, 240, 4)
    assert isinstance(why, Unsupported) and why.kind is UnsupportedKind.DOES_NOT_RUN and "refuses fp32" in why.message
    why = peer.refusal(req.the_variant, req.the_kernel, False, DType.BF16, 2, 1, 240, 4)
    assert isinstance(why, Unsupported) and why.kind is UnsupportedKind.REFUSED_BY_RELEASE and "causal=False" in why.message


@pytest.mark.parametrize(
    "args, option, word, choices",
    [
        (["check", "--dtype", "fp8"], "--dtype", "fp8", "'fp32', 'bf16', 'fp16'"),
        (["check", "--device", "tpu"], "--device", "tpu", "'auto', 'cpu', 'cuda'"),
        (["check", "--impl", "megatron"], "--impl", "megatron", "'diffusers', 'ring-flash-attn', 'yunchang', 'torch'"),
        (["model", "flux", "--dtype", "fp64"], "--dtype", "fp64", "'fp32', 'bf16', 'fp16'"),
        (["env", "--dtype", "fp64"], "--dtype", "fp64", "'auto', 'fp32', 'bf16', 'fp16'"),
        (["step", "t.py:f", "--reference", "bf16"], "--reference", "bf16", "'fp64', 'fp32'"),
    ],
)
def test_a_word_outside_the_vocabulary_is_exit_2_in_typers_words(args, option, word, choices):
    result = runner.invoke(app, args, env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert f"Invalid value for '{option}'" in text and f"'{word}' is not one of {choices}" in text, text


def test_help_lists_the_choices_and_no_type_after_a_switch():
    result = runner.invoke(app, ["check", "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0
    rows = {line.split()[1]: line for line in result.output.splitlines() if line.strip("│ ").startswith("--")}
    assert "<fp32|bf16|fp16>" in rows["--dtype"] and "<auto|cpu|cuda>" in rows["--device"]
    assert "<diffusers|ring-flash-attn|yunchang|torch>" in rows["--impl"]
    assert "<bool>" not in rows["--patch"] and "<bool>" not in rows["--emulate"] and "<bool>" not in rows["--causal"]


@pytest.mark.parametrize("command", [[], ["check"], ["doctor"], ["env"], ["model"], ["plan"], ["run"], ["step"]])
def test_no_help_prints_a_type_after_a_switch(command):
    """Not even typer's own `--help` (issue 32): every command, and the app."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output, [line for line in result.output.splitlines() if "<bool>" in line]
