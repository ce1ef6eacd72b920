"""What each diffusers attention backend can do here, found by asking the registry and trying it.

Nothing in this module is a hard-coded list of capabilities. For a backend name it establishes, on this
device and dtype, with tiny tensors and in one process:
- whether it is registered at all and registered as CP-capable;
- whether diffusers' requirement check passes (packages such as flash-attn);
- whether, given a parallel config, it routes into diffusers' templated CP attention at all (a spy replaces
  `_templated_context_parallel_attention` for the call and records the forward/backward ops it is handed),
  or silently computes local attention (`_native_math` does: it ignores the parallel config);
- whether its forward op runs here, returns an LSE (ring attention needs one) and has a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat import diffusers as compat
from cpdoctor.errors import Unsupported, UnsupportedKind

AUTO = "auto"
PREFERENCE = ("_native_flash", "_native_cudnn", "flash", "flash_hub", "_flash_3", "cpdoctor_cpu")
"""Order in which `--backend auto` considers the backends that pass every test below."""


@dataclass
class BackendFacts:
    name: str
    registered: bool
    cp_registered: bool = False
    requirement_error: str | None = None
    routes_cp: bool | None = None
    forward_op: str | None = None
    backward_op: str | None = None
    runs_here: bool = False
    run_error: str | None = None
    returns_lse: bool | None = None
    lse_error: str | None = None
    has_backward: bool | None = None
    emulated: bool = False
    """The CUDA kernels underneath are cpdoctor's CPU stand-ins (cpdoctor/cpu_kernels/standins.py)."""

    def unsupported(self, ring: int, model_level: bool = False) -> Unsupported | None:
        """Why a CP examination with this ring degree cannot run here, or None when it can. `model_level`: the
        examination goes through `enable_parallelism`, which refuses a backend not registered for CP."""
        if not self.registered:
            return Unsupported(UnsupportedKind.NOT_REGISTERED, f"{self.name} is not a registered attention backend in this diffusers")
        if self.requirement_error:
            return Unsupported(UnsupportedKind.MISSING_PACKAGE, self.requirement_error)
        if not self.runs_here:
            cp = (
                ""
                if self.cp_registered
                else f"; nor is {self.name} registered for context parallelism in this diffusers (enable_parallelism refuses it)"
            )
            return Unsupported(UnsupportedKind.DOES_NOT_RUN, f"{self.name} does not run here: {self.run_error}{cp}")
        if self.has_backward is False and not self.emulated:
            # Under emulation every kernel has a backward: a backward that fails is the backend's own code
            # (e.g. K/V transposed twice), which the examination must run and report, not skip.
            return Unsupported(
                UnsupportedKind.NO_BACKWARD, f"{self.name} has no backward here, and the examination back-propagates: {self.run_error}"
            )
        if ring > 1 and self.routes_cp and self.returns_lse is False:
            return Unsupported(
                UnsupportedKind.NO_LSE, f"{self.name} has no LSE, and ring attention needs one to merge blocks ({self.lse_error})"
            )
        if model_level and not self.cp_registered:
            return Unsupported(
                UnsupportedKind.NOT_CP_CAPABLE,
                f"{self.name} is not registered as context-parallel capable, and enable_parallelism refuses it",
            )
        return None


class _Captured(Exception):
    def __init__(self, forward_op: Callable, backward_op: Callable):
        super().__init__("captured")
        self.forward_op = forward_op
        self.backward_op = backward_op


class OpCtx:
    """Stands in for the autograd ctx diffusers' templates hand to a forward op, when one is called outside autograd
    (here, and by env's backend table)."""

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


@dataclass(frozen=True)
class BackendProbe:
    """One backend probed once: its facts, and the forward/backward ops it handed diffusers' templated CP
    attention (None when it does not route there). env's backend table calls those ops again as training does,
    so it reads them here instead of probing the backend a second time."""

    facts: BackendFacts
    forward_op: Callable | None = None
    backward_op: Callable | None = None


def _call_with_spy(
    name: str, device: Any, dtype: Any, heads: int, head_dim: int
) -> tuple[bool | None, Callable | None, Callable | None, str | None, Any]:
    """(routes_cp, forward_op, backward_op, error, local output): call the backend with a parallel config while
    a spy stands in for diffusers' templated CP attention. Nothing is computed when the backend routes to CP;
    when it computed local attention instead, its output is returned (a leaf that requires grad went in, so its
    backward can be tried without a second forward)."""
    import torch

    def spy(*args: Any, forward_op: Callable, backward_op: Callable, **kwargs: Any) -> Any:
        raise _Captured(forward_op, backward_op)

    q = torch.randn(1, 8, heads, head_dim, device=device, dtype=dtype).requires_grad_(True)
    fn = compat.backend_function(name)
    accepted = compat.accepted_kwargs(name)
    if "_parallel_config" not in accepted:
        return False, None, None, "does not accept a parallel config (dispatch_attention_fn drops it)", None
    kwargs = {"query": q, "key": q, "value": q, "_parallel_config": object()}
    with compat.replaced_templated_attention(spy):
        call = Attempt.of(lambda: fn(**kwargs))
    if isinstance(call.error, _Captured):
        return True, call.error.forward_op, call.error.backward_op, None, None
    if not call.ok:  # a backend that fails this call in any way has no CP path we can see
        return None, None, None, call.why(), None
    return False, None, None, None, call.value


