"""Tiny random-weight GLM-4.1V checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

from pathlib import Path

# GLM-4.1V's vision markers (ref: transformers v5 models/glm4v/processing_glm4v.py: one ``<|image|>``
# id for image and video frames; ``<|begin_of_video|>`` / ``<|end_of_video|>`` decide the modality).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|video|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)

# GLM's chat layout: each image is its placeholder between the image markers.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif part['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Small enough for seconds-long exports; the structure (bicubic-resampled 4x4 position table,
# conv downsample + gated merger, sandwich-norm decoder, half-width interleaved M-RoPE) is that of
# the real model (partial_rotary_factor 0.5: GLM-4.1V rotates half of each head).
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=14,
    image_size=56,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
# Pixel bounds keep tiny-test images small (the processor counts 2 frames for an image); the
# published processor uses 112^2 .. 28^2 * 15000 (Glm4vImageProcessor's class defaults).
MIN_PIXELS = 2 * 4 * 28 * 28
MAX_PIXELS = 2 * 256 * 28 * 28


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny GLM-4.1V to ``out_dir``."""
    import torch
    from transformers import (
        Glm4vConfig,
        Glm4vForConditionalGeneration,
        Glm4vImageProcessor,
        Glm4vProcessor,
        Glm4vVideoProcessor,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|user|>",
        pad_token="<|endoftext|>",
        extra_attributes={"image_token": "<|image|>", "video_token": "<|video|>"},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    config = Glm4vConfig(
        text_config=dict(
            TEXT,
            vocab_size=len(tokenizer),
            eos_token_id=ids["<|user|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=VISION,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Glm4vForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids["<|user|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    common = dict(size=size, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Glm4vProcessor(
        image_processor=Glm4vImageProcessor(**common),
        video_processor=Glm4vVideoProcessor(**common),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
