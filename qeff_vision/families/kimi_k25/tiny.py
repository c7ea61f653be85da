"""Tiny random-weight Kimi-K2.5 checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

from pathlib import Path

# Kimi's chat and media markers (ids 163584.. in moonshotai/Kimi-K2.5's tokenizer); <|media_pad|>
# is the image placeholder the processor repeats once per merged patch.
SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
    "[PAD]",
)
IMAGE_TOKEN = "<|media_pad|>"
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"

# Kimi-K2.5's turn layout (role, <|im_middle|>, content, <|im_end|>) with each image wrapped in its
# media markers. Parts stay in order, so prompts can interleave images and text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|im_user|>user"
    "{% elif message['role'] == 'assistant' %}<|im_assistant|>assistant"
    "{% else %}<|im_system|>{{ message['role'] }}{% endif %}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# The DeepSeek-V3 structure of the published text model at toy widths: query and KV low-rank
# projections (MLA), interleaved YaRN rope with mscale, layer 0 dense and layer 1 routed MoE with a
# shared expert and grouped top-k routing (the published checkpoint: 61 layers, first one dense,
# 384 experts top 8, one group). kv_lora_rank + qk_rope_head_dim is the latent width per position.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
# MoonViT at toy width: 14-px patches, an 8x8 learned position grid resampled bicubically to each
# image's grid, axial 2-D rope, 2x2 patch merge into the projector (the published tower: 27 layers,
# 1,152 wide, a 64x64 grid).
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=14,
    pos_emb_height=8,
    pos_emb_width=8,
    pos_emb_time=4,
    merge_kernel_size=[2, 2],
)
# At most 16 patches per side (224 px) keeps tiny-test images small; the published processor
# allows 512 per side and 16,384 patches.
MAX_PATCHES_PER_SIDE = 16
MAX_PATCHES = 256


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Kimi-K2.5 to ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import (
        DeepseekV3Config,
        Kimi_K25Config,
        Kimi_K25ForConditionalGeneration,
        Kimi_K25ImageProcessor,
        Kimi_K25Processor,
        Kimi_K25VideoProcessor,
        Kimi_K25VisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="[PAD]",
        extra_attributes={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    config = Kimi_K25Config(
        text_config=DeepseekV3Config(
            **TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=ids["[BOS]"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["[PAD]"],
        ),
        vision_config=Kimi_K25VisionConfig(**VISION),
        projection_hidden_size=VISION["hidden_size"],
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    # Random router biases, so the correction term of DeepSeek-V3's routing is exercised (the
    # published checkpoint's are trained; transformers initialises them to zero).
    for layer in model.model.language_model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.1)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["[PAD]"]
    model.save_pretrained(out_dir, safe_serialization=True)
    # The weights in transformers' own layout (q/k/v projections apart, experts stacked): the
    # published layout's fused ``wqkv`` with its rope permutation is a load-time conversion
    # streaming export does not do (export/weight_sources.py), so the tiny checkpoint does not use it.
    state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    image_options = dict(
        size={"max_height": MAX_PATCHES_PER_SIDE, "max_width": MAX_PATCHES_PER_SIDE},
        max_patches=MAX_PATCHES,
        patch_size=VISION["patch_size"],
        merge_size=2,
    )
    processor = Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(**image_options),
        video_processor=Kimi_K25VideoProcessor(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
