"""Tiny random-weight Llama 4: tiled vision tower, MoE + dense decoder with chunked and NoPE layers.

Small enough for tests, shaped like Scout/Maverick where it matters: three chunked RoPE layers with
QK-norm then a NoPE global layer (``no_rope_layer_interval`` 4), MoE layers interleaved with dense
ones (Maverick's ``interleave_moe_layer_step`` 2; Scout has MoE everywhere), top-1 sigmoid routing
plus a shared expert. ``attention_chunk_size`` 16 so prompts cross blocks, and ``floor_scale`` 8 so
the NoPE layers' query temperature changes inside a test prompt (real checkpoints: 8192).
Tiles are 84 px (6x6 patches of 14, 9 tokens after the pixel shuffle), up to 2x2 tiles.
"""

from __future__ import annotations

from pathlib import Path

BOS, EOT, PAD = "<|begin_of_text|>", "<|eot|>", "<|finetune_right_pad_id|>"
HEADER_START, HEADER_END = "<|header_start|>", "<|header_end|>"
IMAGE_START, IMAGE_END, IMAGE, PATCH = "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"
TILE_X, TILE_Y = "<|tile_x_separator|>", "<|tile_y_separator|>"
SPECIAL_TOKENS = (
    BOS,
    EOT,
    PAD,
    HEADER_START,
    HEADER_END,
    IMAGE_START,
    IMAGE_END,
    IMAGE,
    PATCH,
    TILE_X,
    TILE_Y,
)

# Llama 4's instruct layout (ref: transformers v5 models/llama4/processing_llama4.py, chat_template):
# each message is <|header_start|>role<|header_end|>\n\n content <|eot|>; an image part is one
# <|image|> that the processor expands into the tiles' <|patch|> runs.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot|>{% endfor %}"
    # Inside a Jinja string literal the escapes render newlines, as in the message headers above
    # (outside one they rendered a backslash and an n, which the next turn's prompt did not extend).
    "{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{% endif %}"
)

TILE = 84
PATCH_SIZE = 14
MAX_TILES = 4
VISION = dict(
    hidden_size=32,
    intermediate_size=128,  # fc1 of the pixel-shuffle MLP takes 4 x hidden (ratio 0.5)
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=PATCH_SIZE,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=64,
    projector_output_dim=64,
    vision_output_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=64,
    intermediate_size_mlp=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    max_position_embeddings=4096,
    attention_chunk_size=16,
    floor_scale=8,
    attn_scale=0.1,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    initializer_range=0.2,  # wide enough that an image row visibly moves the logits
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Llama 4 to ``out_dir``."""
    import torch
    from transformers import (
        Llama4Config,
        Llama4ForConditionalGeneration,
        Llama4ImageProcessor,
        Llama4Processor,
        Llama4TextConfig,
        Llama4VisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOT, pad_token=PAD
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    text = Llama4TextConfig(
        **TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOT],
        pad_token_id=ids[PAD],
    )
    config = Llama4Config(
        vision_config=Llama4VisionConfig(**VISION),
        text_config=text,
        image_token_index=ids[PATCH],  # the tiles' <|patch|> tokens take the rows, as in Scout
        boi_token_index=ids[IMAGE_START],
        eoi_token_index=ids[IMAGE_END],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = ids[EOT]
    model.generation_config.pad_token_id = ids[PAD]
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = Llama4Processor(
        image_processor=Llama4ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES),
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        pixel_shuffle_ratio=0.5,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
