"""Tiny random-weight Molmo2: SigLIP-style ViT, pooling adapter, Qwen3-style decoder, real processor.

The layout follows allenai/Molmo2-4B (specs/configs/Molmo2-4B): the image special tokens sit in the
additional vocabulary after ``vocab_size`` (the embedding covers both, ``lm_head`` only the base
vocabulary, so they are never generated), and the chat template puts every image of the
conversation before the first message (``Image 1<|image|>Image 2<|image|>`` for several).
"""

from __future__ import annotations

from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
#: The base vocabulary's specials (Qwen's), then the additional vocabulary's image tokens in
#: Molmo2-4B's order (image_start 151936, image_end, patch, col, low_res_start, ..., frame_end).
BASE_SPECIALS = (END_OF_TEXT, IM_START, IM_END)
IMAGE_SPECIALS = (
    "<im_start>",
    "<im_end>",
    "<im_patch>",
    "<im_col>",
    "<low_res_im_start>",
    "<|image|>",
    "<im_low>",
    "<frame_start>",
    "<frame_end>",
    "<|video|>",
)

# Molmo2's layout written for a byte tokenizer: images first (numbered when there are several),
# then the video, then the turns; a user turn after the first closes the assistant's with <|im_end|>.
CHAT_TEMPLATE = (
    "{% set count = namespace(images=0, videos=0) %}"
    "{% for message in messages %}{% if message['content'] is not string %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{% set count.images = count.images + 1 %}{% elif part['type'] == 'video' %}"
    "{% set count.videos = count.videos + 1 %}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if count.images == 1 %}<|image|>{% elif count.images > 1 %}"
    "{% for i in range(count.images) %}Image {{ i + 1 }}<|image|>{% endfor %}{% endif %}"
    "{% for i in range(count.videos) %}<|video|>{% endfor %}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set joined = namespace(text='') %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{% set joined.text = joined.text ~ ('' if not joined.text else ' ') "
    "~ part['text'] %}{% endif %}{% endfor %}{% set text = joined.text %}{% endif %}"
    "{% if message['role'] == 'user' %}{% if not loop.first %}<|im_end|>\n{% endif %}"
    "<|im_start|>user\n{{ text }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ text }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# 56 px crops of 14 px patches (4x4 patches), 1-patch overlap margins, up to 4 crops: a low-res
# view of 2x2 pooled tokens and a high-res canvas of up to 4 windows of 2 patches (plus margins).
CROP = 56
MAX_CROPS = 4
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    image_size=[CROP, CROP],
    patch_size=14,
)
# Two ViT layers concatenated, as the real [-3, -9] (stored after conversion as [24, 18]).
ADAPTER = dict(
    vision_feature_layer=[2, 0],
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    text_hidden_size=64,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    qk_norm_type="qwen3",
    # Wider weights than the default 0.02 so an image row visibly moves the logits.
    initializer_range=0.2,
)


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Molmo2 to ``out_dir``."""
    import torch
    from transformers import (
        Molmo2AdapterConfig,
        Molmo2Config,
        Molmo2ForConditionalGeneration,
        Molmo2ImageProcessor,
        Molmo2Processor,
        Molmo2TextConfig,
        Molmo2VideoProcessor,
        Molmo2VisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        BASE_SPECIALS + IMAGE_SPECIALS,
        chat_template=CHAT_TEMPLATE,
        bos_token=END_OF_TEXT,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        extra_attributes={"image_token": "<|image|>", "video_token": "<|video|>"},
    )
    ids = dict(zip(IMAGE_SPECIALS, tokenizer.convert_tokens_to_ids(list(IMAGE_SPECIALS))))
    base_vocab = len(tokenizer) - len(IMAGE_SPECIALS)
    text = Molmo2TextConfig(
        **TEXT,
        vocab_size=base_vocab,
        additional_vocab_size=len(IMAGE_SPECIALS),
        bos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
    )
    config = Molmo2Config(
        vision_config=Molmo2VisionConfig(**VISION),
        adapter_config=Molmo2AdapterConfig(**ADAPTER),
        text_config=text,
        image_start_token_id=ids["<im_start>"],
        low_res_image_start_token_id=ids["<low_res_im_start>"],
        image_end_token_id=ids["<im_end>"],
        image_patch_id=ids["<im_patch>"],
        frame_start_token_id=ids["<frame_start>"],
        frame_end_token_id=ids["<frame_end>"],
        tie_word_embeddings=False,
    )
    # The published config.json also names the column and low-res tokens (Molmo2Config keeps them as
    # extra fields); the family reads every image token id from there.
    config.image_col_id = ids["<im_col>"]
    config.image_low_res_id = ids["<im_low>"]
    torch.manual_seed(seed)
    model = Molmo2ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the default init leaves the position table near zero
        model.model.vision_tower.positional_embedding.normal_(std=0.5)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(IM_END)
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    model.save_pretrained(out_dir, safe_serialization=True)
    size = {"height": CROP, "width": CROP}
    processor = Molmo2Processor(
        image_processor=Molmo2ImageProcessor(
            size=size, max_crops=MAX_CROPS, overlap_margins=[1, 1], patch_size=14, pooling_size=[2, 2]
        ),
        # Frames at the crop size, pooled 3x3 as the published video processor (4x4 patches -> 2x2 tokens).
        video_processor=Molmo2VideoProcessor(
            size=size,
            patch_size=14,
            pooling_size=[3, 3],
            do_rescale=True,
            do_normalize=True,
            image_mean=[0.5] * 3,
            image_std=[0.5] * 3,
        ),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
