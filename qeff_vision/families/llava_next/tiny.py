"""Tiny random-weight Granite-Vision-style LLaVA-NeXT: SigLIP tower, Granite decoder, real processor."""

from __future__ import annotations

from pathlib import Path

END_OF_TEXT = "<|end_of_text|>"
IMAGE = "<image>"
SPECIAL_TOKENS = (END_OF_TEXT, "<|system|>", "<|user|>", "<|assistant|>", IMAGE)
SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# Granite Vision's layout: role tags on their own line, "<image>\n" before the text of a turn.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>\n" + SYSTEM_PROMPT + "\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% if message['role'] == 'assistant' %}<|end_of_text|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# 56-pixel tiles of 14-pixel patches: 4x4 features per tile. The pinpoints are Granite's
# pattern (1..3 tiles a side, one side at most 1 tile beyond 2x2) scaled to that tile size.
TILE = 56
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112], [56, 168], [168, 56]]
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=14,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
# Granite's muP multipliers, with non-trivial values so parity exercises every one of them.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0625,
    logits_scaling=8.0,
    rope_parameters={"rope_type": "default", "rope_theta": 300000.0},
    # Wide weights and an untied head: with 0.02 and tied embeddings the residual stream (scaled by
    # 0.22 against 12x embeddings) barely moves, every prompt greedily repeats its last token and an
    # image changes the logits by ~1e-3, too little for parity tests to see a wrong image row.
    initializer_range=0.3,
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny LLaVA-NeXT to ``out_dir``."""
    import torch
    from transformers import (
        GraniteConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        SiglipVisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        extra_attributes={"image_token": IMAGE},
    )
    end_of_text, image_token = tokenizer.convert_tokens_to_ids([END_OF_TEXT, IMAGE])
    text = GraniteConfig(
        **TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        pad_token_id=end_of_text,
        tie_word_embeddings=False,
    )
    config = LlavaNextConfig(
        vision_config=SiglipVisionConfig(**VISION),
        text_config=text,
        image_token_index=image_token,
        vision_feature_select_strategy="full",  # SigLIP has no CLS token to drop
        vision_feature_layer=[-2, -1],  # several layers, concatenated, as in Granite Vision
        image_grid_pinpoints=PINPOINTS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = end_of_text
    model.generation_config.pad_token_id = end_of_text
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = LlavaNextImageProcessor(
        size={"height": TILE, "width": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=PINPOINTS,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE,
        image_token=IMAGE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
