"""`cpdoctor env`: what this machine and this diffusers can do for context parallelism, in one process.

Three parts, each a plain function of the machine (nothing here prints):

1. Facts about the environment, one small function each (in the manner of torch/utils/collect_env.py): a fact
   that cannot be gathered reads "could not collect" instead of raising.
2. One row per attention backend registered in the installed diffusers (cpdoctor's `cpdoctor_cpu` included):
   `backends.examine_backend` asks the registry and tries the backend on tiny tensors; for the backends that
   route into diffusers' CP templates this module then calls the discovered forward and backward ops the way
   the Ulysses template does during training (forward with `return_lse=False, _save_ctx=True` on a stand-in
   ctx, under no_grad, with a parallel config of world size 2; then `backward_op(ctx, grad_out)`), and looks at
   what the forward saved (an LSE or not), at the arguments the kernels received (`compute_log_sumexp`,
   `dropout_p`), at whether the generator of the device moved, and at the gradients against an fp64
   reference. A backend that is installed but has no kernel for this device is run on the meta device
   instead (shapes and kernel arguments only, no numbers).
3. Findings about the installed code (the ring template, the dispatcher, the backends' ops), each with a
   diagnosis, a remedy and, where more than one process is needed to settle it, the `cpdoctor check` command
   that measures it. Nothing is decided from a version number.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.examinations.attention.judge import EXIT_FOUND, EXIT_OK, FAIL, PASS, Finding, tolerance

WARN, INFO = "WARN", "INFO"
NOT_COLLECTED = "could not collect"
NOT_INSTALLED = "not installed"
DTYPE_NAMES = ("fp32", "bf16", "fp16")

SHAPE = (1, 16, 2, 32)
"""(B, S, H, D) of the probe tensors: S, H and D differ so that a layout mix-up shows in the shapes."""

ATTENTION_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "flash-attn": (("flash-attn", "flash_attn"), "flash_attn"),
    "flash_attn_interface (FA3)": (("flash-attn-3", "flash_attn_3", "flashattn-hopper"), "flash_attn_interface"),
    "sageattention": (("sageattention",), "sageattention"),
    "xformers": (("xformers",), "xformers"),
    "kernels (HF hub kernels)": (("kernels",), "kernels"),
    "torch_npu": (("torch-npu", "torch_npu"), "torch_npu"),
    "torch_xla": (("torch-xla", "torch_xla"), "torch_xla"),
}
"""Packages behind diffusers' attention backends, reported by version only (never imported here: importing
flash-attn can take seconds or abort on a driver mismatch; diffusers' own requirement check is in the table)."""

