"""Model-level CP parity, on the ranks: a real diffusers model class through its own `enable_parallelism`, output
and every parameter gradient, against the same model in one process.

Every rank builds the same model (spec.py, build.py), sets the attention backend, enables context parallelism
with `ContextParallelConfig(ring_degree=, ulysses_degree=)` (the model's `_cp_plan` hooks split the inputs and
gather the output), feeds the same full inputs, back-propagates the same seeded upstream gradient and sums the
parameter gradients over the CP group (each rank back-propagates only its own tokens; one collective for all of
them). It then runs the op-level attention probe at the same ring × Ulysses layout (the exact `cpdoctor check`
the diagnosis suggests), so the verdict can say whether the attention op alone reproduces what the model shows.

Rank 0 evaluates against the reference (the same weights and inputs in float64 on CPU, diffusers' default
attention backend) and measures the baseline (the same model in one process, probe dtype, same backend: the
error without CP, which sets the tolerance). Numbers only: judge.py judges. Never prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat import diffusers as compat
from cpdoctor.errors import BadInput, Unsupported, UnsupportedKind
from cpdoctor.examinations import registry
from cpdoctor.examinations.backend_choice import BackendAsk, NotRunnable, no_backend_here, prepare_emulation
from cpdoctor.examinations.backend_choice import select_backend as choose_backend
from cpdoctor.examinations.base import Examination
from cpdoctor.examinations.judging import emulation_note
from cpdoctor.examinations.measurement import Measurement, compare, rank_environment, torch_dtype
from cpdoctor.examinations.model.blocks import BlockRecord, BlockRecorder, block_errors
from cpdoctor.examinations.model.build import build_model, make_inputs, step
from cpdoctor.examinations.model.grads import ParamLayout, grad_errors
from cpdoctor.examinations.model.prepare import indivisible
from cpdoctor.examinations.model.request import ModelRequest
from cpdoctor.examinations.model.spec import REFERENCE_BACKEND, ModelSpec, model_survey, request_spec
from cpdoctor.examinations.request import LayoutRequest
from cpdoctor.launch.jobs import Case, RankResult
from cpdoctor.launch.progress import tick, ticking
from cpdoctor.model_zoo.plan_fit import inner_gathers
from cpdoctor.report import BlockRow, ParamRow, TensorRow
from cpdoctor.report.environment import Environment
from cpdoctor.vocabulary import DType, Kind


def op_level() -> Examination:
    """The op-level examination (`cpdoctor check`), which the model examination runs as its cross-check: reached
    through the registry by its kind, as the runner reaches every examination, never by importing its package."""
    return registry.get(Kind.ATTENTION)


def op_level_requests(req: ModelRequest) -> tuple[LayoutRequest, ...]:
    """The op-level cross-checks run at the same layout: exactly what `cpdoctor check --ring R --ulysses U
    [--dtype D] [--backend B]` runs, and again with `--mask-pad N` when the model's text is padded."""
    common = dict(
        ring=req.ring, ulysses=req.ulysses, backend=req.backend, dtype=req.dtype, device=req.device, emulate=req.emulate,
        checkpointing=req.checkpointing,
    )  # fmt: skip
    ops = [op_level().build_request(**common)]
    if req.mask_pad:
        ops.append(op_level().build_request(**common, mask_pad=req.mask_pad))
    return tuple(ops)


@dataclass
class OpShard:
    """This rank's op-level cross-check: its shard, or why it did not run."""

    result: RankResult | None = None
    error: str | None = None


@dataclass
class ModelShard(RankResult):
    """One rank's CP run of the model: its (gathered) output, where rank 0 keeps the summed gradients, the
    parameter layout (rank 0), the op-level cross-checks, every block's record, what it read from disk."""

    backend: str
    facts: Any
    out: Any
    grads: Any  # a launch.context.LocalRef on rank 0, None elsewhere
    layout: ParamLayout | None
    op: list[OpShard]
    blocks: BlockRecord
    read: Any  # cpdoctor.model_zoo.slicing.ReadStats


@dataclass(frozen=True)
class StackExamined:
    """How many blocks of one stack were examined, of how many."""

    examined: int
    depth: int


