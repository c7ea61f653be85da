"""Tiny random-weight Gemma 3 checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

from pathlib import Path

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
START_OF_IMAGE, END_OF_IMAGE, IMAGE_SOFT_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
SPECIAL_TOKENS = (PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, START_OF_IMAGE, END_OF_IMAGE, IMAGE_SOFT_TOKEN)

# Gemma's turn layout: <bos>, then "<start_of_turn>{user|model}\n ... <end_of_turn>\n" per message; a
# system message is folded into the first user turn; an image part is <start_of_image>, which the
# processor expands to "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = '' %}{% set turns = messages %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] %}"
    "{% set system = (first if first is string else first[0]['text']) ~ '\n\n' %}"
    "{% set turns = messages[1:] %}{% endif %}"
    "{% for message in turns %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if loop.first %}{{ system }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# 112 px / 14 px = 8x8 patches pooled 2x2 into 16 tokens per image, and a sliding window of 8 that
# is shorter than one image, so the sliding layer's window cuts the image's bidirectional block
# (the mask composition the real model uses with 1024-token windows over longer prompts).
IMAGE_SIDE = 112
MM_TOKENS_PER_IMAGE = 16
SLIDING_WINDOW = 8
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIDE,
    patch_size=14,
    vision_use_head=False,
)
# One sliding and one full-attention layer; linear RoPE scaling on the global layers and the local
# base frequency on sliding ones, as in gemma-3-4b-it.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    max_position_embeddings=4096,
    sliding_window=SLIDING_WINDOW,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)
# Spread of the random values given to parameters transformers initializes to zero.
ZERO_INIT_STD = 0.1


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, sliding_window: int = SLIDING_WINDOW) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Gemma 3 to ``out_dir``.

    ``sliding_window`` overrides the sliding layers' window (the ring-buffer tests use 16).
    """
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessor,
        Gemma3Processor,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_attributes={
            "image_token": IMAGE_SOFT_TOKEN,
            "boi_token": START_OF_IMAGE,
            "eoi_token": END_OF_IMAGE,
        },
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    stop_ids = [ids[EOS], ids[END_OF_TURN]]
    config = Gemma3Config(
        text_config=dict(
            TEXT,
            sliding_window=sliding_window,
            vocab_size=len(tokenizer),
            pad_token_id=ids[PAD],
            bos_token_id=ids[BOS],
            eos_token_id=stop_ids,
        ),
        vision_config=VISION,
        mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        image_token_index=ids[IMAGE_SOFT_TOKEN],
        boi_token_index=ids[START_OF_IMAGE],
        eoi_token_index=ids[END_OF_IMAGE],
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    # transformers zero-initializes the projector weight (and RMSNorm weights, biases): left so, every
    # image would embed to zeros and the tests could not see a wrong vision row. Give each
    # all-zero parameter small random values instead.
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():
                parameter.normal_(0.0, ZERO_INIT_STD)
    model.generation_config.bos_token_id = ids[BOS]
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = ids[PAD]
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor = Gemma3ImageProcessor(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
        resample=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pan_and_scan=False,
    )
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=MM_TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
