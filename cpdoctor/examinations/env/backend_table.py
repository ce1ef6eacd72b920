"""One row per attention backend of the installed diffusers, found by trying each one on tiny tensors.

`backends.probe_backend` asks the registry and tries the backend once; for the backends that route into diffusers'
CP templates, `probe_ops` then calls the forward and backward ops it discovered the way the Ulysses template does
during training (forward with `return_lse=False, _save_ctx=True` on a stand-in ctx, under no_grad, with a
parallel config of world size 2; then `backward_op(ctx, grad_out)`), and looks at what the forward saved (an LSE
or not), at the arguments the kernels received (`compute_log_sumexp`, `dropout_p`), at whether the generator of
the device moved, and at the gradients against an fp64 reference. A backend that is installed but has no kernel
for this device is run on the meta device instead (shapes and kernel arguments only, no numbers).

The ring / Ulysses / training cells of a row come from a table of rules (`CELL_RULES`, `TRAINING_RULES`): plain
functions of the row's facts, which a unit test can feed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.backends import BackendFacts, BackendProbe, OpCtx
from cpdoctor.examinations.env.common import SHAPE, torch_dtype
from cpdoctor.examinations.judging import tolerance
from cpdoctor.report.serialize import to_jsonable

META = "meta"
"""torch's meta device, as `str(torch.device("meta"))` spells it: where an op without a kernel here is run for its
shapes and kernel arguments."""


@dataclass
class OpProbe:
    """What a backend's CP forward/backward ops do when called as the Ulysses template calls them in training."""

    measured_on: str
    """The device the ops ran on, or "meta" (shapes and kernel arguments only) when there is no kernel here."""
    error: str | None = None
    saved_lse: bool | None = None
    """The forward saved a float32 tensor shaped like an LSE ((B,S,H) or (B,H,S[,1])) although not asked for one."""
    saved_lse_shape: list[int] | None = None
    kernel_args: dict[str, list[Any]] = field(default_factory=dict)
    """Per kernel op, the `compute_log_sumexp` / `dropout_p` values it received (forward and backward)."""
    lse_not_requested: bool | None = None
    """A kernel was called with compute_log_sumexp=False: it will not produce the LSE its backward reads."""
    forced_dropout: float | None = None
    """A kernel got dropout_p > 0 although the caller passed 0: it draws from the device generator."""
    grad_shapes_ok: bool | None = None
    grad_shapes: list[list[int]] | None = None
    backward_error: str | None = None
    rel_err: dict[str, float] | None = None
    """out/dq/dk/dv relative L2 error against an fp64 reference (real devices only)."""
    tolerance: float | None = None
    rng_advanced: bool | None = None
    config_error: str | None = None
    """Why the forward refused the stand-in parallel config (it was then called without one), or None."""
    fix_calls_kernel: bool | None = None
    """cpdoctor's fix has a fused block kernel for this backend, so its ring and Ulysses call the kernel
    directly and never these ops (False: its Ulysses steps aside to diffusers' own; None: not known here)."""

    @property
    def on_meta(self) -> bool:
        """The ops ran on the meta device (shapes and kernel arguments only, no numbers): no kernel here."""
        return self.measured_on == META

    @property
    def backward_ok(self) -> bool | None:
        if self.error or self.backward_error or self.grad_shapes_ok is False or self.lse_not_requested:
            return False
        if self.rel_err is not None and self.tolerance is not None:
            return max(self.rel_err.values()) <= self.tolerance
        return self.grad_shapes_ok


@dataclass
class Cell:
    """One verdict cell of the table: ok is True (✓), False (✗) or None (not applicable); why says why not."""

    ok: bool | None
    why: str = ""


@dataclass
class BackendRow:
    """One row of env's backend table: the backend's facts, its ops as training calls them, and the cells."""

    name: str
    facts: BackendFacts
    accepts_parallel_config: bool
    op: OpProbe | None
    ring: Cell
    ulysses: Cell
    training: Cell

    @property
    def installed(self) -> bool:
        return not self.facts.requirement_error

    @property
    def cp_capable(self) -> bool:
        return bool(self.facts.cp_registered)

    @property
    def runs_here(self) -> bool:
        return bool(self.facts.runs_here)

    @property
    def returns_lse(self) -> bool | None:
        return self.facts.returns_lse

    def to_dict(self) -> dict[str, Any]:
        """The row as the JSON report has it (the facts, the probed ops, the cells, and the derived columns): a
        `cpdoctor.report.sections.Row` of the report's `backends`."""
        data = {f.name: to_jsonable(getattr(self, f.name)) for f in fields(self)}
        data.update(installed=self.installed, cp_capable=self.cp_capable, runs_here=self.runs_here, returns_lse=self.returns_lse)
        data["has_backward"] = self.facts.has_backward
        return data


