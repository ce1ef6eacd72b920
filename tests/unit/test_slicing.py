"""A model sliced to fit (cpdoctor.model_zoo.slicing): the block stacks and the config keys that size them, the
config rewrite, which tensors N blocks need, and a sliced load that reads exactly those, one get_tensor each."""

from __future__ import annotations

import re

import pytest
from hub_cache import TINY_FLUX, TINY_QWEN_IMAGE

from cpdoctor.errors import BadInput
from cpdoctor.model_zoo import slicing

FLUX33 = dict(TINY_FLUX, num_layers=3, num_single_layers=3)


@pytest.fixture(scope="module")
def flux33(tmp_path_factory):
    """A tiny Flux with 3 double + 3 single blocks saved sharded with an index; the model it came from."""
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(5)
    model = FluxTransformer2DModel(**FLUX33)
    path = tmp_path_factory.mktemp("flux33")
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="40KB")
    return model, path


def test_stacks_and_the_keys_that_size_them():
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

    survey = slicing.survey(FluxTransformer2DModel, FLUX33)
    assert [(s.name, s.depth, s.key) for s in survey.stacks] == [
        ("transformer_blocks", 3, "num_layers"),
        ("single_transformer_blocks", 3, "num_single_layers"),
    ]
    assert survey.depth == 3 and survey.blocks(1) == 2 and survey.blocks(5) == 6
    assert survey.params(3) == sum(p.numel() for p in FluxTransformer2DModel(**FLUX33).parameters())
    qwen = slicing.survey(
        QwenImageTransformer2DModel,
        TINY_QWEN_IMAGE,
    )
    assert [(s.name, s.depth, s.key) for s in qwen.stacks] == [("transformer_blocks", 2, "num_layers")]


def test_config_rewrite():
    from diffusers import FluxTransformer2DModel

    stacks = slicing.survey(FluxTransformer2DModel, FLUX33).stacks
    cut = slicing.sliced_config(FLUX33, stacks, 1)
    assert cut["num_layers"] == 1 and cut["num_single_layers"] == 1 and cut["attention_head_dim"] == 16
    assert slicing.sliced_config(FLUX33, stacks, 3) == FLUX33
    keyless = [slicing.Stack("blocks", 4, None, "Block")]
    with pytest.raises(BadInput, match="no config key sizes it"):
        slicing.sliced_config({"depth_x": 4}, keyless, 2)


def test_selected_keys_are_the_embedders_the_first_blocks_and_the_output_layers(flux33):
    from diffusers import FluxTransformer2DModel

    model, _ = flux33
    everything = list(model.state_dict())
    cut = slicing.sliced_config(FLUX33, slicing.survey(FluxTransformer2DModel, FLUX33).stacks, 1)
    keys = slicing.selected_keys(FluxTransformer2DModel, cut)
    expected = [k for k in everything if not re.match(r"(single_)?transformer_blocks\.[12]\.", k)]
    assert keys == expected
    assert any(k.startswith("x_embedder.") for k in keys) and any(k.startswith("proj_out.") for k in keys)
    assert any(k.startswith("single_transformer_blocks.0.") for k in keys)


def test_sliced_load_reads_only_its_tensors_one_at_a_time(flux33, monkeypatch):
    import safetensors
    import torch
    from diffusers import FluxTransformer2DModel

    model, path = flux33
    real = safetensors.safe_open
    calls = {"get_tensor": 0, "opened": []}

    class Counting:
        def __init__(self, file, framework, **kw):
            self.inner = real(file, framework, **kw)
            calls["opened"].append(file)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            calls["get_tensor"] += 1
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    index = slicing.index_file_of(files, str(path), None)
    where = slicing.weight_map(files, index)
    assert calls["opened"] == []  # the index alone says where each tensor lies
    stats = slicing.ReadStats()
    cut = slicing.sliced_config(FLUX33, slicing.survey(FluxTransformer2DModel, FLUX33).stacks, 1)
    sliced = slicing.load_sliced(FluxTransformer2DModel, cut, where, stats, dtype=torch.float32)
    needed = slicing.selected_keys(FluxTransformer2DModel, cut)
    assert calls["get_tensor"] == stats.tensors_read == len(needed) < len(where) == stats.tensors_in_checkpoint
    assert len(set(calls["opened"])) == stats.files_opened < len(files)
    full = model.state_dict()
    for name, t in sliced.state_dict().items():
        assert torch.equal(t, full[name]), name
    assert not any(p.is_meta for p in sliced.parameters())
    assert len(sliced.transformer_blocks) == 1 and len(sliced.single_transformer_blocks) == 1


def test_missing_tensor_is_one_line(flux33):
    _, path = flux33
    with pytest.raises(BadInput, match="has no tensor nope"):
        slicing.read_tensors(["nope"], {})
