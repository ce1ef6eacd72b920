"""Ranks that failed, judged without processes: crash signatures of diffusers' CP code, and a hang named by
the step each rank reached (launch/progress.py), never by timing."""

from __future__ import annotations

from cpdoctor.examinations.judging import CRASH_SIGNATURES, crash_signature, failure_findings
from cpdoctor.launch.jobs import FailureKind, RankFailure
from cpdoctor.launch.progress import Blame, Collectives, Milestone, blame
from cpdoctor.report import Verdict


def crash(rank: int, message: str, tb: str = "") -> RankFailure:
    return RankFailure(rank, FailureKind.CRASH, message, tb)


def test_double_transpose_signature():
    (f,) = failure_findings("p", [crash(0, "RuntimeError: Number of heads in key/value must divide number of heads in query")], 30)
    assert f.verdict == Verdict.CRASH and "double transpose" in f.diagnosis and f.failure.signature == "double transpose"
    assert "cpdoctor.patch()" in f.remedy


def test_wrong_number_of_gradients_signature():
    sig = crash_signature(
        [crash(1, "RuntimeError: function TemplatedRingAttentionBackward returned an incorrect number of gradients (expected 13, got 12)")]
    )
    assert sig is not None and sig.name == "wrong number of gradients"


def test_lse_rank_signature_needs_an_lse_in_the_failing_line():
    tb = '  File "attention_dispatch.py", line 1, in forward\n    out = out - F.sigmoid(block_lse - prev_lse) * (out - block_out)\n'
    msg = "RuntimeError: The size of tensor a (512) must match the size of tensor b (8) at non-singleton dimension 2"
    assert crash_signature([crash(0, msg, tb)]).name == "LSE rank"
    assert crash_signature([crash(0, msg, "    x = a + b  # return_lse=False\n")]) is None


UNPACKED_TWICE = (
    "CheckpointError: torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
    "If you are calling ctx.saved_tensors in backward, make sure to do so only once."
)
RING_BACKWARD_TB = (
    'Traceback (most recent call last):\n  File "/x/site-packages/diffusers/models/attention_dispatch.py", line 2506, in backward\n'
    "    grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(\n"
    '  File "/x/site-packages/torch/utils/checkpoint.py", line 1199, in unpack_hook\n'
    f"torch.utils.checkpoint.{UNPACKED_TWICE}\n"
)


def test_ring_backward_under_checkpointing_signature():
    (f,) = failure_findings("p", [crash(0, UNPACKED_TWICE, RING_BACKWARD_TB), crash(1, UNPACKED_TWICE, RING_BACKWARD_TB)], 30)
    assert f.verdict == Verdict.CRASH and f.failure.signature == "ring backward under checkpointing"
    assert "once per ring step" in f.diagnosis and "non-reentrant" in f.diagnosis
    assert f.remedy.startswith("cpdoctor.patch()") and "Ulysses-only CP" in f.remedy and "use_reentrant=True" in f.remedy
    # the same refusal raised by someone else's autograd Function is not diffusers' ring
    assert crash_signature([crash(0, UNPACKED_TWICE, '  File "/my/train.py", line 3, in backward\n')]) is None


def test_an_unknown_crash_says_read_the_traceback():
    (f,) = failure_findings("p", [crash(1, "RuntimeError: fault injected into rank 1", "Traceback ...")], 30)
    assert f.remedy == "read the traceback below" and f.failure.signature is None
    assert f.tracebacks == {1: "Traceback ..."} and f.details()["tracebacks"] == {"1": "Traceback ..."}


def test_a_waiting_rank_is_named_not_blamed():
    failures = [crash(1, "RuntimeError: boom"), RankFailure(0, FailureKind.CRASH, "stopped", waiting=True)]
    (f,) = failure_findings("p", failures, 30)
    assert f.diagnosis.startswith("rank 1 raised: RuntimeError: boom") and "rank 0 was waiting" in f.diagnosis


def test_every_signature_has_a_remedy():
    assert all(s.remedy and s.diagnosis and s.patterns for s in CRASH_SIGNATURES)


