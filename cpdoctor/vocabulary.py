"""The words cpdoctor's requests, options and reports share, spelled once: dtypes (with the torch dtype, the
machine epsilon, the tolerances and the bytes per element each carries), devices, and a peer's implementation,
variants and block kernels. Every one is a `str` enum, so a member is its own JSON value, compares equal to the
string a suite or an old script writes, and typer lists the members in `--help` and refuses any other word
(exit 2, typer's own message).

Layer 0: imports nothing of cpdoctor's and never torch at import time (`cpdoctor --help` must not); the torch
dtype is looked up when asked for (`DType.torch`)."""

from __future__ import annotations

import enum
from typing import Any


class Word(str, enum.Enum):
    """A str enum that prints as its value (`f"{DType.BF16}"` is "bf16", as the messages and commands need)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class DType(Word):
    """A floating-point dtype an examination computes in (fp64 only for references and memory plans)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP64 = "fp64"

    @classmethod
    def examined(cls) -> tuple[DType, ...]:
        """The dtypes a user may ask an examination to compute in (`--dtype`): fp64 is the references' only."""
        return (cls.FP32, cls.BF16, cls.FP16)

    @classmethod
    def references(cls) -> tuple[DType, ...]:
        """The precisions a one-process reference may compute in (`--reference`)."""
        return (cls.FP64, cls.FP32)

    @classmethod
    def most_precise_first(cls) -> tuple[DType, ...]:
        """fp64, fp32, bf16, fp16: a step's compute dtype is the last of its weights' and output's in this order."""
        return (cls.FP64, cls.FP32, cls.BF16, cls.FP16)

    @classmethod
    def of_torch(cls, dtype: Any) -> DType | None:
        """The member of a torch dtype (torch.float32 -> FP32), None for a dtype cpdoctor has no word for."""
        return _BY_TORCH_NAME.get(str(dtype).removeprefix("torch."))

    @property
    def torch_name(self) -> str:
        """torch's attribute name ("float32"), for generated code and for `getattr(torch, ...)`."""
        return _TORCH_NAME[self]

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch: call it on a rank or after torch is loaded, never at import time)."""
        import torch

        return getattr(torch, self.torch_name)

    @property
    def eps(self) -> float:
        """Machine epsilon: the `+ eps` of the op-level tolerance (examinations/judging.py)."""
        return _EPS[self]

    @property
    def grad_tolerance(self) -> float:
        """The step examination's fixed relative-L2 tolerance for gradients computed in this dtype (far above
        rounding, far below every defect measured: examinations/step/judgment/judge.py)."""
        return _GRAD_TOLERANCE[self]

    @property
    def bytes(self) -> int:
        """Bytes per element (memory plans)."""
        return _BYTES[self]

    @property
    def is_half(self) -> bool:
        """bf16 or fp16: what flash-attn and cuDNN take."""
        return self in (DType.BF16, DType.FP16)


_TORCH_NAME = {DType.FP32: "float32", DType.BF16: "bfloat16", DType.FP16: "float16", DType.FP64: "float64"}
_BY_TORCH_NAME = {name: dtype for dtype, name in _TORCH_NAME.items()}
_EPS = {DType.FP32: 2.0**-23, DType.BF16: 2.0**-7, DType.FP16: 2.0**-10, DType.FP64: 2.0**-52}
_GRAD_TOLERANCE = {DType.FP32: 1e-4, DType.BF16: 3e-2, DType.FP16: 1e-2, DType.FP64: 1e-10}
_BYTES = {DType.FP64: 8, DType.FP32: 4, DType.BF16: 2, DType.FP16: 2}
HALF = (DType.BF16, DType.FP16)
"""The dtypes flash-attn and cuDNN kernels take."""
ALL = (DType.FP32, DType.BF16, DType.FP16)
"""Every dtype an examination computes in."""


class Kind(Word):
    """Which launched examination a request is for (examinations/registry.py maps each to its entry); the word
    a suite's check is keyed by."""

    ATTENTION = "attention"
    MODEL = "model"
    PEER = "peer"
    STEP = "step"
    FIX_TRAINING = "fix_training"


class Device(Word):
    """Where the ranks run: `auto` (a GPU per rank when there are enough, else the CPU), or forced."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Impl(Word):
    """Whose CP attention `cpdoctor check` examines: diffusers' own (kind "attention"), or a peer's."""

    DIFFUSERS = "diffusers"
    RING_FLASH_ATTN = "ring-flash-attn"
    YUNCHANG = "yunchang"
    TORCH = "torch"

    @classmethod
    def peers(cls) -> tuple[Impl, ...]:
        """The peer implementations (every one but diffusers')."""
        return tuple(i for i in cls if i is not cls.DIFFUSERS)

    @property
    def is_peer(self) -> bool:
        return self is not Impl.DIFFUSERS


class Variant(Word):
    """A peer's algorithm, by the name its own code uses (ring-flash-attn's function, yunchang's
    `ring_impl_type`, torch's rotate method). Which peer offers which is the adapter's declaration."""

    BASIC = "basic"
    ZIGZAG = "zigzag"
    STRIPE = "stripe"
    LLAMA3 = "llama3"
    STRIP = "strip"
    BASIC_PYTORCH = "basic_pytorch"
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"


class Kernel(Word):
    """A peer's block kernel, by the name its own code uses (yunchang's `AttnType`, torch's SDPA backend)."""

    FA = "fa"
    TORCH_FLASH = "torch_flash"
    TORCH_EFFICIENT = "torch_efficient"
    FLASH = "flash"
    CUDNN = "cudnn"
    EFFICIENT = "efficient"


def parse(cls: type[Word], value: Any, what: str) -> Any:
    """`value` as a member of `cls` (a member, or its string from a suite or the API); raises ValueError naming
    `what` and the members otherwise (requests turn it into BadInput)."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(cls.names())}") from None


ExaminedDType = Word("ExaminedDType", {d.name: d.value for d in DType.examined()})
"""`--dtype` of `check` and `model`: the dtypes an examination computes in (a member equals its `DType`)."""
ProbeDType = Word("ProbeDType", {"AUTO": "auto", **{d.name: d.value for d in DType.examined()}})
"""`cpdoctor env --dtype`: auto (bf16 on CUDA, fp32 on the CPU) or a dtype an examination computes in."""
Reference = Word("Reference", {d.name: d.value for d in DType.references()})
"""`--reference`: the precision of a one-process recomputation (fp64, or fp32 where fp64 does not fit)."""
