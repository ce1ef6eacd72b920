"""A watched step's degrees for a model whose CP is not diffusers' (examinations/step/watcher/degrees.py), the refusal of
one run where no reference copy can be built, and gradients compared as full tensors under bare names
(examinations/step/watcher/full_grads.py)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.errors import BadInput  # noqa: E402
from cpdoctor.examinations.step.watcher.degrees import (  # noqa: E402
    Declared,
    DegreeSource,
    consecutive_group,
    job_degrees,
    mesh_layout,
    one_run_refusal,
    rebuildable,
    two_run_command,
)
from cpdoctor.examinations.step.watcher.full_grads import compare, full_gradients  # noqa: E402


class FakeMesh:
    """What degrees.py reads of a DeviceMesh: its dimension names and the tensor of global ranks."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...] | None) -> None:
        self.mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        self.mesh_dim_names = names


def test_declared_degrees_and_consecutive_groups():
    d = job_degrees(rank=5, world=8, declared=Declared(ring=2, dp=4))
    assert (d.ring, d.ulysses, d.dp, d.cp, d.source) == (2, 1, 4, 2, DegreeSource.ARGUMENTS)
    assert d.cp_ranks == (4, 5) == consecutive_group(5, 2)
    assert job_degrees(rank=3, world=4, declared=Declared(ring=2, ulysses=2)).cp_ranks == (0, 1, 2, 3)
    world = job_degrees(rank=1, world=4, declared=Declared(dp=2))  # torchrun's world and the declared dp
    assert world.source is DegreeSource.WORLD and world.cp == 2 and world.cp_ranks == (0, 1)


def test_a_group_or_mesh_the_user_passes():
    g = job_degrees(rank=2, world=4, group_ranks=[2, 3])
    assert g.source is DegreeSource.GROUP and g.cp == 2 and g.dp == 2 and g.cp_ranks == (2, 3)
    titan = FakeMesh((2, 2), ("batch", "cp"))  # torchtitan: (batch, cp), CP innermost
    assert mesh_layout(titan, 3) == (2, 1, (2, 3))
    assert job_degrees(rank=3, world=4, mesh=titan).source is DegreeSource.MESH
    strided = FakeMesh((2, 2), ("cp", "dp"))  # CP outer: groups of strided ranks
    assert mesh_layout(strided, 1) == (2, 1, (1, 3))
    usp = FakeMesh((2, 2, 2), ("dp", "ring", "ulysses"))  # diffusers' convention
    assert mesh_layout(usp, 6) == (2, 2, (4, 5, 6, 7))
    assert mesh_layout(FakeMesh((4,), None), 2) == (4, 1, (0, 1, 2, 3))  # a 1-D CP mesh, unnamed
    with pytest.raises(BadInput, match="not in the mesh"):
        mesh_layout(FakeMesh((2,), ("cp",)), 5)


def test_the_diffusers_config_is_one_source_among_others():
    d = job_degrees(rank=0, world=2, diffusers=(2, 1), diffusers_ranks=(0, 1))
    assert d.source is DegreeSource.DIFFUSERS and d.ring == 2
    agree = job_degrees(rank=0, world=2, declared=Declared(ring=2), diffusers=(2, 1), diffusers_ranks=(0, 1))
    assert agree.source is DegreeSource.ARGUMENTS


def test_disagreeing_or_missing_degrees_are_bad_input():
    with pytest.raises(BadInput, match="said two ways"):
        job_degrees(rank=0, world=4, declared=Declared(ring=2), group_ranks=[0, 1, 2, 3])
    with pytest.raises(BadInput, match="nothing says"):
        job_degrees(rank=0, world=4)
    with pytest.raises(BadInput, match="does not divide"):
        job_degrees(rank=0, world=4, declared=Declared(ring=3))
    with pytest.raises(BadInput, match="is 8 ranks"):
        job_degrees(rank=0, world=4, declared=Declared(ring=2, dp=4))


def test_one_run_refusal_names_the_two_run_command():
    class FluxModel(torch.nn.Module):
        pass

    text = one_run_refusal(FluxModel(), "train.py:step", Declared(ring=2, dp=2))
    assert "FluxModel cannot be examined in one run" in text and "cpdoctor step train.py:step --ring 2 --dp 2" in text
    assert not rebuildable(FluxModel())
    assert two_run_command(None, None) == "cpdoctor step path/to/train.py:step --ring 2"


def test_a_diffusers_model_is_rebuildable():
    diffusers = pytest.importorskip("diffusers")
    tiny = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
    )  # fmt: skip
    assert rebuildable(tiny)


def test_gradients_compare_under_bare_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    wrapped = copy.deepcopy(plain)
    wrapped[0] = checkpoint_wrapper(wrapped[0])  # its parameters are named 0._checkpoint_wrapped_module.weight, ...
    x = torch.randn(5, 3)
    for m in (plain, wrapped):
        m(x).pow(2).sum().backward()
    wrapped[1].bias.requires_grad_(False)
    got, ref = full_gradients(wrapped), full_gradients(plain)
    assert "0.weight" in got and "1.bias" not in got
    c = compare(got, ref)
    assert c.rel_err < 1e-6 and abs(c.factor - 1) < 1e-6 and c.only_expected == ("1.bias",) and not c.only_got
    halved = compare({n: g / 2 for n, g in ref.items()}, ref)
    assert abs(halved.factor - 0.5) < 1e-12 and abs(halved.rel_err - 0.5) < 1e-12 and halved.same_names
    plain[0].weight.grad = None
    assert torch.count_nonzero(full_gradients(plain)["0.weight"]) == 0  # no gradient: zeros, as a sum reads it
    with pytest.raises(ValueError, match="shape"):
        compare({"a": torch.zeros(2)}, {"a": torch.zeros(3)})


def test_dtensor_gradients_are_gathered_whole():
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        layer = torch.nn.Linear(4, 2)
        full = torch.randn(2, 4)
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        layer.weight.grad = distribute_tensor(full, mesh, [Shard(0)])
        got = full_gradients(layer)
        assert type(got["weight"]) is torch.Tensor and torch.equal(got["weight"], full)
    finally:
        dist.destroy_process_group()
