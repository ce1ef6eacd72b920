"""The private diffusers API the fixed ring replaces or reads, recognised by shape (never by version string).

Small on purpose: these helpers may move into `cpdoctor/diffusers_compat.py`. Everything here answers one
question about the installed diffusers by inspecting its objects (attribute presence, signatures, code
names), so the patch can refuse code it does not recognise.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

RING_CLASS = "TemplatedRingAttention"
"""The module global of diffusers.models.attention_dispatch the fix replaces."""

RING_FORWARD_PARAMS = (
    "ctx",
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
    "return_lse",
    "forward_op",
    "backward_op",
    "_parallel_config",
)
"""`TemplatedRingAttention.forward`'s parameters in every release with CP (0.36 onward); the fixed ring
takes exactly these, so a release with another signature must not be patched blindly."""

CALLERS = ("_templated_context_parallel_attention", "_templated_unified_attention")
"""Functions of attention_dispatch that look the ring class up as a module global at call time."""


def ring_class_problem(mod: Any) -> str | None:
    """Why `mod.TemplatedRingAttention` is not the class the fix knows how to replace, or None."""
    import torch

    cls = getattr(mod, RING_CLASS, None)
    if cls is None:
        return f"diffusers.models.attention_dispatch has no {RING_CLASS}"
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        return f"{RING_CLASS} is not a torch.autograd.Function ({cls!r})"
    try:
        params = tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of {RING_CLASS}.forward ({exc})"
    if params != RING_FORWARD_PARAMS:
        return f"{RING_CLASS}.forward has the parameters ({', '.join(params)}), expected ({', '.join(RING_FORWARD_PARAMS)})"
    if not any(RING_CLASS in global_names(getattr(mod, name, None)) for name in CALLERS):
        return f"no function of attention_dispatch looks {RING_CLASS} up by name ({', '.join(CALLERS)}); replacing it would change nothing"
    return None


def global_names(fn: Any) -> tuple[str, ...]:
    """Global names a Python function's code refers to (empty for anything else)."""
    code = getattr(fn, "__code__", None)
    return tuple(code.co_names) if code is not None else ()


def callers_of_ring(mod: Any) -> list[str]:
    """The functions of attention_dispatch that will pick up a replaced ring class on their next call."""
    return [name for name in CALLERS if RING_CLASS in global_names(getattr(mod, name, None))]


def backward_passes_tensors(cls: Any) -> bool | None:
    """Does the ring's backward hand its op the rotated chunk (`backward_op(ctx, grad_out, query=..., key=...)`)?
    False is the stale-KV signature (the op recomputes every step from the tensors saved at step 0); None
    when the source cannot be read."""
    source = _source(cls.backward)
    if source is None:
        return None
    return "key=" in source and "value=" in source


def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def backward_sends_dkv_to_next(cls: Any) -> bool | None:
    """Does the ring's backward send its dK/dV accumulator to rank r+1 (`next_ranks = list(range(1, W)) + [0]`)?
    At step i rank r holds KV chunk r+i, so the accumulator belongs at r−1: r+1 is right only for W = 2."""
    source = _source(cls.backward)
    if source is None:
        return None
    return bool(re.search(r"list\(range\(1,\s*\w+\)\)\s*\+\s*\[0\]", source)) and "permute_tensor" in source


def forward_gathers_mask(cls: Any) -> bool | None:
    """Does the ring's forward gather the attention mask with the keys (else every chunk gets the local mask)?"""
    source = _source(cls.forward)
    if source is None:
        return None
    return bool(re.search(r"(all_gather|all_to_all)\w*\([^)]*mask", source))


def cp_config(parallel_config: Any) -> Any:
    return parallel_config.context_parallel_config


def ring_group(parallel_config: Any) -> Any:
    return cp_config(parallel_config)._ring_mesh.get_group()


def ring_rank(parallel_config: Any) -> int:
    cp = cp_config(parallel_config)
    rank = getattr(cp, "_ring_local_rank", None)
    return rank if rank is not None else cp._ring_mesh.get_local_rank()


def ring_degree(parallel_config: Any) -> int:
    return int(cp_config(parallel_config).ring_degree)


def ulysses_degree(parallel_config: Any) -> int:
    return int(getattr(cp_config(parallel_config), "ulysses_degree", 1) or 1)


def ulysses_group(parallel_config: Any) -> Any:
    return cp_config(parallel_config)._ulysses_mesh.get_group()


def convert_to_fp32(parallel_config: Any) -> bool:
    return bool(getattr(cp_config(parallel_config), "convert_to_fp32", True))
