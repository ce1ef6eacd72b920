"""yunchang (feifeibear/long-context-attention, pip `yunchang`): Ulysses × ring "USP", the attention core of
xDiT / xfuser.

Entry point (yunchang/hybrid/attn_layer.py, 0.6.4): `set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree,
rank, world_size, use_ulysses_low=True)` builds its process groups (Ulysses ranks adjacent, ring ranks
strided), then `LongContextAttention(ring_impl_type=..., attn_type=AttnType...)(q, k, v, causal=...)` on
(B, S_local, H, D) shards; it returns the output only (no LSE). Ring implementations: `RING_IMPL_DICT`
(yunchang/hybrid/utils.py: basic, zigzag, strip, basic_pytorch, ...), each with the token layout its
`EXTRACT_FUNC_DICT` entry gives (yunchang/comm/extract_local.py); block kernels: `AttnType`
(yunchang/kernels/__init__.py). The torch_* kernels have a forward only: their backward raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cpdoctor.errors import Unsupported
from cpdoctor.memo import Memo
from cpdoctor.peer_impls.base import Adapter, KernelSpec, PeerOutputs, PeerSpec, RunShape, VariantSpec, refused
from cpdoctor.peer_impls.layouts import Layout
from cpdoctor.peer_impls.source import SourceLine
from cpdoctor.vocabulary import HALF, DType, Impl
from cpdoctor.vocabulary import Kernel as K
from cpdoctor.vocabulary import Variant as V

MODULE = "yunchang"

_NO_TORCH_BACKWARD = SourceLine(
    MODULE, "kernels/attention.py", r'raise RuntimeError\("(Not implemented backward for PyTorch attention types)"\)'
)
_FA_REFUSES = "'FlashAttention only support fp16 and bf16 data type' (flash-attn's mha_fwd, csrc/flash_attn/flash_api.cpp)"

SPEC = PeerSpec(
    impl=Impl.YUNCHANG,
    distribution="yunchang",
    module=MODULE,
    version="0.6.4",
    variants=(
        VariantSpec(V.BASIC, Layout.CONTIGUOUS, exposes_lse=False, source="ring/ring_flash_attn.py"),
        VariantSpec(
            V.ZIGZAG,
            Layout.ZIGZAG,
            causal=(True,),
            exposes_lse=False,
            source="ring/zigzag_ring_flash_attn.py",
            refuses=SourceLine(MODULE, "ring/zigzag_ring_flash_attn.py", r'assert causal == True, "([^"]+)"'),
        ),
        VariantSpec(
            V.STRIP,
            Layout.STRIPE,
            causal=(True,),
            exposes_lse=False,
            source="ring/stripe_flash_attn.py",
            refuses=SourceLine(MODULE, "ring/stripe_flash_attn.py", r'assert \(\s*causal\s*\),\s*"([^"]+)"'),
        ),
        VariantSpec(
            V.BASIC_PYTORCH,
            Layout.CONTIGUOUS,
            exposes_lse=False,
            note="yunchang's ring over its PyTorch kernels",
            source="ring/ring_pytorch_attn.py",
            no_backward=_NO_TORCH_BACKWARD,  # its backward calls pytorch_attn_backward whatever the kernel
        ),
    ),
    kernels=(
        KernelSpec(
            K.FA,
            HALF,
            "cpdoctor's flash-attn 2 stand-in (cpdoctor/cpu_kernels/flash_attn_standin)",
            refuses_dtype=_FA_REFUSES,
            package="flash_attn",
        ),
        KernelSpec(K.TORCH_FLASH, HALF, "cpdoctor's aten flash stand-in", no_backward=_NO_TORCH_BACKWARD),
        KernelSpec(K.TORCH_EFFICIENT, (DType.FP32, *HALF), "cpdoctor's aten efficient stand-in", no_backward=_NO_TORCH_BACKWARD),
    ),
    has_ring=True,
    has_ulysses=True,
)


class YunchangGroups:
    """yunchang's (Ulysses, ring) process groups per (ring, ulysses), made once per world: its set_seq_parallel_pg
    makes new groups on every call (a collective every rank must join alike). Lifetime: one instance, `GROUPS`,
    created empty at this module's import; filled on a layout's first run; emptied when the default process
    group is no longer the one they were made in (a later job's new world), so no group of a destroyed world
    is handed to yunchang."""

    def __init__(self) -> None:
        self.world: Any = None
        """The default process group the kept groups belong to."""
        self.made: Memo[tuple[Any, Any]] = Memo("(ring, ulysses) -> yunchang's (Ulysses, ring) process groups")

    def get(self, world: Any, ring: int, ulysses: int, make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        if world is not self.world:
            self.made.clear()
            self.world = world
        return self.made.get((ring, ulysses), make)


GROUPS = YunchangGroups()


class Yunchang(Adapter):
    spec = SPEC

    def degree_refusal(self, variant: VariantSpec, causal: bool, ring: int, ulysses: int, seq: int, heads: int) -> Unsupported | None:
        if heads % ulysses:
            return refused(
                f"yunchang's Ulysses all-to-all splits the heads: --heads {heads} does not divide by --ulysses {ulysses} "
                "(yunchang/comm/all_to_all.py all_to_all_4D reshapes heads into (ulysses, heads/ulysses))"
            )
        step = 2 * ring * ulysses if variant.layout is Layout.ZIGZAG else ring * ulysses
        if seq % step:
            return refused(f"yunchang {variant.name} at ring {ring} × ulysses {ulysses} needs --seq divisible by {step}, got {seq}")
        return None

    def run(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, mesh: Any = None, extra: Any = None) -> PeerOutputs:
        import torch.distributed as dist
        from yunchang import LongContextAttention
        from yunchang.globals import PROCESS_GROUP, set_seq_parallel_pg
        from yunchang.kernels import AttnType

        from cpdoctor.peer_impls.shims import self_send_shim, self_sends_as_copies

        def make() -> tuple[Any, Any]:
            set_seq_parallel_pg(shape.ulysses, shape.ring, shape.rank, shape.world)
            return PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG

        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = GROUPS.get(dist.group.WORLD, shape.ring, shape.ulysses, make)
        attn = LongContextAttention(ring_impl_type=shape.variant.value, attn_type=AttnType.from_string(shape.kernel.value))
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with self_sends_as_copies() as copies:
            out = attn(q, k, v, softmax_scale=shape.scale, causal=shape.causal)
            out.backward(dout)
        shims = [self_send_shim(copies[0])] if copies[0] else []
        return PeerOutputs(out.detach(), q.grad, k.grad, v.grad, None, shims=shims)

    def single_process(self, shape: RunShape, q: Any, k: Any, v: Any, dout: Any, extra: Any = None) -> PeerOutputs:
        from flash_attn import flash_attn_func

        q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = flash_attn_func(q, k, v, softmax_scale=shape.scale, causal=shape.causal)
        out.backward(dout)
        return PeerOutputs(out.detach(), q.grad, k.grad, v.grad)


ADAPTER = Yunchang()
