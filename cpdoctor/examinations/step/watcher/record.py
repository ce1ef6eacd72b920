"""What one rank saw of the watched step, recorded by hooks on the diffusers transformer: the full inputs it
received (before its `_cp_plan` splits them: torch runs forward pre-hooks before the `forward` that diffusers'
hooks wrap), the output (after the plan gathered it) and the gradient that flowed into that output, the weights
the forward used, and the RNG states around the step. Parameter gradients are read at the watcher's exit; what
the step did to them (its loss constants, scaler, clip, reductions) is observe.py's.

The hooks run outside dynamo (`torch.compiler.disable`): a compiled model traces around them, so the watcher
never changes what the compiled step computes. Numbers only; what differs between ranks is worked out in
measure.py."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from cpdoctor.compat import parallel_config as compat
from cpdoctor.examinations.step.watcher.messages import InputPrint
from cpdoctor.vocabulary import DType


def digest(value: Any) -> str:
    """A short fingerprint of a tensor's exact bytes (or of a plain value's repr): equal on two ranks only when
    the values are bitwise equal."""
    import torch

    h = hashlib.sha1()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")  # the buffer itself: no copy
    else:
        h.update(repr(value).encode())
    return h.hexdigest()[:16]


def weights_digest(module: Any, canonical: Any, full_tensor: Any) -> str:
    """One fingerprint of every parameter's value (by the bare model's names; FSDP2's gathered whole: a collective
    on every rank): equal in two runs only when they start from the same weights."""
    h = hashlib.sha1()
    for name, p in sorted(((canonical(n), p) for n, p in module.named_parameters()), key=lambda np: np[0]):
        h.update(name.encode())
        h.update(digest(full_tensor(p.detach())).encode())
    return h.hexdigest()[:16]


def rng_digest() -> str:
    """A fingerprint of this process's RNG states (CPU, and the current CUDA device's when there is one)."""
    import torch

    parts = [digest(torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(digest(torch.cuda.get_rng_state()))
    return "/".join(parts)


def output_tensor(result: Any) -> Any:
    """The model's output tensor: the first tensor of a tuple, or `.sample` of an output dataclass."""
    import torch

    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, (tuple, list)):
        return next((x for x in result if isinstance(x, torch.Tensor)), None)
    sample = getattr(result, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    to_tuple = getattr(result, "to_tuple", None)
    return output_tensor(to_tuple()) if callable(to_tuple) else None


def _detached(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def autocast_state(example: Any) -> tuple[bool, Any]:
    """(enabled, dtype) of the autocast active now for the device type of `example` (CPU when None)."""
    import torch

    device_type = example.device.type if example is not None else "cpu"
    try:
        return bool(torch.is_autocast_enabled(device_type)), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError, RuntimeError):  # a torch without per-device autocast queries: as if off
        return False, None


@dataclass
class Forward:
    """One forward of the model inside the watched block (a micro-batch): its input fingerprints, and on the CP
    group's first rank the inputs and the output themselves; the gradient that flowed into its output."""

    prints: tuple[InputPrint, ...]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    out_dtype: str = ""
    """The dtype the model's output was computed in (bf16 under autocast even with fp32 weights)."""
    out_numel: int = 0
    out_shape: tuple[int, ...] = ()
    out_grad: Any = None
    backwards: int = 0


@dataclass
class Hooks:
    """The hooks on one diffusers transformer. `keep_full` (the CP group's first rank) keeps the inputs and the
    output themselves for the reference; the others keep fingerprints only. Every forward inside the block is
    one `Forward` (gradient accumulation runs several)."""

    module: Any
    keep_full: bool
    snapshot_weights: Any  # () -> {name: tensor}: the weights the forward uses (FSDP2: a collective on every rank)
    recorder: Any = None
    """The watch's recorder.Recorder: told each output, where the loss graph's paths end."""
    calls: list[Forward] = field(default_factory=list)
    weights: dict | None = None
    autocast: tuple[bool, Any] = (False, None)
    """(enabled, dtype) of the autocast around the first forward, on the model's device type."""
    _handles: list = field(default_factory=list)

    @property
    def forwards(self) -> int:
        return len(self.calls)

    @property
    def backwards(self) -> int:
        return sum(1 for f in self.calls if f.backwards)

    @property
    def prints(self) -> tuple[InputPrint, ...]:
        """Every forward's input fingerprints; a later micro-batch's inputs are named `name@k`."""
        return tuple(
            InputPrint(p.name if k == 0 else f"{p.name}@{k + 1}", p.digest, p.norm) for k, f in enumerate(self.calls) for p in f.prints
        )

    def inputs(self) -> dict[str, Any]:
        """Every forward's inputs as compared with the run without CP (kept where `keep_full`): named as `prints`
        names them; tensors and plain values as they are, anything else by its fingerprint (equal only when equal)."""
        out: dict[str, Any] = {}
        for k, call in enumerate(self.calls):
            named = [(f"arg{i}", a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
            for name, value in named:
                out[name if k == 0 else f"{name}@{k + 1}"] = value if _plain(value) else digest(value)
        return out

    def out_grads(self) -> dict[str, Any]:
        """The gradient that flowed into each forward's output (None: no backward), named `out_grad`, `out_grad@2`, ..."""
        return {"out_grad" if k == 0 else f"out_grad@{k + 1}": call.out_grad for k, call in enumerate(self.calls)}

    def install(self) -> Hooks:
        import torch

        self._handles.append(self.module.register_forward_pre_hook(torch.compiler.disable(self._pre), with_kwargs=True))
        self._handles.append(self.module.register_forward_hook(torch.compiler.disable(self._post)))
        return self

    def seen(self, args: tuple, kwargs: dict, result: Any) -> None:
        """One call of the model seen whole after it ran (`cpdoctor step -- cmd` records through torch's global
        forward hook, which is the only one that receives keyword arguments): as the two hooks record it."""
        self._pre(self.module, args, kwargs)
        self._post(self.module, args, result)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        named = [(f"arg{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
        prints = tuple(
            InputPrint(n, digest(v), float(v.detach().double().norm()) if isinstance(v, torch.Tensor) and v.is_floating_point() else None)
            for n, v in named
        )
        call = Forward(prints)
        if not self.calls:
            self.autocast = autocast_state(next((a for _, a in named if isinstance(a, torch.Tensor)), None))
            weights = self.snapshot_weights()
            if self.keep_full:
                self.weights = weights
        if self.keep_full:
            call.args, call.kwargs = _detached(args), _detached(kwargs)
        self.calls.append(call)

    def _post(self, module: Any, args: tuple, result: Any) -> None:
        out = output_tensor(result)
        if out is None or not self.calls:
            return
        call = self.calls[-1]
        call.out_dtype, call.out_numel = str(out.dtype).replace("torch.", ""), out.numel()
        call.out_shape = tuple(out.shape)
        if self.recorder is not None:
            self.recorder.output(out, len(self.calls) - 1)
        if self.keep_full:
            call.output = out.detach().cpu().float().clone()
        if out.requires_grad:

            def grad(g: Any, call: Forward = call) -> None:
                call.backwards += 1
                g = g.detach().cpu().float()
                call.out_grad = g.clone() if call.out_grad is None else call.out_grad + g

            out.register_hook(grad)


def _plain(value: Any) -> bool:
    import torch

    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def unwrap(model: Any) -> Any:
    """The model inside DDP (and accelerate's prepare, which wraps in DDP) or torch.compile's
    OptimizedModule (FSDP2 shards the module in place); inside a trainer's own wrapper module, the first submodule
    with context parallelism enabled."""
    import torch

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)  # whatever model they hold
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
            data_parallel = isinstance(model, wrappers)
            if inner is None or not (data_parallel or (hasattr(inner, "config") and not hasattr(model, "config"))):
                break
        model = inner
    if compat.parallel_config_of(model) is None and callable(getattr(model, "modules", None)):
        return next((m for m in model.modules() if compat.parallel_config_of(m) is not None), model)
    return model


def compute_dtype(module: Any, out_dtypes: list[str]) -> str:
    """The least precise of the trainable weights' dtypes and the outputs' (autocast computes in bf16 with fp32
    weights; a LoRA step trains fp32 adapters over a bf16 base): the dtype the tolerance follows."""
    seen = {DType.of_torch(p.dtype) or DType.FP32 for p in module.parameters()}
    seen |= {DType.of_torch(d) or DType.FP32 for d in out_dtypes if d}
    return max(seen or {DType.FP32}, key=DType.most_precise_first().index).value


def autocast_dtypes() -> list[str]:
    """The dtype CPU autocast computes in, when it is on here (empty when it is off)."""
    import torch

    try:
        on, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    except (TypeError, AttributeError):  # torch before 2.4: the CPU-specific names
        on, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
    return [str(dtype)] if on else []


def module_device(module: Any) -> Any:
    p = next(module.parameters(), None)
    return getattr(p, "device", "cpu")


@dataclass(frozen=True)
class Recorded:
    """What a rank recorded of the watched step, as the baseline reads it (never the watcher itself): the model, the
    hooks' calls (inputs, outputs, weights, autocast) and the fingerprint of the weights it started from."""

    module: Any
    hooks: Hooks
    weights_digest: str | None = None

    @property
    def device(self) -> Any:
        return module_device(self.module)

    @property
    def dtype(self) -> str:
        return compute_dtype(self.module, [f.out_dtype for f in self.hooks.calls])
