"""Tiny random-weight Qwen3.5-MoE checkpoint: Qwen3.5's tiny one with sparse MLPs and a shared expert."""

from __future__ import annotations

from pathlib import Path

from qeff_vision.families.qwen3_5.tiny import QWEN3_5_VISION, TEXT
from qeff_vision.families.qwen3_vl.tiny import write_checkpoint

# 4 experts, top 2, plus the gated shared expert, in every layer (the published 122B-A10B: 256
# experts, top 8). moe_intermediate_size 24 keeps 2 x 24 != hidden 64, so no expert axis is ambiguous.
MOE_TEXT = dict(
    {key: value for key, value in TEXT.items() if key != "intermediate_size"},
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Qwen3.5-MoE to ``out_dir``."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return write_checkpoint(
        out_dir, seed, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, MOE_TEXT, QWEN3_5_VISION
    )
