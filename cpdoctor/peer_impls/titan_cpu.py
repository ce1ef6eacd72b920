"""torchtitan's trainer on CPU ranks (gloo), unmodified: the environment shims `cpdoctor step --emulate
torchtitan-cpu -- <command>` applies in every process of the command, right after torch is imported and before
any of the user's code (examinations/step/runs/emulation.py). Each is only where CPU ranks differ from the CUDA ranks
torchtitan 0.3.0 is written for (docs/TORCHTITAN.md, docs/FACTS.md "torchtitan's FLUX trainer on CPU ranks"); none
changes torchtitan's logic or the user's command:

1. torchtitan's device: `torchtitan.tools.utils` computes `device_type = _get_available_device_type() or "cuda"` at
   its import, and every torchtitan module reads it from there (`parallel_dims`, `distributed.utils`, the trainer's
   `utils.device_type`, the metrics' `device_module`): imported first here and set to "cpu", its device module
   `torch.cpu` with the memory queries torchtitan's metrics make of `torch.cuda` answered for the host
   (`CpuDevice`: its name, the host's memory as capacity, no allocator statistics).
2. `import torch.testing._internal.distributed.fake_pg` (torch 2.13): torchtitan builds size-1 mesh dims on the
   "fake" backend, which that import registers.
3. FSDP2 reduces in sums: gloo has no PREMUL_SUM, so every module `fully_shard` returns gets
   `set_force_sum_reduction_for_comms(True)` (torchtitan sets its divide factor to 1.0: a sum is the same math).
   `torch.distributed.fsdp.fully_shard` is wrapped before torchtitan imports it.
4. SDPA routed to the CUDA efficient op, served on the CPU by cpdoctor's contract-faithful aten stand-in
   (cpu_kernels/standins.py): torch's context_parallel intercepts only the CUDA SDPA ops, and on CPU tensors SDPA
   picks `*_for_cpu` ops that have no DTensor sharding strategy (peer_impls/shims.py). The same kernel runs in the
   run without CP. Its LSE is padded to 32 queries: each rank's local length must be a multiple of 32. A call with a
   mask (the T5 encoder's) goes to torch's own SDPA: no CP attention takes one.
torchtitan's default `spmd_backend` ("spmd_types") needs torch >= 2.14: on 2.13 the command itself says
`--parallelism.spmd_backend partial_dtensor` (a choice of the user's config, not a shim)."""

from __future__ import annotations

import functools
import os
import platform
from types import SimpleNamespace
from typing import Any

from cpdoctor.vocabulary import Kernel


def emulate() -> None:
    """Apply shims 1-4 in this process (once; the process is the command's)."""
    import torch
    import torch.distributed.fsdp as fsdp
    import torch.nn.functional as F
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (shim 2: registers the "fake" backend)

    from cpdoctor.cpu_kernels import standins
    from cpdoctor.peer_impls.shims import sdpa_router

    fsdp.fully_shard = _summing(fsdp.fully_shard)  # shim 3, before torchtitan's `from torch.distributed.fsdp import`
    import torchtitan.tools.utils as titan_utils  # shim 1: first of torchtitan's modules, before any reads it

    titan_utils.device_type, titan_utils.device_module = "cpu", CpuDevice(torch.cpu)
    standins.LIBRARY.install()  # shim 4
    F.scaled_dot_product_attention = sdpa_router(Kernel.EFFICIENT, others=F.scaled_dot_product_attention)


def _summing(fully_shard: Any) -> Any:
    """`fully_shard`, then the module it returns reduces in sums (shim 3)."""

    @functools.wraps(fully_shard)
    def shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        sharded = fully_shard(module, *args, **kwargs)
        for m in sharded if isinstance(sharded, list) else [sharded]:
            m.set_force_sum_reduction_for_comms(True)
        return sharded

    return shard


class CpuDevice:
    """`torch.cpu` as torchtitan's device module (shim 1): what it has, plus the queries torchtitan makes of
    `torch.cuda` for its memory metrics, answered for the host (no allocator statistics: they read as unknown)."""

    def __init__(self, cpu: Any) -> None:
        self.cpu = cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return platform.processor() or "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return SimpleNamespace(total_memory=pages * size, name=self.get_device_name())

    def current_device(self) -> int:
        return 0

    def memory_stats(self, device: Any = None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def main(argv: list[str]) -> None:
    """`python -m cpdoctor.peer_impls.titan_cpu -m MODULE ARGS...`: run MODULE as `python -m` would, under the same
    shims (e.g. torchtitan's own `--checkpoint.create_seed_checkpoint` before `cpdoctor step`, under torchrun)."""
    import runpy
    import sys

    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: python -m cpdoctor.peer_impls.titan_cpu -m MODULE [ARGS...]")
    emulate()
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
