"""Small things the parts of `cpdoctor env` share: the probe shape, dtype names, a one-thread scope."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cpdoctor.examinations.measurement import torch_dtype

__all__ = ["DTYPE_NAMES", "NOT_COLLECTED", "SHAPE", "one_thread", "torch_dtype"]

DTYPE_NAMES = ("fp32", "bf16", "fp16")
NOT_COLLECTED = "could not collect"

SHAPE = (1, 16, 2, 32)
"""(B, S, H, D) of the probe tensors: S, H and D differ so that a layout mix-up shows in the shapes."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread (idle OpenMP workers spinning between ops cost more than they help)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