@dataclass
class ModelInfo:
    """What was examined: the class, where its weights came from, its size, the shapes fed to it."""

    short_name: str
    class_name: str
    source: str
    parameters: int | None = None
    parameter_tensors: int | None = None
    height: int | None = None
    width: int | None = None
    frames: int | None = None
    text_len: int | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    reference_dtype: DType | None = None
    read: Any = None
    stacks: dict[str, StackExamined] = field(default_factory=dict)
    tiny: Any = None  # cpdoctor.model_zoo.tiny.TinyConfig: the derived config, what bounded each key, its cost
    inner_gathers: tuple[str, ...] = ()  # the plan's gathers inside the block stacks (plan_fit.inner_gathers)


@dataclass
class OpLevel:
    """One op-level cross-check as rank 0 measured it, or why it did not run."""

    request: LayoutRequest  # the op-level examination's request (an AttentionRequest)
    evaluated: Measurement | None = None
    error: str | None = None


@dataclass
class ModelMeasurement(Measurement):
    """What rank 0 measured for one model case: the rows `out` and `grads` (all parameter gradients together),
    each parameter's row, each block's, the op-level cross-checks, the model examined."""

    model: ModelInfo | None = None
    params: dict[str, ParamRow] = field(default_factory=dict)
    blocks: list[BlockRow] = field(default_factory=list)
    op_level: list[OpLevel] = field(default_factory=list)


def select_backend(req: ModelRequest, spec: ModelSpec, device: Any) -> tuple[str, Any]:
    """The backend to examine with the model's own heads (per Ulysses rank) and head dim."""
    full = spec.full_config()
    heads = int(full.get("num_attention_heads") or 2)
    head_dim = int(full.get("attention_head_dim") or 64)
    ask = BackendAsk(req.backend, req.dtype, req.ring, req.ulysses, heads, head_dim, req.emulate)
    return choose_backend(ask, device)


# --------------------------------------------------------------------------------------------------------------
# on every rank
# --------------------------------------------------------------------------------------------------------------


def run_rank(case: Case, ctx: Any) -> RankResult:
    """This rank's CP run of the model (or why it cannot run here), then the op-level cross-checks."""
    from cpdoctor.cpu_kernels import cpu_backend
    from cpdoctor.fix import patch as fix_patch

    req: ModelRequest = case.request.validate()
    prepare_emulation(req)  # the kernel stand-ins, before diffusers is imported (with --emulate)
    fix_patch.set_patched(case.patched)
    cpu_backend.register()
    with compat.quiet(FutureWarning), compat.preserved_active_backend():
        spec = request_spec(req, local_only=True)
        name, facts = select_backend(req, spec, ctx.device)
        unsupported = _not_runnable(facts, req)
        if unsupported is not None:
            return NotRunnable(name, facts, unsupported)
        shard = _cp_step(case, spec, name, facts, ctx)
        if isinstance(shard, ModelShard):
            shard.op = [_op_shard(op, case, ctx) for op in op_level_requests(req)]
    return shard


def _not_runnable(facts: Any, req: ModelRequest) -> Unsupported | None:
    if facts.name == "auto":
        return no_backend_here(facts, req.ring)
    return facts.unsupported(req.ring, model_level=True)


