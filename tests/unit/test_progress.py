"""Ticks (launch/progress.py): a long computation on one rank moves, module by module, forward and backward,
through the rank's step file alone (no process, no collective)."""

from __future__ import annotations

import pytest

from cpdoctor.launch import progress
from cpdoctor.launch.progress import StepLog, read_step


@pytest.fixture
def log(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "TICK_WRITE_S", 0.0)  # every tick written, so the file shows the last one
    step_log = StepLog(str(tmp_path / "rank0.step"), flight_path=str(tmp_path / "rank0.flight"))
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


def test_advice_reaches_the_parent_once_and_is_printed_as_it_comes(tmp_path, capsys):
    from cpdoctor.launch.spawn import _Watch
    from cpdoctor.launch.worker import RankFile, rank_file

    progress.activate(StepLog(None), advice_path=rank_file(str(tmp_path), 1, RankFile.ADVICE))
    try:
        progress.advise("bf16 is 243× slower\nthan fp32 here")
        progress.advise("bf16 is 243× slower\nthan fp32 here")  # said once per process
        progress.advise("a second thing")
    finally:
        progress.activate(None)
    assert capsys.readouterr().err == ""  # a supervised rank writes its file, never its own stderr
    watch = _Watch(str(tmp_path), procs=[None, None], started=0.0)  # type: ignore[list-item]
    watch.read_advice()
    watch.read_advice()
    assert watch.advice == ["bf16 is 243× slower than fp32 here", "a second thing"]
    assert capsys.readouterr().err.splitlines() == [f"cpdoctor: warning: {line}" for line in watch.advice]


def test_advice_without_a_supervisor_is_printed_here_once(capsys):
    progress.activate(None)
    progress.advise("the watched step computes in bf16")
    progress.advise("the watched step computes in bf16")
    assert capsys.readouterr().err == "cpdoctor: warning: the watched step computes in bf16\n"
    progress.activate(None)


def _write(out_dir, rank: int, text: str) -> None:
    (out_dir / f"rank{rank}.step").write_text(text)


def test_the_parent_sees_a_rank_move_when_its_step_file_changes(tmp_path):
    from cpdoctor.launch.spawn import _Watch

    watch = _Watch(str(tmp_path), procs=[None, None], started=0.0)  # type: ignore[list-item]
    _write(tmp_path, 0, "0 evaluating 10 reference (fp64): transformer_blocks.0")
    _write(tmp_path, 1, "0 awaiting 4")
    watch.watch_progress(now=5.0)
    _write(tmp_path, 0, "0 evaluating 11 reference (fp64): transformer_blocks.1")
    watch.watch_progress(now=9.0)
    watch.watch_progress(now=12.0)  # nothing changed since
    assert watch.moved == {0: 9.0, 1: 5.0} and watch.last_move() == 9.0
    assert watch.moving(now=12.0, within_s=4.0) == [0]


@pytest.mark.parametrize("why", ["stalled", "wall"])
def test_the_rank_computing_is_named_and_the_one_awaiting_it_is_not(tmp_path, why):
    """Issue 22's false HANG the other way round: rank 0 computing its reference, rank 1 done and awaiting it.
    Stalled (nobody moved for the timeout) or stopped at the wall bound while rank 0 still moved: rank 0 is named."""
    import time

    from cpdoctor.launch.spawn import _failures, _Watch

    watch = _Watch(str(tmp_path), procs=[None, None], started=0.0, why=why)  # type: ignore[list-item]
    _write(tmp_path, 0, "0 evaluating 40 reference (fp64): transformer_blocks.0")
    _write(tmp_path, 1, "0 awaiting 12")
    watch.moved = {0: time.monotonic(), 1: time.monotonic() - 100}
    stuck, waiting = _failures(watch, 0, timeout_s=30.0)
    assert (stuck.rank, stuck.waiting, waiting.rank, waiting.waiting) == (0, False, 1, True)
    assert stuck.where == "case 1: evaluating (reference (fp64): transformer_blocks.0)"
    assert stuck.still_moving == (why == "wall") and ("wall bound" in stuck.message) == (why == "wall")


# ------------------------------------------------------------------------------------ the flight record (flight.py)


def test_a_collective_is_in_the_flight_file_while_it_blocks_and_while_its_work_is_waited_for(log):
    """Entered: counted and written; while the call blocks the flight file says which one; left: outside again;
    an issued one (a Work returned) is in it again while its wait blocks, and a second wait is nothing. Written in
    place: the step file is not rewritten (it is 2.5 ms a write here, the record 1 µs)."""
    import torch.distributed as dist

    from cpdoctor.launch.flight import FLIGHT

    def flight() -> tuple[int, str, int]:
        f = read_step(log.path, log.flight_path).flight
        return f.entered, f.op, f.seq

    seen = []
    work = dist.Work()  # never completes: its wait is the fake below
    barrier = FLIGHT._distributed(lambda **kw: seen.append(flight()), "barrier")
    issue = FLIGHT._distributed(lambda **kw: work, "all_reduce")
    wait = FLIGHT._waiting(lambda target: seen.append(flight()))
    step_file = read_step(log.path)
    with _armed():
        barrier()
        assert flight() == (1, "", 0)
        assert read_step(log.path) == step_file and read_step(log.path).ticks == step_file.ticks
        assert issue(async_op=True) is work and flight() == (2, "", 0)
        wait(work)
        wait(work)
        assert flight() == (2, "", 0)
    assert seen == [(1, "barrier", 1), (2, "all_reduce", 2), (2, "", 0)]
    assert flight() == (0, "", 0)  # disarmed: the record is empty again


def test_a_wait_on_a_tensor_without_storage_of_its_own_is_matched_not_raised(log):
    """funcol's AsyncCollectiveTensor (what torchtitan's `dist_sum_tensor` waits on) has no storage: its wait is
    matched through the tensor it wraps, and a wrapper that holds none is waited for without a record."""
    torch = pytest.importorskip("torch")
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from cpdoctor.launch.flight import FLIGHT

    result = AsyncCollectiveTensor(torch.ones(4))
    issue = FLIGHT._functional(lambda: result, "all_reduce")
    waited = []
    wait = FLIGHT._waiting(lambda target: waited.append(FLIGHT.entered))
    with _armed():
        issue()
        assert FLIGHT.pending
        wait(result)
        assert not FLIGHT.pending  # matched through the tensor it wraps
        wait(AsyncCollectiveTensor(torch.zeros(2)))  # never issued: just waited
    assert waited == [1, 1]


def test_nested_collectives_count_once_under_the_outer_name(log):
    from cpdoctor.launch.flight import FLIGHT

    inner = FLIGHT._functional(lambda: None, "all_gather")
    outer = FLIGHT._functional(lambda: inner(), "permute")
    with _armed():
        outer()
        assert FLIGHT.entered == 1


def _armed():
    """FLIGHT armed for the block, as the worker arms it around a case."""
    from cpdoctor.launch.flight import recording

    pytest.importorskip("torch")
    return recording()