WORLD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
SETTING_VARIABLES = ("CUDA_VISIBLE_DEVICES", "DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "CPDOCTOR_PATCH", "OMP_NUM_THREADS")


# ----------------------------------------------------------------------------------------------------------
# 1. The environment, one fact per function
# ----------------------------------------------------------------------------------------------------------


def collect(fn: Callable[[], Any]) -> Any:
    """fn(), or "could not collect" when it raises."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a report must not crash on one missing fact
        return NOT_COLLECTED


def python_version() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()})"


def os_name() -> str:
    return platform.platform()


def cpdoctor_version() -> str:
    try:
        from cpdoctor import __version__

        return __version__
    except ImportError:
        return importlib.metadata.version("cpdoctor")


def torch_version() -> str:
    import torch

    return torch.__version__


def torch_cuda_build() -> str:
    import torch

    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}"
    return torch.version.cuda or "none (CPU build)"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cudnn_version() -> str:
    import torch

    if not torch.backends.cudnn.is_available():
        return "not available"
    v = torch.backends.cudnn.version()
    return str(v) if v is not None else "not available"


def nccl_version() -> str:
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return "not available"
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def gloo_available() -> bool:
    import torch

    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def device_list() -> list[str]:
    """Every device torch sees: 'cuda:0 NVIDIA H200 (sm_90, 139.8 GiB)', then 'cpu'."""
    import torch

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)")
    devices.append(f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)")
    return devices


def diffusers_version() -> str:
    try:
        return importlib.metadata.version("diffusers")
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def package_version(distributions: tuple[str, ...], module: str) -> str:
    """The installed version of a package (by distribution metadata), "installed" when only the module is found."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec(module) is not None:
        return "installed (version unknown)"
    return NOT_INSTALLED


def attention_packages() -> dict[str, str]:
    return {label: collect(lambda d=dists, m=mod: package_version(d, m)) for label, (dists, mod) in ATTENTION_PACKAGES.items()}


def world() -> dict[str, Any]:
    """The world the command runs in: under torchrun or not, and the variables that decide it."""
    variables = {k: os.environ[k] for k in WORLD_VARIABLES if k in os.environ}
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    summary = (
        f"torchrun: rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}, local rank {os.environ.get('LOCAL_RANK', '?')}"
        if torchrun
        else "single process (no RANK/WORLD_SIZE)"
    )
    return {"summary": summary, "torchrun": torchrun, "variables": variables}


def settings() -> dict[str, str]:
    """Environment variables that change what diffusers or cpdoctor do (only those that are set)."""
    return {k: os.environ[k] for k in SETTING_VARIABLES if k in os.environ}


def ring_class() -> str:
    """Which TemplatedRingAttention this process would run (cpdoctor's fixed one when it is patched in)."""
    from cpdoctor.compat import diffusers as compat

    cls = getattr(compat.dispatch_module(), compat.RING_CLASS, None)
    if cls is None:
        return "absent"
    return f"{cls.__module__}.{cls.__qualname__}"


def collect_environment() -> dict[str, Any]:
    """Every fact, in the order the report lists them."""
    return {
        "python": collect(python_version),
        "os": collect(os_name),
        "cpdoctor": collect(cpdoctor_version),
        "torch": collect(torch_version),
        "torch_cuda_build": collect(torch_cuda_build),
        "cuda_available": collect(cuda_available),
        "cudnn": collect(cudnn_version),
        "nccl": collect(nccl_version),
        "gloo": collect(gloo_available),
        "devices": collect(device_list),
        "diffusers": collect(diffusers_version),
        "attention_packages": collect(attention_packages),
        "world": collect(world),
        "settings": collect(settings),
    }


# ----------------------------------------------------------------------------------------------------------
# 2. The backends
# ----------------------------------------------------------------------------------------------------------


def torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def resolve_device(device: str) -> Any:
    """auto: this rank's CUDA device when there is one (LOCAL_RANK under torchrun), else the CPU."""
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"unknown device {device!r}; choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise CannotExamine("--device cuda was asked for but torch sees no CUDA device here")
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_dtype(dtype: str, device: Any) -> str:
    """auto: bf16 on CUDA (what training uses), fp32 on the CPU."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if dtype not in DTYPE_NAMES:
        raise BadInput(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPE_NAMES)}")
    return dtype


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
    name: str
    facts: dict[str, Any]
    accepts_parallel_config: bool
    op: OpProbe | None
    ring: Cell
    ulysses: Cell
    training: Cell

    def to_dict(self) -> dict:
        data = asdict(self)
        data["installed"] = not self.facts.get("requirement_error")
        data["cp_capable"] = bool(self.facts.get("cp_registered"))
        data["runs_here"] = bool(self.facts.get("runs_here"))
        data["returns_lse"] = self.returns_lse
        data["has_backward"] = self.facts.get("has_backward")
        return data

    @property
    def returns_lse(self) -> bool | None:
        return self.facts.get("returns_lse")


class _OpCtx:
    """Stands in for the autograd ctx the templates hand to a forward op."""

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 1] + "…"


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
                    given = {**dict(zip(names, args)), **kwargs}
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


def probe_ops(forward_op: Callable, backward_op: Callable, device: Any, dtype_name: str, parallel_config: Any) -> OpProbe:
    """Call a backend's CP ops as the Ulysses template calls them in training, on `device` (or meta)."""
    import torch

    dtype = torch_dtype(dtype_name)
    meta = device.type == "meta"
    probe = OpProbe(measured_on=str(device))
    b, s, h, d = SHAPE
    if meta:
        q, k, v, g = (torch.empty(SHAPE, device=device, dtype=dtype) for _ in range(4))
    else:
        gen = torch.Generator().manual_seed(0)
        q, k, v, g = (torch.randn(SHAPE, generator=gen).to(device, dtype) for _ in range(4))
    ctx = _OpCtx()
    rng_before = None if meta else _rng_state(device)
    with record_kernel_args() as calls:
        try:
            with torch.no_grad():
                try:
                    out = forward_op(ctx, q, k, v, None, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=parallel_config)
                except Exception as exc:  # noqa: BLE001 - an op that wants more of the config than a stand-in has
                    probe.config_error = _first_line(exc)
                    calls.clear()
                    ctx = _OpCtx()
                    out = forward_op(ctx, q, k, v, None, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=None)
        except Exception as exc:  # noqa: BLE001
            probe.error = f"forward: {_first_line(exc)}"
            probe.kernel_args = calls
            return probe
        out = out[0] if isinstance(out, tuple) else out
        fwd_calls = {k2: list(v2) for k2, v2 in calls.items()}
        grads = None
        try:
            with torch.no_grad():
                grads = backward_op(ctx, g)
        except Exception as exc:  # noqa: BLE001
            probe.backward_error = _first_line(exc)
    if not meta:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        probe.rng_advanced = not torch.equal(rng_before, _rng_state(device))
    probe.kernel_args = calls
    lse_flags = [c.get("compute_log_sumexp") for cs in fwd_calls.values() for c in cs if "compute_log_sumexp" in c]
    probe.lse_not_requested = (False in lse_flags) if lse_flags else None
    dropouts = [c.get("dropout_p") for cs in calls.values() for c in cs if isinstance(c.get("dropout_p"), (int, float))]
    forced = [p for p in dropouts if p > 0]
    probe.forced_dropout = max(forced) if forced else None
    if not meta:
        probe.saved_lse, probe.saved_lse_shape = _find_lse(ctx, b, s, h)
    if grads is None:
        return probe
    grads = tuple(grads[:3])
    probe.grad_shapes = [list(x.shape) if isinstance(x, torch.Tensor) else None for x in grads]
    probe.grad_shapes_ok = all(isinstance(x, torch.Tensor) and tuple(x.shape) == SHAPE for x in grads)
    if meta or not probe.grad_shapes_ok:
        return probe
    ref = _math_attention(q, k, v, g, torch.float64, torch.device("cpu"))
    base = _math_attention(q, k, v, g, dtype, device)
    got = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    probe.rel_err = {n: _rel_err(got[n], ref[n]) for n in got}
    baseline = max(_rel_err(base[n], ref[n]) for n in got)
    probe.tolerance = tolerance(dtype_name, baseline)
    return probe


def _short(reason: str | None, limit: int = 100) -> str:
    """The first sentence of an error message, at most `limit` characters."""
    reason = (reason or "").split(". ")[0].strip().rstrip(".")
    return reason if len(reason) <= limit else reason[: limit - 1] + "…"


def _requirement_hint(message: str) -> str:
    """'install `flash-attn>=2.6.3`' from diffusers' requirement message, else its first sentence."""
    lower = message.lower()
    i = lower.rfind("please ")
    if i >= 0:
        return _short(message[i + len("please ") :])
    return _short(message)


def judge(facts: dict, accepts_config: bool, op: OpProbe | None) -> tuple[Cell, Cell, Cell]:
    """The ring, Ulysses and training cells of one backend on this device."""
    if facts.get("requirement_error"):
        no = Cell(False, f"not installed: {_requirement_hint(facts['requirement_error'])}")
        return no, no, no
    if not facts.get("cp_registered"):
        why = "not registered for CP (enable_parallelism refuses it)"
        if accepts_config and facts.get("routes_cp") is False:
            why += "; accepts a parallel config and ignores it"
        no = Cell(False, why)
        return no, no, no
    if not facts.get("routes_cp"):
        no = Cell(False, f"does not route into diffusers' CP templates ({_short(facts.get('run_error'))})")
        return no, no, no
    if not facts.get("runs_here"):
        no = Cell(False, f"no kernel for this device ({_short(facts.get('run_error'))})")
        return no, no, no
    ring = Cell(True) if facts.get("returns_lse") else Cell(False, "no LSE: the ring needs one to merge KV blocks")
    ulysses = Cell(True)
    if op is None or op.error:
        training = Cell(False, (op.error if op else None) or "its ops could not be called")
    elif op.backward_error:
        training = Cell(False, f"backward raises: {op.backward_error}")
    elif op.grad_shapes_ok is False:
        training = Cell(False, f"backward returns gradients of shape {op.grad_shapes} for inputs {list(SHAPE)}")
    elif op.lse_not_requested or (op.saved_lse is False and op.backward_ok is False):
        training = Cell(False, "its forward saves no LSE unless asked, and its backward needs one")
    elif op.backward_ok is False:
        training = Cell(False, f"backward wrong: rel err {max(op.rel_err.values()):.2g} > tolerance {op.tolerance:.2g}")
    else:
        training = Cell(True)
    return ring, ulysses, training


def examine_row(name: str, device: Any, dtype_name: str, config: Any) -> BackendRow:
    import torch

    from cpdoctor.compat import backends
    from cpdoctor.compat import diffusers as compat

    dtype = torch_dtype(dtype_name)
    facts = backends.examine_backend(name, device, dtype, heads=SHAPE[2], head_dim=SHAPE[3])
    accepts = "_parallel_config" in compat.accepted_kwargs(name)
    op = None
    if facts.routes_cp and not facts.requirement_error:
        _, fwd, bwd, _ = backends.discover_ops(name, device, dtype, SHAPE[2], SHAPE[3])
        if fwd is not None and bwd is not None:
            if facts.runs_here:
                op = probe_ops(fwd, bwd, device, dtype_name, config)
            else:
                op = probe_ops(fwd, bwd, torch.device("meta"), dtype_name, config)
                if op.error:  # no meta kernel either: nothing measured
                    op = None
    ring, ulysses, training = judge(facts.to_dict(), accepts, op)
    return BackendRow(name, facts.to_dict(), accepts, op, ring, ulysses, training)


# ----------------------------------------------------------------------------------------------------------
# 3. Findings
# ----------------------------------------------------------------------------------------------------------


def _finding(probe: str, verdict: str, diagnosis: str, remedy: str = "", command: str | None = None, **details: Any) -> Finding:
    if command:
        details["command"] = command
    return Finding(probe, verdict, diagnosis, remedy, details=details)


def _ring_source_facts() -> dict[str, Any]:
    """What the installed TemplatedRingAttention does, read from its code (None where it cannot be read). When
    cpdoctor's fixed ring is patched into this process, the class it replaced is the one described."""
    from cpdoctor.compat import diffusers as compat

    mod = compat.dispatch_module()
    cls = getattr(mod, compat.RING_CLASS, None)
    patched = False
    with contextlib.suppress(Exception):
        from cpdoctor.fix import patch

        patched = patch.is_patched()
        if patched:
            last = patch.last_report()
            return {
                "patched": True,
                "passes_tensors": getattr(last, "original_backward_passes_tensors", None),
                "sends_to_next": getattr(last, "original_sends_dkv_to_next", None),
                "gathers_mask": getattr(last, "original_gathers_mask", None),
                "callers": compat.callers_of_ring(mod),
            }
    if cls is None:
        return {"patched": patched, "absent": True}
    return {
        "patched": False,
        "passes_tensors": compat.backward_passes_tensors(cls),
        "sends_to_next": compat.backward_sends_dkv_to_next(cls),
        "gathers_mask": compat.forward_gathers_mask(cls),
        "callers": compat.callers_of_ring(mod),
    }


def ring_findings() -> list[Finding]:
    src = _ring_source_facts()
    if src.get("absent"):
        return [_finding("ring template", WARN, "the installed diffusers has no TemplatedRingAttention: ring CP is not examined here", "", "cpdoctor check --ring 2")]
    also = ", in ring × Ulysses too (it goes through the same class)" if "_templated_unified_attention" in (src.get("callers") or []) else ""
    prefix = "the installed code (replaced in this process by cpdoctor's patch) " if src["patched"] else "the installed code "
    stale = src["passes_tensors"] is False
    out = []
    if src["passes_tensors"] is None:
        out.append(_finding("ring backward: rotated K/V", WARN, "the source of TemplatedRingAttention.backward cannot be read", "measure it", "cpdoctor check --ring 2"))
    elif stale:
        out.append(_finding(
            "ring backward: rotated K/V",
            FAIL,
            prefix + "calls `ctx.backward_op(ctx, grad_out)` in TemplatedRingAttention.backward without the rotated "
            "query/key/value/out/lse: every ring step's gradient is recomputed against the iteration-0 (local) K/V and "
            f"partial out/lse, so dQ/dK/dV are wrong at every ring degree ≥ 2{also}; the forward is right",
            "cpdoctor.patch(); or upgrade diffusers to a release whose ring backward passes key=/value= (then re-check "
            "ring ≥ 3); or Ulysses-only CP",
            "cpdoctor check --ring 2",
        ))
    else:
        out.append(_finding("ring backward: rotated K/V", PASS, prefix + "passes the rotated key/value and the merged out/lse to backward_op", "", "cpdoctor check --ring 2"))
    if src["sends_to_next"] is None:
        out.append(_finding("ring backward: dK/dV direction", WARN, "the direction of the dK/dV hand-off cannot be read from the source", "measure it", "cpdoctor check --ring 3"))
    elif src["sends_to_next"]:
        hidden = "; today it hides behind the stale K/V defect above and remains once that is fixed" if stale else ""
        out.append(_finding(
            "ring backward: dK/dV direction",
            FAIL,
            prefix + "sends the dK/dV accumulator to rank r+1 (`next_ranks = list(range(1, world_size)) + [0]`) while "
            "rank r holds KV chunk r+i at step i, so it belongs at r−1: dK/dV are wrong at ring degree ≥ 3 "
            f"(the two directions agree only at ring 2){also}{hidden}",
            "cpdoctor.patch(); or keep ring_degree ≤ 2 and scale with Ulysses",
            "cpdoctor check --ring 3",
        ))
    else:
        out.append(_finding("ring backward: dK/dV direction", PASS, prefix + "does not hand dK/dV to rank r+1 with `list(range(1, W)) + [0]`", "", "cpdoctor check --ring 3"))
    if src["gathers_mask"] is None:
        out.append(_finding("ring forward: mask rotation", WARN, "whether the ring rotates the attention mask cannot be read from the source", "measure it", "cpdoctor check --ring 2 --mask-pad 3"))
    elif not src["gathers_mask"]:
        out.append(_finding(
            "ring forward: mask rotation",
            FAIL,
            prefix + "passes each rank's local attn_mask to every rotated KV chunk of TemplatedRingAttention "
            f"(it never gathers the mask with the keys): with a padding mask (e.g. Qwen-Image's text mask) out and "
            f"gradients are silently wrong{also}; Ulysses all-gathers the mask and is exact",
            "cpdoctor.patch() (its ring rotates the mask with the keys); or Ulysses-only CP for masked models",
            "cpdoctor check --ring 2 --mask-pad 3",
        ))
    else:
        out.append(_finding("ring forward: mask rotation", PASS, prefix + "gathers the attention mask with the keys", "", "cpdoctor check --ring 2 --mask-pad 3"))
    return out


def dispatch_finding(rows: list[BackendRow], device: Any, dtype_name: str, config: Any) -> Finding:
    """Does dispatch_attention_fn refuse a parallel config for a backend that is not registered for CP? Tried
    with such a backend that runs here."""
    import torch

    from cpdoctor.compat import diffusers as compat

    local_only = [r for r in rows if r.facts.get("runs_here") and not r.facts.get("cp_registered")]
    ignoring = [r.name for r in local_only if r.accepts_parallel_config]
    dropping = [r.name for r in local_only if not r.accepts_parallel_config]
    probe = "dispatch: CP check"
    if not local_only:
        return _finding(probe, INFO, "no backend that is not registered for CP runs here, so nothing could route a parallel config to one")
    # The backend tried, and named in the command, is one whose own backward runs here: `cpdoctor check` with it
    # then shows the wrong numbers instead of a crash.
    ordered = [r.name for r in local_only if r.accepts_parallel_config] + [r.name for r in local_only if not r.accepts_parallel_config]
    tried = next((n for n in ordered if _local_backward_runs(n, device, dtype_name)), ordered[0])
    q = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(device, torch_dtype(dtype_name))
    try:
        with _quiet():
            compat.dispatch_module().dispatch_attention_fn(q, q, q, backend=compat.backend_member(tried), parallel_config=config)
    except Exception as exc:  # noqa: BLE001
        msg = _first_line(exc)
        if "parallel" in msg.lower():
            return _finding(probe, PASS, f"dispatch_attention_fn refuses a parallel config for {tried}, which is not registered for CP ({msg})")
        return _finding(probe, INFO, f"dispatch_attention_fn with a parallel config and {tried} raised {msg}; whether it checks supports_context_parallel is not settled here", "", f"cpdoctor check --ring 2 --backend {tried}")
    names = []
    if ignoring:
        names.append(f"{', '.join(ignoring)} (accept the parallel config and ignore it)")
    if dropping:
        names.append(f"{', '.join(dropping)} (do not accept it: dispatch drops it)")
    return _finding(
        probe,
        WARN,
        f"dispatch_attention_fn called with a parallel config and backend {tried} (not registered for CP) returned "
        f"local attention without a word: it never checks supports_context_parallel. Backends here that would do "
        f"this: {'; '.join(names)}; each rank then attends only to its own 1/W of the keys. enable_parallelism and "
        "set_attention_backend do check, so this bites when the backend is chosen afterwards (the installed "
        "attention_backend context manager does not check) or dispatch_attention_fn is called directly",
        "choose a CP-capable backend (a ✓ in the Ulysses column) before enable_parallelism and do not switch it afterwards",
        f"cpdoctor check --ring 2 --backend {tried}",
        tried=tried,
        ignores_config=ignoring,
        drops_config=dropping,
    )


def _shape_mismatch(shapes: list | None) -> str:
    """'dK, dV of shape [1, 2, 16, 32] = (B, H, S, D), the kernel layout' for the gradients that differ from SHAPE."""
    b, s, h, d = SHAPE
    labels = ("dQ", "dK", "dV")
    wrong = [(labels[i], sh) for i, sh in enumerate(shapes or []) if sh is None or tuple(sh) != SHAPE]
    if not wrong:
        return "gradients of the right shape"
    names = ", ".join(n for n, _ in wrong)
    shape = wrong[0][1]
    layout = ", the kernel layout (B, H, S, D)" if shape is not None and tuple(shape) == (b, h, s, d) else ""
    return f"{names} of shape {shape}{layout}"


def _local_backward_runs(name: str, device: Any, dtype_name: str) -> bool:
    """Does the backend's own (non-CP) path accept inputs that require grad here and build a graph? (A backend
    without a backward on this device, such as flex on the CPU, refuses them in the forward.)"""
    import torch

    from cpdoctor.compat import diffusers as compat

    q = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)).to(device, torch_dtype(dtype_name)).requires_grad_(True)
    try:
        with _quiet(), torch.enable_grad():
            out = compat.backend_function(name)(query=q, key=q, value=q)
    except Exception:  # noqa: BLE001
        return False
    return bool((out[0] if isinstance(out, tuple) else out).requires_grad)