def _try_forward_op(forward_op: Callable, q: Any, return_lse: bool, parallel_config: Any = None) -> tuple[Any, OpCtx]:
    ctx = OpCtx()
    out = forward_op(ctx, q, q, q, None, 0.0, False, None, False, return_lse, _save_ctx=True, _parallel_config=parallel_config)
    return out, ctx


def _ring_like_config(device: Any) -> Any:
    """A parallel config as the ring hands it to a forward op (world size 2, no process group): some ops decide
    from it whether to compute an LSE or force dropout (docs/FACTS.md); None when this diffusers cannot build one."""
    return Attempt.of(lambda: compat.meshless_parallel_config(2, 1, device)).value  # None: the plain call still tells


def examine_backend(name: str, device: Any, dtype: Any, heads: int = 2, head_dim: int = 64) -> BackendFacts:
    """All facts about one backend on this device and dtype (milliseconds; no second process)."""
    return probe_backend(name, device, dtype, heads, head_dim).facts


def probe_backend(name: str, device: Any, dtype: Any, heads: int = 2, head_dim: int = 64) -> BackendProbe:
    """All facts about one backend on this device and dtype, and the CP ops it hands diffusers' templates; each
    op is tried once here, whatever it raises being the fact recorded."""
    import torch

    if compat.backend_member(name) is None:
        return BackendProbe(BackendFacts(name, registered=False))
    facts = BackendFacts(name, registered=True, cp_registered=compat.is_cp_registered(name))
    facts.requirement_error = compat.requirement_error(name)
    if facts.requirement_error:
        return BackendProbe(facts)
    routes, fwd, bwd, err, local_out = _call_with_spy(name, device, dtype, heads, head_dim)
    facts.routes_cp = routes
    facts.forward_op = getattr(fwd, "__name__", None)
    facts.backward_op = getattr(bwd, "__name__", None)
    q = torch.randn(1, 8, heads, head_dim, device=device, dtype=dtype)
    if fwd is None:
        # No CP path to test (the backend ignores or drops the parallel config): does it run here at all,
        # forward and backward? When it ignored the parallel config, the call above already ran the forward.
        run = Attempt.of(
            lambda: local_out if local_out is not None else compat.backend_function(name)(query=q.requires_grad_(True), key=q, value=q)
        )
        facts.runs_here = run.ok
        failed = run
        if run.ok:
            failed = Attempt.of(lambda: run.value.float().sum().backward())
            facts.has_backward = failed.ok
        if not failed.ok:
            facts.run_error = failed.why() if err is None else err
        return BackendProbe(facts)
    forward = Attempt.of(lambda: _try_forward_op(fwd, q, return_lse=False))
    if forward.value is None:
        facts.run_error = forward.why()
        return BackendProbe(facts, fwd, bwd)
    facts.runs_here = True
    out, ctx = forward.value
    # called as the ring calls it (return_lse, a parallel config of world size 2); its saved context is what a
    # CP backward gets, so the backward below is tried on it; whatever it raises means it has no LSE here
    ring = Attempt.of(lambda: _try_forward_op(fwd, q, return_lse=True, parallel_config=_ring_like_config(device)))
    if ring.value is None:
        facts.returns_lse, facts.lse_error = False, ring.why()
    else:
        res, ring_ctx = ring.value
        facts.returns_lse = isinstance(res, tuple) and len(res) >= 2 and res[1] is not None
        if facts.returns_lse:
            out, ctx = res[0], ring_ctx
    backward = Attempt.of(lambda: all(g is not None for g in bwd(ctx, torch.randn_like(out))[:3]))
    facts.has_backward = bool(backward.value)
    if not backward.ok:
        facts.run_error = f"backward: {backward.why()}"
    return BackendProbe(facts, fwd, bwd)


def resolve_auto(
    device: Any, dtype: Any, heads: int, head_dim: int, ring: int, emulated: bool = False
) -> tuple[str | None, list[BackendFacts]]:
    """The first backend of PREFERENCE that can run CP here (ring needs an LSE), with the facts seen."""
    seen = []
    for name in PREFERENCE:
        facts = examine_backend(name, device, dtype, heads, head_dim)
        facts.emulated = emulated
        seen.append(facts)
        if facts.cp_registered and facts.routes_cp and facts.has_backward and facts.unsupported(ring) is None:
            return name, seen
    return None, seen
