"""Every owner of process-wide state (docs/ARCHITECTURE.md, "State with an owner") entered twice, its state
checked after each entry and each exit: what one use leaves behind must not change the next one.
The held process group's real entry needs a process group: tests/integration/test_held_group_owner.py."""

from __future__ import annotations

import pytest

# ------------------------------------------------------------------------------------------------ the patch


@pytest.fixture
def dispatch():
    """diffusers' attention_dispatch, unpatched before and after the test."""
    pytest.importorskip("diffusers")
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.fix import patch

    patch.revert()
    yield compat.dispatch_module()
    patch.revert()


def test_the_patch_state_applied_and_reverted_twice(dispatch):
    from cpdoctor.fix import patch
    from cpdoctor.fix.ring import RingAttention
    from cpdoctor.fix.ulysses import UlyssesAttention

    ring, ulysses = dispatch.TemplatedRingAttention, dispatch.TemplatedUlyssesAttention
    assert not patch.STATE.originals and patch.STATE.report is None and UlyssesAttention.original is None
    for _ in range(2):
        report = patch.apply()
        assert not report.already_patched and patch.last_report() is report and patch.STATE.report is report
        assert patch.STATE.originals == {
            (dispatch.__name__, "TemplatedRingAttention"): ring,
            (dispatch.__name__, "TemplatedUlyssesAttention"): ulysses,
        }
        assert dispatch.TemplatedRingAttention is RingAttention and dispatch.TemplatedUlyssesAttention is UlyssesAttention
        assert UlyssesAttention.original is ulysses
        again = patch.apply()  # while patched: the state is kept as it is, the report says so
        assert again.already_patched and again.replaced == report.replaced and patch.STATE.report is report
        assert patch.revert() is True
        assert dispatch.TemplatedRingAttention is ring and dispatch.TemplatedUlyssesAttention is ulysses
        assert not patch.STATE.originals and patch.last_report() is None and UlyssesAttention.original is None
        assert patch.revert() is False


def test_patched_block_leaves_the_state_as_it_found_it(dispatch):
    from cpdoctor.fix import patch

    for _ in range(2):
        with patch.patched() as report:
            assert patch.is_patched() and patch.STATE.report is report
        assert not patch.is_patched() and not patch.STATE.originals and patch.STATE.report is None
    patch.apply()
    with patch.patched() as report:
        assert report.already_patched
    assert patch.is_patched() and patch.STATE.originals  # it was patched before the block: it stays so


def test_apply_takes_no_dkv_strategy(dispatch):
    """The dK/dV strategy had one member left ("ring"): the parameter and its enum are gone."""
    from cpdoctor.fix import patch, ring

    assert not hasattr(ring, "DkvStrategy")
    with pytest.raises(TypeError):
        patch.apply(dkv="ring")  # type: ignore[call-arg]
    assert not patch.is_patched()


# ------------------------------------------------------------------------------------------------ autopatch


def test_autopatch_run_twice(dispatch, capsys):
    import cpdoctor.autopatch as autopatch
    from cpdoctor.fix import patch

    hook = autopatch.AutoPatch()
    for _ in range(2):
        hook.run({autopatch.ENV: "1"})
        assert hook.report is not None and not hook.report.already_patched and patch.is_patched()
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("cpdoctor: replaced") and "TemplatedRingAttention" in line
        patch.revert()
    hook.run({autopatch.ENV: "force"})
    assert hook.report is not None and patch.is_patched()
    patch.revert()
    capsys.readouterr()
    for value in ("", "0", "yes"):  # anything else: nothing, silently, and no report left from the last run
        hook.run({autopatch.ENV: value})
        assert hook.report is None and not patch.is_patched() and capsys.readouterr().err == ""


def test_autopatch_module_report_reads_its_owner(monkeypatch):
    import cpdoctor.autopatch as autopatch

    monkeypatch.setattr(autopatch.AUTOPATCH, "report", "a report")
    assert autopatch.report == "a report"
    monkeypatch.setattr(autopatch.AUTOPATCH, "report", None)
    assert autopatch.report is None
    with pytest.raises(AttributeError):
        autopatch.reports  # noqa: B018


