"""Requests validate themselves: one line of bad input each, before any process starts."""

from __future__ import annotations

import pytest

from cpdoctor.errors import BadInput
from cpdoctor.examinations.attention.request import AttentionRequest, build_request, default_seq
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.request import validate_timeout


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(ring=0), "--ring must be at least 1"),
        (dict(ring=1, ulysses=1), "ring × ulysses ≥ 2"),
        (dict(ring=2.5), "--ring must be an integer"),
        (dict(ring=2, seq=511), "--seq 511 does not divide by ring × ulysses = 2"),
        (dict(ulysses=3, heads=8), "--heads 8 does not divide by --ulysses 3"),
        (dict(ring=2, dtype="fp8"), "unknown dtype 'fp8'"),
        (dict(ring=2, device="tpu"), "unknown device 'tpu'"),
        (dict(ring=2, mask_pad=512), "--mask-pad must be between 0 and seq-1"),
        (dict(ring=2, seed="1"), "--seed must be an integer"),
    ],
)
def test_bad_attention_requests(fields, message):
    with pytest.raises(BadInput, match=None) as info:
        build_request(**fields)
    assert message in str(info.value)


def test_defaults_fill_degrees_and_seq():
    assert build_request(ulysses=2).ring == 1 and build_request().ring == 2
    assert build_request(ring=3).seq == 513 == default_seq(3)


def test_unknown_keys_name_the_kind():
    with pytest.raises(BadInput, match="unknown attention-request keys: rings"):
        AttentionRequest.from_dict({"rings": 2})
    with pytest.raises(BadInput, match="unknown model-request keys: modle"):
        ModelRequest.from_dict({"modle": "flux"})


def test_round_trip():
    req = build_request(ring=2, ulysses=2, mask_pad=3, dtype="bf16")
    assert AttentionRequest.from_dict(req.to_dict()) == req and req.world_size == 4


def test_model_request_shares_the_layout_checks():
    with pytest.raises(BadInput, match="ring × ulysses ≥ 2"):
        ModelRequest(ring=1).validate()
    with pytest.raises(BadInput, match="--mask-pad must be between 0 and text-len - 1 = 7"):
        ModelRequest(text_len=8, mask_pad=8).validate()


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "10"])
def test_bad_timeouts(value):
    with pytest.raises(BadInput, match="--timeout must be a positive, finite number"):
        validate_timeout(value)
