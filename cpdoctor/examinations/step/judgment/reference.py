"""The same step without CP, on the CP group's first rank: a fresh copy of the model (its class and config, so
none of diffusers' CP hooks come along; FSDP2's sharded weights gathered whole; the user's peft adapters added
again by their own configs), in fp64, fed the recorded full inputs and back-propagating the recorded output
gradient of every forward of the block (one per micro-batch). It runs outside any autocast the user opened, and
inside `torch.random.fork_rng`, so it draws nothing from the job's generators.

Parameter names are compared without the segments wrappers insert (`_checkpoint_wrapped_module.` of torch's
checkpoint_wrapper, `_orig_mod.` of torch.compile, `_fsdp_wrapped_module.`): the copy has none of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cpdoctor.examinations.step.watcher.record import output_tensor
from cpdoctor.launch.progress import ticking
from cpdoctor.vocabulary import DType

REFERENCE_BACKEND = "native"
"""diffusers' default backend (torch SDPA): it runs in fp64 on every device."""

WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""What torch's wrappers insert into a parameter's name (checkpoint_wrapper, torch.compile, FSDP1)."""


def canonical(name: str) -> str:
    """A parameter's name as the bare diffusers model (and the fresh copy) spells it."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """diffusers' warnings about building and casting the copy are not the user's business."""
    import logging

    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def model_class(module: Any) -> type:
    """The diffusers class of a module, under the subclass FSDP2's fully_shard puts it in."""
    for cls in type(module).__mro__:
        if hasattr(cls, "from_config") and not cls.__name__.startswith("FSDP"):
            return cls
    return type(module)


def _cast(value: Any, dtype: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, device) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype, device) for k, v in value.items()}
    return value


def fresh_copy(module: Any, weights: dict[str, Any]) -> Any:
    """The model's class built from its config with `weights`: on the meta device and then given the weights
    (no random initialisation of a model about to be overwritten), unless the model has buffers or tensors of
    its own (Qwen-Image's rotary frequencies): those would stay unset on meta, so it is built normally."""
    import torch

    cls = model_class(module)
    with quiet_diffusers(), torch.device("meta"):
        ref = cls.from_config(module.config)
    on_meta = not any(True for _ in ref.buffers()) and not _meta_attributes(ref)
    if not on_meta:
        with quiet_diffusers():
            ref = cls.from_config(module.config)
    _add_adapters(ref, module)
    missing = ref.load_state_dict(weights, strict=False, assign=on_meta).missing_keys
    absent = [n for n, p in ref.named_parameters() if n in missing or p.is_meta]
    if absent:
        raise RuntimeError(f"the reference copy lacks weights for {', '.join(absent[:3])}")
    for n, p in ref.named_parameters():  # each weight in the dtype the user's step holds it in (a bf16 base, fp32 adapters)
        if n in weights and p.dtype != weights[n].dtype:
            p.data = weights[n]
    return ref


def _add_adapters(ref: Any, module: Any) -> None:
    """The user's peft adapters (diffusers' `add_adapter(LoraConfig(...))` keeps their configs in `peft_config`),
    added to the copy under the same names, so the copy's parameters are named as the user's
    (`...to_q.base_layer.weight`, `...to_q.lora_A.default.weight`); their weights come with the snapshot."""
    import copy

    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs or not hasattr(ref, "add_adapter"):
        return
    for name, config in configs.items():
        ref.add_adapter(copy.deepcopy(config), adapter_name=name)
    active = getattr(module, "active_adapters", None)
    names = active() if callable(active) else None
    if names and hasattr(ref, "set_adapter"):
        ref.set_adapter(list(names) if len(names) > 1 else names[0])


def _meta_attributes(model: Any) -> bool:
    """Whether a module holds a plain tensor attribute (not a parameter or buffer) that was built on meta."""
    import torch

    return any(isinstance(v, torch.Tensor) and v.is_meta for m in model.modules() for v in vars(m).values())


@dataclass(frozen=True)
class ReferencePlan:
    """What the one-process reference holds on the CP group's first rank, in bytes, before it starts: the copy of
    the model and the gradients of its trainable parameters in the reference precision (and once more in the
    step's own dtypes for a bf16/fp16 step). Activations are not counted: the full sequence in one process needs
    about cp × one rank's."""

    copy_bytes: int
    grad_bytes: int
    native_bytes: int
    available: int | None
    working_bytes: int = 0
    """The comparison's working copies (the peers' summed gradients, the data-parallel mean): the peers' gathered
    gradients are already held when the plan is made, so `available` has them taken off."""

    @property
    def total(self) -> int:
        return self.copy_bytes + self.grad_bytes + self.native_bytes + self.working_bytes

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def text(self) -> str:
        have = "unknown" if self.available is None else _size(self.available)
        return (
            f"the reference needs {_size(self.total)} (copy {_size(self.copy_bytes)}, gradients {_size(self.grad_bytes)}, "
            f"same-dtype pass {_size(self.native_bytes)}, comparison {_size(self.working_bytes)}; activations not counted), "
            f"{have} available"
        )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def reference_plan(
    weights: dict[str, Any], trainable: int, precision: str, native: bool, available: int | None, peers: int = 1
) -> ReferencePlan:
    """The plan of the one-process reference for these recorded weights and `trainable` trainable elements, made on
    the CP group's first rank once the peers' gradients are gathered: what it still allocates, the copy in
    `precision`, its gradients and their flat float32 form, the same-dtype pass's gradients (it runs on the
    recorded weights themselves), and the comparison's two working copies. `peers` is kept for the report."""
    del peers
    per = DType(precision).bytes
    elements = sum(int(w.numel()) for w in weights.values())
    native_bytes = trainable * 8 if native else 0
    return ReferencePlan(elements * per, trainable * (per + 4), native_bytes, available, trainable * 4 * 2)


