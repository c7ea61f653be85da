"""Tiny random-weight InternVL 3: InternViT tower, pixel-shuffle projector, Qwen2 decoder, real processor."""

from __future__ import annotations

from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMG_START, IMG_END, IMG_CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT, VIDEO)

# InternVL3 -hf layout (ChatML; an image part is the context token and a newline, which the
# processor expands to <img> + tokens + </img>).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'video' %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# 112-pixel tiles of 14-pixel patches: 8x8 patches, pixel-shuffled to 4x4 = 16 tokens per tile.
TILE = 112
MAX_TILES = 4  # canvases of up to 4 tiles (+ thumbnail): 16..80 tokens per image
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=[TILE, TILE],
    patch_size=[14, 14],
    attention_bias=True,
    norm_type="layer_norm",
    use_mean_pooling=True,
    layer_scale_init_value=0.1,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    # Wider weights than the default 0.02 so an image row visibly moves the logits.
    initializer_range=0.2,
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny InternVL 3 to ``out_dir``."""
    import torch
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVideoProcessor,
        InternVLVisionConfig,
        Qwen2Config,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        extra_attributes={
            "context_image_token": IMG_CONTEXT,
            "start_image_token": IMG_START,
            "end_image_token": IMG_END,
            "video_token": VIDEO,
        },
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    text = Qwen2Config(
        **TEXT,
        vocab_size=len(tokenizer),
        bos_token_id=ids[END_OF_TEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[END_OF_TEXT],
        tie_word_embeddings=False,
    )
    per_tile = (TILE // 14 // 2) ** 2
    config = InternVLConfig(
        vision_config=InternVLVisionConfig(**VISION),
        text_config=text,
        image_token_id=ids[IMG_CONTEXT],
        image_seq_length=per_tile,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config).eval()
    # The default init leaves layer scales at 0.1 and the CLS token at zero: make them non-trivial.
    with torch.no_grad():
        model.model.vision_tower.embeddings.cls_token.normal_(std=0.5)
        model.model.vision_tower.embeddings.position_embeddings.normal_(std=0.5)
    model.generation_config.eos_token_id = ids[IM_END]
    model.generation_config.pad_token_id = ids[END_OF_TEXT]
    model.save_pretrained(out_dir, safe_serialization=True)
    size = {"height": TILE, "width": TILE}
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(
            size=size,
            crop_to_patches=True,
            min_patches=1,
            max_patches=MAX_TILES,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        ),
        video_processor=InternVLVideoProcessor(size=size),
        tokenizer=tokenizer,
        image_seq_length=per_tile,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
