"""Peers without processes: token layouts against the peers' own sharding, requests refused with the
implementation's own reasons, UNSUPPORTED from the parent, and the peer rules fed numbers."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest
import torch

from cpdoctor.errors import BadInput, UnsupportedKind
from cpdoctor.examinations.peer import EXAMINATION
from cpdoctor.examinations.peer import judge as peer_judge
from cpdoctor.examinations.peer.catalog import doctor_checks, installed_peers
from cpdoctor.examinations.peer.probe import PeerFacts
from cpdoctor.examinations.peer.request import build_request
from cpdoctor.launch.jobs import Case, FailureKind, RankFailure
from cpdoctor.peer_impls import Impl, adapter
from cpdoctor.peer_impls.layouts import Layout, cu_seqlens, token_indices, varlen_lengths
from cpdoctor.peer_impls.source import package_root
from cpdoctor.report import TensorRow, Verdict

RFA = package_root("ring_flash_attn") is not None
YUNCHANG = package_root("yunchang") is not None
needs_rfa = pytest.mark.skipif(not RFA, reason="ring-flash-attn is not installed (pip install 'cpdoctor[peers]')")
needs_yunchang = pytest.mark.skipif(not YUNCHANG, reason="yunchang is not installed (pip install 'cpdoctor[peers]')")

# ---------------------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize(("ring", "ulysses"), [(2, 1), (3, 1), (4, 1), (2, 2), (1, 4)])
def test_every_layout_partitions_the_sequence(layout, ring, ulysses):
    seq = 240
    held = [token_indices(layout, seq, ring, ulysses, r) for r in range(ring * ulysses)]
    assert sorted(t for ts in held for t in ts) == list(range(seq))
    assert len({len(ts) for ts in held}) == 1


def test_zigzag_holds_chunk_r_and_its_mirror():
    assert token_indices(Layout.ZIGZAG, 8, 2, 1, 0) == [0, 1, 6, 7]
    assert token_indices(Layout.ZIGZAG, 8, 2, 1, 1) == [2, 3, 4, 5]


def test_stripe_is_round_robin():
    assert token_indices(Layout.STRIPE, 9, 3, 1, 1) == [1, 4, 7]


def test_head_tail_is_torchs_load_balancer():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    for world in (2, 3, 4):
        order = _HeadTailLoadBalancer(48, world, "cpu")._generate_indices()[0].tolist()
        ours = [t for r in range(world) for t in token_indices(Layout.HEAD_TAIL, 48, world, 1, r)]
        assert ours == order


@needs_yunchang
@pytest.mark.parametrize(("ring", "ulysses"), [(2, 1), (2, 2), (4, 1), (1, 2), (3, 2)])
def test_stripe_and_zigzag_match_yunchangs_extract_functions(monkeypatch, ring, ulysses):
    """Every yunchang variant's layout against yunchang's own `EXTRACT_FUNC_DICT` function, fed the process
    groups its own `set_seq_parallel_pg` builds (torch.distributed answered by the rank lists: no processes)."""
    import yunchang.comm.extract_local as extract
    from yunchang.globals import PROCESS_GROUP, set_seq_parallel_pg

    from cpdoctor.peer_impls.yunchang import SPEC

    seq, world = 48, ring * ulysses
    monkeypatch.setattr(torch.distributed, "new_group", tuple)  # a group is its rank list
    for name in ("RING_PG", "ULYSSES_PG"):
        monkeypatch.setattr(PROCESS_GROUP, name, None)
    tokens = torch.arange(seq).view(1, seq, 1)
    checked = set()
    for rank in range(world):
        set_seq_parallel_pg(ulysses, ring, rank, world)
        fake_dist = types.SimpleNamespace(
            get_rank=lambda group=None, rank=rank: group.index(rank),
            get_world_size=lambda group=None: len(group),
        )
        monkeypatch.setattr(extract, "dist", fake_dist)
        for variant in SPEC.variants:
            held = extract.EXTRACT_FUNC_DICT[variant.name](tokens, rank, world, ring, ulysses)
            assert held.flatten().tolist() == token_indices(variant.layout, seq, ring, ulysses, rank), (variant.name, rank)
            checked.add(variant.layout)
    assert checked == {Layout.CONTIGUOUS, Layout.ZIGZAG, Layout.STRIPE}


def test_varlen_lengths_are_uneven_and_sum_to_the_total():
    lengths = varlen_lengths(240, 3)
    assert sum(lengths) == 240 and len(set(lengths)) == 3
    assert cu_seqlens(lengths) == [0, lengths[0], lengths[0] + lengths[1], 240]


# ---------------------------------------------------------------------------------------------------------
# requests: the implementation's own reasons
# ---------------------------------------------------------------------------------------------------------


def test_unknown_impl_lists_the_known_ones():
    with pytest.raises(BadInput, match="unknown --impl 'megatron' \\(one of diffusers, ring-flash-attn, yunchang, torch\\)"):
        build_request(impl="megatron")


def test_defaults_are_the_first_variant_and_kernel():
    req = build_request(impl="ring-flash-attn")
    assert (req.variant, req.kernel, req.ring, req.ulysses, req.dtype) == ("basic", "fa", 2, 1, "bf16")
    assert build_request(impl="torch").kernel == "flash"


@pytest.mark.parametrize(
    ("impl", "variant", "said", "where"),
    [
        ("ring-flash-attn", "zigzag", "zigzag ring is meaningless for causal=False", "ring_flash_attn/zigzag_ring_flash_attn.py:"),
        ("ring-flash-attn", "stripe", "stripe flash attn only supports causal attention", "ring_flash_attn/stripe_flash_attn.py:"),
        ("yunchang", "zigzag", "zigzag ring is meaningless for causal=False", "yunchang/ring/zigzag_ring_flash_attn.py:"),
    ],
)
def test_a_variant_refused_without_causal_says_the_peers_own_words(impl, variant, said, where):
    if package_root(adapter(Impl(impl)).spec.module) is None:
        pytest.skip(f"{impl} is not installed")
    with pytest.raises(BadInput) as info:
        build_request(impl=impl, variant=variant, causal=False)
    message = str(info.value)
    assert said in message and where in message and "\n" not in message


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(impl="ring-flash-attn", dtype="fp32"), "refuses fp32: 'FlashAttention only support fp16 and bf16"),
        (dict(impl="ring-flash-attn", ring=2, ulysses=2), "no Ulysses degree"),
        (dict(impl="ring-flash-attn", variant="zigzag", causal=True, ring=4, seq=100), "divisible by 2 × ring = 8"),
        (dict(impl="yunchang", ring=1, ulysses=3, heads=4), "does not divide by --ulysses 3"),
        (dict(impl="torch", ring=3, seq=100), "does not divide by 3 ranks"),
        (dict(impl="ring-flash-attn", variant="ring"), "has no variant 'ring'"),
        (dict(impl="torch", kernel="fa"), "has no kernel 'fa'"),
        (dict(impl="ring-flash-attn", ring=1), "ring × ulysses ≥ 2"),
    ],
)
def test_bad_input_is_one_line(fields, match):
    with pytest.raises(BadInput, match=match) as info:
        build_request(**fields)
    assert "\n" not in str(info.value)


def test_torchs_layout_follows_causal_and_the_length():
    assert build_request(impl="torch", causal=True).layout is Layout.HEAD_TAIL
    assert build_request(impl="torch", causal=False).layout is Layout.CONTIGUOUS
    assert build_request(impl="torch", causal=True, ring=2, seq=242).layout is Layout.CONTIGUOUS


def test_a_missing_peer_is_unsupported_from_the_parent_in_well_under_a_second(monkeypatch):
    import cpdoctor.peer_impls.base as base

    monkeypatch.setattr(base, "package_root", lambda module: None)
    start = time.perf_counter()
    why = EXAMINATION.unsupported_here(build_request(impl="yunchang"))
    assert time.perf_counter() - start < 1.0
    assert why.kind is UnsupportedKind.MISSING_PACKAGE
    assert "pip install --no-deps yunchang==0.6.4" in why.message
    assert EXAMINATION.unsupported_finding(build_request(impl="yunchang"), why).remedy.startswith("install it: pip install")


@needs_yunchang
def test_a_forward_only_kernel_is_unsupported_with_the_peers_line():
    why = EXAMINATION.unsupported_here(build_request(impl="yunchang", kernel="torch_flash"))
    assert why.kind is UnsupportedKind.NO_BACKWARD
    assert "Not implemented backward for PyTorch attention types" in why.message and "yunchang/kernels/attention.py:" in why.message
    req = build_request(impl="yunchang", variant="basic_pytorch")
    why = EXAMINATION.unsupported_here(req)
    assert why.kind is UnsupportedKind.NO_BACKWARD
    f = EXAMINATION.unsupported_finding(req, why)
    assert f.verdict is Verdict.UNSUPPORTED and "kernels: fa;" in f.remedy and "basic_pytorch" not in f.remedy


def test_peer_modules_import_no_torch():
    code = (
        "import sys\nfrom cpdoctor.examinations.peer.request import build_request\nfrom cpdoctor.examinations.peer import EXAMINATION\n"
        "r = build_request(impl='torch', causal=True)\nEXAMINATION.unsupported_here(r)\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_catalog_lists_every_peer_and_the_doctor_rows_only_installed_ones():
    infos = {p.impl: p for p in installed_peers()}
    assert set(infos) == {"ring-flash-attn", "yunchang", "torch"}
    assert infos["torch"].installed and infos["ring-flash-attn"].lse == ("basic", "zigzag", "stripe", "llama3")
    from cpdoctor.doctor import RINGS

    rows = doctor_checks(RINGS)
    assert {r.request.impl for r in rows} == {p.impl for p in infos.values() if p.installed}
    assert sorted({r.request.ring for r in rows}) == [2, 3]


# ---------------------------------------------------------------------------------------------------------
# rules fed numbers
# ---------------------------------------------------------------------------------------------------------


def _measured(req, errors: dict[str, float], baseline=2.5e-3, bad_ranks=None, nonfinite=0):
    from cpdoctor.examinations.measurement import Measurement

    world = req.world_size
    facts = PeerFacts(req.impl, "x", req.variant, req.kernel, req.layout.value, True, True)
    m = Measurement(req.impl, facts)
    for name, err in errors.items():
        per = tuple(err if (bad_ranks is None or r in bad_ranks) else baseline for r in range(world))
        m.tensors[name] = TensorRow(err, err, nonfinite if name == "out" else 0, 0, per, baseline)
    return m


def test_within_tolerance_is_pass_and_says_the_closest():
    req = build_request(impl="torch", causal=True)
    f = EXAMINATION.finding(Case(req), _measured(req, dict(out=3e-3, dq=3e-3, dk=4e-3, dv=3e-3)))
    assert f.verdict is Verdict.PASS and "closest: dK" in f.diagnosis and f.command is None
    assert "CUDA kernels emulated on CPU" in f.emulated


@needs_rfa
def test_dq_alone_in_fp16_names_the_bf16_cast_at_its_line():
    req = build_request(impl="ring-flash-attn", dtype="fp16")
    f = EXAMINATION.finding(Case(req), _measured(req, dict(out=3e-4, lse=1e-5, dq=1.7e-3, dk=3e-4, dv=3e-4), baseline=3e-4))
    assert f.verdict is Verdict.FAIL
    assert "dQ cast to bf16" in f.diagnosis and "return dq.to(torch.bfloat16)" in f.diagnosis
    assert "ring_flash_attn/ring_flash_attn.py:" in f.diagnosis
    assert (
        f.remedy == "run ring-flash-attn basic in bf16; or a variant whose backward keeps the dtype (llama3)"
    )  # non-causal: not zigzag/stripe
    assert f.command.startswith("cpdoctor check --impl ring-flash-attn --variant basic")


@needs_rfa
def test_backward_wrong_on_some_ranks_names_the_ranks_and_the_function():
    req = build_request(impl="ring-flash-attn", variant="zigzag", causal=True, ring=3)
    f = EXAMINATION.finding(Case(req), _measured(req, dict(out=3e-3, lse=1e-5, dq=3e-3, dk=0.9, dv=0.8), bad_ranks={1, 2}))
    assert f.verdict is Verdict.FAIL
    assert "forward exact, backward wrong only on ranks 1, 2 of 3" in f.diagnosis
    assert "zigzag_ring_flash_attn_backward at ring_flash_attn/zigzag_ring_flash_attn.py:" in f.diagnosis


def test_forward_wrong_and_lse_wrong():
    req = build_request(impl="torch", causal=True)
    f = EXAMINATION.finding(Case(req), _measured(req, dict(out=0.5, dq=0.6, dk=0.6, dv=0.6)))
    assert f.verdict is Verdict.FAIL and f.diagnosis.startswith("forward wrong on all 2 ranks")
    req = build_request(impl="ring-flash-attn")
    f = EXAMINATION.finding(Case(req), _measured(req, dict(out=3e-3, lse=0.2, dq=3e-3, dk=3e-3, dv=3e-3)))
    assert "the LSE it returns is wrong" in f.diagnosis


def test_a_crash_names_the_peers_line_and_not_diffusers_signatures():
    req = build_request(impl="torch", kernel="efficient", causal=True, dtype="fp32")
    import torch.distributed.tensor.experimental._context_parallel._attention as cp

    path = cp.__file__
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "{path}", line 186, in _merge_one\n'
        "    out = out - F.sigmoid(block_lse - lse) * (out - block_out)\n"
        "RuntimeError: The size of tensor a (64) must match the size of tensor b (60) at non-singleton dimension 2\n"
    )
    failure = RankFailure(0, FailureKind.CRASH, "RuntimeError: The size of tensor a (64) must match the size of tensor b (60)", tb)
    (f,) = EXAMINATION.failure_findings(Case(req), [failure], 60.0)
    assert f.verdict is Verdict.CRASH
    assert "torch/distributed/tensor/experimental/_context_parallel/_attention.py:186 in _merge_one" in f.diagnosis
    assert "LSE padded to 32" in f.diagnosis and "older releases" not in f.diagnosis
    assert "multiple of 32" in f.remedy and f.failure.signature == "LSE padded to 32"


def test_signature_reads_only_what_failed():
    req = build_request(impl="torch", causal=True)
    tensors = peer_judge.judged(_measured(req, dict(out=3e-3, dq=3e-3, dk=3e-3, dv=3e-3)).tensors, "bf16")
    sig = peer_judge.signature(req, tensors)
    assert sig.bad == frozenset() and sig.forward_at is None and sig.dq_cast is None