def op_findings(rows: list[BackendRow], dtype_name: str) -> list[Finding]:
    """Per backend whose CP ops were called: LSE for training, backward correctness, RNG advance."""
    out: list[Finding] = []
    measured = [r for r in rows if r.op is not None and not r.op.error]
    for r in measured:
        op = r.op
        meta = op.measured_on == "meta"
        on = (
            "measured on the meta device, as this device has no kernel for it: shapes and kernel arguments only"
            if meta
            else f"measured on {op.measured_on} in {dtype_name}"
        )
        # On the meta device the numbers are for a machine where the backend runs (bf16 is what training uses there).
        ulysses_cmd = f"cpdoctor check --ulysses 2 --backend {r.name}" + (" --dtype bf16" if meta else "")
        if op.lse_not_requested or (op.saved_lse is False and op.backward_ok is False and not op.backward_error and op.grad_shapes_ok):
            out.append(_finding(
                f"{r.name}: LSE for backward",
                FAIL,
                f"called as Ulysses calls it in training (return_lse=False), {r.name}'s forward op "
                + ("asks its kernel not to compute the LSE (compute_log_sumexp=False)" if op.lse_not_requested else "saves no LSE")
                + f" although its backward reads one: training through it (Ulysses, and the ring's first step) gets "
                f"wrong gradients or an error; {on}",
                f"another backend for training (cpdoctor_cpu on CPU; one with ✓ in the training column); or upgrade "
                f"diffusers to a release whose {r.name} forward computes the LSE whenever a backward may need it",
                ulysses_cmd,
                kernel_args=op.kernel_args,
            ))
        if op.backward_error:
            out.append(_finding(f"{r.name}: backward", FAIL, f"{r.name}'s backward op raises after a forward that was not asked for an LSE: {op.backward_error}; {on}", "another backend for training", ulysses_cmd))
        elif op.grad_shapes_ok is False:
            out.append(_finding(
                f"{r.name}: backward",
                FAIL,
                f"{r.name}'s backward op returns {_shape_mismatch(op.grad_shapes)} for q/k/v of shape {list(SHAPE)} = (B, S, H, D) "
                f"(it transposes tensors its forward saved in kernel layout once more): training through it raises, or, "
                f"where the shapes happen to agree, gets wrong gradients; {on}",
                "another backend for training; or upgrade diffusers to a release whose backward ops return model layout",
                ulysses_cmd,
            ))
        elif op.rel_err is not None and op.backward_ok is False and not op.lse_not_requested:
            errs = ", ".join(f"{k} {v:.2g}" for k, v in op.rel_err.items())
            out.append(_finding(f"{r.name}: backward", FAIL, f"{r.name}'s ops disagree with an fp64 reference on one process ({errs}; tolerance {op.tolerance:.2g}); {on}", "another backend", ulysses_cmd))
        if op.rng_advanced or op.forced_dropout:
            how = "advanced the device generator" if op.rng_advanced else f"gave its kernel dropout_p={op.forced_dropout:g} (the generator will advance)"
            out.append(_finding(
                f"{r.name}: RNG",
                WARN,
                f"a forward+backward through {r.name}'s ops with dropout 0 {how} ({on}): runs are not bitwise "
                "reproducible and other random draws (noise, dropout elsewhere) shift with every attention call",
                "a backend whose RNG column is steady; or upgrade diffusers (the flash op forcing dropout_p=1e-30 to "
                "obtain an LSE was removed upstream)",
            ))
    clean = [r.name for r in measured if r.op.measured_on != "meta" and r.training.ok and not r.op.rng_advanced and not r.op.forced_dropout]
    if clean:
        out.append(_finding(
            "CP ops on this device",
            PASS,
            f"{', '.join(clean)}: the forward saves what the backward needs when no LSE is asked for, the backward "
            "matches an fp64 reference, and the device generator does not move",
        ))
    if not any(r.ulysses.ok for r in rows):
        out.append(_finding("CP backends here", WARN, "no attention backend can run CP on this device and dtype", "install a CP-capable backend for this device, or try --device/--dtype"))
    return out