_RECORDED_ARGS = ("compute_log_sumexp", "dropout_p")


@contextlib.contextmanager
def record_kernel_args() -> Iterator[dict[str, list[Any]]]:
    """While active, every aten/custom op whose schema has `compute_log_sumexp` or `dropout_p` is recorded with
    the values it received (defaults included): {"aten._scaled_dot_product_cudnn_attention": [{...}, ...]}."""
    calls: dict[str, list[Any]] = {}
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # a torch without Python dispatch modes: nothing recorded, nothing concluded
        yield calls
        return

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            schema = getattr(func, "_schema", None)
            if schema is not None:
                names = [a.name for a in schema.arguments]
                if any(n in names for n in _RECORDED_ARGS):
                    given = {**dict(zip(names, args, strict=False)), **kwargs}
                    seen = {}
                    for a in schema.arguments:
                        if a.name in _RECORDED_ARGS:
                            seen[a.name] = given.get(a.name, a.default_value if a.has_default_value() else None)
                    calls.setdefault(schema.name.replace("::", "."), []).append(seen)
            return func(*args, **kwargs)

    with _Recorder():
        yield calls


def _rng_state(device: Any) -> Any:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _find_lse(ctx: Any, b: int, s: int, h: int) -> tuple[bool, list[int] | None]:
    """Did the forward save a float32 tensor shaped like an LSE, in saved_tensors or as a ctx attribute?"""
    import torch

    shapes = {(b, s, h), (b, h, s), (b, s, h, 1), (b, h, s, 1)}
    candidates = list(getattr(ctx, "saved_tensors", ()) or ()) + [v for k, v in vars(ctx).items() if k != "saved_tensors"]
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) in shapes and t.numel() > 0:
            return True, list(t.shape)
    return False, None


def _rel_err(a: Any, ref: Any) -> float:
    a, ref = a.detach().double().cpu(), ref.detach().double().cpu()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def _math_attention(q: Any, k: Any, v: Any, grad_out: Any, dtype: Any, device: Any) -> dict[str, Any]:
    """Plain softmax attention and its gradients in closed form (no autograd), model layout (B, S, H, D), in
    `dtype` on `device`: P = softmax(q kᵀ·scale), dV = Pᵀ dO, dS = P ⊙ (dO vᵀ − rowsum(dO ⊙ O)),
    dQ = scale·dS k, dK = scale·dSᵀ q."""
    q, k, v, g = (x.detach().to(device, dtype).transpose(1, 2) for x in (q, k, v, grad_out))
    scale = q.shape[-1] ** -0.5
    p = ((q @ k.transpose(-1, -2)) * scale).softmax(-1)
    out = p @ v
    ds = p * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
    grads = {"out": out, "dq": scale * ds @ k, "dk": scale * ds.transpose(-1, -2) @ q, "dv": p.transpose(-1, -2) @ g}
    return {n: t.transpose(1, 2) for n, t in grads.items()}


# ----------------------------------------------------------------------------------------------------------
# Calling a backend's CP ops as the Ulysses template does in training
# ----------------------------------------------------------------------------------------------------------


def _probe_inputs(device: Any, dtype: Any) -> tuple[Any, Any, Any, Any]:
    """q, k, v and grad_out of SHAPE: seeded random numbers, or empty tensors on the meta device."""
    import torch

    if device.type == META:
        return tuple(torch.empty(SHAPE, device=device, dtype=dtype) for _ in range(4))  # type: ignore[return-value]
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(SHAPE, generator=gen).to(device, dtype) for _ in range(4))  # type: ignore[return-value]


def _forward(forward_op: Callable, qkv: tuple, config: Any, probe: OpProbe, calls: dict) -> tuple[Any, OpCtx]:
    """The forward as Ulysses calls it in training; again without the parallel config when the op wants more of
    it than the stand-in has (the refusal is kept in `probe.config_error`)."""
    import torch

    def call(parallel_config: Any) -> tuple[Any, OpCtx]:
        ctx = OpCtx()
        with torch.no_grad():
            return forward_op(ctx, *qkv, None, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=parallel_config), ctx

    with_config = Attempt.of(lambda: call(config))
    if with_config.value is not None:
        return with_config.value
    probe.config_error = with_config.why(limit=200)  # an op that wants more of the config than a stand-in has
    calls.clear()
    return call(None)


