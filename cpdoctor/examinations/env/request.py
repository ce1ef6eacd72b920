"""What `cpdoctor env` is asked to examine: a device and a dtype, validated before anything is imported."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from cpdoctor.errors import BadInput, CannotExamine
from cpdoctor.vocabulary import Device, DType

DTYPE_NAMES = DType.examined()
DEVICES = Device.names()


@dataclass(frozen=True)
class EnvRequest:
    device: str = "auto"
    dtype: str = "auto"
    emulate: bool = False  # the CUDA backends' ops on CPU through cpdoctor's kernel stand-ins

    def validate(self) -> EnvRequest:
        """BadInput (exit 2) for an unknown device or dtype."""
        if self.device not in DEVICES:
            raise BadInput(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise BadInput(f"unknown dtype {self.dtype!r}; choose auto, {', '.join(DTYPE_NAMES)}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "env", **asdict(self)}


def resolve_device(device: str) -> Any:
    """auto: this rank's CUDA device when there is one (LOCAL_RANK under torchrun), else the CPU."""
    import torch

    if device not in DEVICES:
        raise BadInput(f"unknown device {device!r}; choose auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise CannotExamine("--device cuda was asked for but torch sees no CUDA device here")
    if device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def resolve_dtype(dtype: str, device: Any, emulate: bool = False) -> str:
    """auto: bf16 on CUDA (what training uses) and when emulating the CUDA kernels (flash and cuDNN take only
    half precision), fp32 on the CPU."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" or emulate else "fp32"
    if dtype not in DTYPE_NAMES:
        raise BadInput(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPE_NAMES)}")
    return dtype
