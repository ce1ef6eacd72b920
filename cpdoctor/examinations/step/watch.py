"""`cpdoctor.watch_step(model)`: one step of the user's own CP training loop, examined against one process.

    with cpdoctor.watch_step(model) as step:
        out = model(**inputs)            # their noise, timesteps, forward (several: accumulation)
        loss = ...; loss.backward()      # their loss, scaled as they like
        <their gradient sync>            # all_reduce over the CP group, DDP, FSDP2, clipping, ...
    optimizer.step()                     # after the block: the watcher reads the gradients at its exit
    print(step.report.verdict)           # the same Report on every rank

On entry every rank hooks the diffusers transformer (unwrapped from DDP, accelerate and torch.compile; FSDP2's
fully_shard keeps it in place) and the backward roots (loss_graph.py). At exit the ranks first agree, through the
process group's store and never a collective, that every rank is here and well (a rank that raised, or is stuck
in a collective of the step, is a CRASH / HANG finding on every rank within the timeout); then every rank sends
what it saw to its CP group's first rank, which compares the final gradients with what one process computes
(baseline.py: the reference) and measures (measure.py); the CP groups' findings are shared with every rank. An
exception in cpdoctor's own code is a CRASH finding too; the watcher never raises out of the block, and the
user's own exception goes on. Collectives are launch/watcher_comm.py's, in the user's own process group; private
diffusers names are compat/parallel_config.py's."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

from cpdoctor.compat import parallel_config as compat
from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.baseline import Baseline, OneProcessReference
from cpdoctor.examinations.step.judge import step_finding
from cpdoctor.examinations.step.loss_graph import BackwardRoots
from cpdoctor.examinations.step.measure import measure
from cpdoctor.examinations.step.record import Hooks, PeerRecord, rng_digest, weights_digest
from cpdoctor.examinations.step.reference import ReferenceTooLarge, canonical
from cpdoctor.launch import progress, watcher_comm
from cpdoctor.report import Environment, FailureEvidence, Finding, Report, Verdict
from cpdoctor.vocabulary import DType

DEFAULT_TIMEOUT_S = 600.0

GO = "go"
"""What a rank posts in the decision round when it found nothing that stops the examination."""


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


@dataclass(frozen=True)
class StepEvidence:
    """What a step finding carries besides its rows (JSON `details`)."""

    ranks: tuple[int, ...]
    ring: int
    ulysses: int
    dp: int
    inputs_differ: dict[str, tuple[int, ...]]
    rng_after_groups: tuple[tuple[int, ...], ...]
    out_grad_spread: float
    peer_spread: float
    cp_sum_rel_err: float
    factor: float
    factor_residual: float
    first_bad_param: str | None
    reference: str
    compute_dtype: str = ""
    forwards: int = 1
    loss_factors: tuple[float, ...] = ()
    reference_gib: float | None = None
    """The one-process reference's plan on the CP group's first rank (copy + gradients), GiB; None with two runs."""


@dataclass(frozen=True)
class TooLarge:
    """The evidence of a step whose one-process reference was refused by its memory plan (`cpdoctor step` turns
    it into bad input, exit 2; in a training script it is a finding and the job goes on)."""

    plan: str


@dataclass(frozen=True)
class Arrival:
    """What a rank posts when it reaches the end of the watched block: where it is and whether the step raised."""

    rank: int
    index: int
    forwards: int
    backwards: int
    error: str | None = None


def unwrap(model: Any) -> Any:
    """The diffusers transformer inside DDP (and accelerate's prepare, which wraps in DDP) or torch.compile's
    OptimizedModule (FSDP2 shards the module in place); inside a trainer's own wrapper module, the first submodule
    with context parallelism enabled."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
            if inner is None or not hasattr(inner, "config") or hasattr(model, "config"):
                break
        model = inner
    if compat.parallel_config_of(model) is None and callable(getattr(model, "modules", None)):
        return next((m for m in model.modules() if compat.parallel_config_of(m) is not None), model)
    return model


def _named_trainable(module: Any) -> list[tuple[str, Any]]:
    return [(canonical(n), p) for n, p in module.named_parameters() if p.requires_grad]


def compute_dtype(module: Any, out_dtypes: list[str]) -> str:
    """The least precise of the trainable weights' dtypes and the outputs' (autocast computes in bf16 with fp32
    weights; a LoRA step trains fp32 adapters over a bf16 base): the dtype the tolerance follows."""
    seen = {DType.of_torch(p.dtype) or DType.FP32 for p in module.parameters()}
    seen |= {DType.of_torch(d) or DType.FP32 for d in out_dtypes if d}
    return max(seen or {DType.FP32}, key=DType.most_precise_first().index).value


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


def autocast_dtypes() -> list[str]:
    """The dtype CPU autocast computes in, when it is on here (empty when it is off)."""
    import torch

    try:
        on, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    except (TypeError, AttributeError):  # torch before 2.4: the CPU-specific names
        on, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return [str(dtype)] if on else []


@dataclass(frozen=True)
class WatchedStep:
    """What a watched step's report says was asked: the layout it ran in and which step it was, against which
    baseline (JSON `request`: `ring`, `ulysses`, `world_size`, `step`, `reference`)."""

    ring: int
    ulysses: int
    world_size: int
    step: int
    reference: str

    def to_dict(self) -> dict[str, Any]:
        return {"ring": self.ring, "ulysses": self.ulysses, "world_size": self.world_size, "step": self.step, "reference": self.reference}


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
    ) -> None:
        if reference not in DType.references():
            raise BadInput(f"reference must be fp64 or fp32, not {reference!r}")
        if loss_scale is not None and not loss_scale > 0:
            raise BadInput(f"loss_scale must be a positive number (the factor your CP step scales its loss by), not {loss_scale!r}")
        self.module = unwrap(model)
        self.step = step
        self.reference = reference
        self.loss_scale = loss_scale
        self.timeout_s = float(timeout_s)
        self.baseline: Baseline = baseline or OneProcessReference(reference)
        self.on_report = on_report
        """Called with the report at the block's exit (what `cpdoctor step` keeps of every watched step)."""
        self.report: Report | None = None
        self._hooks: Hooks | None = None
        self._roots: BackwardRoots | None = None

    # -- entry ----------------------------------------------------------------------------------------------
    def __enter__(self) -> StepWatch:
        rank, world = watcher_comm.world()
        if world < 2:
            raise BadInput("watch_step needs the job's process group (torch.distributed initialised, more than one rank)")
        config = compat.parallel_config_of(self.module)
        if config is None:
            raise BadInput(
                f"{type(self.module).__name__} has no context parallelism enabled: call model.enable_parallelism(config=...) "
                "before watching a CP step"
            )
        self.group = compat.cp_group(config)
        if self.group is None:
            raise BadInput("the model's CP mesh is not set up: call enable_parallelism with this job's process group first")
        self.ring, self.ulysses = compat.cp_degrees(config)
        self.ranks = watcher_comm.group_ranks(self.group)
        self.rank, self.world = rank, world
        self.leader = rank == self.ranks[0]
        self.seq = WATCHED.next()
        self.index = self.step if self.step is not None else self.seq
        self._t0 = time.perf_counter()
        self.rng_before = rng_digest()
        self.weights = None
        if getattr(self.baseline, "needs_weights_digest", False):  # two runs: did both start from the same weights?
            self.weights = weights_digest(self.module, canonical, watcher_comm.full_tensor)
        self._hooks = Hooks(self.module, keep_full=self.leader and self.baseline.needs_inputs, snapshot_weights=self._weights).install()
        self._roots = BackwardRoots().install()
        if self.leader:
            advise_slow_half(compute_dtype(self.module, autocast_dtypes()), self._device())
        return self

    def _weights(self) -> dict[str, Any]:
        """The weights the forward uses: whole (FSDP2 gathered, on every rank alike), kept on the first rank when
        the reference recomputes the step."""
        out = {}
        swapped = type(self.module).__name__.startswith("FSDP")  # FSDP2 swaps in unsharded weights it frees after the forward
        for name, p in self.module.named_parameters():
            full = watcher_comm.full_tensor(p.detach())
            if self.leader and self.baseline.needs_inputs:
                # a plain weight does not change before the block's exit and the reference only reads it: not copied
                out[canonical(name)] = full.clone() if swapped or hasattr(p, "full_tensor") else full
        return out

    # -- exit -----------------------------------------------------------------------------------------------
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        hooks, self._hooks = self._hooks, None
        roots, self._roots = self._roots, None
        assert hooks is not None and roots is not None
        hooks.remove()
        roots.remove()
        if self.leader:  # autocast entered inside the block shows in the outputs' dtypes
            advise_slow_half(compute_dtype(self.module, [f.out_dtype for f in hooks.calls]), self._device())
        error = "".join(traceback.format_exception(exc_type, exc, tb)) if exc is not None else None
        if error is not None:  # a peer may never arrive (stuck in a collective this rank left): the parent names this
            progress.raised(f"{exc_type.__name__}: {exc}", error)
        try:
            self.report = self._close(hooks, roots, error)
        except Exception:  # noqa: BLE001 - cpdoctor's own failure is a finding on this rank, never the user's step's exception
            self.report = self._report([self._crash({self.rank: traceback.format_exc()}, "cpdoctor's examination raised")])
        if self.on_report is not None:
            self.on_report(self.report)
        return False  # the user's own exception, if any, goes on

    def _subject(self) -> str:
        return f"training step {self.index}, ring {self.ring} × Ulysses {self.ulysses}, {self.world} ranks"

    def _crash(self, tracebacks: dict[int, str], what: str) -> Finding:
        lines = "; ".join(f"rank {r}: {_last_line(t)}" for r, t in sorted(tracebacks.items()))
        return Finding(
            self._subject(),
            Verdict.CRASH,
            f"{what} on rank {', '.join(map(str, sorted(tracebacks)))} ({lines})",
            "read the traceback of that rank (in the JSON details)",
            failure=FailureEvidence(tracebacks=dict(tracebacks)),
        )

    def _report(self, findings: list[Finding]) -> Report:
        import torch

        from cpdoctor.compat.diffusers import diffusers_version

        env = Environment(torch=str(torch.__version__), diffusers=diffusers_version(), world_size=self.world, device=str(self._device()))
        request = WatchedStep(self.ring, self.ulysses, self.world, self.index, self.baseline.name)
        return Report.of(findings, env, request, wall_s=time.perf_counter() - self._t0)

    def _device(self) -> Any:
        p = next(self.module.parameters(), None)
        return getattr(p, "device", "cpu")

    def _arrive(self, hooks: Hooks, error: str | None) -> list[Finding] | None:
        """Every rank agrees, through the store, that all ranks reached the block's end and none raised; the
        findings when not (the same on every rank), None when the collectives may start."""
        mine = Arrival(self.rank, self.index, hooks.forwards, hooks.backwards, error)
        seen = watcher_comm.exchange(f"cpdoctor/watch/{self.seq}/arrive", mine, tuple(range(self.world)), self.timeout_s)
        absent = [r for r, a in enumerate(seen) if a is None]
        raised = {a.rank: a.error for a in seen if a is not None and a.error}
        findings = []
        if raised:
            findings.append(self._crash(raised, "the step raised"))
        if absent:
            findings.append(
                Finding(
                    self._subject(),
                    Verdict.HANG,
                    f"rank {', '.join(map(str, absent))} did not reach the end of the watched step within {self.timeout_s:g} s "
                    f"(rank {', '.join(str(a.rank) for a in seen if a is not None)} did): it is still inside the step, e.g. in a "
                    "collective of it that a rank which raised never joins",
                    "read the traceback of the rank that raised; otherwise make every rank run the same step",
                )
            )
        if not findings:
            problem = self._count_problem([(a.index, a.forwards, a.backwards) for a in seen])
            findings = [problem] if problem is not None else []
        return self._decide(findings)

    def _decide(self, findings: list[Finding]) -> list[Finding] | None:
        """A second round through the store: every rank says whether it stops (with its findings) or goes on. A rank
        that arrived late saw everyone and would go on while its peers gave up on it: this round makes it stop
        with them, so no rank enters a collective alone."""
        everyone = tuple(range(self.world))
        said = watcher_comm.exchange(f"cpdoctor/watch/{self.seq}/decide", findings or GO, everyone, self.timeout_s)
        stopped = next((f for f in said if f and f != GO), None)
        if stopped is not None:
            return stopped
        silent = [r for r, f in zip(everyone, said) if f is None]
        if silent:
            return [
                Finding(
                    self._subject(),
                    Verdict.HANG,
                    f"rank {', '.join(map(str, silent))} did not say within {self.timeout_s:g} s whether it goes on",
                    "make every rank run the same step",
                )
            ]
        return None

    def _close(self, hooks: Hooks, roots: BackwardRoots, error: str | None) -> Report:
        stopped = self._arrive(hooks, error)
        if stopped is not None:
            return self._report(stopped)
        rng_after = rng_digest()
        names, grads, missing = self._grads()
        out_grads = tuple(f.out_grad for f in hooks.calls)
        record = PeerRecord(self.rank, hooks.forwards, hooks.backwards, hooks.prints, self.rng_before, rng_after, out_grads, None, missing)
        records = watcher_comm.gather_to_first(record, self.group)
        all_grads = watcher_comm.gather_tensor_to_first(grads, self.group)  # a tensor collective: no pickling
        if records is not None and all_grads is not None:
            for rec, g in zip(records, all_grads):
                rec.grads = g
        del grads  # the first rank holds its own among the gathered ones
        leaders = self.leaders = self._all_leaders()
        expected_mine, failed, refused = None, None, None
        if self.leader:
            assert records is not None
            try:
                expected_mine = self.baseline.expected(self, hooks, records, [n for n, _ in names])
            except ReferenceTooLarge as exc:  # not examined, and said before anything was allocated
                refused = str(exc)
            except Exception:  # noqa: BLE001 - the reference's failure is reported on every rank, no rank left waiting
                failed = traceback.format_exc()
        posted = watcher_comm.exchange(f"cpdoctor/watch/{self.seq}/reference", ("done", failed, refused), leaders, self.timeout_s)
        refusals = [p[2] for p in posted if p is not None and p[2]]
        if refusals:
            return self._report(
                [
                    Finding(
                        self._subject(),
                        Verdict.UNSUPPORTED,
                        f"not examined: {refusals[0]}",
                        "use one of the ways that fit, named in the diagnosis",
                        evidence=TooLarge(refusals[0]),
                    )
                ]
            )
        crashed = {r: p[1] for r, p in zip(leaders, posted) if p is not None and p[1]}
        if crashed:
            return self._report([self._crash(crashed, f"cpdoctor's reference ({self.baseline.name}) raised")])
        late = [r for r, p in zip(leaders, posted) if p is None]
        if late:
            return self._report(
                [
                    Finding(
                        self._subject(),
                        Verdict.HANG,
                        f"cpdoctor's reference on rank {', '.join(map(str, late))} did not finish within {self.timeout_s:g} s",
                        "give watch_step a longer timeout_s, or examine fewer blocks (`cpdoctor model --blocks N`)",
                    )
                ]
            )
        finding = self._judge(hooks, roots, records, names, expected_mine)
        return self._report([f for f in watcher_comm.all_gather(finding) if f is not None])

    def _all_leaders(self) -> tuple[int, ...]:
        """The first rank of every CP group (the groups partition the world)."""
        return tuple(sorted(set(watcher_comm.all_gather(self.ranks[0]))))

    def _judge(self, hooks: Hooks, roots: BackwardRoots, records: Any, names: list, expected_mine: Any) -> Finding | None:
        import torch

        numels = [n for _, n in names]
        own = expected_mine if expected_mine is not None else torch.zeros(sum(numels), dtype=torch.float32)  # as the reference returns it
        n_groups = self.world // len(self.ranks)
        expected = self.baseline.combine(own, n_groups)
        if not self.leader:
            return None
        try:
            numbers = measure(
                records,
                ring=self.ring,
                ulysses=self.ulysses,
                dp=n_groups,
                dtype=compute_dtype(self.module, [f.out_dtype for f in hooks.calls]),
                gather_dim=compat.output_gather_dim(self.module),
                out=self.baseline.output(hooks),
                ref_out=self.baseline.ref_output,
                expected=expected,
                own=own,
                param_names=[n for n, _ in names],
                param_numels=numels,
                loss=tuple(roots.readings),
                loss_scale=self.loss_scale,
                reference=self.baseline.name,
                recomputed=self.baseline.needs_inputs,
                out_numel=hooks.calls[0].out_numel,
                native=getattr(self.baseline, "native", None),
            )
            finding = step_finding(numbers)
            finding.subject = f"training step {self.index}, {finding.subject.removeprefix('training step, ')}"
            finding.evidence = _evidence(numbers, finding, self.baseline.name, getattr(self.baseline, "plan", None))
            if getattr(self.baseline, "matched", 0) is None and not numbers.inputs_differ:
                return self._unmatched(finding)
            return finding
        except Exception:  # noqa: BLE001 - reported on every rank through the gather that follows
            return self._crash({self.rank: traceback.format_exc()}, "cpdoctor's measurement raised")

    def _unmatched(self, finding: Finding) -> Finding:
        """The run without CP fed the model other inputs than this CP group: its gradients answer another
        question, so nothing is judged (the step's data depends on the layout, not a CP defect)."""
        return Finding(
            finding.subject,
            Verdict.UNSUPPORTED,
            "no rank of the run without CP started from the weights and fed the model the inputs this CP group did (their "
            "fingerprints differ): the step's data or weights depend on the CP layout, so its gradients cannot be compared "
            "with one process's",
            "seed weights, noise and timesteps by the data-parallel rank (never the global rank or the world size), the "
            "same way whatever the degrees",
            finding.tensors,
            evidence=finding.evidence,
        )

    def _count_problem(self, counts: list[tuple[int, int, int]]) -> Finding | None:
        steps = {c[0] for c in counts}
        if len(steps) > 1:
            text = ", ".join(f"rank {r} at step {c[0]}" for r, c in enumerate(counts))
            return Finding(
                self._subject(),
                Verdict.FAIL,
                f"the ranks disagree on the step count: {text}",
                "run the same number of steps on every rank (the same data length per rank; no rank-only steps)",
            )
        no_fwd = [r for r, c in enumerate(counts) if c[1] == 0]
        if no_fwd:
            return Finding(
                self._subject(),
                Verdict.UNSUPPORTED,
                f"the model was not called inside the watched step on rank {', '.join(map(str, no_fwd))}",
                "run the step's forward inside the `with cpdoctor.watch_step(model)` block",
            )
        uneven = {c[1] for c in counts}
        if len(uneven) > 1:
            text = ", ".join(f"rank {r}: {c[1]}" for r, c in enumerate(counts))
            return Finding(
                self._subject(),
                Verdict.FAIL,
                f"the ranks ran different numbers of forwards inside the watched step ({text})",
                "run the same micro-batches on every rank of a CP group",
            )
        no_bwd = [r for r, c in enumerate(counts) if c[2] == 0]
        if no_bwd:
            return Finding(
                self._subject(),
                Verdict.UNSUPPORTED,
                f"the step never called backward through the model's output on rank {', '.join(map(str, no_bwd))}: no gradient to examine",
                "call loss.backward() (and the gradient sync) inside the `with cpdoctor.watch_step(model)` block",
            )
        return None

    def _grads(self) -> tuple[list[tuple[str, int]], Any, tuple[str, ...]]:
        """Every trainable parameter's gradient after the sync, flat (FSDP2's gathered whole on every rank)."""
        import torch

        trainable = _named_trainable(self.module)
        flat = torch.empty(sum(p.numel() for _, p in trainable))  # filled in place: no second whole copy
        names, missing, offset = [], [], 0
        for name, p in trainable:
            n = p.numel()
            if p.grad is None:
                missing.append(name)
                flat[offset : offset + n] = 0
            else:
                flat[offset : offset + n] = watcher_comm.full_tensor(p.grad.detach()).reshape(-1)
            names.append((name, n))
            offset += n
        return names, flat, tuple(missing)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no traceback)"


def _evidence(numbers: Any, finding: Finding, reference: str, plan: Any = None) -> StepEvidence:
    from cpdoctor.examinations.step.judge import StepSignature, first_bad_param

    s = StepSignature(numbers)
    first = first_bad_param(s)
    return StepEvidence(
        ranks=numbers.ranks,
        ring=numbers.ring,
        ulysses=numbers.ulysses,
        dp=numbers.dp,
        inputs_differ={d.name: d.different for d in numbers.inputs_differ},
        rng_after_groups=numbers.rng_after_groups,
        out_grad_spread=numbers.out_grad_spread,
        peer_spread=numbers.peer_spread,
        cp_sum_rel_err=numbers.sum_rel_err,
        factor=s.worst.factor,
        factor_residual=s.worst.residual,
        first_bad_param=None if first is None else first.name,
        reference=reference,
        compute_dtype=numbers.dtype,
        forwards=max(numbers.forwards, default=1),
        loss_factors=tuple(f for r in numbers.loss for f in r.constants()),
        reference_gib=None if plan is None else round(plan.total / 2**30, 3),
    )