def kernel_flags(fwd_calls: dict[str, list[dict]], calls: dict[str, list[dict]]) -> tuple[bool | None, float | None]:
    """(lse_not_requested, forced_dropout) from the recorded kernel arguments: a forward kernel told not to
    compute the LSE; the largest dropout_p > 0 any kernel got although the caller passed 0."""
    lse_flags = [c.get("compute_log_sumexp") for cs in fwd_calls.values() for c in cs if "compute_log_sumexp" in c]
    dropouts = [c.get("dropout_p") for cs in calls.values() for c in cs if isinstance(c.get("dropout_p"), (int, float))]
    forced = [p for p in dropouts if p > 0]
    return ((False in lse_flags) if lse_flags else None), (max(forced) if forced else None)


def _compare(probe: OpProbe, qkvg: tuple, out: Any, grads: tuple, dtype_name: str, device: Any) -> None:
    """rel_err of out/dq/dk/dv against an fp64 reference, and the tolerance from a same-dtype plain attention."""
    import torch

    q, k, v, g = qkvg
    ref = _math_attention(q, k, v, g, torch.float64, torch.device("cpu"))
    base = _math_attention(q, k, v, g, torch_dtype(dtype_name), device)
    got = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    probe.rel_err = {n: _rel_err(got[n], ref[n]) for n in got}
    probe.tolerance = tolerance(dtype_name, max(_rel_err(base[n], ref[n]) for n in got))


def _fix_calls_kernel(forward_op: Callable, parallel_config: Any) -> bool | None:
    """Does cpdoctor's fix run this backend through a fused block kernel of its own (fix/block_kernels.py)?"""
    from cpdoctor.fix import block_kernels

    return Attempt.of(lambda: block_kernels.select(forward_op, parallel_config).fused).value  # None: e.g. flash-attn not importable


def probe_ops(forward_op: Callable, backward_op: Callable, device: Any, dtype_name: str, parallel_config: Any) -> OpProbe:
    """Call a backend's CP ops as the Ulysses template calls them in training, on `device` (or meta)."""
    import torch

    meta = device.type == META
    probe = OpProbe(measured_on=str(device), fix_calls_kernel=_fix_calls_kernel(forward_op, parallel_config))
    qkvg = _probe_inputs(device, torch_dtype(dtype_name))
    rng_before = None if meta else _rng_state(device)
    grads = None
    with record_kernel_args() as calls:
        forward = Attempt.of(lambda: _forward(forward_op, qkvg[:3], parallel_config, probe, calls))
        if forward.value is None:
            probe.error, probe.kernel_args = f"forward: {forward.why(limit=200)}", calls
            return probe
        out, ctx = forward.value
        fwd_calls = {name: list(seen) for name, seen in calls.items()}
        with torch.no_grad():
            backward = Attempt.of(lambda: backward_op(ctx, qkvg[3]))
        grads, probe.backward_error = backward.value, backward.why(limit=200)
    if not meta:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        probe.rng_advanced = not torch.equal(rng_before, _rng_state(device))
        probe.saved_lse, probe.saved_lse_shape = _find_lse(ctx, SHAPE[0], SHAPE[1], SHAPE[2])
    probe.kernel_args = calls
    probe.lse_not_requested, probe.forced_dropout = kernel_flags(fwd_calls, calls)
    if grads is None:
        return probe
    grads = tuple(grads[:3])
    probe.grad_shapes = [list(x.shape) if isinstance(x, torch.Tensor) else None for x in grads]
    probe.grad_shapes_ok = all(isinstance(x, torch.Tensor) and tuple(x.shape) == SHAPE for x in grads)
    if not meta and probe.grad_shapes_ok:
        _compare(probe, qkvg, out[0] if isinstance(out, tuple) else out, grads, dtype_name, device)
    return probe


# ----------------------------------------------------------------------------------------------------------
# The ring / Ulysses / training cells: rules over a row's facts
# ----------------------------------------------------------------------------------------------------------


