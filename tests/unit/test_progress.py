"""Ticks (launch/progress.py): a long computation on one rank moves, module by module, forward and backward,
through the rank's step file alone (no process, no collective)."""

from __future__ import annotations

import pytest

from cpdoctor.launch import progress
from cpdoctor.launch.progress import StepLog, read_step


@pytest.fixture
def log(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "TICK_WRITE_S", 0.0)  # every tick written, so the file shows the last one
    step_log = StepLog(str(tmp_path / "rank0.step"))
    step_log.mark(0, "evaluating")
    progress.activate(step_log)
    yield step_log
    progress.activate(None)


def test_a_model_computed_alone_moves_block_by_block_forward_and_backward(log):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 1))
    before = read_step(log.path)
    seen = []
    with progress.ticking(model, "reference (fp64)"):
        model[2].register_forward_hook(lambda *_: seen.append(read_step(log.path)))  # runs after the tick
        model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    after = read_step(log.path)
    assert before is not None and after is not None and after.ticks >= before.ticks + 6  # 4 modules forward, 3 backward
    assert seen[0].doing == "reference (fp64): 2"  # the module that ran, while it ran
    assert after.doing.endswith("(backward)") and after.describe().startswith("case 1: evaluating (reference (fp64)")
    ticks = after.ticks
    model(torch.randn(3, 4)).sum().backward()  # the hooks are gone after the block
    assert read_step(log.path).ticks == ticks


def test_ticks_without_a_supervisor_are_nothing():
    progress.activate(None)
    progress.tick("anything")  # under torchrun nobody reads them: no file, no error
    StepLog(None).tick("anything")
