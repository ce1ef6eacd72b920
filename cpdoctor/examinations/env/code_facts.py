"""Facts about the installed diffusers code that `findings` judges: gathered here, judged there.

What the ring template does (read from its source via `compat`), what `dispatch_attention_fn` does with a
parallel config and a backend that is not registered for CP (tried once, on tiny tensors), and which
uneven-length ("anything") modes ContextParallelConfig has and whether their backward refuses to run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.diffusers import quiet
from cpdoctor.examinations.env.backend_table import BackendRow
from cpdoctor.examinations.env.common import SHAPE, torch_dtype
from cpdoctor.examinations.env.findings import CodeFacts, DispatchTrial, RingSource


def ring_source() -> RingSource:
    """What the installed TemplatedRingAttention does. When cpdoctor's fixed ring is patched into this process,
    the class it replaced is the one described."""
    from cpdoctor.compat import diffusers as compat

    mod = compat.dispatch_module()
    # broad: reading the patch state is a nicety; if it fails in any way the installed class is described
    with contextlib.suppress(Exception):
        from cpdoctor.fix import patch

        if patch.is_patched():
            last = patch.last_report()
            return RingSource(
                patched=True,
                passes_tensors=getattr(last, "original_backward_passes_tensors", None),
                sends_to_next=getattr(last, "original_sends_dkv_to_next", None),
                gathers_mask=getattr(last, "original_gathers_mask", None),
                callers=list(compat.callers_of_ring(mod)),
            )
    cls = getattr(mod, compat.RING_CLASS, None)
    if cls is None:
        return RingSource(absent=True)
    return RingSource(
        passes_tensors=compat.backward_passes_tensors(cls),
        sends_to_next=compat.backward_sends_dkv_to_next(cls),
        gathers_mask=compat.forward_gathers_mask(cls),
        callers=list(compat.callers_of_ring(mod)),
    )


def _local_backward_runs(name: str, device: Any, dtype_name: str) -> bool:
    """Does the backend's own (non-CP) path accept inputs that require grad here and build a graph? (A backend
    without a backward on this device, such as flex on the CPU, refuses them in the forward.)"""
    import torch

    from cpdoctor.compat import diffusers as compat

    q = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).to(device, torch_dtype(dtype_name)).requires_grad_(True)
    with quiet(), torch.enable_grad():
        local = Attempt.of(lambda: compat.backend_function(name)(query=q, key=q, value=q))
    if not local.ok:  # a backend whose local call fails in any way has no local backward here
        return False
    out = local.value
    return bool((out[0] if isinstance(out, tuple) else out).requires_grad)


def dispatch_trial(rows: list[BackendRow], device: Any, dtype_name: str, config: Any) -> DispatchTrial:
    """Call dispatch_attention_fn with a parallel config and a backend that runs here but is not registered for
    CP. The backend tried (and named in the command) is one whose own backward runs here, so that `cpdoctor
    check` with it shows wrong numbers instead of a crash."""
    import torch

    from cpdoctor.compat import diffusers as compat

    local_only = [r for r in rows if r.runs_here and not r.cp_capable]
    trial = DispatchTrial(
        ignoring=[r.name for r in local_only if r.accepts_parallel_config],
        dropping=[r.name for r in local_only if not r.accepts_parallel_config],
    )
    ordered = trial.ignoring + trial.dropping
    if not ordered:
        return trial
    trial.tried = next((n for n in ordered if _local_backward_runs(n, device, dtype_name)), ordered[0])
    q = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(device, torch_dtype(dtype_name))
    with quiet():
        dispatched = Attempt.of(
            lambda: compat.dispatch_module().dispatch_attention_fn(
                q, q, q, backend=compat.backend_member(trial.tried), parallel_config=config
            )
        )
    trial.error = dispatched.why(limit=200)  # what diffusers' dispatch raises is the fact recorded
    return trial


def uneven_modes() -> dict[str, bool | None]:
    """Each uneven-length mode this ContextParallelConfig has -> whether its backward raises NotImplementedError."""
    from cpdoctor.compat import diffusers as compat

    fields = compat.context_parallel_fields()
    return {m: compat.anything_backward_refused(m) for m in ("ulysses_anything", "ring_anything") if m in fields}


def gather(rows: list[BackendRow], device: Any, dtype_name: str, config: Any) -> CodeFacts:
    return CodeFacts(
        ring=ring_source(),
        dispatch=dispatch_trial(rows, device, dtype_name, config),
        uneven_modes=uneven_modes(),
        default_backend=os.environ.get("DIFFUSERS_ATTN_BACKEND") or None,
    )
