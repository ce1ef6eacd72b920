"""What `cpdoctor step -- COMMAND`'s parent makes of a launch that stopped, from what its processes left (no
processes here: each launch is built as the run's folder would have it read)."""

from __future__ import annotations

import pytest

from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.runs.capture import Captured, Ending
from cpdoctor.examinations.step.runs.command import RunDegrees
from cpdoctor.examinations.step.runs.command_run import Launched, stop_findings
from cpdoctor.examinations.step.runs.request import Role
from cpdoctor.launch.command import CommandRun
from cpdoctor.launch.progress import STEPS, Blame, Milestone
from cpdoctor.report import Verdict

OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def launched(role: Role = Role.WITHOUT_CP, code: int | None = 0, **fields) -> Launched:
    world = 2 if role is Role.WITHOUT_CP else 4
    ended = fields.pop("ended", CommandRun(code, 3.0))
    degrees = RunDegrees(1, 1, 2) if role is Role.WITHOUT_CP else RunDegrees(2, 1, 2)
    run = Launched(role, degrees, ["torchrun", f"--nproc-per-node={world}", "train.py"], ended, **fields)
    return run


def test_run_1_that_does_not_fit_names_the_rank_and_what_to_change():
    run = launched(raised={"rank1": (OOM, "Traceback ...\n" + OOM), "pid77": ("ChildFailedError: ...", "...")}, code=1)
    (finding,) = stop_findings(run, 60)
    assert finding.verdict is Verdict.UNSUPPORTED and finding.diagnosis.startswith("run 1 does not fit on rank 1: torch.OutOfMemoryError")
    assert "shorter sequence" in finding.remedy and set(finding.tracebacks) == {1}  # torchrun's own exception left out


def test_the_same_error_in_run_2_is_a_crash_of_the_cp_step():
    (finding,) = stop_findings(launched(Role.WITH_CP, raised={"rank3": (OOM, OOM)}, code=1), 60)
    assert finding.verdict is Verdict.CRASH and finding.diagnosis.startswith("rank 3 raised: torch.OutOfMemoryError")


def test_a_hang_names_the_rank_behind_and_where_each_was():
    steps = {0: Milestone(0, STEPS.index("examining")), 1: Milestone(0, STEPS.index("joining"))}
    ended = CommandRun(None, 40.0, stalled=True, steps=steps, blamed=Blame([1], [0]))
    (finding,) = stop_findings(launched(ended=ended), 30)
    assert finding.verdict is Verdict.HANG
    assert (
        "rank 1 (started, before its first training forward) stopped: nothing moved for 30 s while rank 0 was inside the training step"
        in finding.diagnosis
    )


def test_a_command_that_stops_without_a_step_examines_nothing_or_crashed():
    (quiet,) = stop_findings(launched(armed=2), 30)
    assert quiet.verdict is Verdict.UNSUPPORTED and "(2 Python processes armed)" in quiet.diagnosis
    (never_armed,) = stop_findings(launched(), 30)
    assert "python -I, -E or -S" in never_armed.diagnosis
    summary = "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 41)\n"
    (killed,) = stop_findings(launched(code=1, ended=CommandRun(1, 3.0, output_tail=summary), armed=2), 30)
    assert killed.verdict is Verdict.CRASH and "ended by signal 9" in killed.tracebacks[1]


def test_a_run_on_other_processes_than_its_degrees_is_bad_input():
    outcomes = {f"rank{r}": Captured(f"rank{r}", r, 4, Ending.SAVED) for r in range(4)}
    with pytest.raises(BadInput, match="ran 4 process\\(es\\) but its degrees make 2"):
        stop_findings(launched(outcomes=outcomes, armed=4), 30)
    refused = {"rank0": Captured("rank0", 0, 4, Ending.REFUSED, "FluxTransformer2DModel has no context parallelism enabled")}
    with pytest.raises(BadInput, match="run 2 .*: FluxTransformer2DModel has no context parallelism enabled"):
        stop_findings(launched(Role.WITH_CP, outcomes=refused, armed=4), 30)
