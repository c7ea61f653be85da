"""Tiny random-weight Qwen3-VL-MoE checkpoint: Qwen3-VL's tiny one with a mixture-of-experts layer."""

from __future__ import annotations

from pathlib import Path

from qeff_vision.families.qwen3_vl.tiny import TEXT, write_checkpoint

# Layer 0 is sparse (4 experts, top 2), layer 1 a dense MLP (``mlp_only_layers``), so both kinds of
# feed-forward are exported; the published checkpoints have 128 experts, top 8, in every layer.
# moe_intermediate_size 24 keeps 2 * 24 != hidden 64, so the stored expert layout is unambiguous.
MOE_TEXT = dict(
    TEXT,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
    norm_topk_prob=True,
)
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Qwen3-VL-MoE to ``out_dir``.

    The expert tensors are stored as the published checkpoints store them, [experts, in, out]
    (transformers v5 keeps [experts, out, in] and swaps axes 1 and 2 on load, ref:
    transformers conversion_mapping.py, ``qwen3_vl_moe``), so the tiny checkpoint exercises that
    conversion wherever the real ones do.
    """
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    out_dir = write_checkpoint(out_dir, seed, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, MOE_TEXT)
    weights = out_dir / "model.safetensors"
    tensors = load_file(weights)
    for key in tensors:
        if key.endswith(EXPERT_TENSORS):
            tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    return out_dir