def _cp_step(case: Case, spec: ModelSpec, backend: str, facts: Any, ctx: Any) -> ModelShard | NotRunnable:
    """The model under CP (with --checkpointing through its own `enable_gradient_checkpointing()`), forward and
    backward; the parameter gradients summed over the CP group. A plan that does not fit the model is refused
    before `enable_parallelism` (the parent refuses it first; a suite's shared launch reaches here)."""
    from cpdoctor.model_zoo.plan_fit import plan_misfit
    from cpdoctor.model_zoo.slicing import ReadStats

    req: ModelRequest = case.request
    dtype = torch_dtype(req.dtype)
    stats = ReadStats()
    model = build_model(spec, req, ctx.device, dtype, stats)
    misfit = plan_misfit(model)
    if misfit is not None:
        return NotRunnable(backend, facts, Unsupported(UnsupportedKind.PLAN_DOES_NOT_FIT, misfit.line()))
    recorder = BlockRecorder(model)
    kwargs = make_inputs(spec, req, spec.full_config())
    model.set_attention_backend(backend)
    if req.checkpointing:
        model.enable_gradient_checkpointing()
    with compat.accelerator_count_at_least_one():
        model.enable_parallelism(config=compat.context_parallel_config(req.ring, req.ulysses, mesh=ctx.cp_mesh(req.ring, req.ulysses)))
    try:
        with ticking(model, "CP run"):
            out, grads, layout = step(model, kwargs, req, ctx.device, dtype)
    except AssertionError as exc:
        if "divisible" in str(exc):  # diffusers' split hook asserting on an uneven shard
            raise BadInput(
                indivisible(req, "an input the model splits inside its forward")
                + f" (`cpdoctor plan {spec.short_name} --ring {req.ring} --ulysses {req.ulysses}` names sizes that divide)"
            ) from exc
        raise
    summed = ctx.all_sum_cpu(grads)
    blocks = recorder.record()
    recorder.remove()
    rank0 = ctx.rank == 0
    return ModelShard(backend, facts, out, ctx.keep(summed) if rank0 else None, layout if rank0 else None, [], blocks, stats)


def _op_shard(op_request: LayoutRequest, case: Case, ctx: Any) -> OpShard:
    # the op-level cross-check is evidence, not the examination: its failure is kept, not raised
    shard = Attempt.of(lambda: op_level().run_rank(Case(op_request, case.patched), ctx))
    return OpShard(shard.value) if shard.ok else OpShard(error=shard.why())


# --------------------------------------------------------------------------------------------------------------
# on rank 0
# --------------------------------------------------------------------------------------------------------------


def reference_dtype(req: ModelRequest) -> Any:
    """fp64 unless the memory plan `prepare` made chose fp32 (req.reference) for the reference."""
    return torch_dtype(DType.FP32 if req.reference is DType.FP32 else DType.FP64)


@dataclass
class SingleProcess:
    """One run of the model in one process: its output, flat gradients, parameter layout and block record
    (None when it could not run, e.g. a backend without a local path)."""

    out: Any = None
    grads: Any = None
    layout: ParamLayout | None = None
    blocks: BlockRecord | None = None


def _single_process(
    spec: ModelSpec, req: ModelRequest, kwargs: dict[str, Any], backend: str, device: Any, dtype: Any, what: str
) -> SingleProcess:
    """The model without CP on `device` in `dtype` through `backend`, block by block recorded (and ticking as
    `what`, launch/progress.py)."""
    tick(f"{what}: building the model")
    model = build_model(spec, req, device, torch_dtype(req.dtype)).to(dtype)
    recorder = BlockRecorder(model)
    try:
        model.set_attention_backend(backend)  # set_attention_backend also sets the global active one
        with ticking(model, what):  # rank 0 alone, for long: its peers wait, it moves block by block
            out, grads, layout = step(model, kwargs, req, device, dtype)
        return SingleProcess(out, grads, layout, recorder.record())
    finally:
        recorder.remove()


def evaluate(case: Case, results: list[RankResult], ctx: Any) -> ModelMeasurement:
    """On rank 0: the CP output and summed gradients against the fp64 single-process reference, the no-CP
    error in the probe dtype (the baseline), per parameter and per block too, and the op-level cross-checks."""
    req: ModelRequest = case.request
    prepare_emulation(req)
    first = results[0]
    emulated = emulation_note(first.backend) if req.emulate else None
    result = ModelMeasurement(first.backend, first.facts, _environment(ctx, first.backend, req, emulated))
    with compat.quiet(FutureWarning), compat.preserved_active_backend():
        spec = request_spec(req, local_only=True)
        result.model = ModelInfo(spec.short_name, spec.class_name, spec.source)
        refused = next((r for r in results if isinstance(r, NotRunnable)), None)
        if refused is not None:
            result.unsupported = refused.unsupported
            return result
        shards: list[ModelShard] = results  # type: ignore[assignment]
        _measure_against_reference(result, spec, req, shards, ctx)
    result.op_level = [_op_level(op, i, case, shards, ctx) for i, op in enumerate(op_level_requests(req))]
    return result


