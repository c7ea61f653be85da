"""Tiny random-weight Qwen3-VL checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

from pathlib import Path

from qeff_vision.families.qwen2_5_vl.tiny import SPECIAL_TOKENS

# Qwen's ChatML layout with the vision markers around each image or video placeholder (the
# processor expands a video into timestamped frames, each in its own markers).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Small enough for seconds-long exports; the structure (interpolated 8x8 position table, two
# deepstack layers feeding the first two decoder layers, QK-norm, GQA, interleaved M-RoPE) is
# that of the real model.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [4, 2, 2],
        "mrope_interleaved": True,
    },
)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
)
# Pixel bounds keep tiny-test images small; the published checkpoints use 256^2 .. 4096^2 pixels.
MIN_PIXELS = 4 * 32 * 32
MAX_PIXELS = 256 * 32 * 32


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Qwen3-VL to ``out_dir``."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return write_checkpoint(out_dir, seed, Qwen3VLConfig, Qwen3VLForConditionalGeneration, TEXT)


def write_checkpoint(
    out_dir: str | Path, seed: int, config_class, model_class, text: dict, vision: dict | None = None
) -> Path:
    """A tiny checkpoint of a Qwen3-VL architecture (dense or MoE, or Qwen3.5) with text config ``text``.

    ``vision`` replaces the Qwen3-VL vision config (Qwen3.5's has no deepstack layers).
    """
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_attributes={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    config = config_class(
        text_config=dict(
            text,
            vocab_size=len(tokenizer),
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=VISION if vision is None else vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    mean_std = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size=size, patch_size=16, merge_size=2, temporal_patch_size=2, **mean_std
        ),
        video_processor=Qwen3VLVideoProcessor(
            size=size, patch_size=16, merge_size=2, temporal_patch_size=2, **mean_std
        ),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