def test_the_rank_behind_is_the_hung_one():
    assert blame({0: Milestone(0, 2), 1: Milestone(0, 1)}) == Blame([1], [0])  # rank 0 examining, rank 1 still preparing


def test_a_rank_that_never_started_is_behind_everyone():
    assert blame({0: Milestone(1, 3), 1: None, 2: Milestone(1, 3)}) == Blame([1], [0, 2])


def test_ranks_stuck_at_the_same_step_are_all_named():
    assert blame({0: Milestone(0, 2), 1: Milestone(0, 2)}) == Blame([0, 1], [])


# ------------------------------------------------------------------------ ranks at one step, by their flight records


def examining(entered: int = 0, op: str = "", seq: int = 0) -> Milestone:
    return Milestone(0, 2, 5, flight=Collectives(entered, op, seq))


def test_the_rank_outside_any_collective_is_named_alone_while_its_peer_waits_in_one():
    """Issue 30: rank 1 stopped inside the attention before the ring's all-gather that rank 0 waits in; by the
    steps alone both were examining and both were named."""
    got = blame({0: examining(1, "all_gather", 1), 1: examining()})
    assert got == Blame([1], [0], "stopped outside any collective while rank 0 waits in all_gather #1")


def test_a_rank_that_entered_fewer_collectives_is_named_alone():
    """Rank 2 stopped after the first all-to-all; ranks 0 and 1 wait in the third collective (the second
    all-to-all of one, the all-gather of the other: named each with its own)."""
    got = blame({0: examining(3, "all_to_all", 3), 1: examining(3, "all_gather", 3), 2: examining(1)})
    assert got.stuck == [2] and got.waiting == [0, 1]
    assert got.why == "stopped outside any collective while rank 0 waits in all_to_all #3, rank 1 waits in all_gather #3"
    together = blame({0: examining(4, "send/recv", 4), 1: examining(4, "send/recv", 4), 2: examining(3)})
    assert together.why == "stopped outside any collective while rank 0, 1 wait in send/recv #4"


def test_a_rank_that_issued_the_collective_but_never_waited_is_named():
    """Rank 1 entered the all-gather rank 0 waits in (issued, as a functional collective returns at once) and
    stopped before waiting for it: it is still the one outside."""
    assert blame({0: examining(2, "all_gather", 2), 1: examining(2)}).stuck == [1]


def test_ranks_all_in_a_collective_are_all_named():
    """A deadlock inside the collective, or mismatched collectives (rank 1 waits in an earlier one than rank 0):
    nobody outside to blame, all named, each with where it waits."""
    assert blame({0: examining(2, "all_gather", 2), 1: examining(2, "all_gather", 2)}) == Blame([0, 1], [])
    assert blame({0: examining(3, "all_gather", 3), 1: examining(2, "all_to_all", 2)}) == Blame([0, 1], [])
    assert examining(2, "all_to_all", 2).describe() == "case 1: examining, in all_to_all #2"


def test_ranks_outside_every_collective_keep_the_step_rule():
    """Nobody in a collective (all computing, or all asleep between collectives): the steps alone decide."""
    assert blame({0: examining(3), 1: examining(1)}) == Blame([0, 1], [])
    assert blame({0: examining(), 1: examining()}) == Blame([0, 1], [])


def test_a_rank_outside_that_went_past_the_collective_its_peer_waits_in_is_not_guessed_at():
    """Rank 1 entered 5 collectives and stopped outside; rank 0 waits in #2, which rank 1 went past: the records
    disagree (mismatched sequence numbers), so both are named rather than one guessed."""
    assert blame({0: examining(2, "all_gather", 2), 1: examining(5)}) == Blame([0, 1], [])


def test_the_step_rule_comes_first():
    """A rank behind in the steps is stuck whatever the collectives of the ranks ahead."""
    assert blame({0: examining(1, "all_gather", 1), 1: Milestone(0, 1)}) == Blame([1], [0])