def default_backend_finding(rows: list[BackendRow]) -> Finding | None:
    """DIFFUSERS_ATTN_BACKEND picks the backend of every processor that sets none: can that one do CP here?"""
    name = os.environ.get("DIFFUSERS_ATTN_BACKEND")
    if not name:
        return None
    row = next((r for r in rows if r.name == name), None)
    probe = "default backend (DIFFUSERS_ATTN_BACKEND)"
    if row is None:
        return _finding(probe, WARN, f"DIFFUSERS_ATTN_BACKEND={name} is not a backend of the installed diffusers", "unset it or name a backend from the table")
    if not row.ulysses.ok:
        return _finding(probe, WARN, f"DIFFUSERS_ATTN_BACKEND={name} cannot do CP here: {row.ulysses.why}", "name a backend with ✓ in the Ulysses (and ring) column")
    if not row.ring.ok or not row.training.ok:
        gaps = "; ".join(c.why for c in (row.ring, row.training) if not c.ok)
        return _finding(probe, WARN, f"DIFFUSERS_ATTN_BACKEND={name} does Ulysses here but not everything: {gaps}", "name a backend with ✓ in the ring and training columns if you need them")
    return _finding(probe, PASS, f"DIFFUSERS_ATTN_BACKEND={name} can do ring, Ulysses and training here")


