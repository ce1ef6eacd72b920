"""PyTorch's own context parallelism (`torch.distributed.tensor.experimental.context_parallel`, as torchtitan
uses it): ring attention behind `F.scaled_dot_product_attention`.

Entry point (torch/distributed/tensor/experimental/_context_parallel/_attention.py): `context_parallel(mesh,
buffers=[...], buffer_seq_dims=[...], no_restore_buffers=...)` shards the buffers in place along the sequence
(with `_HeadTailLoadBalancer` when `_cp_options.enable_load_balance` is on and the length divides by 2·W,
contiguously otherwise) and, inside the block, turns SDPA on (B, H, S, D) shards into ring attention over
`mesh`; `set_rotate_method("allgather" | "alltoall")` chooses how K/V travel. Its ring refuses a non-causal
call while load balancing is on ("Load balancing requires `is_causal=True`."), so `enable_load_balance`
follows `causal` (what torchtitan configures). The kernel is the SDPA backend chosen with
`torch.nn.attention.sdpa_kernel`. It returns the output only (no LSE). Degrees: one ring (world = ring).
"""

from __future__ import annotations

from typing import Any

from cpdoctor.errors import Unsupported
from cpdoctor.peer_impls.base import Adapter, KernelSpec, PeerOutputs, PeerSpec, RunShape, VariantSpec, refused
from cpdoctor.peer_impls.layouts import Layout
from cpdoctor.vocabulary import HALF, DType, Impl
from cpdoctor.vocabulary import Kernel as K
from cpdoctor.vocabulary import Variant as V

SOURCE = "distributed/tensor/experimental/_context_parallel/_attention.py"

SPEC = PeerSpec(
    impl=Impl.TORCH,
    distribution="torch",
    module="torch",
    version="(the installed torch)",
    variants=(
        VariantSpec(
            V.ALLGATHER, Layout.HEAD_TAIL, exposes_lse=False, note="K/V all-gathered (torch's default rotate method)", source=SOURCE
        ),
        VariantSpec(V.ALLTOALL, Layout.HEAD_TAIL, exposes_lse=False, note="K/V passed round the ring", source=SOURCE),
    ),
    kernels=(
        KernelSpec(K.FLASH, HALF, "cpdoctor's aten flash stand-in", refuses_dtype="'FlashAttention only support fp16 and bf16 data type'"),
        KernelSpec(K.CUDNN, HALF, "cpdoctor's aten cuDNN stand-in", refuses_dtype="cuDNN attention takes fp16 and bf16 only"),
        KernelSpec(K.EFFICIENT, (DType.FP32, *HALF), "cpdoctor's aten efficient stand-in"),
    ),
    bundled=True,
    shards_itself=True,
)

SDPA_BACKENDS = {K.FLASH: "FLASH_ATTENTION", K.CUDNN: "CUDNN_ATTENTION", K.EFFICIENT: "EFFICIENT_ATTENTION"}


class TorchContextParallel(Adapter):
    spec = SPEC

    def layout(self, variant: VariantSpec, causal: bool, seq: int, world: int) -> Layout:
        """Head-tail when the load balancer is on (causal) and the length divides by 2·W (torch's
        `_create_default_load_balancer`), contiguous otherwise."""
        return Layout.HEAD_TAIL if causal and seq % (2 * world) == 0 else Layout.CONTIGUOUS

    def degree_refusal(self, variant: VariantSpec, causal: bool, ring: int, ulysses: int, seq: int, heads: int) -> Unsupported | None:
        if seq % ring:
            return refused(f"torch context_parallel shards the sequence evenly: --seq {seq} does not divide by {ring} ranks")
        return None

    def run(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, mesh: Any = None, extra: Any = None) -> PeerOutputs:
        """`q`..`dout` are the FULL (B, S, H, D) tensors: context_parallel shards them itself."""
        import contextlib

        import torch
        from torch.distributed.tensor.experimental import _attention as cp
        from torch.distributed.tensor.experimental import context_parallel
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from cpdoctor.peer_impls.shims import cuda_sdpa_routing, sdpa_routing_shim

        bufs = [t.transpose(1, 2).contiguous().clone() for t in (q, k, v, dout)]
        cp.set_rotate_method(shape.variant.value)
        old = cp._cp_options.enable_load_balance
        cp._cp_options.enable_load_balance = shape.causal
        on_cpu = bufs[0].device.type == "cpu"
        routing = cuda_sdpa_routing(shape.kernel) if on_cpu else contextlib.nullcontext()
        try:
            with routing, context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
                qs, ks, vs = (b.requires_grad_(True) for b in bufs[:3])
                with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[shape.kernel])):
                    out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=shape.causal, scale=shape.scale)
                out.backward(bufs[3])
        finally:
            cp._cp_options.enable_load_balance = old
        t = lambda x: x.detach().transpose(1, 2)  # noqa: E731
        shims = [sdpa_routing_shim(shape.kernel)] if on_cpu else []
        return PeerOutputs(t(out), t(qs.grad), t(ks.grad), t(vs.grad), None, shims=shims)

    def single_process(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, extra: Any = None) -> PeerOutputs:
        """The same SDPA op without CP."""
        import torch

        from cpdoctor.peer_impls.shims import cuda_sdpa_routing

        q, k, v = (t.transpose(1, 2).detach().clone().requires_grad_(True) for t in (q, k, v))
        with cuda_sdpa_routing(shape.kernel):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, scale=shape.scale)
        out.backward(dout.transpose(1, 2))
        t = lambda x: x.detach().transpose(1, 2)  # noqa: E731
        return PeerOutputs(t(out), t(q.grad), t(k.grad), t(v.grad))


ADAPTER = TorchContextParallel()
