"""`cpdoctor.watch_step(model)`: one step of the user's own CP training loop, examined against one process.

    with cpdoctor.watch_step(model) as step:
        out = model(**inputs)            # their noise, timesteps, forward (several: accumulation)
        loss = ...; loss.backward()      # their loss, scaled as they like
        <their gradient sync>            # all_reduce over the CP group, DDP, FSDP2, clipping, GradScaler, ...
    optimizer.step()                     # after the block: the watcher reads the gradients at its exit
    print(step.report.verdict)           # the same Report on every rank

On entry every rank finds its CP group (a diffusers transformer's parallel config; for a model whose CP is not
diffusers', what the caller says: degrees.py), hooks the model (unwrapped from DDP, accelerate and torch.compile;
FSDP2's fully_shard keeps it in place: record.py) and starts observing what the step does to its gradients (observe.py:
the backward roots, GradScaler, clipping, reductions). At exit it stops observing (always, whatever happened)
and closes the examination (examine.py): the ranks agree through the store that they are all here and well, the
CP group's first rank compares the gradients before any clip with the baseline and judges them with the events.
An exception in cpdoctor's own code is a CRASH finding; the watcher never raises out of the block, and the user's
own exception goes on. This module holds the watch's lifetime only."""

from __future__ import annotations

import time
import traceback
from typing import Any

from cpdoctor.compat import parallel_config as compat
from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.judgment.baseline import Baseline, OneProcessReference
from cpdoctor.examinations.step.judgment.reference import canonical
from cpdoctor.examinations.step.watcher import agree
from cpdoctor.examinations.step.watcher.degrees import Declared, Given, job_degrees, one_run_refusal, rebuildable
from cpdoctor.examinations.step.watcher.examine import Closing, close, report_of
from cpdoctor.examinations.step.watcher.group import StepGroup
from cpdoctor.examinations.step.watcher.observe import OBSERVING, Capture, Recorder
from cpdoctor.examinations.step.watcher.record import (
    Hooks,
    Recorded,
    autocast_dtypes,
    compute_dtype,
    module_device,
    rng_digest,
    unwrap,
    weights_digest,
)
from cpdoctor.launch import progress, watcher_comm
from cpdoctor.report import Report
from cpdoctor.vocabulary import DType, parse

DEFAULT_TIMEOUT_S = 600.0


