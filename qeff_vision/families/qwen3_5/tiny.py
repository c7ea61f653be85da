"""Tiny random-weight Qwen3.5 checkpoint: Qwen3-VL's tokenizer, processor and tower, a hybrid decoder."""

from __future__ import annotations

from pathlib import Path

from qeff_vision.families.qwen3_vl.tiny import VISION, write_checkpoint

# Four layers: linear, linear, full, linear, so a linear layer runs before the first full layer and
# after it (the published models repeat three linear layers and one full, ``full_attention_interval``
# 4). Twice as many value heads as key heads (Qwen3.5-27B: 16 key, 48 value heads), key and value
# head dims differ so no state axis is ambiguous; head_dim 32 with partial rotary 0.25 gives 4
# rotary frequencies for the interleaved M-RoPE sections [2, 1, 1].
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
QWEN3_5_VISION = {key: value for key, value in VISION.items() if key != "deepstack_visual_indexes"}


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Qwen3.5 to ``out_dir``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    return write_checkpoint(
        out_dir, seed, Qwen3_5Config, Qwen3_5ForConditionalGeneration, TEXT, QWEN3_5_VISION
    )
