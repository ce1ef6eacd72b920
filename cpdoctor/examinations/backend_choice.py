"""Which diffusers attention backend an examination runs, and why it cannot run here: the choice the op-level
examination makes for its request and the model examination makes at the model's own heads (both call diffusers'
dispatch through a backend), with the CUDA kernels' CPU stand-ins put in place first where asked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cpdoctor.errors import BadInput, Unsupported, UnsupportedKind
from cpdoctor.examinations.measurement import torch_dtype
from cpdoctor.launch.jobs import RankResult
from cpdoctor.vocabulary import DType


@dataclass(frozen=True)
class BackendAsk:
    """What choosing a backend reads of a request: the backend asked for at given degrees, heads and head dim. An
    attention request has these fields and is passed as it is; the model examination builds one at its model's
    attention."""

    backend: str
    dtype: DType
    ring: int
    ulysses: int
    heads: int
    head_dim: int
    emulate: bool = False


@dataclass
class NotRunnable(RankResult):
    """This rank found that the backend cannot run the examination here, and why."""

    backend: str
    facts: Any
    unsupported: Unsupported


def prepare_emulation(req: Any) -> None:
    """With `emulate`, the CUDA kernels' CPU stand-ins are put in place before diffusers is imported (the
    flash-attn stand-in must be on sys.path when diffusers checks for flash-attn at import time); without it,
    stand-ins a previous case of this process installed are removed, so nothing changes."""
    from cpdoctor.cpu_kernels import standins

    if req.emulate:
        standins.activate()
    elif standins.installed():
        standins.uninstall()


def resolved_backend(req: BackendAsk | Any, measured: str | None = None) -> str:
    """The backend the ranks ran: the one the measurement names or, when none came back to say so (a CRASH), the
    backend asked for, `auto` resolved here as the ranks resolve it on their device (`select_backend`): what
    `--repro`'s script names and what the doctor's line says. Imports torch and diffusers."""
    if measured and measured != "auto":
        return measured
    if req.backend != "auto":
        return req.backend
    import torch

    cuda = req.device == "cuda" or (req.device == "auto" and torch.cuda.is_available())
    name, _ = select_backend(req, torch.device("cuda" if cuda else "cpu"))
    return name


def select_backend(req: BackendAsk | Any, device: Any) -> tuple[str, Any]:
    """The backend name to examine and its facts; BadInput for a name this diffusers does not know."""
    import difflib

    from cpdoctor.compat import backends
    from cpdoctor.compat import diffusers as compat
    from cpdoctor.cpu_kernels import cpu_backend

    cpu_backend.register()
    dtype = torch_dtype(req.dtype)
    heads = req.heads // req.ulysses
    if req.backend == backends.AUTO:
        name, seen = backends.resolve_auto(device, dtype, heads, req.head_dim, req.ring, emulated=req.emulate)
        if name is None:
            reasons = "; ".join(f"{f.name}: {_why(f.unsupported(req.ring))}" for f in seen)
            facts = backends.BackendFacts(
                "auto", registered=True, runs_here=False, run_error=f"no CP-capable backend runs here ({reasons})"
            )
            return "auto", facts
        return name, seen[-1]
    if compat.backend_member(req.backend) is None:
        names = compat.registered_backend_names()
        close = difflib.get_close_matches(req.backend, names, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else f" (known: {', '.join(sorted(names))})"
        raise BadInput(f"unknown attention backend {req.backend!r}{hint}")
    facts = backends.examine_backend(req.backend, device, dtype, heads, req.head_dim)
    facts.emulated = req.emulate
    return req.backend, facts


def _why(unsupported: Unsupported | None) -> str:
    return "not CP-capable" if unsupported is None else unsupported.message


def no_backend_here(facts: Any, ring: int) -> Unsupported | None:
    """Why the chosen backend cannot run the examination: its own reason, or none of auto's candidates runs."""
    if facts.name == "auto":
        return Unsupported(UnsupportedKind.NOT_CP_CAPABLE, facts.run_error)
    return facts.unsupported(ring)
