"""Tiny random-weight Gemma 4 checkpoints in the three layouts of the published models.

* ``e`` (E2B/E4B): per-layer embeddings (PLE), the last layers reading earlier layers' caches
  (``num_kv_shared_layers``), a double-wide MLP on those layers, causal image attention, and an
  audio tower (loaded and exported around, never run: audio input is refused).
* ``moe`` (26B-A4B): a router and experts beside the dense MLP, ``attention_k_eq_v`` full layers
  with their own KV-head count, ``use_bidirectional_attention == "vision"``.
* ``dense`` (31B): the 26B layout without experts.

Every layout has sliding layers (head_dim 16, window 8: decode runs far past it) and full layers
with a wider head (``global_head_dim`` 32) and partial proportional RoPE, as the real models.
"""

from __future__ import annotations

from pathlib import Path

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
IMAGE, BOI, EOI = "<|image|>", "<|image>", "<image|>"
AUDIO, BOA, EOA = "<|audio|>", "<|audio>", "<audio|>"
SPECIAL_TOKENS = (PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, IMAGE, BOI, EOI, AUDIO, BOA, EOA)

# A Gemma turn layout; an image part is the image token, which the processor expands to
# BOI + one IMAGE per soft token + EOI (ref: transformers v5.23 processing_gemma4.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

PATCH_SIZE = 4
POOLING = 3
# The smallest budget the processor accepts (70, 140, 280, 560, 1120): an image is at most 70 rows.
MAX_SOFT_TOKENS = 70
SLIDING_WINDOW = 8
SLIDING, FULL = "sliding_attention", "full_attention"
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=PATCH_SIZE,
    pooling_kernel_size=POOLING,
    position_embedding_size=64,
    # The published checkpoints' vision_config carries the image budget under this name (280 in
    # google/gemma-4-*-it, their processor's max_soft_tokens too); transformers' config class does
    # not declare it but keeps it, and vLLM 0.23 sizes image prompts from it.
    default_output_length=MAX_SOFT_TOKENS,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    max_position_embeddings=4096,
    sliding_window=SLIDING_WINDOW,
    final_logit_softcapping=30.0,
    rope_parameters={
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    },
)
LAYOUTS = {
    # Layers 3 (sliding) and 4 (full) compute no K/V: they read layers 2 and 1.
    "e": dict(
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
        num_hidden_layers=5,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        use_double_wide_mlp=True,
    ),
    "moe": dict(
        layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL],
        num_hidden_layers=5,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        use_bidirectional_attention="vision",
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "dense": dict(
        layer_types=[SLIDING, FULL, SLIDING, FULL],
        num_hidden_layers=4,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        use_bidirectional_attention="vision",
    ),
}
# A one-layer audio tower for the E layout (the E checkpoints carry one).
AUDIO_TOWER = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[8, 4],
    output_proj_dims=32,
    conv_kernel_size=3,
)
# Spread of the random values given to parameters transformers initializes to zero or one
# (norm weights, the position table, the router's scales): left so, a wrong row would not show.
INIT_STD = 0.1


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, layout: str = "e") -> Path:
    """Write config, safetensors, tokenizer and processor of a tiny Gemma 4 in ``layout`` to ``out_dir``."""
    import torch
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
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
            "image_token": IMAGE,
            "boi_token": BOI,
            "eoi_token": EOI,
            "audio_token": AUDIO,
            "boa_token": BOA,
            "eoa_token": EOA,
        },
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    stop_ids = [ids[EOS], ids[END_OF_TURN]]
    vocab = len(tokenizer) + 1  # the processor adds "<|video|>" to the tokenizer
    text = dict(
        TEXT,
        **LAYOUTS[layout],
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        pad_token_id=ids[PAD],
        bos_token_id=ids[BOS],
        eos_token_id=stop_ids,
    )
    vision = dict(VISION, standardize=layout != "e", use_clipped_linears=layout == "e")
    image_processor = Gemma4ImageProcessor(
        patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=POOLING
    )
    video_processor = Gemma4VideoProcessor(
        patch_size=PATCH_SIZE, max_soft_tokens=MAX_SOFT_TOKENS, pooling_kernel_size=POOLING
    )
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=MAX_SOFT_TOKENS,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=AUDIO_TOWER if layout == "e" else None,
        image_token_id=ids[IMAGE],
        boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI],
        video_token_id=processor.video_token_id,
        audio_token_id=ids[AUDIO],
        boa_token_id=ids[BOA],
        eoa_token_index=ids[EOA],
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    finish_random_weights(model)
    model.generation_config.bos_token_id = ids[BOS]
    model.generation_config.eos_token_id = stop_ids
    model.generation_config.pad_token_id = ids[PAD]
    model.save_pretrained(out_dir, safe_serialization=True)
    processor.save_pretrained(out_dir)
    return out_dir


def finish_random_weights(model) -> None:
    """What random Gemma 4 weights need to behave like trained ones (tiny and real-width checkpoints).

    Norm weights, position table and the tower's standardization get random values near their
    trained scale (left at 0 or 1 a wrong row would not show), and q_norm / k_norm carry the
    1 / sqrt(head_dim) that Gemma 4's attention (scaling 1.0) relies on.
    """
    import torch

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() <= 1 or not parameter.any() or name.endswith("position_embedding_table"):
                parameter.normal_(1.0 if parameter.dim() <= 1 else 0.0, INIT_STD)
        for name, buffer in model.named_buffers():
            if name.endswith(("std_bias", "std_scale")):
                buffer.normal_(1.0 if name.endswith("scale") else 0.0, INIT_STD)
            elif name.endswith("layer_scalar"):
                buffer.fill_(0.9)
        # Gemma 4 attends with scaling 1.0 after q_norm / k_norm: a trained checkpoint's norm
        # weights carry the 1 / sqrt(head_dim) other models apply. Unit-scale random ones would
        # make the scores' spread grow with head_dim and the tiny model fp16-fragile as no real
        # checkpoint is, so they get that scale (split between the two norms).
        for module in model.modules():
            if hasattr(module, "q_norm") and hasattr(module, "head_dim"):
                for norm in (module.q_norm, getattr(module, "k_norm", None)):
                    if norm is not None:
                        norm.weight.mul_(module.head_dim**-0.25)
