"""Shims: only where gloo or the CPU differ from NCCL or CUDA in a way a peer relies on. Each keeps the
behaviour the peer gets on GPUs, never changes the peer's code, and returns the `Shim` record the report
shows (what, why, how often it acted).

- `import_ring_flash_attn`: ring-flash-attn 0.1.8's `__init__` imports its Hugging Face adapter
  (ring_flash_attn/adapters/hf_adapter.py), which imports transformers' flash-attention helpers; without
  transformers, or with a transformers that removed a symbol it imports, `import ring_flash_attn` fails before
  any attention function is defined. Only when that import fails there, the adapter submodule (and nothing
  else) is replaced by a stub whose functions raise, and the import is retried; the failure's own message and
  file:line go into the record.
- `self_sends_as_copies`: NCCL runs a P2P send to one's own rank inside `batch_isend_irecv`; gloo refuses it
  ("Pair is not connected"). yunchang's ring at ring degree 1 sends dK/dV to itself
  (yunchang/ring/ring_flash_attn.py: `d_kv_comm.send_recv(dk)` on every step, RingComm's send_rank =
  (rank + 1) % 1). A self-send paired with a self-receive becomes a local copy: what NCCL delivers.
- `cuda_sdpa_routing`: PyTorch's context_parallel intercepts the CUDA SDPA ops (`aten._scaled_dot_product_
  {flash,efficient,cudnn}_attention` and their backwards: `_sdpa_handler` in torch/distributed/tensor/
  experimental/_context_parallel/_attention.py). On CPU tensors `F.scaled_dot_product_attention` picks the
  `*_for_cpu` ops, which it does not intercept (no sharding strategy), so `F.scaled_dot_product_attention` is
  routed to the op the CUDA router picks for the chosen backend (aten/src/ATen/native/transformers/
  attention.cpp `_fused_sdp_choice` → flash / efficient / cuDNN, with a logsumexp when an input requires grad),
  which cpdoctor's aten stand-ins run on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

from cpdoctor.attempt import Attempt
from cpdoctor.peer_impls.base import Shim
from cpdoctor.peer_impls.source import peer_frame
from cpdoctor.vocabulary import Kernel

HF_ADAPTER = "ring_flash_attn.adapters.hf_adapter"


def _purge(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def _hf_adapter_stub(reason: str) -> types.ModuleType:
    stub = types.ModuleType(HF_ADAPTER)
    stub.__doc__ = f"cpdoctor's stub of {HF_ADAPTER}: the real module failed to import ({reason})"

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{HF_ADAPTER} is stubbed by cpdoctor: {reason}")

    stub.substitute_hf_flash_attn = unavailable  # type: ignore[attr-defined]
    stub.update_ring_flash_attn_params = unavailable  # type: ignore[attr-defined]
    return stub


def import_ring_flash_attn() -> tuple[Any, Shim | None]:
    """`import ring_flash_attn`, stubbing only its HF adapter submodule when that submodule fails to import."""
    doc = getattr(sys.modules.get(HF_ADAPTER), "__doc__", None) or ""  # the real module has no docstring
    if doc.startswith("cpdoctor's stub"):
        import ring_flash_attn

        return ring_flash_attn, _hf_shim(doc)
    imported = Attempt.of(lambda: importlib.import_module("ring_flash_attn"), trace=True, catching=(ImportError,))
    if imported.error is None:
        return imported.value, None
    frame = peer_frame(imported.trace or "", "ring_flash_attn")
    if frame is None or "adapters" not in frame.location:
        raise imported.error
    reason = f"{type(imported.error).__name__}: {imported.error} at {frame.location}"
    _purge("ring_flash_attn")
    sys.modules[HF_ADAPTER] = _hf_adapter_stub(reason)
    import ring_flash_attn

    return ring_flash_attn, _hf_shim(sys.modules[HF_ADAPTER].__doc__ or reason)


def _hf_shim(doc: str) -> Shim:
    return Shim(
        "ring-flash-attn HF adapter stubbed",
        f"{HF_ADAPTER} replaced by a stub (its substitute_hf_flash_attn / update_ring_flash_attn_params raise); "
        "the attention functions examined are untouched",
        doc.split("(", 1)[-1].rstrip(")") if "(" in doc else doc,
        acted=1,
    )


class _Done:
    """The request of a P2P op completed locally (what `Work.wait()` returns for a finished op)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def self_sends_as_copies() -> Iterator[list[int]]:
    """Within the block, on a gloo group, `torch.distributed.batch_isend_irecv` pairs each send to this rank with
    the next receive from this rank and copies instead (NCCL's self-send); other ops, and every op on another
    backend, go to torch unchanged. Yields a one-element list counting the copies made."""
    import torch.distributed as dist

    original = dist.batch_isend_irecv
    count = [0]

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        if not p2p_op_list or dist.get_backend(p2p_op_list[0].group) != "gloo":
            return original(p2p_op_list)  # NCCL runs self-sends itself
        me = dist.get_rank()
        sends = [op for op in p2p_op_list if op.peer == me and op.op in (dist.isend, dist.send)]
        recvs = [op for op in p2p_op_list if op.peer == me and op.op in (dist.irecv, dist.recv)]
        if not sends:
            return original(p2p_op_list)
        if len(sends) != len(recvs):
            raise RuntimeError(f"cpdoctor's self-send shim: {len(sends)} self-sends but {len(recvs)} self-receives")
        for send, recv in zip(sends, recvs):
            recv.tensor.copy_(send.tensor)
            count[0] += 1
        rest = [op for op in p2p_op_list if op.peer != me]
        done: list[Any] = [_Done() for _ in range(len(sends) + len(recvs))]
        return (original(rest) if rest else []) + done

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield count
    finally:
        dist.batch_isend_irecv = original


