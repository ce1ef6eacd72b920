"""`cpdoctor step -- COMMAND`'s request, read in the parent before anything starts: the placeholders give each run
its degrees, a command the same in both runs or a program that is not there is bad input, and the CLI tells a
step function from a command by its one argument."""

from __future__ import annotations

import sys

import pytest

from cpdoctor.cli.step import FUNCTION_FORM
from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.runs.command import CommandRequest, RunDegrees, substitute
from cpdoctor.examinations.step.runs.request import Role

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node={nproc}", "train.py", "--cp", "{cp}"]


def test_each_placeholder_takes_its_runs_value_wherever_it_stands():
    run1, run2 = RunDegrees(1, 1, 2), RunDegrees(2, 3, 2)
    text = "{cp}/{ring}/{ulysses}/{dp}/{world}/{nproc}/{other}"
    assert substitute(text, run1) == "1/1/1/2/2/2/{other}"
    assert substitute(text, run2) == "6/2/3/2/12/12/{other}"


def test_the_two_runs_of_a_command():
    request = CommandRequest.of(TORCHRUN, ring=2, dp=2)
    assert request.argv(Role.WITHOUT_CP)[-4:] == ["--nproc-per-node=2", "train.py", "--cp", "1"]
    assert request.argv(Role.WITH_CP)[-4:] == ["--nproc-per-node=4", "train.py", "--cp", "2"]
    assert request.to_dict()["runs"]["with_cp"] == request.argv(Role.WITH_CP)
    assert CommandRequest.of(TORCHRUN).ring == 2  # as `cpdoctor step path:fn`: ring 2 when no degree is given
    assert CommandRequest.of(TORCHRUN, ulysses=2).ring == 1


@pytest.mark.parametrize(
    ("command", "degrees", "said"),
    [
        ([], {}, "give the command to run after --"),
        ([sys.executable, "train.py", "--cp", "2"], {}, "the command is the same in both runs"),
        ([sys.executable, "train.py", "--dp", "{dp}"], {"dp": 2}, "the command is the same in both runs"),
        (["no-such-program-anywhere", "{cp}"], {}, "no program 'no-such-program-anywhere' found"),
        (TORCHRUN, {"ring": 1}, "a CP degree of at least 2"),
        (TORCHRUN, {"dp": 0}, "--dp must be a positive integer"),
    ],
)
def test_bad_input_before_anything_starts(command, degrees, said):
    with pytest.raises(BadInput, match=said):
        CommandRequest.of(command, **degrees)


def test_a_path_that_is_not_executable_says_so(tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(BadInput, match="is not executable"):
        CommandRequest.of([str(script), "{cp}"])
    script.chmod(0o755)
    assert CommandRequest.of([str(script), "{cp}"]).command[0] == str(script)


@pytest.mark.parametrize(
    ("words", "function"),
    [
        ("train.py:step", True),
        ("examples/x.py:lora_step", True),
        ("torchrun", False),
        ("python", False),
        ("--x:y", False),
        ("a.py:1x", False),
    ],
)
def test_one_argument_path_colon_identifier_is_a_step_function(words, function):
    assert bool(FUNCTION_FORM.match(words)) is function
