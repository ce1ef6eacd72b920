"""Ranks that failed, judged without processes: crash signatures of diffusers' CP code, and a hang named by
the step each rank reached (launch/progress.py), never by timing."""

from __future__ import annotations

from cpdoctor.examinations.judging import CRASH_SIGNATURES, crash_signature, failure_findings
from cpdoctor.launch.jobs import FailureKind, RankFailure
from cpdoctor.launch.progress import Step, blame
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
    hung, waiting = blame({0: Step(0, 2), 1: Step(0, 1)})  # rank 0 examining, rank 1 still preparing
    assert hung == [1] and waiting == [0]


def test_a_rank_that_never_started_is_behind_everyone():
    assert blame({0: Step(1, 3), 1: None, 2: Step(1, 3)}) == ([1], [0, 2])


def test_ranks_stuck_at_the_same_step_are_all_named():
    assert blame({0: Step(0, 2), 1: Step(0, 2)}) == ([0, 1], [])


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
    evaluating, awaiting = Step.parse("0 evaluating 40 reference (fp64): transformer_blocks.0"), Step.parse("0 awaiting 12")
    assert blame({0: evaluating, 1: awaiting}) == ([0], [1])


def test_step_round_trip():
    assert Step.parse("3 reporting") == Step(3, 3) and Step.parse("garbage") is None
    step = Step(0, 4, 17, "reference (fp64): transformer_blocks.3")
    assert Step.parse(step.text()) == step and Step.parse(step.text()).doing == step.doing
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
