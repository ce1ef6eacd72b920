"""Every use of diffusers' private API, in one place, chosen by feature detection.

cpdoctor must work on every diffusers release with context parallelism (0.36.0 onward). Private names move
and signatures change between releases, so each difference is detected here (attribute presence,
`inspect.signature`, dataclass fields), never by comparing version strings. Other modules ask this one.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.errors import BadInput


def dispatch_module() -> Any:
    """diffusers.models.attention_dispatch, or BadInput (a missing package: exit 2) when diffusers or its CP
    support is missing."""
    try:
        from diffusers.models import attention_dispatch
    except ImportError as exc:
        raise BadInput(f"diffusers is not installed or does not import ({exc}); pip install diffusers") from exc
    if not hasattr(attention_dispatch, "_templated_context_parallel_attention"):
        raise BadInput("this diffusers has no context parallelism (it arrived in 0.36.0); upgrade diffusers")
    return attention_dispatch


def cp_plan(cls: Any) -> dict[str, Any]:
    """A model class's context-parallel plan (`_cp_plan`: which module's inputs are split on which dim, which
    output is gathered), {} when it has none."""
    return dict(getattr(cls, "_cp_plan", None) or {})


def supports_gradient_checkpointing(cls: type) -> bool:
    """Whether `enable_gradient_checkpointing()` works on the class (ModelMixin refuses it unless the class sets
    `_supports_gradient_checkpointing`)."""
    return bool(getattr(cls, "_supports_gradient_checkpointing", False)) and hasattr(cls, "enable_gradient_checkpointing")


def forward_params(cls: type) -> set[str]:
    """The parameter names of a model class's `forward` (without self): which optional inputs this release's
    class takes (pooled projections, guidance, ids, masks) is read from its signature."""
    return set(inspect.signature(cls.forward).parameters) - {"self"}


@contextlib.contextmanager
def quiet(warning_category: type[Warning] = Warning) -> Iterator[None]:
    """diffusers' logger at error level and Python warnings of `warning_category` ignored, for the block:
    diffusers warns on every enable_parallelism / set_attention_backend ("experimental"), backends tried on tiny
    tensors warn, torch warns on the functional collectives diffusers calls; probes never print."""
    import warnings

    try:
        from diffusers.utils import logging as dlogging
    except ImportError:
        dlogging = None
    level = dlogging.get_verbosity() if dlogging is not None else None
    if dlogging is not None:
        dlogging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", warning_category)
            yield
    finally:
        if dlogging is not None and level is not None:
            dlogging.set_verbosity(level)


def diffusers_version() -> str:
    try:
        import diffusers
    except ImportError:
        return "not installed"
    return getattr(diffusers, "__version__", "unknown")


def registry() -> Any:
    return dispatch_module()._AttentionBackendRegistry


def backend_enum() -> Any:
    return dispatch_module().AttentionBackendName


def registered_backend_names() -> list[str]:
    return [getattr(b, "value", str(b)) for b in registry()._backends]


def backend_member(name: str) -> Any | None:
    """The AttentionBackendName member for `name`, or None when this release has no such backend."""
    enum = backend_enum()
    try:
        member = enum(name)
    except ValueError:
        return None
    return member if member in registry()._backends else None


def backend_function(name: str) -> Callable:
    return registry()._backends[backend_member(name)]


@dataclasses.dataclass(frozen=True)
class BackendRefusal:
    """What a backend's registered function refuses of a ring step: `return_lse=True` (no_lse: it runs no ring,
    which merges its steps by LSE) or an `attn_mask`, with diffusers' own message."""

    no_lse: bool
    message: str


