"""Small things the parts of `cpdoctor env` share: the probe shape, dtype names, quiet and one-thread scopes."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from cpdoctor.examinations.measurement import torch_dtype

__all__ = ["DTYPE_NAMES", "NOT_COLLECTED", "NOT_INSTALLED", "SHAPE", "first_line", "one_thread", "quiet", "torch_dtype"]

DTYPE_NAMES = ("fp32", "bf16", "fp16")
NOT_COLLECTED = "could not collect"
NOT_INSTALLED = "not installed"

SHAPE = (1, 16, 2, 32)
"""(B, S, H, D) of the probe tensors: S, H and D differ so that a layout mix-up shows in the shapes."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """'TypeName: first line of the message', at most `limit` characters."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 1] + "…"


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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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
            for lg, lvl in zip(loggers, levels, strict=True):
                lg.setLevel(lvl)
