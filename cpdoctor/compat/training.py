"""What the step watcher reads of torch's and accelerate's training machinery besides its public calls: DDP's
process group and comm hooks, FSDP2's reduction groups and divide factor, a GradScaler's record of inf/NaN. Each
is read by attribute with a fallback (None: not readable on this release), never by version; every private name
of these libraries that the watcher needs lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def ddp_class() -> type | None:
    """torch's DistributedDataParallel (None where torch.distributed is not available)."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch without distributed support
        return None
    return DistributedDataParallel


def ddp_comm_hook(ddp: Any) -> str | None:
    """The name of the comm hook registered on a DDP module (it replaces the averaging), None without one."""
    hooks = getattr(ddp, "_comm_hooks", None) or []
    for hook, _state in hooks:
        return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__
    return None


def ddp_syncs(ddp: Any) -> bool:
    """Whether this DDP module reduces in the coming backward (False inside `no_sync()`)."""
    return bool(getattr(ddp, "require_backward_grad_sync", True))


@dataclass(frozen=True)
class FSDPReduction:
    """How FSDP2 reduces one module's gradients: over the shard group (and the replicate group for HSDP), divided
    by `divide_factor` (None: the groups' size, its default)."""

    groups: tuple[Any, ...]
    divide_factor: float | None


def fsdp_reductions(module: Any) -> list[FSDPReduction] | None:
    """The reductions of every FSDP2 (`fully_shard`) module inside `module` ([] when there is none); None when
    there is one but its state cannot be read here."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    found = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = getattr(m, "_get_fsdp_state", lambda: None)()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            return None
        for group in groups:
            info = getattr(group, "mesh_info", None)
            pgs = tuple(
                pg for pg in (getattr(info, "shard_process_group", None), getattr(info, "replicate_process_group", None)) if pg is not None
            )
            if not pgs:
                return None
            factor = getattr(group, "gradient_divide_factor", None)
            found.append(FSDPReduction(pgs, None if factor is None else float(factor)))
    return found


def scaler_found_inf(scaler: Any, optimizer: Any) -> bool | None:
    """Whether GradScaler found inf/NaN in this optimizer's gradients at its last unscale (None: not readable)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict) or id(optimizer) not in states:
        return None
    found = states[id(optimizer)].get("found_inf_per_device", {})
    if not found:
        return None
    return any(float(v) != 0 for v in found.values())


def scaler_classes() -> list[type]:
    """The GradScaler classes whose public methods the watcher wraps: torch.amp's (torch.cuda.amp's subclasses
    it), and FSDP1's ShardedGradScaler where it defines its own."""
    import sys

    classes: list[type] = []
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # a torch without torch.amp
        return classes
    classes.append(GradScaler)
    sharded = sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler")
    if sharded is not None and hasattr(sharded, "ShardedGradScaler"):
        classes.append(sharded.ShardedGradScaler)
    return classes


def clip_functions() -> tuple[Any, str | None, str | None]:
    """(torch.nn.utils.clip_grad module, the name of the function every norm clip multiplies through, the name of
    the value clip): torch's clip_grad_norm_ computes the total norm, then calls a module global that scales by
    max_norm / (norm + 1e-6) clamped to 1; wrapping that global sees every norm clip, even one imported by name
    before the watch."""
    from torch.nn.utils import clip_grad

    scale = next((n for n in ("_clip_grads_with_norm_", "clip_grads_with_norm_") if callable(getattr(clip_grad, n, None))), None)
    value = "clip_grad_value_" if callable(getattr(clip_grad, "clip_grad_value_", None)) else None
    return clip_grad, scale, value
