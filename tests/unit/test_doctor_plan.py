"""The doctor's plan (`cpdoctor` alone): which checks for which host, and the command line of each. Pure
functions: no process starts."""

from __future__ import annotations

import dataclasses

import pytest

from cpdoctor import doctor
from cpdoctor.errors import BadInput
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.suite import build_requests
from cpdoctor.vocabulary import Kind

BASE = [
    ("ring 2", {"ring": 2}),
    ("ring 3", {"ring": 3}),
    ("Ulysses 2", {"ulysses": 2}),
    ("ring 2 × Ulysses 2", {"ring": 2, "ulysses": 2}),
    ("ring 2, mask_pad 3", {"ring": 2, "mask_pad": 3}),
    ("ring 2, checkpointing", {"ring": 2, "checkpointing": True}),
]


def _plan(accelerators: int, torchrun_world: int | None = None) -> list[tuple[str, dict]]:
    return [(c.label, c.fields) for c in doctor.plan(accelerators, torchrun_world)]


@pytest.mark.parametrize("accelerators", [0, 1, 2, 3])
def test_no_ring_over_all_accelerators_on_cpu_one_gpu_or_when_ring_2_or_3_already_covers_them(accelerators):
    assert _plan(accelerators) == BASE


@pytest.mark.parametrize("accelerators", [4, 8])
def test_a_ring_over_every_accelerator_after_ring_3(accelerators):
    plan = _plan(accelerators)
    assert plan == BASE[:2] + [(f"ring {accelerators}", {"ring": accelerators})] + BASE[2:]


def test_cpu_plan_is_three_launches_of_world_2_3_and_4():
    checks = doctor.plan(0)
    assert [c.world_size for c in checks] == [2, 3, 2, 4, 2, 2]
    assert sorted({c.world_size for c in checks}) == [2, 3, 4]
    assert all(c.why for c in checks)


def test_suite_is_attention_checks_on_the_best_backend_in_plan_order():
    """The plan holds each check's request, built once from the fields its row shows; the suite runs those."""
    suite = doctor.suite_for(doctor.plan(8))
    assert suite.name == "doctor"
    assert [r.kind for r in suite.checks] == [Kind.ATTENTION] * 7
    assert suite.checks == [AttentionRequest.of(**f) for _, f in _plan(8)]
    assert all(r.backend == "auto" for r in suite.checks)  # the request's default


def test_the_suite_runs_the_planned_requests_patched_as_asked():
    checks = doctor.plan(0)
    for patch in (False, True):
        requests = build_requests(doctor.suite_for(checks), patch)
        assert requests == [dataclasses.replace(c.request, patch=patch) for c in checks]


@pytest.mark.parametrize(
    "fields, patch, expected",
    [
        ({"ring": 2}, False, "cpdoctor check --ring 2"),
        ({"ring": 3}, True, "cpdoctor check --ring 3 --patch"),
        ({"ring": 8}, True, "cpdoctor check --ring 8 --patch"),
        ({"ulysses": 2}, False, "cpdoctor check --ulysses 2"),
        ({"ring": 2, "ulysses": 2}, True, "cpdoctor check --ring 2 --ulysses 2 --patch"),
        ({"ring": 2, "mask_pad": 3}, True, "cpdoctor check --ring 2 --mask-pad 3 --patch"),
        ({"ring": 2, "checkpointing": True}, True, "cpdoctor check --ring 2 --checkpointing --patch"),
    ],
)
def test_command_for_each_check(fields, patch, expected):
    assert doctor.command_for(doctor.PlannedCheck.attention("", **fields), patch=patch) == expected


def test_every_planned_command_parses_as_the_same_request():
    """The command line of a check, read back by `cpdoctor check`'s option names, is the check itself."""
    from cpdoctor.api import build_request

    for check in doctor.plan(8):
        words = doctor.command_for(check, patch=True).split()
        assert words[:2] == ["cpdoctor", "check"] and words[-1] == "--patch"
        fields: dict = {}
        for i, word in enumerate(words[2:-1], 2):  # an option and its value, or a switch (--checkpointing)
            if word.startswith("--"):
                value = words[i + 1]
                fields[word[2:].replace("-", "_")] = True if value.startswith("--") else int(value)
        assert build_request(**fields) == build_request(**dict(check.fields))


def test_under_torchrun_only_the_checks_of_its_world_size():
    assert _plan(8, torchrun_world=2) == [BASE[0], BASE[2], BASE[4], BASE[5]]
    assert _plan(8, torchrun_world=3) == [BASE[1]]
    assert _plan(0, torchrun_world=4) == [("ring 4", {"ring": 4}), BASE[3]]
    assert _plan(8, torchrun_world=8) == [("ring 8", {"ring": 8})]
    ring4 = doctor.PlannedCheck.attention("", ring=4)
    assert ring4.label == "ring 4"
    assert doctor.command_for(ring4, patch=True, torchrun_world=4) == "torchrun --nproc-per-node 4 -m cpdoctor check --ring 4 --patch"