def _measure_against_reference(result: ModelMeasurement, spec: ModelSpec, req: ModelRequest, shards: list[ModelShard], ctx: Any) -> None:
    """Fill the rows: baseline and reference single-process runs, then output, gradients, parameters, blocks."""
    dtype = torch_dtype(req.dtype)
    kwargs = make_inputs(spec, req, spec.full_config())
    # a backend without a local path still gets a dtype-only tolerance
    baseline = Attempt.of(lambda: _single_process(spec, req, kwargs, shards[0].backend, ctx.device, dtype, f"no-CP baseline ({req.dtype})"))
    base = baseline.or_else(SingleProcess())
    result.baseline_error = baseline.why()
    ref_name = DType.FP32 if req.reference is DType.FP32 else DType.FP64
    ref = _single_process(spec, req, kwargs, REFERENCE_BACKEND, ctx.device, reference_dtype(req), f"reference ({ref_name})")
    assert ref.layout is not None and ref.blocks is not None
    result.model = _model_info(spec, req, kwargs, ref.layout, shards[0].read)
    result.blocks = block_errors([s.blocks for s in shards], base.blocks, ref.blocks)
    per_rank = [compare(s.out, ref.out) for s in shards]
    worst = max(range(len(per_rank)), key=lambda r: per_rank[r].rel_err)
    base_out = None if base.out is None else compare(base.out, ref.out).rel_err
    out_row = TensorRow.of(
        per_rank[worst], worst_rank=worst, per_rank_rel_err=tuple(p.rel_err for p in per_rank), baseline_rel_err=base_out
    )
    assert shards[0].layout is not None
    errors = grad_errors(ctx.take(shards[0].grads), base.grads, ref.grads, shards[0].layout, ref.layout)
    base_all = None if errors.baseline_total is None else errors.baseline_total.rel_err
    result.tensors = {"out": out_row, "grads": TensorRow.of(errors.total, baseline_rel_err=base_all)}
    result.params = errors.params


def _op_level(op_request: LayoutRequest, i: int, case: Case, shards: list[ModelShard], ctx: Any) -> OpLevel:
    ops = [s.op[i] if i < len(s.op) else OpShard(error="not run") for s in shards]
    error = next((o.error for o in ops if o.error is not None), None)
    if error is not None:
        return OpLevel(op_request, error=error)
    # the op-level cross-check is evidence: its failure is told, not raised
    judged = Attempt.of(lambda: op_level().evaluate(Case(op_request, case.patched), [o.result for o in ops], ctx))  # type: ignore[misc]
    return OpLevel(op_request, judged.value) if judged.ok else OpLevel(op_request, error=judged.why())


def _environment(ctx: Any, backend: str, req: ModelRequest, emulated: str | None) -> Environment:
    env = rank_environment(ctx, backend, req, emulated)
    return env.replace(launch=env.launch.replace(model=req.model))


def _model_info(spec: ModelSpec, req: ModelRequest, kwargs: dict[str, Any], layout: ParamLayout, read: Any) -> ModelInfo:
    tokens = {k: int(t.shape[1]) for k in ("hidden_states", "encoder_hidden_states") if (t := kwargs.get(k)) is not None and t.ndim == 3}
    return ModelInfo(
        spec.short_name,
        spec.class_name,
        spec.source,
        parameters=int(sum(s.numel for s in layout)),
        parameter_tensors=len(layout),
        height=req.height,
        width=req.width,
        frames=req.frames,
        text_len=req.text_len,
        tokens=tokens,
        reference_dtype=DType.FP32 if req.reference is DType.FP32 else DType.FP64,
        read=read,
        stacks={s.name: StackExamined(min(req.blocks or s.depth, s.depth), s.depth) for s in model_survey(spec).stacks},
        tiny=spec.tiny,
        inner_gathers=inner_gathers(spec.cls, [s.name for s in model_survey(spec).stacks]),
    )
