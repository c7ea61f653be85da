"""Tiny random-weight Mistral 3: Pixtral tower, patch merger, Mistral decoder, real Pixtral processor."""

from __future__ import annotations

from pathlib import Path

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
SPECIAL_TOKENS = (BOS, EOS, PAD, "[INST]", "[/INST]", IMG, IMG_BREAK, IMG_END)

# Mistral's instruct layout: user turns in [INST] ... [/INST], an image part is one [IMG] that the
# processor expands to rows of [IMG] ended by [IMG_BREAK] and a final [IMG_END].
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endif %}{% endfor %}"
)

PATCH = 14
LONGEST_EDGE = 168  # at most 6x6 tokens (12x12 patches) per image in tests
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=LONGEST_EDGE,
    patch_size=PATCH,
    hidden_act="silu",
    rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    sliding_window=None,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000000.0},
    initializer_range=0.2,  # wide enough that an image row visibly moves the logits
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Mistral 3 to ``out_dir``."""
    import torch
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessor,
        PixtralProcessor,
        PixtralVisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    text = MistralConfig(
        **TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
    )
    config = Mistral3Config(
        vision_config=PixtralVisionConfig(**VISION),
        text_config=text,
        image_token_index=ids[IMG],
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids[EOS]
    model.generation_config.pad_token_id = ids[PAD]
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": LONGEST_EDGE}, patch_size=PATCH),
        tokenizer=tokenizer,
        patch_size=PATCH,
        spatial_merge_size=2,
        chat_template=CHAT_TEMPLATE,
        image_token=IMG,
        image_break_token=IMG_BREAK,
        image_end_token=IMG_END,
    )
    processor.save_pretrained(out_dir)
    return out_dir
