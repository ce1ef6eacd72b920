"""A CP rank's inputs against the run without CP's (examinations/step/judgment/input_layouts.py): replicated, this rank's
shard in a layout torch's context parallelism uses (made here with torch's own sharding code where it is
importable), or wrong with what it is instead; and the CP group's verdict on each input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cpdoctor.examinations.step.judgment.input_layouts import (  # noqa: E402
    InputLayout,
    Mismatch,
    Placement,
    classify,
    classify_all,
    judge_group,
    judge_inputs,
    shard_of,
)
from cpdoctor.peer_impls.layouts import Layout  # noqa: E402


def torch_head_tail(full: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard as torch's `_context_parallel_buffers` makes it with `_HeadTailLoadBalancer`: gather
    by the balancer's indices along the sequence dimension, then `Shard(dim)` (a chunk)."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    index = balancer._HeadTailLoadBalancer(full.shape[dim], cp, "cpu")._generate_indices()[0].long()
    return full.index_select(dim, index).chunk(cp, dim)[rank]


@pytest.fixture
def img() -> torch.Tensor:
    return torch.randn(2, 16, 5, generator=torch.Generator().manual_seed(0))


def test_equal_inputs_are_replicated(img):
    assert classify("timesteps", torch.tensor([0.3]), torch.tensor([0.3]), 2, 1).placement is Placement.REPLICATED
    nan = torch.tensor([float("nan"), 1.0])
    assert classify("x", nan, nan.clone(), 2, 0).placement is Placement.REPLICATED
    assert classify("guidance", 3.5, 3.5, 2, 0).placement is Placement.REPLICATED


@pytest.mark.parametrize("cp", [2, 4])
def test_contiguous_shards_are_this_ranks_shard(img, cp):
    for rank in range(cp):
        got = classify("img", img.chunk(cp, 1)[rank], img, cp, rank)
        assert got.placement is Placement.SHARD and got.dim == 1 and got.layouts[0] is Layout.CONTIGUOUS


@pytest.mark.parametrize("cp", [2, 4])
def test_torch_head_tail_shards_are_recognised(img, cp):
    for rank in range(cp):
        local = torch_head_tail(img, 1, cp, rank)
        assert torch.equal(local, shard_of(img, 1, Layout.HEAD_TAIL, cp, rank))
        got = classify("img", local, img, cp, rank)
        assert got.placement is Placement.SHARD and got.layouts == (Layout.HEAD_TAIL,) and got.dim == 1


def test_stripes_and_uneven_chunks(img):
    for rank in range(4):
        got = classify("img", img[:, rank::4], img, 4, rank)
        assert got.placement is Placement.SHARD and Layout.STRIPE in got.layouts
    odd = torch.arange(10.0).reshape(1, 5, 2)
    assert classify("txt", odd[:, 3:], odd, 2, 1).layouts == (Layout.CONTIGUOUS,)  # torch's Shard: chunk sizes 3, 2


def test_a_timestep_drawn_per_rank_is_wrong_with_its_difference():
    got = classify("timesteps", torch.tensor([0.71]), torch.tensor([0.25]), 2, 1)
    assert got.placement is Placement.WRONG and got.mismatch is Mismatch.VALUES and "relative" in got.detail


def test_noise_drawn_per_rank_is_a_part_but_no_ranks_shard(img):
    other = torch.randn(img.shape, generator=torch.Generator().manual_seed(1))
    got = classify("img", other.chunk(2, 1)[1], img, 2, 1)
    assert got.placement is Placement.WRONG and got.mismatch is Mismatch.NOT_A_SHARD and got.dim == 1


def test_another_ranks_chunk_is_named(img):
    got = classify("img", img.chunk(2, 1)[1], img, 2, 0)
    assert got.mismatch is Mismatch.OTHER_RANKS_SHARD and got.other_rank == 1 and "CP rank 1's contiguous" in got.detail


def test_shapes_dtypes_and_values_that_do_not_fit(img):
    assert classify("img", img[:, :5, :3], img, 2, 0).mismatch is Mismatch.SHAPE  # two dimensions cut
    assert classify("img", img.double(), img, 2, 0).mismatch is Mismatch.DTYPE
    assert classify("n", 4, 5, 2, 0).mismatch is Mismatch.VALUE
    assert classify("n", img, 5, 2, 0).mismatch is Mismatch.VALUE


def test_classify_all_names_inputs_only_one_side_has(img):
    got = {x.name: x for x in classify_all({"img": img, "extra": 1}, {"img": img, "y": 2}, 2, 0)}
    assert got["img"].placement is Placement.REPLICATED
    assert got["extra"].mismatch is Mismatch.MISSING and got["y"].mismatch is Mismatch.MISSING


def test_a_group_agrees_on_one_layout(img):
    ranks = (4, 5)
    shards = [classify("img", img.chunk(2, 1)[r], img, 2, r) for r in range(2)]
    group = judge_group(shards, ranks)
    assert group.placement is Placement.SHARD and group.layout is Layout.CONTIGUOUS and group.dim == 1
    zeros = torch.zeros(1, 8, 3)  # torchtitan's text position ids: every layout's shard looks alike
    constant = judge_group([classify("txt_ids", zeros[:, :4], zeros, 2, r) for r in range(2)], ranks)
    assert constant.placement is Placement.SHARD and constant.layout is Layout.CONTIGUOUS
    assert judge_group([classify("t", torch.ones(1), torch.ones(1), 2, r) for r in range(2)], ranks).placement is Placement.REPLICATED


def test_a_group_that_mixes_layouts_or_has_a_wrong_rank_is_wrong(img):
    ranks = (0, 1)
    mixed = [classify("img", img.chunk(2, 1)[0], img, 2, 0), classify("img", torch_head_tail(img, 1, 2, 1), img, 2, 1)]
    group = judge_group(mixed, ranks)
    assert group.placement is Placement.WRONG and len(group.wrong_ranks) == 1 and "peers hold" in group.describe()
    drawn = judge_group([classify("timesteps", torch.tensor([0.1 * (r + 1)]), torch.tensor([0.1]), 2, r) for r in range(2)], ranks)
    assert drawn.placement is Placement.WRONG and drawn.wrong_ranks == (1,) and drawn.describe().startswith("timesteps: rank 1:")


def test_judge_inputs_covers_every_name(img):
    rank0 = classify_all({"img": img.chunk(2, 1)[0], "t": torch.ones(1)}, {"img": img, "t": torch.ones(1)}, 2, 0)
    rank1 = classify_all({"img": img.chunk(2, 1)[1]}, {"img": img, "t": torch.ones(1)}, 2, 1)
    got = {g.name: g for g in judge_inputs([rank0, rank1], (0, 1))}
    assert got["img"].placement is Placement.SHARD
    assert got["t"].placement is Placement.WRONG and got["t"].wrong_ranks == (1,)
    assert isinstance(rank0[0], InputLayout) and rank0[0].right


def test_a_tensor_computed_through_the_model_is_judged_within_a_tolerance(img):
    """An output gradient of a sharded output: each rank's is its shard of the run without CP's, up to rounding."""
    rounded = img * (1 + 1e-7)
    assert classify("out_grad", rounded.chunk(2, 1)[1], img, 2, 1).placement is Placement.WRONG  # exact by default
    got = classify("out_grad", rounded.chunk(2, 1)[1], img, 2, 1, rtol=1e-5)
    assert got.placement is Placement.SHARD and got.layouts[0] is Layout.CONTIGUOUS
    assert classify("out_grad", rounded, img, 2, 0, rtol=1e-5).placement is Placement.REPLICATED
    assert classify("out_grad", img * 1.5, img, 2, 0, rtol=1e-5).mismatch is Mismatch.VALUES
    assert classify_all({"o": rounded}, {"o": img}, 2, 0, rtol=1e-5)[0].right


# -- a CP group against the run without CP (examinations/step/judgment/inputs.py: which replica, which inputs are wrong) ----


def _peer(rank: int, cp_place: int, mine: dict, replicas: list[dict], cp: int = 2):
    """A CP rank's record as the examination gathers it: its inputs' fingerprints and, for every rank of the run
    without CP, what its inputs are against that rank's (each rank classifies its own)."""
    from cpdoctor.examinations.step.watcher.messages import InputPrint, PeerRecord, ReplicaLayouts
    from cpdoctor.examinations.step.watcher.record import digest

    layouts = tuple(ReplicaLayouts(r, classify_all(mine, full, cp, cp_place), ()) for r, full in enumerate(replicas))
    prints = tuple(InputPrint(n, digest(v), None) for n, v in mine.items())
    return PeerRecord(rank, 1, 1, prints, "", "", (), None, (), (), layouts)


