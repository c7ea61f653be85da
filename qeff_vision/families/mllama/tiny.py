"""Tiny random-weight Llama 3.2 Vision (mllama): tiled tower, cross-attention decoder, real processor.

56 px tiles of 14 px patches (17 rows per tile with the class token), up to 4 tiles; a 4-layer
decoder whose layers 1 and 3 are cross-attention layers (Llama-3.2-11B-Vision has 8 of 40).
"""

from __future__ import annotations

from pathlib import Path

BOS, EOT, PAD, IMAGE = "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", "<|image|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = (BOS, EOT, PAD, HEADER_START, HEADER_END, "<|python_tag|>", IMAGE)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TILE = 56
VISION = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_global_layers=1,
    attention_heads=2,
    intermediate_size=64,
    image_size=TILE,
    patch_size=14,
    max_num_tiles=4,
    intermediate_layers_indices=[0, 1],
    vision_output_dim=96,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    cross_attention_layers=[1, 3],
    max_position_embeddings=4096,
    initializer_range=0.2,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def write_tiny_checkpoint(out_dir, seed=0):
    """Write config, safetensors, byte tokenizer (Llama 3 chat template) and processor to ``out_dir``."""
    import torch
    from transformers import (
        MllamaConfig,
        MllamaForConditionalGeneration,
        MllamaImageProcessor,
        MllamaProcessor,
        MllamaTextConfig,
        MllamaVisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        extra_attributes={"image_token": IMAGE},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    text = MllamaTextConfig(
        **TEXT, vocab_size=len(tokenizer), bos_token_id=ids[BOS], eos_token_id=ids[EOT], pad_token_id=ids[PAD]
    )
    config = MllamaConfig(
        vision_config=MllamaVisionConfig(**VISION), text_config=text, image_token_index=ids[IMAGE]
    )
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config).eval()
    finish_random_weights(model)
    model.generation_config.eos_token_id = ids[EOT]
    model.generation_config.pad_token_id = ids[PAD]
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = MllamaProcessor(
        image_processor=MllamaImageProcessor(size={"height": TILE, "width": TILE}, max_image_tiles=4),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir


def finish_random_weights(model) -> None:
    """Open every gate of a random mllama (tiny and real-width checkpoints).

    Every gate starts at zero (tanh(0) = 0 hides what it guards): open them so the cross layers
    and the tower's gated tile/position embeddings and global layers reach the logits.
    """
    import torch

    with torch.no_grad():
        for index in model.config.text_config.cross_attention_layers:
            layer = model.model.language_model.layers[index]
            layer.cross_attn_attn_gate.fill_(1.0)
            layer.cross_attn_mlp_gate.fill_(1.0)
        for name, parameter in model.model.vision_model.named_parameters():
            if name.endswith("gate") or name.endswith("gate_attn") or name.endswith("gate_ffn"):
                parameter.fill_(0.7)