def self_send_shim(copies: int) -> Shim:
    return Shim(
        "self-send as local copy",
        "torch.distributed.batch_isend_irecv: a send to one's own rank paired with a receive from it became a local copy",
        "NCCL runs a self-send, gloo refuses it ('Pair is not connected'); yunchang's ring sends dK/dV to itself at ring degree 1",
        acted=copies,
    )


CUDA_OPS = {
    Kernel.FLASH: "_scaled_dot_product_flash_attention",
    Kernel.CUDNN: "_scaled_dot_product_cudnn_attention",
    Kernel.EFFICIENT: "_scaled_dot_product_efficient_attention",
}
"""The CUDA SDPA op of each backend (what PyTorch's context_parallel intercepts)."""


def sdpa_router(kernel: Kernel, others: Any = None) -> Any:
    """What `F.scaled_dot_product_attention` becomes: the CUDA op of `kernel`, with a logsumexp when an input needs
    gradients. A call with a mask or GQA goes to `others` (the original SDPA: a text encoder's masked attention,
    which no CP attention is) and raises without it (the examinations pass neither)."""
    import torch

    op = getattr(torch.ops.aten, CUDA_OPS[kernel])

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        if (attn_mask is not None or enable_gqa) and others is not None:
            return others(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if attn_mask is not None or enable_gqa:
            raise NotImplementedError("cpdoctor's CUDA SDPA routing takes no mask and no GQA (the examination passes neither)")
        lse = any(t.requires_grad for t in (query, key, value))
        if kernel is Kernel.FLASH:
            return op(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel is Kernel.CUDNN:
            return op(query, key, value, None, lse, dropout_p, is_causal, False, scale=scale)[0]
        return op(query, key, value, None, lse, dropout_p, is_causal, scale=scale)[0]

    return scaled_dot_product_attention


@contextlib.contextmanager
def cuda_sdpa_routing(kernel: Kernel) -> Iterator[list[int]]:
    """Within the block, `torch.nn.functional.scaled_dot_product_attention` calls the CUDA op of `kernel`
    (enter it before context_parallel, which wraps whatever F.scaled_dot_product_attention is then)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa_router(kernel)
    try:
        yield [1]
    finally:
        F.scaled_dot_product_attention = original


def sdpa_routing_shim(kernel: Kernel) -> Shim:
    return Shim(
        "CUDA SDPA routing",
        f"torch.nn.functional.scaled_dot_product_attention routed to aten.{CUDA_OPS[kernel]} (the op CUDA picks for {kernel})",
        "on CPU tensors SDPA picks the *_for_cpu ops, which context_parallel does not intercept",
        acted=1,
    )
