"""The environment of `cpdoctor env`, one fact per function (in the manner of torch/utils/collect_env.py).

Each function gathers one fact and may raise; `collect` turns a raise into "could not collect", so one missing
fact never stops the report. Nothing here prints, and nothing is decided from a version number.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Callable
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.compat.packages import installed_version
from cpdoctor.examinations.env.common import NOT_COLLECTED
from cpdoctor.report.environment import Environment, Software

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


def collect(fn: Callable[[], Any]) -> Any:
    """fn(), or "could not collect" when it raises."""
    return Attempt.of(fn).or_else(NOT_COLLECTED)  # a report must not crash on one missing fact


def python_version() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()})"


def os_name() -> str:
    return platform.platform()


def cpdoctor_version() -> str:
    try:
        from cpdoctor.version import __version__

        return __version__
    except ImportError:
        return importlib.metadata.version("cpdoctor")


def torch_version() -> str:
    import torch

    return str(torch.__version__)


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
    return installed_version("diffusers")


def attention_packages() -> dict[str, str]:
    return {label: collect(lambda d=dists, m=mod: installed_version(*d, module=m)) for label, (dists, mod) in ATTENTION_PACKAGES.items()}


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


def collect_environment() -> Environment:
    """Every fact, in the order the report lists them (`Software`, in the order the JSON lists them)."""
    return Environment(
        Software(
            python=collect(python_version),
            os=collect(os_name),
            cpdoctor=collect(cpdoctor_version),
            torch=collect(torch_version),
            torch_cuda_build=collect(torch_cuda_build),
            cuda_available=collect(cuda_available),
            cudnn=collect(cudnn_version),
            nccl=collect(nccl_version),
            gloo=collect(gloo_available),
            devices=collect(device_list),
            diffusers=collect(diffusers_version),
            attention_packages=collect(attention_packages),
            world=collect(world),
            settings=collect(settings),
        )
    )