def ring_mask_refusal(name: str) -> BackendRefusal | None:
    """What the backend refuses of a masked ring step, with diffusers' own message, read from a top-level `if
    <attn_mask / return_lse test>: raise ...("...")` of its registered function; None when it refuses neither (or
    has no Python source). Read, not tried: trying a backend whose package diffusers looks for at import would
    need a fresh interpreter."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(backend_function(name))))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for node in fn.body:
        if not (isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Raise)):
            continue
        tested = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        if tested and tested <= {"attn_mask", "return_lse"}:
            exc = node.body[0].exc
            args = exc.args if isinstance(exc, ast.Call) else []
            said = next((a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)), None)
            no_lse = "return_lse" in tested
            return BackendRefusal(no_lse, said or f"refuses {'return_lse=True' if no_lse else 'attn_mask'}")
    return None


def is_cp_registered(name: str) -> bool:
    """Registered with supports_context_parallel=True (what enable_parallelism checks)."""
    supports = getattr(registry(), "_supports_context_parallel", set())
    return name in supports or backend_member(name) in supports


def accepted_kwargs(name: str) -> set[str]:
    """The keyword names dispatch_attention_fn will pass to the backend (it drops the others silently)."""
    reg = registry()
    names = getattr(reg, "_supported_arg_names", {}).get(backend_member(name))
    return set(names) if names is not None else set(inspect.signature(backend_function(name)).parameters)


def requirement_error(name: str) -> str | None:
    """diffusers' own check that the packages behind a backend are importable (flash-attn, sage, ...)."""
    check = getattr(dispatch_module(), "_check_attention_backend_requirements", None)
    if check is None:
        return None
    return Attempt.of(lambda: check(backend_member(name))).why(with_type=False)  # any failure: "cannot run here"


def add_backend(name: str, fn: Callable, supports_context_parallel: bool) -> None:
    """Register `fn` under a new AttentionBackendName member `name` (the registry only takes members)."""
    enum = backend_enum()
    if name not in enum._value2member_map_:
        member = str.__new__(enum, name)
        member._name_ = name.upper()
        member._value_ = name
        with contextlib.suppress(AttributeError):
            member.__objclass__ = enum
        enum._value2member_map_[name] = member
        enum._member_map_[member._name_] = member
        enum._member_names_.append(member._name_)
        type.__setattr__(enum, member._name_, member)
    member = enum(name)
    reg = registry()
    params = inspect.signature(reg.register).parameters
    kwargs: dict[str, Any] = {"constraints": []}
    if "supports_context_parallel" in params:
        kwargs["supports_context_parallel"] = supports_context_parallel
    reg.register(member, **kwargs)(fn)


def templated_attention() -> Callable:
    """The module global every CP backend calls, looked up now (patches and spies replace it)."""
    return dispatch_module()._templated_context_parallel_attention


@contextlib.contextmanager
def replaced_templated_attention(fn: Callable) -> Iterator[None]:
    """Temporarily replace the module global `_templated_context_parallel_attention` (used to discover a
    backend's forward/backward ops without running them)."""
    mod = dispatch_module()
    original = mod._templated_context_parallel_attention
    mod._templated_context_parallel_attention = fn
    try:
        yield
    finally:
        mod._templated_context_parallel_attention = original


def parallel_config_classes() -> tuple[Any, Any]:
    try:
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    except ImportError as exc:
        raise BadInput(f"this diffusers has no ContextParallelConfig ({exc}); upgrade diffusers") from exc
    return ContextParallelConfig, ParallelConfig


def context_parallel_config(ring: int, ulysses: int, **extra: Any) -> Any:
    """ContextParallelConfig by keywords (field order changed between releases); unknown extras dropped."""
    cp_cls, _ = parallel_config_classes()
    fields = {f.name for f in dataclasses.fields(cp_cls)}
    kwargs = {"ring_degree": ring, "ulysses_degree": ulysses, **{k: v for k, v in extra.items() if k in fields}}
    return cp_cls(**kwargs)


def context_parallel_fields() -> set[str]:
    cp_cls, _ = parallel_config_classes()
    return {f.name for f in dataclasses.fields(cp_cls)}


