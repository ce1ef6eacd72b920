"""CPU stand-ins for the CUDA attention kernels diffusers' GPU backends call, keeping each kernel's contract.

The CP defects of diffusers' `_native_flash`, `_native_cudnn` and `flash` backends live in its Python glue
around the kernel call (argument order, layouts, which tensors it saves), not inside the kernels
(docs/FACTS.md). A stand-in that keeps the kernel's contract exposes them on a CPU. What is kept, per op:
the argument list and order and the return tuple (the installed torch's schemas,
`torch.ops.aten.<op>.default._schema`), output shapes and dtypes, LSE shape and padding and the returned
philox seed/offset tensors (torch/_meta_registrations.py: `meta__scaled_dot_product_flash_attention`,
`meta__scaled_dot_product_cudnn_attention`, `meta__scaled_dot_product_efficient_attention`,
`meta__efficient_attention_forward` and their backwards), the dtypes and shapes the real kernel refuses (the
TORCH_CHECKs of flash-attn's `mha_fwd` / `mha_bwd` in csrc/flash_attn/flash_api.cpp, which torch vendors for
its flash kernel), and the RNG effect: with dropout > 0 the real kernels take a philox (seed, offset) from the
device generator and advance it; here the CPU default generator is drawn from (its state advances,
deterministically) and the drawn value seeds the dropout mask, which the backward replays from the returned
seed/offset. Dropout keeps an element when a uniform uint8 is <= floor(keep_prob·255) (flash-attn's
`p_dropout_in_uint8_t`), so a dropout of 1e-30 keeps everything, as on the GPU, but still advances the
generator. Numerics come from torch's CPU kernels in fp32 (`_scaled_dot_product_flash_attention_for_cpu` and
its backward) or explicit fp32 softmax math (dropout, bottom-right causal), cast to the kernel's dtype.

Not emulated: the CUDA kernels' own arithmetic (tiling, bf16 rounding of P), varlen / paged / windowed /
softcap / ALiBi variants (they raise NotImplementedError), and the exact wording of errors the real kernels
raise outside flash-attn's checks (cuDNN's are paraphrased). This module imports no diffusers: PyTorch's own
context parallel and ring-flash-attention call the same aten ops and flash-attn entry points.

The parts: `standin_math.py` (what every stand-in computes with: RNG, attention in fp32, the LSE as read),
`standin_checks.py` (what the real kernels refuse), `aten_standins.py` (the aten ops), `flash_attn_varlen.py` and
`flash_attn_standin/` (flash-attn 2's interface). Here: `install()` registers the aten stand-ins for the CPU dispatch
key through `torch.library` (idempotent);
`flash_attn_path()` is the folder to put on sys.path (before importing diffusers) for the flash-attn 2
stand-in package (`flash_attn.flash_attn_interface`, version `2.6.3+cpdoctor.standin`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from cpdoctor.cpu_kernels.aten_standins import ATEN_OPS

__all__ = ["install", "uninstall", "installed", "flash_attn_path", "activate", "ATEN_OPS", "EMULATED_BACKENDS", "FLASH_ATTN_VERSION"]

EMULATED_BACKENDS = ("_native_flash", "_native_cudnn", "flash")
"""The diffusers backends whose CUDA kernels these stand-ins take the place of (aten flash, aten cuDNN, flash-attn 2)."""

FLASH_ATTN_VERSION = "2.6.3+cpdoctor.standin"
"""What `importlib.metadata.version("flash_attn")` says with the stand-in on sys.path (diffusers requires >= 2.6.3)."""


# --------------------------------------------------------------------------------------------------------
# Installing
# --------------------------------------------------------------------------------------------------------


class StandinLibrary:
    """The aten stand-ins registered with torch's dispatcher in this process. Lifetime: one instance, `LIBRARY`,
    created at this module's import, holding nothing; `install` registers the stand-ins once (a second install
    is a no-op returning the same ops); `uninstall` destroys the registration, after which the CUDA-only ops are
    missing on CPU again and the next `install` registers them afresh. Nothing survives an uninstall."""

    def __init__(self) -> None:
        self.library: Any = None
        """The `torch.library.Library` holding the registrations, or None."""
        self.ops: list[str] = []
        """The aten ops registered (an op that already had a CPU kernel in this torch is left alone)."""

    @property
    def installed(self) -> bool:
        return self.library is not None

    def install(self) -> list[str]:
        if self.library is None:
            lib = torch.library.Library("aten", "IMPL")
            done = []
            for name, fn in ATEN_OPS.items():
                packet = getattr(torch.ops.aten, name, None)
                if packet is None or torch._C._dispatch_has_kernel_for_dispatch_key(packet.default.name(), "CPU"):
                    continue
                lib.impl(name, fn, "CPU")
                done.append(name)
            self.library, self.ops = lib, done
        return list(self.ops)

    def uninstall(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library, self.ops = None, []


LIBRARY = StandinLibrary()


def installed() -> bool:
    return LIBRARY.installed


def install() -> list[str]:
    """Register every aten stand-in for the CPU dispatch key (idempotent); returns the ops registered. An op
    that already has a CPU kernel in this torch is left alone."""
    return LIBRARY.install()


def uninstall() -> None:
    """Remove the registrations (the CUDA-only ops are again missing on CPU)."""
    LIBRARY.uninstall()


def flash_attn_path() -> str:
    """The folder holding the flash-attn 2 stand-in package (`flash_attn/`) and its dist-info."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "flash_attn_standin")


def activate() -> None:
    """Everything an emulating process needs, before it imports diffusers: the flash-attn stand-in first on
    sys.path (diffusers checks flash-attn's version and imports it at import time) and the aten stand-ins."""
    import sys

    path = flash_attn_path()
    if path not in sys.path:
        sys.path.insert(0, path)
        import importlib

        importlib.invalidate_caches()
    install()


def flash_attn_require_emulation(q: torch.Tensor) -> None:
    """Outside an emulated examination the flash-attn stand-in behaves as the real flash-attn does with CPU
    tensors (mha_fwd's CHECK_DEVICE), so a process that imported it earlier cannot run `flash` unannounced."""
    if not installed():
        raise RuntimeError("Input tensor must be on CUDA device (cpdoctor's flash-attn stand-in is only active under --emulate)")
