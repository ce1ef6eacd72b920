"""What compat reads in diffusers' ring source, tested on the lines of the two releases CI installs (quoted
from diffusers/models/attention_dispatch.py, TemplatedRingAttention), and on the fixed form."""

from __future__ import annotations

from cpdoctor.compat.diffusers import gathers_mask, passes_rotated_tensors, sends_dkv_to_next

RING_0_39_BACKWARD = """
        next_ranks = list(range(1, world_size)) + [0]
        for i in range(world_size):
            grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(ctx, grad_out)
            if i > 0:
                next_grad_kv = funcol.permute_tensor(grad_kv_buffer, next_ranks, group=ring_mesh.get_group())
"""
RING_0_42_BACKWARD = """
        next_ranks = list(range(1, world_size)) + [0]
        for i in range(world_size):
            grad_query_op, grad_key_op, grad_value_op, *_ = ctx.backward_op(
                ctx, grad_out, query=query, key=key, value=value, out=out, lse=lse
            )
                next_grad_kv = funcol.permute_tensor(grad_kv_buffer, next_ranks, group=ring_mesh.get_group())
"""
FIXED_BACKWARD = """
        prev_ranks = [world_size - 1] + list(range(world_size - 1))
        grads = ctx.backward_op(ctx, grad_out, query=query, key=key, value=value, out=out, lse=lse)
        acc = funcol.permute_tensor(acc, prev_ranks, group)
"""
RING_FORWARD_LOCAL_MASK = """
        kv_buffer = funcol.all_gather_tensor(kv_buffer, gather_dim=0, group=ring_mesh.get_group())
        out, lse = forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True)
"""
RING_FORWARD_GATHERED_MASK = """
        kv_buffer = funcol.all_gather_tensor(kv_buffer, gather_dim=0, group=group)
        masks = funcol.all_gather_tensor(attn_mask.contiguous(), gather_dim=0, group=group)
"""


def test_stale_kv_is_the_backward_without_the_rotated_chunk():
    assert passes_rotated_tensors(RING_0_39_BACKWARD) is False
    assert passes_rotated_tensors(RING_0_42_BACKWARD) is True


def test_dkv_direction():
    assert sends_dkv_to_next(RING_0_39_BACKWARD) and sends_dkv_to_next(RING_0_42_BACKWARD)
    assert not sends_dkv_to_next(FIXED_BACKWARD)


def test_mask_gathering():
    assert not gathers_mask(RING_FORWARD_LOCAL_MASK)
    assert gathers_mask(RING_FORWARD_GATHERED_MASK)