def test_installed_peers_add_their_rows_after_diffusers_checks():
    request = PeerRequest(impl="torch", ring=2, causal=True)
    peer = doctor.PlannedCheck("torch ring 2", request, {"impl": "torch", "ring": 2, "causal": True}, "where most jobs start")
    checks = doctor.plan(0, peers=(peer,))
    assert checks[-1] is peer and [c.kind for c in checks] == [Kind.ATTENTION] * 6 + [Kind.PEER]
    assert doctor.command_for(peer, patch=True) == "cpdoctor check --impl torch --ring 2 --causal"  # the fix is diffusers'
    assert doctor.suite_for(checks).checks[-1] is request


@pytest.mark.parametrize("impl, causal", [("ring-flash-attn", False), ("yunchang", False), ("torch", True)])
@pytest.mark.parametrize("ring", [2, 3])
def test_a_peer_rows_command_is_the_peer_judges_brief_line_and_reads_back_as_its_request(impl, ring, causal):
    """The doctor's peer command comes from the peer judge's command builder (brief: what differs from
    `cpdoctor check --impl`'s defaults), is the line the doctor always printed, and names the same request."""
    request = PeerRequest(impl=impl, ring=ring, causal=causal)
    command = doctor.command_for(doctor.PlannedCheck("p", request, {}))
    assert command == f"cpdoctor check --impl {impl} --ring {ring}" + (" --causal" if causal else "")
    words = command.split()[2:]
    given = {
        w[2:]: (True if i + 1 == len(words) or words[i + 1].startswith("--") else words[i + 1])
        for i, w in enumerate(words)
        if w.startswith("--")
    }
    assert PeerRequest(**{k: int(v) if k == "ring" else v for k, v in given.items()}) == request


def test_torchrun_world_of_one_is_bad_input():
    with pytest.raises(BadInput, match="at least 2"):
        doctor.plan(8, torchrun_world=1)


def test_fallback_environment_names_where_the_ranks_ran(monkeypatch):
    """When no rank reports, the parent still says the device and process group the ranks chose (by the rule
    they use) and the backend asked for, not '?'."""
    from cpdoctor.examinations import runner
    from cpdoctor.examinations.attention.request import build_request

    monkeypatch.setattr(runner, "visible_gpus", lambda: 0)
    env = runner.fallback_environment(build_request(ring=2))
    assert (env.launch.device, env.launch.process_group, env.attention.backend) == ("cpu", "gloo", "auto")
    assert {"torch", "diffusers", "python"} <= set(env.to_jsonable())
    monkeypatch.setattr(runner, "visible_gpus", lambda: 1)
    shared = runner.fallback_environment(build_request(ring=2))
    assert (shared.launch.device, shared.launch.process_group) == ("cuda", "gloo")  # two ranks share one GPU
    monkeypatch.setattr(runner, "visible_gpus", lambda: 8)
    own = runner.fallback_environment(build_request(ring=2))
    assert (own.launch.device, own.launch.process_group) == ("cuda", "nccl")


def test_the_doctors_backend_is_the_one_its_checks_chose_and_resolved_here_when_every_rank_failed(monkeypatch):
    """0.36.0: every diffusers check's ranks raise before saying which backend `auto` chose; the doctor's line then
    resolves `auto` here as the ranks do, not "auto". A check judged from numbers names its backend itself, and a
    report with neither (a fed one) keeps "auto"."""
    from cpdoctor.compat.backends import BackendFacts
    from cpdoctor.examinations import backend_choice
    from cpdoctor.examinations.attention.judge import AttentionEvidence
    from cpdoctor.report import FailureEvidence, Finding, Verdict

    asked = []
    monkeypatch.setattr(backend_choice, "resolved_backend", lambda req: asked.append(req) or "cpdoctor_cpu")
    checks = doctor.plan(0)
    crashed = tuple(Finding("x", Verdict.CRASH, "raised", failure=FailureEvidence({0: "Traceback"})) for _ in checks)
    assert doctor.backends_chosen(checks, crashed) == "cpdoctor_cpu" and asked == [c.request for c in checks]
    asked.clear()
    judged = Finding("x", Verdict.PASS, "exact", evidence=AttentionEvidence(BackendFacts("flash", registered=True)))
    assert doctor.backends_chosen(checks, (judged, *crashed[1:])) == "flash" and not asked
    assert doctor.backends_chosen(checks, tuple(Finding("x", Verdict.PASS, "exact") for _ in checks)) == "auto" and not asked