def anything_finding() -> Finding:
    """Does this ContextParallelConfig have the uneven-length "anything" modes, and are they inference only?"""
    from cpdoctor.compat import diffusers as compat

    fields = compat.context_parallel_fields()
    modes = [m for m in ("ulysses_anything", "ring_anything") if m in fields]
    if not modes:
        return _finding("uneven sequence lengths", INFO, "ContextParallelConfig has no ulysses_anything/ring_anything: every split length must divide ring × ulysses", "", "cpdoctor plan MODEL --ring R --ulysses U")
    scopes = []
    for mode in modes:
        raises = compat.anything_backward_refused(mode)
        scopes.append(f"{mode} ({'inference only: its backward raises NotImplementedError' if raises else 'backward not refused' if raises is False else 'no class found'})")
    return _finding(
        "uneven sequence lengths",
        INFO,
        f"ContextParallelConfig has {', '.join(scopes)}: they shard lengths that do not divide the CP world",
        "for training, pick lengths that divide (`cpdoctor plan MODEL` lists the nearest ones)",
        "cpdoctor plan MODEL --ring R --ulysses U",
        modes=modes,
    )


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread (idle OpenMP workers spinning between ops cost more than they help)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the warnings backends emit when tried on tiny tensors (flex without torch.compile, ...)."""
    import logging

    loggers = [logging.getLogger(n) for n in ("diffusers", "diffusers.models.attention_dispatch")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lvl in zip(loggers, levels):
                lg.setLevel(lvl)


# ----------------------------------------------------------------------------------------------------------
# The examination
# ----------------------------------------------------------------------------------------------------------


@dataclass
class EnvReport:
    verdict: str
    exit_code: int
    environment: dict[str, Any]
    backends: list[BackendRow]
    findings: list[Finding]
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "environment": self.environment,
            "backends": [r.to_dict() for r in self.backends],
            "findings": [{**f.to_dict(), "command": f.details.get("command")} for f in self.findings],
            "wall_s": round(self.wall_s, 3),
        }

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), indent=2, default=str)


def overall(findings: list[Finding]) -> tuple[str, int]:
    """FAIL findings -> FAIL, exit 1; WARN alone -> WARN, exit 0; otherwise PASS, exit 0."""
    verdicts = {f.verdict for f in findings}
    if FAIL in verdicts:
        return FAIL, EXIT_FOUND
    if WARN in verdicts:
        return WARN, EXIT_OK
    return PASS, EXIT_OK


def examine(device: str = "auto", dtype: str = "auto") -> EnvReport:
    """The whole `cpdoctor env` examination in this process. BadInput (exit 2) without torch or a diffusers with
    CP (a missing required package, as errors.py has it); CannotExamine (exit 3) for --device cuda without a GPU."""
    t0 = time.perf_counter()
    if device not in ("auto", "cpu", "cuda"):
        raise BadInput(f"unknown device {device!r}; choose auto, cpu or cuda")
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise BadInput(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPE_NAMES)}")
    if importlib.util.find_spec("torch") is None:
        raise BadInput("torch is not installed; pip install torch")
    dev = resolve_device(device)
    dtype_name = resolve_dtype(dtype, dev)
    environment = collect_environment()
    from cpdoctor.kernels import cpu_backend
    from cpdoctor.compat import diffusers as compat

    compat.dispatch_module()  # BadInput (exit 2) when diffusers, or its CP support, is missing
    environment["probe_device"] = str(dev)
    environment["probe_dtype"] = dtype_name
    environment["ring_class"] = collect(ring_class)
    cpu_backend.register()
    config = compat.meshless_parallel_config(ring=1, ulysses=2, device=dev)
    with _quiet(), _one_thread():
        rows = [examine_row(name, dev, dtype_name, config) for name in compat.registered_backend_names()]
        findings = ring_findings()
        findings.append(dispatch_finding(rows, dev, dtype_name, config))
    findings += op_findings(rows, dtype_name)
    default = default_backend_finding(rows)
    if default is not None:
        findings.append(default)
    findings.append(anything_finding())
    verdict, code = overall(findings)
    return EnvReport(verdict, code, environment, rows, findings, time.perf_counter() - t0)


def rank_of_this_process() -> int:
    """RANK under torchrun, 0 otherwise: only rank 0 prints."""
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0