class ReferenceTooLarge(RuntimeError):
    """The reference does not fit where it would run: the watcher reports it as not examined, never a crash."""

    def __init__(self, plan: ReferencePlan, what_fits: str) -> None:
        super().__init__(f"{plan.text()}: {what_fits}")
        self.plan = plan


@dataclass(frozen=True)
class Precision:
    """How the user's step computed: each weight's own dtype, and the autocast it ran under (recorded at its
    first forward)."""

    autocast: bool = False
    autocast_dtype: Any = None
    backend: str | None = None
    """The job's attention backend (run without CP): the same kernel, so the baseline's rounding is the job's."""


def _run(ref: Any, calls: list[tuple[tuple, dict, Any]], dtype: Any, device: Any, what: str) -> list[Any]:
    """Forward and backward of every recorded call through `ref`; `dtype` casts the inputs (None: as recorded).
    The first rank computes it alone while its peers wait: it ticks module by module as `what` (launch/progress.py)."""
    outputs = []
    for i, (args, kwargs, out_grad) in enumerate(calls):
        if dtype is not None:
            args, kwargs = _cast(args, dtype, device), _cast(kwargs, dtype, device)
        else:
            args, kwargs = _cast(args, None, device), _cast(kwargs, None, device)
        with ticking(ref, f"{what}, call {i + 1} of {len(calls)}"):
            out = output_tensor(ref(*args, **kwargs))
            if out_grad is not None:
                out.backward(out_grad.to(device=device, dtype=out.dtype))
        outputs.append(out.detach().float().cpu())
    return outputs


def _flat_grads(ref: Any, names: list[str]) -> Any:
    """The copy's gradients of `names`, flat in float32 (a real model's would be GBs more in float64; float32 keeps
    the fp64 reference's gradients to 6e-8, far below every tolerance)."""
    import torch

    params = {canonical(n): p for n, p in ref.named_parameters()}
    flat = torch.empty(sum(params[n].numel() for n in names), dtype=torch.float32)
    offset = 0
    for n in names:
        p = params[n]
        flat[offset : offset + p.numel()] = p.grad.reshape(-1) if p.grad is not None else 0
        offset += p.numel()
    return flat


@dataclass
class ReferenceResult:
    outputs: list[Any]
    grads: Any
    """Flat float32 gradient in the caller's `names` order."""
    native: Any = None
    """The same step without CP in the user's own dtypes and autocast (only when it computed in bf16/fp16): its
    distance from `grads` is the rounding a correct CP step may show on top."""


def reference_step(
    module: Any,
    weights: dict[str, Any],
    calls: list[tuple[tuple, dict, Any]],
    names: list[str],
    precision: str,
    device: Any,
    native: Precision | None = None,
) -> ReferenceResult:
    """One process running the recorded step: each (args, kwargs, output gradient) in `calls` forward and
    backward, the gradients accumulating as the user's micro-batches did; in `precision` (fp64 or fp32), and with
    `native` also in the user's own dtypes and autocast (the same-dtype baseline of the tolerance)."""
    import torch

    from cpdoctor.compat.diffusers import preserved_active_backend

    dtype = DType(precision).torch
    device_type = torch.device(device).type
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.autocast(device_type, enabled=False):
        ref = fresh_copy(module, weights)
        wanted = set(names)
        for n, p in ref.named_parameters():  # gradients only where the user's step has them (a frozen LoRA base: none)
            p.requires_grad_(canonical(n) in wanted)
        result_native = None
        if native is not None:
            with preserved_active_backend():
                ref.set_attention_backend(native.backend or REFERENCE_BACKEND)
            ref = ref.to(device=device).train(module.training)
            with torch.autocast(device_type, dtype=native.autocast_dtype, enabled=native.autocast):
                _run(ref, calls, None, device, "reference in the step's own dtypes")
            result_native = _flat_grads(ref, names)
            ref.zero_grad(set_to_none=True)
        with preserved_active_backend():  # the reference runs torch's SDPA (fp64 on CPU); the job's backend stays active
            ref.set_attention_backend(REFERENCE_BACKEND)
        with quiet_diffusers():  # "modules that should be kept in float32": the reference is all fp64 on purpose
            ref = ref.to(device=device, dtype=dtype).train(module.training)
        outputs = _run(ref, calls, dtype, device, f"reference ({precision})")
    return ReferenceResult(outputs, _flat_grads(ref, names), result_native)
