"""What the step examination reads of a diffusers model's context parallelism: its parallel config, the CP
process group it shards over, and the dimension its `_cp_plan` gathers the output on. Private diffusers names
live here (the house rule), each behind one small function."""

from __future__ import annotations

from typing import Any


def parallel_config_of(model: Any) -> Any | None:
    """The ParallelConfig `enable_parallelism` stored on the model, or None when CP was never enabled."""
    config = getattr(model, "_parallel_config", None)
    if config is None or getattr(config, "context_parallel_config", None) is None:
        return None
    return config


def cp_degrees(parallel_config: Any) -> tuple[int, int]:
    """(ring, ulysses) of a ParallelConfig."""
    cp = parallel_config.context_parallel_config
    return int(getattr(cp, "ring_degree", 1) or 1), int(getattr(cp, "ulysses_degree", 1) or 1)


def cp_group(parallel_config: Any) -> Any:
    """The process group of the CP ranks that share one sequence (ring × Ulysses, flattened), as the model hooks
    shard over it. None when the config was never set up (no forward has run yet on some releases)."""
    cp = parallel_config.context_parallel_config
    flat = getattr(cp, "_flattened_mesh", None)
    if flat is not None:
        return flat.get_group()
    ring, ulysses = cp_degrees(parallel_config)
    if ulysses == 1 and getattr(cp, "_ring_mesh", None) is not None:
        return cp._ring_mesh.get_group()
    if ring == 1 and getattr(cp, "_ulysses_mesh", None) is not None:
        return cp._ulysses_mesh.get_group()
    return None


def output_gather_dim(model: Any) -> int:
    """The dimension the model's `_cp_plan` gathers its output on (1, the sequence, when the plan does not say)."""
    plan = getattr(type(model), "_cp_plan", None) or {}
    for entry in plan.values():
        dim = getattr(entry, "gather_dim", None)
        if dim is not None:
            return int(dim)
    return 1


def attention_backend_of(model: Any) -> str | None:
    """The attention backend `model.set_attention_backend` gave the model's attention processors (None when it was
    never set: the process-wide active one runs). Read as the first processor's `_attention_backend`."""
    for module in model.modules():
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return None
