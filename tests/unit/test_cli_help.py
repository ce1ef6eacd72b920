"""Each command's `--help` says what it runs, read against the code that runs it: the doctor's and `cpdoctor`'s list
every check of the doctor's plan (its checkpointing row and the peers' rows included), `check`'s options name the
peers' own variants and kernels and the defaults the requests hold, `run` names every shipped suite, `env` every
column of its table, and every command the exit codes the report gives. The help is read from the command objects
typer builds (what `--help` renders), in this process: no command runs."""

from __future__ import annotations

import re

import pytest
import typer

from cpdoctor import doctor, suite
from cpdoctor.cli import app
from cpdoctor.cli.env import COLUMNS
from cpdoctor.examinations.attention.request import AttentionRequest
from cpdoctor.examinations.peer.request import PeerRequest
from cpdoctor.peer_impls import adapter
from cpdoctor.report.verdict import ExitCode
from cpdoctor.vocabulary import Impl

COMMAND = typer.main.get_command(app)


def _text(help_text: str | None) -> str:
    """A help text with its whitespace as one line (typer wraps docstrings and long strings)."""
    return re.sub(r"\s+", " ", help_text or "")


def help_of(name: str | None) -> str:
    """`cpdoctor [name] --help`'s text: the command's own help, then each option's."""
    command = COMMAND if name is None else COMMAND.commands[name]  # type: ignore[attr-defined]
    options = [f"{'/'.join(p.opts)}: {getattr(p, 'help', '')}" for p in command.params]
    return _text(" ".join([command.help or "", *options]))


def option_help(name: str, option: str) -> str:
    return next(_text(p.help) for p in COMMAND.commands[name].params if option in p.opts)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", [None, "doctor"])
def test_the_doctors_help_lists_every_check_of_its_plan(command):
    """Every row the doctor runs on a CPU, the ring over every accelerator where it has 4, and each peer's rows."""
    text = help_of(command)
    for check in doctor.plan(0):
        assert check.label in text, (check.label, text)
    assert "checkpointing" in text and "ring N" in text
    assert f"ring {max(c.request.ring for c in doctor.plan(4))}" not in text  # the count is N, not one machine's
    for impl in Impl.peers():
        assert impl.value in text
    for ring, _ in doctor.RINGS:
        assert f"ring {ring}" in text


def test_check_names_each_peers_own_variants_and_kernels():
    variants, kernels = option_help("check", "--variant"), option_help("check", "--kernel")
    for impl in Impl.peers():
        spec = adapter(impl).spec
        said = re.search(rf"{re.escape(impl.value)} ([\w|]+)", variants)
        assert said and set(said.group(1).split("|")) == {str(v.name) for v in spec.variants}, (impl, variants)
        said = re.search(rf"{re.escape(impl.value)} ([\w|]+)", kernels)
        assert said and set(said.group(1).split("|")) == {str(k.name) for k in spec.kernels}, (impl, kernels)


@pytest.mark.parametrize(
    "option, field",
    [("--dtype", "dtype"), ("--batch", "batch"), ("--seq", "seq"), ("--heads", "heads"), ("--head-dim", "head_dim")],
)
def test_checks_defaults_are_the_requests(option, field):
    """`(default X; a peer's: Y)`: X is an AttentionRequest's default, Y a PeerRequest's."""
    text = option_help("check", option)
    numbers = re.findall(r"default (\w+)[;,] a peer's:? (\w+)", text)
    assert numbers, text
    ours, peers = numbers[0]
    assert ours == str(getattr(AttentionRequest(), field)) and peers == str(getattr(PeerRequest(), field))


def test_the_degrees_defaults_are_the_requests():
    assert "default 2, or 1 when only --ulysses is given" in option_help("check", "--ring")
    assert (AttentionRequest().ring, AttentionRequest().ulysses, AttentionRequest(ulysses=2).ring) == (2, 1, 1)
    assert "default 1" in option_help("check", "--ulysses")
    assert f"default {AttentionRequest().seed}" in option_help("check", "--seed")


def test_run_names_every_shipped_suite_and_env_every_column():
    text = help_of("run")
    for name in suite.shipped():
        assert name in text
    text = help_of("env")
    for column in COLUMNS[1:-1]:
        assert column in text


@pytest.mark.parametrize("command", ["check", "doctor", "env", "model", "plan", "run", "step", None])
def test_every_command_says_its_exit_codes(command):
    text = help_of(command) if command is not None else _text(COMMAND.commands["doctor"].help)  # type: ignore[attr-defined]
    codes = [int(code) for code in ExitCode]
    assert re.search(r"Exit " + r"\D+".join(str(c) for c in codes) + r"\D", text), text


def test_every_command_has_its_help():
    assert set(COMMAND.commands) == {"check", "doctor", "env", "model", "plan", "run", "step"}  # type: ignore[attr-defined]
    for name, command in COMMAND.commands.items():  # type: ignore[attr-defined]
        assert len(_text(command.help)) > 80, name
