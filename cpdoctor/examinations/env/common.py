"""Small things the parts of `cpdoctor env` share: the probe shape, a one-thread scope."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from cpdoctor.examinations.measurement import torch_dtype

__all__ = ["NOT_COLLECTED", "SHAPE", "one_thread", "torch_dtype"]

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