def setup_parallel_config(ring: int, ulysses: int, rank: int, world_size: int, device: Any, mesh: Any) -> Any:
    """A ParallelConfig set up on an existing (ring, ulysses) mesh, as the model hooks would have it."""
    _, pc_cls = parallel_config_classes()
    config = pc_cls(context_parallel_config=context_parallel_config(ring, ulysses))
    setup = config.setup
    params = inspect.signature(setup).parameters
    if "mesh" in params:
        setup(rank, world_size, device, mesh=mesh)
    else:
        setup(rank, world_size, device)
    return config


def flat_cp_rank(parallel_config: Any) -> int:
    """This rank's index among the sequence shards (what the model hooks use to pick its chunk)."""
    cp = parallel_config.context_parallel_config
    flat = getattr(cp, "_flattened_mesh", None)
    if flat is not None:
        return flat.get_local_rank()
    return cp._ring_local_rank * cp.ulysses_degree + cp._ulysses_local_rank


@contextlib.contextmanager
def accelerator_count_at_least_one() -> Iterator[None]:
    """Some releases' enable_parallelism divide by torch.accelerator.device_count(), which is 0 on a CPU-only
    host (ZeroDivisionError). Scope it to return at least 1 while they run; a no-op where it is not needed."""
    import torch

    acc = getattr(torch, "accelerator", None)
    original = getattr(acc, "device_count", None)
    if original is None or original() > 0:
        yield
        return
    acc.device_count = lambda: 1
    try:
        yield
    finally:
        acc.device_count = original


def count_accelerators_as_at_least_one() -> None:
    """`accelerator_count_at_least_one` for the rest of the process (a process of the user's command emulated on a
    CPU host: its own calls to enable_parallelism run later, outside any scope cpdoctor could open)."""
    import torch

    acc = getattr(torch, "accelerator", None)
    original = getattr(acc, "device_count", None)
    if original is not None and original() == 0:
        acc.device_count = lambda: 1


def meshless_parallel_config(ring: int, ulysses: int, device: Any = None) -> Any:
    """A ParallelConfig as diffusers' CP templates hand it to a backend's forward op on rank 0, but without a
    process group or mesh: the identity fields `setup()` fills (`_rank`, `_world_size`, `_ring_local_rank`,
    `_ulysses_local_rank`, `_device`) are set where this release has them. For calling forward ops in one
    process: some ops read `context_parallel_config._world_size` to decide what CP needs (whether to compute an
    LSE, whether to force dropout); anything that needs a collective fails, as it should."""
    _, pc_cls = parallel_config_classes()
    cp = context_parallel_config(ring, ulysses)
    fields = {f.name for f in dataclasses.fields(cp)}
    for name, value in (
        ("_rank", 0),
        ("_world_size", ring * ulysses),
        ("_ring_local_rank", 0),
        ("_ulysses_local_rank", 0),
        ("_device", device),
    ):
        if name in fields or hasattr(cp, name):
            setattr(cp, name, value)
    return pc_cls(context_parallel_config=cp)


@contextlib.contextmanager
def preserved_active_backend() -> Iterator[None]:
    """`model.set_attention_backend` also sets diffusers' process-wide active backend; put it back afterwards,
    so an examination run inside a training script leaves that script's choice alone."""
    reg = registry()
    saved = getattr(reg, "_active_backend", None)
    try:
        yield
    finally:
        if saved is not None:
            reg._active_backend = saved


# ----------------------------------------------------------------------------------------------------------
# The CP templates the fix replaces, recognised by shape, and the parallel-config fields they read
# ----------------------------------------------------------------------------------------------------------

RING_CLASS = "TemplatedRingAttention"
"""The module global of diffusers.models.attention_dispatch the fixed ring replaces."""

