"""Tiny random-weight LLaVA-1.5 checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

from pathlib import Path

# Llama's specials, then LLaVA's additions (ids 32000/32001 in llava-hf/llava-1.5-7b-hf).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<image>", "<pad>")
IMAGE_TOKEN = "<image>"

# LLaVA-1.5's "USER: <image>\n... ASSISTANT:" layout. Unlike llava-hf's template (which renders a
# turn's images before its text) the parts stay in order, so prompts can interleave images and text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] + ' ' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# 56 px / 14 px patches = 16 image tokens: small prompts, yet a CLS token to drop and three
# layers so vision_feature_layer -2 skips the last one, as in the real 24-layer tower.
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=56,
    patch_size=14,
    projection_dim=32,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny LLaVA-1.5 to ``out_dir``."""
    import torch
    from tokenizers import processors
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_attributes={"image_token": IMAGE_TOKEN},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    # Llama's tokenizer starts every sequence with <s>.
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])]
    )
    image_size, patch_size = VISION["image_size"], VISION["patch_size"]
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=LlamaConfig(
            **TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<pad>"],
        ),
        image_token_index=ids[IMAGE_TOKEN],
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.bos_token_id = ids["<s>"]
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out_dir, safe_serialization=True)
    # llava-hf's processor: shortest edge to image_size, center crop, CLIP normalization; the
    # processor expands each <image> into patches + 1 (CLS) - 1 (dropped by "default") tokens.
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