def test_autopatch_that_cannot_patch_says_so_and_keeps_nothing(dispatch, capsys, monkeypatch):
    import cpdoctor.autopatch as autopatch
    from cpdoctor.fix import patch

    def refuse(force: bool = False):
        raise patch.PatchRefused("not this diffusers")

    monkeypatch.setattr(patch, "apply", refuse)
    hook = autopatch.AutoPatch()
    for _ in range(2):
        hook.run({autopatch.ENV: "1"})
        assert hook.report is None and "was NOT patched: not this diffusers" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- held group


class FakeContext:
    def __init__(self, owns_group: bool = True) -> None:
        self.owns_group = owns_group
        self.closed = 0

    def close(self, sync: bool = True) -> None:
        self.closed += 1


def test_the_held_group_armed_kept_and_released_twice():
    from cpdoctor.launch.torchrun import HeldGroup

    held = HeldGroup()
    assert not held.keep(FakeContext())  # not armed: the job closes its own group
    for _ in range(2):
        held.arm()
        scripts = FakeContext(owns_group=False)
        assert not held.keep(scripts) and held.context is None  # a training script's group is never kept
        first, second = FakeContext(), FakeContext()
        assert held.keep(first) and held.context is first
        assert not held.keep(second) and held.context is first  # later jobs join the kept one
        held.release()
        assert first.closed == 1 and held.context is None and not held.armed
        held.release()
        assert first.closed == 1


# ---------------------------------------------------------------------------------------- stand-in library


@pytest.fixture
def standins():
    from cpdoctor.cpu_kernels import standins

    was = standins.installed()
    standins.uninstall()
    yield standins
    standins.uninstall()
    if was:
        standins.install()


def test_the_standin_library_installed_and_uninstalled_twice(standins):
    import torch

    def has_cpu_kernel(op: str) -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key(getattr(torch.ops.aten, op).default.name(), "CPU")

    assert not standins.installed() and standins.LIBRARY.library is None
    first = None
    for _ in range(2):
        ops = standins.install()
        assert ops and standins.installed() and all(has_cpu_kernel(op) for op in ops)
        assert first is None or ops == first
        first = ops
        assert standins.install() == ops  # idempotent while installed
        standins.uninstall()
        assert not standins.installed() and standins.LIBRARY.ops == [] and not any(has_cpu_kernel(op) for op in ops)


# ------------------------------------------------------------------------------------------- step counter


def test_the_watch_counter_reset_and_counted_twice(monkeypatch):
    pytest.importorskip("torch")
    from cpdoctor.examinations.step.watcher.watch import WATCHED

    monkeypatch.setattr(WATCHED, "count", WATCHED.count)  # the process's own count, put back afterwards
    for _ in range(2):
        WATCHED.reset()
        assert WATCHED.count == 0
        assert [WATCHED.next(), WATCHED.next(), WATCHED.next()] == [1, 2, 3] and WATCHED.count == 3