def test_a_flight_record_round_trips_through_its_file():
    record = Collectives(3, "send/recv", 2)
    assert record.token() == "@3:send/recv#2" and Collectives.parse(record.token().ljust(64)) == record
    assert Collectives.parse("@4") == Collectives(4) and Collectives.parse("") == Collectives()
    assert Collectives.parse("@4:all_ga") == Collectives()  # half written: nothing claimed
    step = Milestone.parse("0 examining 9 ring", "@3:send/recv#2")
    assert step == Milestone(0, 2) and step.flight == record and step.doing == "ring"
    assert step.describe() == "case 1: examining (ring), in send/recv #2"
    assert examining(2).describe() == "case 1: examining, outside any collective (2 entered)"
    assert examining().describe() == "case 1: examining"  # nothing entered: what it always said


def test_hang_finding_names_rank_and_step():
    failures = [
        RankFailure(1, FailureKind.HANG, "stopped moving: no rank moved for 25 s", where="case 1: preparing"),
        RankFailure(0, FailureKind.HANG, "waiting", waiting=True, where="case 1: examining"),
    ]
    (f,) = failure_findings("p", failures, 25)
    assert f.verdict == Verdict.HANG
    assert f.diagnosis.startswith("rank 1 stopped moving: no rank moved for 25 s (rank 1 at case 1: preparing)")
    assert "rank 0 was waiting" in f.diagnosis and "stuck" in f.remedy


def test_a_rank_still_moving_at_the_wall_bound_is_told_to_examine_less():
    failures = [RankFailure(0, FailureKind.HANG, "was still moving at the wall bound (3000 s)", still_moving=True)]
    (f,) = failure_findings("p", failures, 300)
    assert f.diagnosis.startswith("rank 0 was still moving") and "--dtype fp32" in f.remedy


def test_a_rank_awaiting_rank_0s_verdict_is_ahead_of_rank_0_evaluating():
    """The false HANG of issue 22: rank 1 had reported and waited for rank 0, which was computing its reference;
    rank 1 was blamed because `reporting` came before `evaluating`."""
    evaluating, awaiting = Milestone.parse("0 evaluating 40 reference (fp64): transformer_blocks.0"), Milestone.parse("0 awaiting 12")
    assert blame({0: evaluating, 1: awaiting}) == Blame([0], [1])


def test_step_round_trip():
    assert Milestone.parse("3 reporting") == Milestone(3, 3) and Milestone.parse("garbage") is None
    step = Milestone(0, 4, 17, "reference (fp64): transformer_blocks.3")
    assert Milestone.parse(step.text()) == step and Milestone.parse(step.text()).doing == step.doing
    assert step.describe() == "case 1: evaluating (reference (fp64): transformer_blocks.3)"


def test_a_release_that_refuses_the_layout_is_unsupported_not_a_crash():
    """0.36.0 refuses ring × Ulysses and masks under CP with its own messages: that is UNSUPPORTED, with the
    release's words and the first release that has it, not a crash to read a traceback for."""
    tb = 'File ".../site-packages/diffusers/models/_modeling_parallel.py", line 94, in __post_init__'
    unified = "ValueError: Unified Ulysses-Ring attention is not yet supported. Please set either `ring_degree` or `ulysses_degree` to 1."
    (f,) = failure_findings("p", [crash(r, unified, tb) for r in range(4)], 30)
    assert f.verdict is Verdict.UNSUPPORTED and "refuses the layout (unified ring × Ulysses)" in f.diagnosis
    assert "0.37.0" in f.remedy and f.failure.tracebacks[0] == tb
    mask = "ValueError: Attention mask is not yet supported for templated attention."
    (f,) = failure_findings("p", [crash(0, mask, tb), crash(1, mask, tb)], 30)
    assert f.verdict is Verdict.UNSUPPORTED and "attention mask" in f.diagnosis and "0.37.0" in f.remedy
    (f,) = failure_findings("p", [crash(0, mask, tb), crash(1, "RuntimeError: boom", tb)], 30)
    assert f.verdict is Verdict.CRASH  # one rank raised something else: a crash
    (f,) = failure_findings("p", [crash(0, mask, 'File "mine.py"')], 30)
    assert f.verdict is Verdict.CRASH  # not raised by diffusers
