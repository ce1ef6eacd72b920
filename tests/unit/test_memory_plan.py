"""The memory plan of a model examination (cpdoctor.model_zoo.memory): pure arithmetic, no torch."""

from __future__ import annotations

import pytest
from hub_cache import FLUX_DEV

from cpdoctor.model_zoo import memory
from cpdoctor.model_zoo.memory import PROCESS_OVERHEAD, GiB, Sizes

FLUX_DOUBLE, FLUX_SINGLE, FLUX_OTHER = 339_831_296, 141_591_808, 64_124_992
"""FLUX.1-dev's parameters per double block, per single block and outside the stacks (a meta build)."""


def flux_sizes(n: int, dtype: str = "bf16", world: int = 2, tokens: int = 256 + 64, device: str = "cpu") -> Sizes:
    params = FLUX_OTHER + min(n, 19) * FLUX_DOUBLE + min(n, 38) * FLUX_SINGLE
    return Sizes(
        params=params, blocks=min(n, 19) + min(n, 38), tokens=tokens, hidden=3072, batch=1, dtype=dtype, world=world, device=device
    )


def test_parts_are_bytes_per_parameter_and_token():
    s = Sizes(params=1000, blocks=2, tokens=64, hidden=8, batch=1, dtype="bf16", world=4, device="cpu")
    rank = memory.cp_rank(s)
    assert rank.weights == rank.grads == 2000
    assert rank.other == 4000  # the flat fp32 gradients, all-reduced in place
    assert rank.activations == 3 * memory.ACT_ELEMENTS_PER_TOKEN * 16 * 8 * 2  # a quarter of the tokens
    ref = memory.single(s, "fp64")
    assert ref.weights == ref.grads == 8000 and ref.activations == 4 * 4 * rank.activations


def test_reference_is_fp64_where_it_fits_else_fp32():
    s = flux_sizes(1)
    roomy = memory.plan(s, available=200 * GiB)
    assert roomy.reference_dtype == "fp64" and roomy.fits
    # fp64 needs ~ 2 x 8 bytes a parameter on rank 0; fp32 half of that
    fp64_peak = roomy.device_peak
    tight = memory.plan(s, available=int(fp64_peak / memory.HEADROOM) - GiB)
    assert tight.reference_dtype == "fp32" and tight.fits and tight.device_peak < fp64_peak


def test_host_peak_counts_every_rank_on_cpu_and_rank0_on_gpu():
    cpu = memory.plan(flux_sizes(1, world=4), available=None)
    per = PROCESS_OVERHEAD + cpu.per_rank.total
    assert cpu.device_peak >= 4 * per
    gpu = memory.plan(flux_sizes(1, world=4, device="cuda"), available=None)
    assert gpu.device_peak == gpu.rank0_peak - PROCESS_OVERHEAD
    assert cpu.fits and gpu.fits  # unknown availability never refuses


def test_full_flux_does_not_fit_here_and_most_blocks_finds_the_largest_that_does():
    avail = 24 * GiB
    full = memory.plan(flux_sizes(38), avail)
    assert not full.fits
    n = memory.most_blocks(lambda k: memory.plan(flux_sizes(k), avail), 38)
    assert 1 <= n < 38
    assert memory.plan(flux_sizes(n), avail).fits and not memory.plan(flux_sizes(n + 1), avail).fits
    assert memory.most_blocks(lambda k: memory.plan(flux_sizes(k), 1 * GiB), 38) == 0


@pytest.mark.parametrize("text, expected", [("MemTotal: 10 kB\nMemAvailable:    2048 kB\n", 2048 * 1024), ("MemTotal: 10 kB\n", None)])
def test_available_host_memory_reads_meminfo(text, expected):
    assert memory.available_host_memory(text) == expected


def test_plan_lines_and_dict():
    p = memory.plan(flux_sizes(1), 24 * GiB, {"transformer_blocks": 1, "single_transformer_blocks": 1})
    lines = p.lines()
    assert lines[0].startswith("memory plan: 545.5M parameters (transformer_blocks 1, single_transformer_blocks 1)")
    assert "reference (fp64)" in lines[2] and "available" in lines[3]
    d = p.to_jsonable()
    assert d["fits"] is True and d["per_rank"]["total"] == p.per_rank.total and d["blocks"]["transformer_blocks"] == 1


def test_prepare_refuses_what_does_not_fit_and_names_the_blocks_that_do(monkeypatch):
    """choose_blocks on FLUX.1-dev's config (a meta survey, no weights) with 24 GiB available: the whole model
    does not fit, --blocks 1 does, and a --blocks that does not fit names the largest one that does."""
    import torch
    from diffusers import FluxTransformer2DModel

    from cpdoctor.errors import BadInput
    from cpdoctor.examinations.model import prepare as probe
    from cpdoctor.examinations.model.request import ModelRequest
    from cpdoctor.examinations.model.spec import ModelSpec, model_survey

    config = dict(FLUX_DEV)
    spec = ModelSpec(FluxTransformer2DModel, "flux", "FluxTransformer2DModel", config, "test", None)
    survey = model_survey(spec)
    kwargs = {"hidden_states": torch.empty(1, 256, 64, device="meta"), "encoder_hidden_states": torch.empty(1, 64, 4096, device="meta")}
    monkeypatch.setattr(probe, "available_memory", lambda device: 24 * GiB)
    req = ModelRequest(model="x", ring=2, dtype="bf16", device="cpu")
    best = probe.choose_blocks(spec, req, survey, kwargs)
    assert 1 <= best < survey.depth
    with pytest.raises(BadInput, match=rf"--blocks 30 needs .* GiB on cpu .*: --blocks {best} fits"):
        probe.choose_blocks(spec, ModelRequest(model="x", ring=2, dtype="bf16", device="cpu", blocks=30), survey, kwargs)
    monkeypatch.setattr(probe, "available_memory", lambda device: 2 * GiB)
    with pytest.raises(BadInput, match="does not fit even with --blocks 1"):
        probe.choose_blocks(spec, req, survey, kwargs)
