"""`cpdoctor.watch_step(model)`: one step of the user's own CP training loop, examined against one process.

    with cpdoctor.watch_step(model) as step:
        out = model(**inputs)            # their noise, timesteps, forward
        loss = ...; loss.backward()      # their loss
        <their gradient sync>            # all_reduce over the CP group, DDP, FSDP2, ...
    optimizer.step()                     # after the block: the watcher reads the gradients at its exit
    print(step.report.verdict)           # the same Report on every rank

On entry every rank hooks the diffusers transformer (unwrapped from DDP; FSDP2's fully_shard keeps it in
place); at exit every rank sends what it saw to its CP group's first rank, which recomputes the step in one
fp64 process (reference.py) and measures (measure.py); the CP groups' findings are shared with every rank.
Collectives are launch/step_comm.py's, in the user's own process group; private diffusers names are
compat/step.py's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cpdoctor.compat import step as compat
from cpdoctor.errors import BadInput
from cpdoctor.examinations.step.judge import step_finding
from cpdoctor.examinations.step.measure import measure, reference_out_grad
from cpdoctor.examinations.step.record import Hooks, PeerRecord, rng_digest
from cpdoctor.examinations.step.reference import reference_step
from cpdoctor.launch import step_comm
from cpdoctor.report import Finding, Report, Verdict

DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}

_watched_steps = 0
"""How many steps this process has watched: every rank must be at the same one when a watcher exits."""


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


def unwrap(model: Any) -> Any:
    """The diffusers transformer inside a DDP wrapper (FSDP2 shards the module in place)."""
    inner = getattr(model, "module", None)
    return inner if inner is not None and hasattr(inner, "config") and not hasattr(model, "config") else model


def _named_trainable(module: Any) -> list[tuple[str, Any]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


class StepWatch:
    """The context manager `watch_step` returns; `report` is set at exit (a cpdoctor Report)."""

    def __init__(self, model: Any, *, step: int | None = None, reference: str = "fp64") -> None:
        if reference not in ("fp64", "fp32"):
            raise BadInput(f"reference must be fp64 or fp32, not {reference!r}")
        self.module = unwrap(model)
        self.step = step
        self.reference = reference
        self.report: Report | None = None
        self._hooks: Hooks | None = None

    # -- entry ----------------------------------------------------------------------------------------------
    def __enter__(self) -> StepWatch:
        global _watched_steps
        rank, world = step_comm.world()
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
        self.ranks = step_comm.group_ranks(self.group)
        self.rank, self.world = rank, world
        self.leader = rank == self.ranks[0]
        _watched_steps += 1
        self.index = self.step if self.step is not None else _watched_steps
        self._t0 = time.perf_counter()
        self.rng_before = rng_digest()
        self._hooks = Hooks(self.module, keep_full=self.leader, snapshot_weights=self._weights).install()
        return self

    def _weights(self) -> dict[str, Any]:
        """The weights the forward uses: whole (FSDP2 gathered, on every rank alike), kept on the first rank."""
        out = {}
        for name, p in self.module.named_parameters():
            full = step_comm.full_tensor(p.detach())
            if self.leader:
                out[name] = full.cpu().clone()
        return out

    # -- exit -----------------------------------------------------------------------------------------------
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        hooks, self._hooks = self._hooks, None
        assert hooks is not None
        hooks.remove()
        if exc is not None:  # the user's step raised: no collective (peers may be elsewhere); their exception goes on
            self.report = self._report(
                [Finding(self._subject(), Verdict.CRASH, f"the step raised on rank {self.rank}: {exc}", "read the traceback")]
            )
            return False
        self.report = self._examine(hooks)
        return False

    def _subject(self) -> str:
        return f"training step {self.index}, ring {self.ring} × Ulysses {self.ulysses}, {self.world} ranks"

    def _report(self, findings: list[Finding]) -> Report:
        import torch

        from cpdoctor.compat.diffusers import diffusers_version

        env = {"torch": str(torch.__version__), "diffusers": diffusers_version(), "world_size": self.world, "device": str(self._device())}
        request = {"ring": self.ring, "ulysses": self.ulysses, "world_size": self.world, "step": self.index, "reference": self.reference}
        return Report.of(findings, env, request, wall_s=time.perf_counter() - self._t0)

    def _device(self) -> Any:
        p = next(self.module.parameters(), None)
        return getattr(p, "device", "cpu")

    def _examine(self, hooks: Hooks) -> Report:
        rng_after = rng_digest()
        counts = step_comm.all_gather((self.index, hooks.forwards, hooks.backwards))
        problem = self._count_problem(counts)
        if problem is not None:
            return self._report([problem])
        names, grads, missing = self._grads()
        record = PeerRecord(
            self.rank, hooks.forwards, hooks.backwards, hooks.prints, self.rng_before, rng_after, hooks.out_grad, None, missing
        )
        records = step_comm.gather_to_first(record, self.group)
        all_grads = step_comm.gather_tensor_to_first(grads, self.group)  # a tensor collective: no pickling
        if records is not None and all_grads is not None:
            for rec, g in zip(records, all_grads):
                rec.grads = g
        numels = [n for _, n in names]
        import torch

        ref_flat = torch.zeros(sum(numels), dtype=torch.float64)
        out = ref_out = None
        if self.leader:
            assert records is not None and hooks.weights is not None
            ref_out, ref_flat = reference_step(
                self.module, hooks.weights, hooks.args, hooks.kwargs, reference_out_grad(records), [n for n, _ in names],
                self.reference, self._device() if str(self._device()) != "meta" else "cpu",
            )  # fmt: skip
            out = hooks.output
        n_groups = self.world // len(self.ranks)
        expected = step_comm.sum_over_world(ref_flat) / n_groups
        finding = None
        if self.leader:
            assert records is not None
            numbers = measure(
                records, ring=self.ring, ulysses=self.ulysses, dp=n_groups, dtype=self._dtype(), gather_dim=compat.output_gather_dim(self.module),
                out=out, ref_out=ref_out, expected=expected, own=ref_flat, param_names=[n for n, _ in names], param_numels=numels,
            )  # fmt: skip
            finding = step_finding(numbers)
            finding.evidence = _evidence(numbers, finding, self.reference)
        findings = [f for f in step_comm.all_gather(finding) if f is not None]
        return self._report(findings)

    def _count_problem(self, counts: list[tuple[int, int, int]]) -> Finding | None:
        steps = {c[0] for c in counts}
        if len(steps) > 1:
            text = ", ".join(f"rank {r} at step {c[0]}" for r, c in enumerate(counts))
            return Finding(self._subject(), Verdict.FAIL, f"the ranks disagree on the step count: {text}",
                           "run the same number of steps on every rank (the same data length per rank; no rank-only steps)")  # fmt: skip
        no_fwd = [r for r, c in enumerate(counts) if c[1] == 0]
        if no_fwd:
            return Finding(self._subject(), Verdict.UNSUPPORTED, f"the model was not called inside the watched step on rank {', '.join(map(str, no_fwd))}",
                           "run the step's forward inside the `with cpdoctor.watch_step(model)` block")  # fmt: skip
        many = [r for r, c in enumerate(counts) if c[1] > 1]
        if many:
            return Finding(self._subject(), Verdict.UNSUPPORTED, f"the model ran {max(c[1] for c in counts)} forwards inside the watched step on rank {', '.join(map(str, many))}; one is examined",
                           "watch one forward and its backward (one micro-batch)")  # fmt: skip
        no_bwd = [r for r, c in enumerate(counts) if c[2] == 0]
        if no_bwd:
            return Finding(self._subject(), Verdict.UNSUPPORTED, f"the step never called backward through the model's output on rank {', '.join(map(str, no_bwd))}: no gradient to examine",
                           "call loss.backward() (and the gradient sync) inside the `with cpdoctor.watch_step(model)` block")  # fmt: skip
        return None

    def _dtype(self) -> str:
        p = next(self.module.parameters(), None)
        return DTYPE_NAMES.get(str(getattr(p, "dtype", "")), "fp32")

    def _grads(self) -> tuple[list[tuple[str, int]], Any, tuple[str, ...]]:
        """Every trainable parameter's gradient after the sync, flat (FSDP2's gathered whole on every rank)."""
        import torch

        names, parts, missing = [], [], []
        for name, p in _named_trainable(self.module):
            g = p.grad
            n = p.numel()
            if g is None:
                missing.append(name)
                parts.append(torch.zeros(n))
            else:
                parts.append(step_comm.full_tensor(g.detach()).reshape(-1).float().cpu())
            names.append((name, n))
        return names, torch.cat(parts) if parts else torch.zeros(0), tuple(missing)


def _evidence(numbers: Any, finding: Finding, reference: str) -> StepEvidence:
    from cpdoctor.examinations.step.judge import StepSignature, first_bad_param

    s = StepSignature(numbers)
    first = first_bad_param(s)
    return StepEvidence(
        ranks=numbers.ranks, ring=numbers.ring, ulysses=numbers.ulysses, dp=numbers.dp,
        inputs_differ={d.name: d.different for d in numbers.inputs_differ}, rng_after_groups=numbers.rng_after_groups,
        out_grad_spread=numbers.out_grad_spread, peer_spread=numbers.peer_spread, cp_sum_rel_err=numbers.sum_rel_err,
        factor=s.worst.factor, factor_residual=s.worst.residual, first_bad_param=None if first is None else first.name, reference=reference,
    )  # fmt: skip


def watch_step(model: Any, *, step: int | None = None, reference: str = "fp64") -> StepWatch:
    """Watch one CP training step of `model` (a diffusers transformer with enable_parallelism, bare, in DDP or
    under FSDP2's fully_shard): use as `with cpdoctor.watch_step(model) as step:` around the forward, the loss,
    backward and the gradient sync, on every rank; `step.report` is a cpdoctor Report, the same on every rank.
    `step` names the step (every rank must watch the same one; default: this process's count of watched steps);
    `reference` is the precision of the one-process recomputation (fp64 or fp32)."""
    return StepWatch(model, step=step, reference=reference)