TEMPLATE_FORWARD_PARAMS = (
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
"""`TemplatedRingAttention.forward`'s and `TemplatedUlyssesAttention.forward`'s parameters in every release with
CP (0.36 onward); the fixed ring and Ulysses take exactly these, so a release with another signature must not be
patched blindly."""

CALLERS = ("_templated_context_parallel_attention", "_templated_unified_attention")
"""Functions of attention_dispatch that look the ring class up as a module global at call time."""

ULYSSES_CLASS = "TemplatedUlyssesAttention"
"""The Ulysses template the fix also replaces: same forward parameters as the ring (TEMPLATE_FORWARD_PARAMS) in
every release with CP."""

ULYSSES_CALLERS = ("_templated_context_parallel_attention",)
"""Functions of attention_dispatch that look the Ulysses class up as a module global at call time."""


def template_class_problem(mod: Any, name: str = RING_CLASS, callers: tuple[str, ...] = CALLERS) -> str | None:
    """Why `mod.<name>` (one of diffusers' CP templates) is not the class the fix knows how to replace, or
    None: missing, not an autograd Function, another forward signature, or nobody looking it up by name."""
    import torch

    cls = getattr(mod, name, None)
    if cls is None:
        return f"diffusers.models.attention_dispatch has no {name}"
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        return f"{name} is not a torch.autograd.Function ({cls!r})"
    read = Attempt.of(lambda: tuple(inspect.signature(cls.forward).parameters), catching=(TypeError, ValueError))
    if read.value is None:
        return f"cannot read the signature of {name}.forward ({read.error})"
    params = read.value
    if params != TEMPLATE_FORWARD_PARAMS:
        return f"{name}.forward has the parameters ({', '.join(params)}), expected ({', '.join(TEMPLATE_FORWARD_PARAMS)})"
    if not any(name in global_names(getattr(mod, caller, None)) for caller in callers):
        return f"no function of attention_dispatch looks {name} up by name ({', '.join(callers)}); replacing it would change nothing"
    return None


def ring_class_problem(mod: Any) -> str | None:
    """Why `mod.TemplatedRingAttention` is not the class the fix knows how to replace, or None."""
    return template_class_problem(mod, RING_CLASS)


def ulysses_class_problem(mod: Any) -> str | None:
    """Why `mod.TemplatedUlyssesAttention` is not the class the fix knows how to replace, or None."""
    return template_class_problem(mod, ULYSSES_CLASS, ULYSSES_CALLERS)


def backward_calls_backend_op(cls: Any) -> bool | None:
    """Does this template's backward hand the work to the backend's `backward_op` (`ctx.backward_op(...)`)?
    Then every defect of a backend's backward op (0.39.0's double transpose) reaches CP through it. None when
    the source cannot be read."""
    source = _source(getattr(cls, "backward", None))
    return None if source is None else "backward_op(" in source


def global_names(fn: Any) -> tuple[str, ...]:
    """Global names a Python function's code refers to (empty for anything else)."""
    code = getattr(fn, "__code__", None)
    return tuple(code.co_names) if code is not None else ()


def callers_of_ring(mod: Any) -> list[str]:
    """The functions of attention_dispatch that will pick up a replaced ring class on their next call."""
    return [name for name in CALLERS if RING_CLASS in global_names(getattr(mod, name, None))]


def passes_rotated_tensors(source: str) -> bool:
    """Does this ring backward source hand its op the rotated chunk (`backward_op(ctx, grad_out, query=...,
    key=..., value=...)`)? False is the stale-KV signature: `backward_op(ctx, grad_out)` recomputes every step
    from the tensors saved at step 0."""
    return "key=" in source and "value=" in source


def sends_dkv_to_next(source: str) -> bool:
    """Does this ring backward source send its dK/dV accumulator to rank r+1 (`next_ranks = list(range(1, W)) +
    [0]` then `permute_tensor`)? At step i rank r holds KV chunk r+i, so the accumulator belongs at r−1: r+1 is
    right only for W = 2."""
    return bool(re.search(r"list\(range\(1,\s*\w+\)\)\s*\+\s*\[0\]", source)) and "permute_tensor" in source


def gathers_mask(source: str) -> bool:
    """Does this ring forward source gather the attention mask with the keys (else every chunk gets the local mask)?"""
    return bool(re.search(r"(all_gather|all_to_all)\w*\([^)]*mask", source))


def backward_passes_tensors(cls: Any) -> bool | None:
    """`passes_rotated_tensors` of the installed ring's backward; None when the source cannot be read."""
    source = _source(cls.backward)
    return None if source is None else passes_rotated_tensors(source)


def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def backward_sends_dkv_to_next(cls: Any) -> bool | None:
    """`sends_dkv_to_next` of the installed ring's backward; None when the source cannot be read."""
    source = _source(cls.backward)
    return None if source is None else sends_dkv_to_next(source)


def forward_gathers_mask(cls: Any) -> bool | None:
    """`gathers_mask` of the installed ring's forward; None when the source cannot be read."""
    source = _source(cls.forward)
    return None if source is None else gathers_mask(source)


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


ANYTHING_CLASSES = {"ulysses_anything": "TemplatedUlyssesAnythingAttention", "ring_anything": "TemplatedRingAnythingAttention"}
"""The uneven-length CP modes (ContextParallelConfig fields) and the autograd Function each one runs."""


def anything_backward_refused(mode: str) -> bool | None:
    """Is the "anything" mode inference only? Calls its autograd Function's backward with placeholder
    arguments: True when it raises NotImplementedError, False when it does something else, None when this
    diffusers has no such class."""
    fn_cls = getattr(dispatch_module(), ANYTHING_CLASSES.get(mode, ""), None)
    if fn_cls is None:
        return None
    params = [
        p
        for p in inspect.signature(fn_cls.backward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    # NotImplementedError is the refusal; anything else means the backward exists and did some work
    return isinstance(Attempt.of(lambda: fn_cls.backward(*([None] * len(params)))).error, NotImplementedError)


# --- the fix's view of backend ops (flash-attn wrappers, hub kernels) ---
# cpdoctor.fix picks the fused kernel underneath the forward op diffusers' ring hands it, and for flash-attn
# calls the same low-level functions diffusers wraps. Those are all private names of attention_dispatch (or
# of flash-attn), so they are looked up here and nowhere in fix/.


class ForwardOpKind(enum.Enum):
    """Which backend a CP forward op belongs to (the value is the backend's public name): what the fix reads to
    pick the fused kernel underneath."""

    NATIVE_FLASH = "_native_flash"
    NATIVE_CUDNN = "_native_cudnn"
    NATIVE_EFFICIENT = "_native_efficient"
    NATIVE = "native"
    FLASH = "flash"
    FLASH_HUB = "flash_hub"


_FORWARD_OP_BACKENDS = {
    "_native_flash_attention_forward_op": ForwardOpKind.NATIVE_FLASH,
    "_cudnn_attention_forward_op": ForwardOpKind.NATIVE_CUDNN,
    "_native_efficient_attention_forward_op": ForwardOpKind.NATIVE_EFFICIENT,
    "_efficient_attention_forward_op": ForwardOpKind.NATIVE_EFFICIENT,
    "_native_attention_forward_op": ForwardOpKind.NATIVE,
    "_flash_attention_forward_op": ForwardOpKind.FLASH,
    "_flash_attention_hub_forward_op": ForwardOpKind.FLASH_HUB,
}
"""A CP backend's forward op (function name in attention_dispatch) -> that backend."""


def forward_op_kind(forward_op: Any) -> ForwardOpKind | None:
    """Which backend's forward op `forward_op` is, or None for any other op.
    Matched by `__name__`, not identity: the ring receives whatever object the backend passed, and a wrapper
    made with functools.wraps (a profiler, a timer) still names the op it wraps."""
    return _FORWARD_OP_BACKENDS.get(getattr(forward_op, "__name__", ""))


def flash_attn_functions(forward_op: Any) -> tuple[Callable, Callable] | None:
    """The low-level flash-attn forward/backward that `forward_op` (diffusers' "flash" or "flash_hub" op)
    calls, so the fixed ring runs the very same kernels with explicit tensors; None when they are not here.

    "flash_hub": the hub kernel's wrappers registered for FLASH_HUB (set once the kernel is loaded). "flash":
    the `_wrapped_flash_attn_forward/_backward` globals of the op's module, else flash-attn's own interface."""
    import sys

    mod = sys.modules.get(getattr(forward_op, "__module__", ""), None)
    if mod is None:
        return None
    if forward_op_kind(forward_op) is ForwardOpKind.FLASH_HUB:
        registry = getattr(mod, "_HUB_KERNELS_REGISTRY", None)
        enum = getattr(mod, "AttentionBackendName", None)
        config = registry.get(getattr(enum, "FLASH_HUB", None)) if registry is not None and enum is not None else None
        fwd, bwd = getattr(config, "wrapped_forward_fn", None), getattr(config, "wrapped_backward_fn", None)
    else:
        fwd, bwd = getattr(mod, "_wrapped_flash_attn_forward", None), getattr(mod, "_wrapped_flash_attn_backward", None)
        if fwd is None or bwd is None:
            fns = _flash_attn_package_functions()
            if fns is None:
                return None
            fwd, bwd = fns
    return (fwd, bwd) if fwd is not None and bwd is not None else None


def flash_attn_is_standin() -> bool:
    """Whether the `flash_attn` this process imported is cpdoctor's CPU stand-in (cpu_kernels/flash_attn_standin, put
    first on sys.path by emulation; its `__version__` carries packages.STANDIN_MARK) rather than the real package.
    Either way it is what diffusers' "flash" op calls here, so the fix runs the same functions; only the stand-in
    must never be named the installed flash-attn."""
    import sys

    from cpdoctor.compat.packages import is_standin

    mod = sys.modules.get("flash_attn")
    return mod is not None and is_standin(str(getattr(mod, "__version__", "")))


def _flash_attn_package_functions() -> tuple[Callable | None, Callable | None] | None:
    """flash-attn's own low-level forward/backward (renamed `_wrapped_*` when it registered torch custom
    ops); None when flash-attn does not import. Under emulation `flash_attn` is cpdoctor's stand-in (see
    `flash_attn_is_standin`): the functions are then the stand-in's, on purpose (diffusers calls the same)."""
    try:
        from flash_attn import flash_attn_interface as fai
    except ImportError:
        return None
    fwd = getattr(fai, "_wrapped_flash_attn_forward", None) or getattr(fai, "_flash_attn_forward", None)
    bwd = getattr(fai, "_wrapped_flash_attn_backward", None) or getattr(fai, "_flash_attn_backward", None)
    return fwd, bwd


class _ScratchCtx:
    """Stands in for an autograd ctx: an op called with `_save_ctx=False` must not need one, but may touch it."""

    def save_for_backward(self, *tensors: Any) -> None:
        pass


def call_forward_op(forward_op: Callable, q: Any, k: Any, v: Any, attn_mask: Any, scale: float, parallel_config: Any) -> Any:
    """One attention block through a backend's forward op, in the op contract (model layout (B, S, H, D),
    dropout 0, not causal, no GQA, return_lse=True) without saving anything for its backward
    (`_save_ctx=False`, a scratch ctx): the fixed ring only borrows the op's forward. Returns what the op
    returns, `(out, lse)` when the op honours return_lse."""
    return forward_op(_ScratchCtx(), q, k, v, attn_mask, 0.0, False, scale, False, True, _save_ctx=False, _parallel_config=parallel_config)