def _short(reason: str | None, limit: int = 100) -> str:
    """The first sentence of an error message, at most `limit` characters."""
    reason = (reason or "").split(". ")[0].strip().rstrip(".")
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"


def requirement_hint(message: str) -> str:
    """'install `flash-attn>=2.6.3`' from diffusers' requirement message, else its first sentence."""
    i = message.lower().rfind("please ")
    return _short(message[i + len("please ") :]) if i >= 0 else _short(message)


def _not_cp_registered(facts: BackendFacts, accepts: bool) -> str:
    why = "not registered for CP (enable_parallelism refuses it)"
    if accepts and facts.routes_cp is False:
        why += "; accepts a parallel config and ignores it"
    return why


CELL_RULES: list[tuple[Callable[[BackendFacts, bool], bool], Callable[[BackendFacts, bool], str]]] = [
    (lambda f, a: bool(f.requirement_error), lambda f, a: f"not installed: {requirement_hint(f.requirement_error or '')}"),
    (lambda f, a: not f.cp_registered, _not_cp_registered),
    (lambda f, a: not f.routes_cp, lambda f, a: f"does not route into diffusers' CP templates ({_short(f.run_error)})"),
    (lambda f, a: not f.runs_here, lambda f, a: f"no kernel for this device ({_short(f.run_error)})"),
]
"""(condition on the backend's facts and whether it accepts a parallel config, why) in order: the first that
holds makes ring, Ulysses and training all ✗ for that reason."""

TRAINING_RULES: list[tuple[Callable[[OpProbe | None], bool], Callable[[OpProbe | None], str]]] = [
    (lambda op: op is None or bool(op.error), lambda op: (op.error if op else None) or "its ops could not be called"),
    (lambda op: bool(op.backward_error), lambda op: f"backward raises: {op.backward_error}"),
    (lambda op: op.grad_shapes_ok is False, lambda op: f"backward returns gradients of shape {op.grad_shapes} for inputs {list(SHAPE)}"),
    (
        lambda op: bool(op.lse_not_requested) or (op.saved_lse is False and op.backward_ok is False),
        lambda op: "its forward saves no LSE unless asked, and its backward needs one",
    ),
    (
        lambda op: op.backward_ok is False,
        lambda op: f"backward wrong: rel err {max(op.rel_err.values()):.2g} > tolerance {op.tolerance:.2g}",
    ),
]
"""(condition on the probed ops, why) in order for a backend that runs CP here: the first that holds makes the
training cell ✗; none holding makes it ✓."""


def judge_cells(facts: BackendFacts, accepts_config: bool, op: OpProbe | None) -> tuple[Cell, Cell, Cell]:
    """The ring, Ulysses and training cells of one backend on this device."""
    for holds, why in CELL_RULES:
        if holds(facts, accepts_config):
            no = Cell(False, why(facts, accepts_config))
            return no, no, no
    ring = Cell(True) if facts.returns_lse else Cell(False, "no LSE: the ring needs one to merge KV blocks")
    training = next((Cell(False, why(op)) for holds, why in TRAINING_RULES if holds(op)), Cell(True))
    return ring, Cell(True), training


def _probe_row_ops(probed: BackendProbe, device: Any, dtype_name: str, config: Any) -> OpProbe | None:
    """The op probe of a backend that routes into the CP templates: here, or on meta when it has no kernel here."""
    import torch

    facts, fwd, bwd = probed.facts, probed.forward_op, probed.backward_op
    if not facts.routes_cp or facts.requirement_error:
        return None
    if fwd is None or bwd is None:
        return None
    if facts.runs_here:
        return probe_ops(fwd, bwd, device, dtype_name, config)
    op = probe_ops(fwd, bwd, torch.device(META), dtype_name, config)
    return None if op.error else op  # no meta kernel either: nothing measured


def examine_row(name: str, device: Any, dtype_name: str, config: Any) -> BackendRow:
    from cpdoctor.compat import backends
    from cpdoctor.compat import diffusers as compat

    probed = backends.probe_backend(name, device, torch_dtype(dtype_name), heads=SHAPE[2], head_dim=SHAPE[3])
    facts = probed.facts
    accepts = "_parallel_config" in compat.accepted_kwargs(name)
    op = _probe_row_ops(probed, device, dtype_name, config)
    ring, ulysses, training = judge_cells(facts, accepts, op)
    return BackendRow(name, facts, accepts, op, ring, ulysses, training)