class WatchCounter:
    """How many steps this process has watched (every rank must be at the same one when a watcher exits): the
    store keys of one watched step are named by it. Lifetime: one instance, `WATCHED`, created at this module's
    import at 0; every watcher's entry (`watch_step`, `cpdoctor step`'s run) takes the next number; it counts for
    the life of the process (every rank of a job counts alike), and only `reset` (a test) starts it again."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> int:
        self.count += 1
        return self.count

    def reset(self) -> None:
        self.count = 0


WATCHED = WatchCounter()

STEP_IN_FP32 = "build the model in fp32 (or leave autocast off) for the examination: it finds the same ones sooner"


def advise_slow_half(dtype: str, device: Any) -> None:
    """Where a step computes in a half dtype on a CPU that runs it far slower than fp32 (model_zoo/throughput.py:
    a probe of a few tens of milliseconds, once per process), say so while the step runs (progress.advise: the
    parent prints it at once): on such a CPU a bf16 step can outlast any timeout, and the dtype is why."""
    if getattr(device, "type", str(device)) == "cpu" and DType(dtype).is_half:
        from cpdoctor.model_zoo.throughput import slow_half_here

        warning = slow_half_here(dtype, STEP_IN_FP32)
        if warning is not None:
            progress.advise(f"the watched step computes in {dtype}: {warning}")


def step_group(module: Any, step: int | None, timeout_s: float, given: Given = Given(), one_run: bool = True) -> StepGroup:
    """This rank's CP group of the watched model and the job's degrees (degrees.job_degrees): a diffusers model's
    parallel config, checked against a CP group or mesh the caller passed; for a model whose CP is not diffusers',
    what the caller says (the function's degrees, a `cp_group`, a `mesh`, the world and a declared degree). BadInput
    when the job has no process group, nothing says the layout, or one run is asked of a model it cannot rebuild
    (the refusal names the two-run command), all before the step runs."""
    rank, world = watcher_comm.world()
    if world < 2:
        raise BadInput("watch_step needs the job's process group (torch.distributed initialised, more than one rank)")
    passed = watcher_comm.group_ranks(given.cp_group) if given.cp_group is not None else None
    config = compat.parallel_config_of(module)
    if config is not None:
        pg = compat.cp_group(config)
        if pg is None:
            raise BadInput("the model's CP mesh is not set up: call enable_parallelism with this job's process group first")
        ring, ulysses = compat.cp_degrees(config)
        ranks = watcher_comm.group_ranks(pg)
        # the model's own config decides (ring and Ulysses apart); what the caller passed must agree with it
        job_degrees(rank=rank, world=world, group_ranks=passed, mesh=given.mesh, diffusers=(ring, ulysses), diffusers_ranks=ranks)
    else:
        if one_run and not rebuildable(module):
            raise BadInput(one_run_refusal(module, given.target, given.declared if given.declared.says_cp else None))
        if rebuildable(module) and given.cp_group is None and given.mesh is None:  # a diffusers class: its CP is diffusers'
            raise BadInput(
                f"{type(module).__name__} has no context parallelism enabled: call model.enable_parallelism(config=...) "
                "before watching a CP step (or pass the job's cp_group= or mesh= when its CP is not diffusers')"
            )
        d = job_degrees(rank=rank, world=world, declared=given.declared, group_ranks=passed, mesh=given.mesh)
        ring, ulysses = d.ring, d.ulysses
        pg = given.cp_group if given.cp_group is not None else watcher_comm.cp_subgroup(d.cp_ranks)
        ranks = watcher_comm.group_ranks(pg)
    seq = WATCHED.next()
    return StepGroup(rank, world, ranks, ring, ulysses, seq, step if step is not None else seq, timeout_s, process_group=pg)


class StepWatch:
    """The context manager `watch_step` returns; `report` is set at exit (a cpdoctor Report)."""

    def __init__(
        self,
        model: Any,
        *,
        step: int | None = None,
        reference: str = "fp64",
        loss_scale: float | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        baseline: Baseline | None = None,
        on_report: Any = None,
        capture: Capture = Capture.VALUE_CLIPS,
        cp_group: Any = None,
        mesh: Any = None,
        ring: int | None = None,
        ulysses: int | None = None,
        dp: int | None = None,
        target: str | None = None,
    ) -> None:
        try:
            self.reference = parse(DType, reference, "reference")
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        if self.reference not in DType.references():
            raise BadInput(f"reference must be fp64 or fp32, not {reference!r}")
        if loss_scale is not None and not loss_scale > 0:
            raise BadInput(f"loss_scale must be a positive number (the factor your CP step scales its loss by), not {loss_scale!r}")
        self.module = unwrap(model)
        self.step = step
        self.loss_scale = loss_scale
        self.timeout_s = float(timeout_s)
        self.baseline: Baseline = baseline or OneProcessReference(self.reference.value)
        self.capture = Capture.EVERY_CLIP if self.baseline.needs_weights_digest else capture
        self.given = Given(Declared(ring, ulysses, dp), cp_group, mesh, target)
        """What the caller said about the job's layout: how a model whose CP is not diffusers' is examined."""
        self.on_report = on_report
        """Called with the report at the block's exit (what `cpdoctor step` keeps of every watched step)."""
        self.on_skip: Any = None
        """Called when the GradScaler skips the optimizer step inside the watch (preflight's armed watch re-arms)."""
        self.report: Report | None = None
        self._hooks: Hooks | None = None
        self._recorder: Recorder | None = None

    # -- entry ----------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """The group, the clock, the RNG states and the weights the step starts from."""
        self.group = step_group(self.module, self.step, self.timeout_s, self.given, one_run=self.baseline.needs_inputs)
        self._t0 = time.perf_counter()
        self.rng_before = rng_digest()
        self.weights = None
        if self.baseline.needs_weights_digest:  # two runs: did both start from the same weights?
            self.weights = weights_digest(self.module, canonical, watcher_comm.full_tensor)

    def adopt(self, recorder: Recorder, hooks: Hooks, rng_before: str, started: float) -> StepWatch:
        """Enter the watch on a step already recorded by `recorder` and `hooks` (entered in OBSERVING by whoever made
        them), as `cpdoctor step -- cmd` does at the first optimizer step: the weights have not moved yet, so the
        group and the weights are read now; `__exit__` closes it as any watch."""
        self._begin()
        self.rng_before, self._t0 = rng_before, started
        self._recorder, self._hooks = recorder, hooks
        return self

    def __enter__(self) -> StepWatch:
        self._begin()
        keep = (self.group.leader and self.baseline.needs_inputs) or self.baseline.judges_inputs
        self._recorder = Recorder(self.module, self.capture, on_skip=self._skipped, on_inner_step=self._keep_weights)
        self._hooks = Hooks(self.module, keep_full=keep, snapshot_weights=self._weights, recorder=self._recorder)
        OBSERVING.enter(self._recorder)
        try:
            self._hooks.install()
            if self.group.leader:
                advise_slow_half(compute_dtype(self.module, autocast_dtypes()), module_device(self.module))
        except BaseException:  # broad on purpose: whatever stops the entry, torch is left unwrapped before it goes on
            self._stop_watching()
            raise
        return self

    def _weights(self) -> dict[str, Any]:
        """The weights the forward uses: whole (FSDP2 gathered, on every rank alike), kept on the first rank when
        the reference recomputes the step."""
        out = {}
        swapped = type(self.module).__name__.startswith("FSDP")  # FSDP2 swaps in unsharded weights it frees after the forward
        for name, p in self.module.named_parameters():
            full = watcher_comm.full_tensor(p.detach())
            if self.group.leader and self.baseline.needs_inputs:
                # a plain weight does not change before the block's exit and the reference only reads it: not copied
                out[canonical(name)] = full.clone() if swapped or hasattr(p, "full_tensor") else full
        return out

    def _keep_weights(self, params: list[Any]) -> None:
        """An optimizer is about to step these parameters inside backward: the reference keeps the weights the
        forward used (the snapshot holds plain weights by reference)."""
        hooks = self._hooks
        if hooks is None or hooks.weights is None:
            return
        ids = {id(p) for p in params}
        for name, p in self.module.named_parameters():
            if id(p) in ids and canonical(name) in hooks.weights:
                hooks.weights[canonical(name)] = watcher_comm.full_tensor(p.detach()).clone()

    def _skipped(self) -> None:
        if self.on_skip is not None:
            self.on_skip()

    def _stop_watching(self) -> Hooks:
        """Remove the model's hooks and stop observing (the entry points are restored when no watch is left)."""
        hooks, self._hooks = self._hooks, None
        recorder = self._recorder
        try:
            if hooks is not None:
                hooks.remove()
        finally:
            if recorder is not None:
                OBSERVING.leave(recorder)
        assert hooks is not None
        return hooks

    def discard(self) -> None:
        """Stop watching without examining (the step the watch saw is not examined: the optimizer skipped it)."""
        self._stop_watching()

    # -- exit -----------------------------------------------------------------------------------------------
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        recorder = self._recorder
        assert recorder is not None
        try:
            recorder.gap("the end of the watch")
        except Exception:  # noqa: BLE001 - an observation that fails is said in the report, never raised into the step
            recorder.failed("the gradients at the end of the watch")
        hooks = self._stop_watching()
        if self.group.leader:  # autocast entered inside the block shows in the outputs' dtypes
            advise_slow_half(compute_dtype(self.module, [f.out_dtype for f in hooks.calls]), module_device(self.module))
        error = "".join(traceback.format_exception(exc_type, exc, tb)) if exc is not None else None
        if error is not None:  # a peer may never arrive (stuck in a collective this rank left): the parent names this
            progress.raised(f"{exc_type.__name__}: {exc}", error)
        closing = Closing(
            self.group,
            Recorded(self.module, hooks, self.weights),
            recorder,
            self.baseline,
            self.rng_before,
            self.loss_scale,
            error,
            self._t0,
        )
        try:
            self.report = close(closing)
        except Exception:  # noqa: BLE001 - cpdoctor's own failure is a finding on this rank, never the user's step's exception
            self.report = report_of(closing, [agree.own_crash(self.group, "cpdoctor's examination raised")])
        if self.on_report is not None:
            self.on_report(self.report)
        return False  # the user's own exception, if any, goes on
