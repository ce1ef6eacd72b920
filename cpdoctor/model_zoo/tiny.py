"""Tiny configs of the model families: the same architecture (the real diffusers class, its real blocks and
CP plan) small enough that one forward + backward takes milliseconds on a CPU. Weights are random, seeded
identically on every rank. `cpdoctor model flux` examines one; tests and examples train them."""

from __future__ import annotations

from typing import Any

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "flux": dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    ),
    "qwen-image": dict(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    ),
    "wan": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        rope_max_seq_len=32,
    ),
}
"""Family short name -> a config of the same architecture small enough that one fwd+bwd takes milliseconds on
a CPU. Weights are random, seeded identically on every rank."""
