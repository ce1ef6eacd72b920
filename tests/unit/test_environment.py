"""The typed Environment writes the JSON the environment dicts wrote before it: for each producer (an attention
rank, a model rank, a peer rank, `cpdoctor env`, `cpdoctor plan`) the dict the earlier code built from the same
inputs, spelled out here, and the Environment it builds now serialise to the same keys and values; a key the
earlier code did not write stays absent. The environment's four parts (the machine's software, the launch, the
attention backend, a peer's layout) hold every JSON key once; a report's findings keep the environment they ran
in."""

from __future__ import annotations

import platform
from types import SimpleNamespace

import pytest

from cpdoctor.report import Environment, Finding, Report, Verdict
from cpdoctor.report.environment import KEYS, PARTS, AttentionBackend, Launch, PeerLayout, Software
from cpdoctor.report.serialize import to_jsonable
from cpdoctor.vocabulary import DType


def _ctx() -> SimpleNamespace:
    import torch

    return SimpleNamespace(device=torch.device("cpu"), pg_backend="gloo", world_size=2)


def _same_json(built: Environment, before: dict) -> None:
    """`built` serialises as the earlier dict did, and the dict read back is the same environment."""
    assert built.to_jsonable() == to_jsonable(before)
    assert Environment.from_dict(before).to_jsonable() == to_jsonable(before)


def test_an_attention_rank_writes_the_keys_it_wrote_before():
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.attention.request import build_request
    from cpdoctor.examinations.measurement import rank_environment

    req = build_request(ring=2, dtype="bf16")
    before = {
        "torch": str(torch.__version__),
        "diffusers": compat.diffusers_version(),
        "python": platform.python_version(),
        "device": "cpu",
        "process_group": "gloo",
        "world_size": 2,
        "ring": 2,
        "ulysses": 1,
        "backend": "cpdoctor_cpu",
        "dtype": DType.BF16,
    }
    _same_json(rank_environment(_ctx(), "cpdoctor_cpu", req), before)
    emulated = rank_environment(_ctx(), "flash", req, "stand-ins")
    _same_json(emulated, {**before, "backend": "flash", "emulated": "stand-ins"})
    assert emulated.to_jsonable()["dtype"] == "bf16"


def test_a_model_rank_adds_its_model():
    import torch

    from cpdoctor.compat import diffusers as compat
    from cpdoctor.examinations.model.probe import _environment
    from cpdoctor.examinations.model.request import ModelRequest

    req = ModelRequest.of(model="flux", ring=2)
    before = {
        "torch": str(torch.__version__),
        "diffusers": compat.diffusers_version(),
        "python": platform.python_version(),
        "device": "cpu",
        "process_group": "gloo",
        "world_size": 2,
        "ring": 2,
        "ulysses": 1,
        "backend": "cpdoctor_cpu",
        "dtype": req.dtype,
        "model": "flux",
    }
    _same_json(_environment(_ctx(), "cpdoctor_cpu", req, None), before)


def test_a_peer_rank_writes_its_impl_variant_kernel_layout_and_no_backend():
    import torch

    from cpdoctor.examinations.peer.probe import PeerFacts, environment
    from cpdoctor.examinations.peer.request import build_request

    req = build_request(impl="ring-flash-attn", variant="zigzag", causal=True, ring=2)
    facts = PeerFacts("ring-flash-attn", "2.8.3", "zigzag", str(req.kernel), "zigzag", True, True)
    before = {
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "device": "cpu",
        "process_group": "gloo",
        "world_size": 2,
        "ring": 2,
        "ulysses": 1,
        "impl": f"{req.impl} 2.8.3",
        "variant": req.variant,
        "kernel": req.kernel,
        "layout": "zigzag",
        "dtype": req.dtype,
        "emulated": "CUDA kernels emulated on CPU by cpdoctor's stand-ins",
    }
    built = environment(_ctx(), req, facts)
    _same_json(built, before)
    assert "backend" not in built.to_jsonable() and "diffusers" not in built.to_jsonable()


ENV_KEYS = [
    "python", "os", "cpdoctor", "torch", "torch_cuda_build", "cuda_available", "cudnn", "nccl", "gloo",
    "devices", "diffusers", "attention_packages", "world", "settings",
]  # fmt: skip
"""`cpdoctor env`'s facts in the order the earlier dict listed them (the order its table shows them)."""


def test_env_lists_its_facts_in_the_order_it_did_before():
    from cpdoctor.examinations.env.facts import collect_environment

    env = collect_environment()
    assert list(env.to_jsonable()) == ENV_KEYS
    before = dict(env.items())  # the values the facts gathered, as the earlier dict held them
    _same_json(env, before)
    probed = Environment(
        env.software, Launch(emulated="stand-ins"), AttentionBackend(probe_device="cpu", probe_dtype="fp32", ring_class="x.Ring")
    )
    assert list(probed.to_jsonable()) == [*ENV_KEYS, "emulated", "probe_device", "probe_dtype", "ring_class"]


def test_plan_writes_torch_diffusers_and_the_meta_device():
    import torch

    from cpdoctor.compat.packages import installed_version
    from cpdoctor.examinations.plan.planner import _environment

    before = {"torch": str(torch.__version__), "diffusers": installed_version("diffusers"), "device": "meta"}
    _same_json(_environment(), before)


def test_an_unknown_key_is_refused():
    with pytest.raises(TypeError, match="flavour"):
        Environment.from_dict({"torch": "2.9", "flavour": "x"})


def test_a_finding_keeps_the_environment_it_ran_in():
    ran = Environment(Software(torch="2.9"), Launch(world_size=2, dtype=DType.BF16), peer=PeerLayout("torch 2.9", "allgather"))
    peer = Finding("torch ring 2", Verdict.PASS, "fine", environment=ran)
    machine = Environment(Software(torch="2.9", python="3.12"))
    plain = Finding("ring 2", Verdict.PASS, "fine")
    report = Report.of([peer, plain], machine, SimpleNamespace(to_dict=dict))
    data = report.to_dict()
    assert data["findings"][0]["environment"] == {
        "torch": "2.9",
        "world_size": 2,
        "impl": "torch 2.9",
        "variant": "allgather",
        "dtype": "bf16",
    }
    assert data["findings"][1]["environment"] == data["environment"] == {"torch": "2.9", "python": "3.12"}
    assert ran.machine_only().to_jsonable() == {"torch": "2.9"}


def test_the_parts_hold_every_key_once_and_a_suite_keeps_the_machine_and_where_its_ranks_ran():
    names = [f for part in PARTS for f in part.__dataclass_fields__]
    assert sorted(names) == sorted(KEYS) and len(names) == len(set(names)) == 31
    everything = Environment.from_dict({key: key for key in KEYS})
    assert list(everything.to_jsonable()) == list(KEYS)
    kept = set(everything.machine_only().to_jsonable())
    per_check = {"world_size", "ring", "ulysses", "backend", "dtype", "model", "impl", "variant", "kernel", "layout", "emulated"}
    assert kept == set(KEYS) - per_check
    assert {"torch", "diffusers", "python", "device", "process_group"} <= kept