def _sample(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"img": torch.randn(1, 8, 4, generator=gen), "timesteps": torch.rand(1, generator=gen), "guidance": 3.5}


def _shards(full: dict, cp: int = 2) -> list[dict]:
    return [{**full, "img": full["img"].chunk(cp, 1)[r]} for r in range(cp)]


def test_a_cp_group_is_judged_against_the_replica_it_fed_whole():
    from cpdoctor.examinations.step.judgment.inputs import judge_against_run

    replicas = [_sample(0), _sample(1)]  # the run without CP on 2 data-parallel ranks
    group = [_peer(2 + r, r, mine, replicas) for r, mine in enumerate(_shards(replicas[1]))]  # the second CP group
    judged = judge_against_run(group, same_weights={0, 1}, fallback=1)
    assert judged.replica == 1 and not judged.diffs and judged.by_layout
    assert {g.name: g.placement for g in judged.inputs} == {
        "img": Placement.SHARD,
        "timesteps": Placement.REPLICATED,
        "guidance": Placement.REPLICATED,
    }
    assert judge_against_run(group, same_weights={0}, fallback=1).replica is None  # other weights: not that replica


def test_an_input_one_cp_rank_drew_apart_is_named_with_its_rank():
    from cpdoctor.examinations.step.judgment.inputs import judge_against_run

    full = _sample(0)
    drawn = _sample(7)  # rank 1 drew its own noise and timestep
    mine = [_shards(full)[0], {**_shards(drawn)[1], "guidance": 3.5}]
    judged = judge_against_run([_peer(r, r, m, [full]) for r, m in enumerate(mine)], same_weights={0}, fallback=0)
    assert judged.replica is None and judged.by_layout and judged.against == 0
    assert {d.name: d.different for d in judged.diffs} == {"img": (1,), "timesteps": (1,)}
    assert "no CP rank's shard" in next(d.detail for d in judged.diffs if d.name == "img")
    assert [g.name for g in judged.right()] == ["guidance"]


def test_data_that_depend_on_the_layout_are_not_blamed_on_cp():
    """No CP rank fed what any rank of the run without CP did (data seeded by the world size): nothing is named
    unless the peers' whole inputs differ between them; a shard has nothing to be compared with."""
    from cpdoctor.examinations.step.judgment.inputs import judge_against_run

    full, other = _sample(0), _sample(5)
    agree = [_peer(r, r, m, [full]) for r, m in enumerate(_shards(other))]
    judged = judge_against_run(agree, same_weights={0}, fallback=0)
    assert judged.replica is None and not judged.diffs and not judged.by_layout
    apart = [_peer(r, r, m, [full]) for r, m in enumerate([_shards(other)[0], _shards(_sample(6))[1]])]
    assert {d.name: d.different for d in judge_against_run(apart, same_weights={0}, fallback=0).diffs} == {"timesteps": (1,)}