def test_the_capture_armed_captured_and_disarmed_twice(tmp_path, monkeypatch):
    """`cpdoctor step -- cmd`'s capture in one process (no process group, run 1's role): armed, the first optimizer
    step of the model that ran with gradients is saved and the job's end is called; disarmed, torch's global hooks
    are gone and nothing is kept. Twice: nothing of the first use is left for the next."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    from cpdoctor.examinations.step.runs.capture import CAPTURE, ArmSpec, Ending
    from cpdoctor.examinations.step.runs.request import Role
    from cpdoctor.examinations.step.watcher.observe import OBSERVING
    from cpdoctor.examinations.step.watcher.watch import WATCHED

    monkeypatch.setattr(WATCHED, "count", WATCHED.count)
    monkeypatch.delenv("RANK", raising=False)

    def global_hooks() -> tuple[int, int, int]:  # the watcher's own step hook stays for the process (observe.py)
        steps = len(optim_module._global_optimizer_pre_hooks) - (OBSERVING.step_hook is not None)
        return len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks), steps

    hooks_before = global_hooks()
    for n in range(2):
        WATCHED.reset()
        ended: list[float] = []
        directory = tmp_path / f"use{n}"
        CAPTURE.arm(str(directory), ArmSpec(Role.WITHOUT_CP, str(directory / "saved"), 1, 1, 1, 30.0), ended.append)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model(torch.ones(2, 4))  # no gradients: not a candidate
        assert not CAPTURE.candidates
        model(torch.ones(2, 4)).sum().backward()
        assert [c.module for c in CAPTURE.candidates] == [model] and OBSERVING.recorders
        opt.step()
        outcome = CAPTURE.outcome
        assert ended == [30.0] and outcome is not None and outcome.ending is Ending.SAVED and outcome.forwards == 1
        assert (directory / "saved" / "step1-rank0.safetensors").exists() and (directory / "outcome" / f"{outcome.who}.pkl").exists()
        CAPTURE.disarm()
        assert not CAPTURE.handles and not CAPTURE.candidates and CAPTURE.spec is None and not OBSERVING.recorders
        assert global_hooks() == hooks_before and not nn_module._has_any_global_hook()


# ------------------------------------------------------------------------------------------------- caches


def test_the_observed_entry_points_wrapped_and_restored_twice():
    """The first watch wraps the training entry points, a second one shares them, the last to leave puts every
    original back (twice over: nothing of the first use is left for the next)."""
    torch = pytest.importorskip("torch")
    from cpdoctor.examinations.step.watcher.observe import OBSERVING, Recorder

    originals = (torch.Tensor.backward, torch.autograd.backward, torch.nn.utils.clip_grad_value_)
    model = torch.nn.Linear(2, 2)
    for _ in range(2):
        assert not OBSERVING.recorders and not OBSERVING.patches
        first, second = Recorder(model), Recorder(model)
        OBSERVING.enter(first)
        wrapped = torch.Tensor.backward
        assert wrapped is not originals[0] and OBSERVING.patches
        OBSERVING.enter(second)
        assert torch.Tensor.backward is wrapped  # one set of wrappers for every open watch
        OBSERVING.leave(first)
        assert torch.Tensor.backward is wrapped and OBSERVING.recorders == [second]
        OBSERVING.leave(second)
        assert (torch.Tensor.backward, torch.autograd.backward, torch.nn.utils.clip_grad_value_) == originals
        assert not OBSERVING.patches and OBSERVING.depth == 0


def test_a_memo_computes_once_per_key_until_cleared():
    from cpdoctor.memo import Memo

    calls: list[str] = []

    def compute(key: str):
        return lambda: calls.append(key) or object()

    memo: Memo[object] = Memo("test values")
    for _ in range(2):
        a = memo.get("a", compute("a"))
        assert memo.get("a", compute("a")) is a and memo.get("b", compute("b")) is not a
        assert calls == ["a", "b"] and len(memo) == 2 and "a" in memo
        memo.clear()
        assert len(memo) == 0 and "a" not in memo
        calls.clear()

    def fails():
        raise ValueError("not now")

    with pytest.raises(ValueError):
        memo.get("c", fails)
    assert "c" not in memo  # a failure is not kept


def _filled_twice(memo, fill):
    """fill() twice: the second is the kept value; clear; twice again: a fresh value, kept again."""
    memo.clear()
    first = fill()
    assert fill() is first and len(memo) == 1
    memo.clear()
    assert len(memo) == 0
    second = fill()
    assert fill() is second and second is not first and len(memo) == 1
    return first, second


def test_the_survey_memo_filled_twice():
    pytest.importorskip("diffusers")
    from hub_cache import TINY_FLUX

    from cpdoctor.examinations.model.spec import SURVEYS, ModelSpec, model_survey
    from cpdoctor.model_zoo.catalog import resolve_model

    resolved = resolve_model("flux")
    spec = ModelSpec(resolved.cls, "flux", resolved.cls.__name__, dict(TINY_FLUX), "test", None)
    first, second = _filled_twice(SURVEYS, lambda: model_survey(spec))
    assert first.stacks == second.stacks


def test_the_tiny_config_memo_filled_twice():
    pytest.importorskip("diffusers")
    from cpdoctor.model_zoo import tiny
    from cpdoctor.model_zoo.catalog import resolve_model

    wan = resolve_model("wan").cls
    first, second = _filled_twice(tiny.DERIVED, lambda: tiny.derive(wan))
    assert first.config == second.config and first.config["num_layers"] == 1


def test_the_model_scan_memo_filled_twice():
    pytest.importorskip("diffusers")
    from cpdoctor.model_zoo import catalog

    first, second = _filled_twice(catalog.SCANNED, catalog._scan)
    assert [e for _, e in first] == [e for _, e in second] == catalog.list_models() and first


def test_the_requirements_memo_filled_twice():
    pytest.importorskip("diffusers")
    from cpdoctor.compat import requirements

    first, second = _filled_twice(requirements.READ, requirements.installed_requirements)
    assert first == second and first  # the installed diffusers' own checks were read


def test_the_yunchang_groups_made_once_per_world():
    from cpdoctor.peer_impls.yunchang import YunchangGroups

    made: list[tuple[int, int]] = []

    def make(ring: int, ulysses: int):
        return lambda: made.append((ring, ulysses)) or (object(), object())

    groups = YunchangGroups()
    for world in (object(), object()):  # a second world (a later job's new default group): made afresh
        made.clear()
        a = groups.get(world, 2, 1, make(2, 1))
        assert groups.get(world, 2, 1, make(2, 1)) is a and groups.get(world, 1, 2, make(1, 2)) is not a
        assert made == [(2, 1), (1, 2)] and groups.world is world and len(groups.made) == 2


def test_the_flight_recorder_armed_and_disarmed_twice(tmp_path):
    """Each case arms the collectives' wrappers and disarms them: every original is back, the record empty, the
    injected stall gone; a wrapper put over ours meanwhile (the step watcher's) stays, and ours passes through."""
    pytest.importorskip("torch")
    import functools

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from cpdoctor.launch import progress
    from cpdoctor.launch.flight import FLIGHT, recording, stall_at_first_collective

    originals = (dist.all_gather, dist.barrier, dist.batch_isend_irecv, dist.Work.wait, funcol.all_gather_tensor, funcol.wait_tensor)
    log = progress.StepLog(str(tmp_path / "rank0.step"), flight_path=str(tmp_path / "rank0.flight"))
    log.mark(0, "examining")
    progress.activate(log)
    try:
        for _ in range(2):
            assert not FLIGHT.armed and FLIGHT.entered == 0 and not FLIGHT.pending and not FLIGHT.stall_first
            stall_at_first_collective()
            with recording():
                assert FLIGHT.armed and dist.barrier is not originals[1] and funcol.wait_tensor is not originals[5]
                with recording():  # a nested block arms nothing more
                    assert FLIGHT.armed
                FLIGHT.entered = 3
                mine = dist.all_reduce
                over = functools.partial(mine)  # someone wraps ours and does not restore it
                dist.all_reduce = over
            assert (
                dist.all_gather,
                dist.barrier,
                dist.batch_isend_irecv,
                dist.Work.wait,
                funcol.all_gather_tensor,
                funcol.wait_tensor,
            ) == originals
            assert dist.all_reduce is over and not FLIGHT.armed and FLIGHT.entered == 0 and not FLIGHT.stall_first
            assert progress.read_step(log.path, log.flight_path).flight == progress.Collectives()
            dist.all_reduce = mine.__wrapped__  # the test's own restoring
    finally:
        progress.activate(None)
