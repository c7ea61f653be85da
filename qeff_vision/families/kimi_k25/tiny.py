"""Tiny random-weight Kimi-K2.5 checkpoint: real config classes, tokenizer, processor and chat template."""

from __future__ import annotations

import re
from pathlib import Path

# Kimi's chat and media markers (ids 163584.. in moonshotai/Kimi-K2.5's tokenizer); <|media_pad|>
# is the image placeholder the processor repeats once per merged patch.
SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
    "[PAD]",
)
IMAGE_TOKEN = "<|media_pad|>"
VIDEO_TOKEN = "<|kimi_k25_video_placeholder|>"

# Kimi-K2.5's turn layout (role, <|im_middle|>, content, <|im_end|>) with each image wrapped in its
# media markers. Parts stay in order, so prompts can interleave images and text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|im_user|>user"
    "{% elif message['role'] == 'assistant' %}<|im_assistant|>assistant"
    "{% else %}<|im_system|>{{ message['role'] }}{% endif %}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)

# The DeepSeek-V3 structure of the published text model at toy widths: query and KV low-rank
# projections (MLA), interleaved YaRN rope with mscale, layer 0 dense and layer 1 routed MoE with a
# shared expert and grouped top-k routing (the published checkpoint: 61 layers, first one dense,
# 384 experts top 8, one group). kv_lora_rank + qk_rope_head_dim is the latent width per position.
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_interleave=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
# MoonViT at toy width: 14-px patches, an 8x8 learned position grid resampled bicubically to each
# image's grid, axial 2-D rope, 2x2 patch merge into the projector (the published tower: 27 layers,
# 1,152 wide, a 64x64 grid).
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    patch_size=14,
    pos_emb_height=8,
    pos_emb_width=8,
    pos_emb_time=4,
    merge_kernel_size=[2, 2],
)
# At most 16 patches per side (224 px) keeps tiny-test images small; the published processor
# allows 512 per side and 16,384 patches.
MAX_PATCHES_PER_SIDE = 16
MAX_PATCHES = 256

#: Weight layouts the writer knows: moonshotai/Kimi-K2.5's own (remote code: ``language_model.*``,
#: ``vision_tower.encoder.blocks.*`` with a fused ``wqkv`` in interleaved-rope row order,
#: per-expert tensors) and transformers' (what ``save_pretrained`` writes).
PUBLISHED = "published"
TRANSFORMERS = "transformers"
LAYOUTS = (PUBLISHED, TRANSFORMERS)

# transformers' parameter name -> the published checkpoint's, applied in order (the inverse of the
# renamings in transformers' conversion_mapping.py ``kimi_k25``; the published names are those of
# moonshotai/Kimi-K2.5's model.safetensors.index.json).
_PUBLISHED_NAMES = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.mm_projector\.in_proj\.", "mm_projector.proj.0."),
    (r"^model\.mm_projector\.out_proj\.", "mm_projector.proj.2."),
    (r"^model\.mm_projector\.", "mm_projector."),
    (
        r"^model\.vision_tower\.patch_embed\.pos_emb\.position_embeddings$",
        "vision_tower.patch_embed.pos_emb.weight",
    ),
    (r"^model\.vision_tower\.patch_embed\.", "vision_tower.patch_embed."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.blocks.\1.norm0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.blocks.\1.norm1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.", r"vision_tower.encoder.blocks.\1.mlp.fc0."),
    (r"^model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.", r"vision_tower.encoder.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.blocks.\1.wo."),
    (r"^model\.vision_tower\.layers\.", "vision_tower.encoder.blocks."),
    (r"^model\.vision_tower\.", "vision_tower.encoder."),
)
_QKV = re.compile(r"^model\.vision_tower\.layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def published_state(model) -> dict:
    """``model``'s weights in moonshotai/Kimi-K2.5's own layout (what transformers converts on load).

    Vision q/k/v are fused into ``wqkv`` with q and k rows back in interleaved rotary order (the
    inverse of ``PermuteForRope``); routed experts are one tensor per expert and projection
    (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, the inverse of qwen2_moe's merge).
    """
    import torch

    from qeff_vision.export.weight_sources import permute_for_rope

    heads = model.config.vision_config.num_attention_heads
    state, fused = {}, {}
    for name, tensor in model.state_dict().items():
        qkv = _QKV.match(name)
        if qkv:
            layer, part, kind = qkv.groups()
            piece = permute_for_rope(tensor, heads, inverse=True) if part in "qk" else tensor
            fused.setdefault((layer, kind), {})[part] = piece
            continue
        experts = _EXPERTS.match(name)
        if experts:
            prefix, kind = experts.groups()
            for number, expert in enumerate(tensor):
                if kind == "gate_up_proj":
                    gate, up = expert.chunk(2, dim=0)
                    state[_published_name(f"{prefix}.{number}.gate_proj.weight")] = gate
                    state[_published_name(f"{prefix}.{number}.up_proj.weight")] = up
                else:
                    state[_published_name(f"{prefix}.{number}.down_proj.weight")] = expert
            continue
        state[_published_name(name)] = tensor
    for (layer, kind), parts in fused.items():
        state[f"vision_tower.encoder.blocks.{layer}.wqkv.{kind}"] = torch.cat([parts[p] for p in "qkv"])
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _published_name(name: str) -> str:
    for pattern, replacement in _PUBLISHED_NAMES:
        renamed = re.sub(pattern, replacement, name)
        if renamed != name:
            return renamed
    return name


def finish_random_weights(model) -> None:
    """Random router biases, so the correction term of DeepSeek-V3's routing is exercised.

    The published checkpoint's are trained; transformers initialises them to zero.
    """
    import torch

    with torch.no_grad():
        for layer in model.model.language_model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape) * 0.1)


def save_weights(model, out_dir: Path, layout: str = PUBLISHED) -> None:
    """Write ``model.safetensors`` in ``layout`` (replacing what ``save_pretrained`` wrote)."""
    from safetensors.torch import save_file

    if layout == PUBLISHED:
        state = published_state(model)
    else:
        state = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    save_file(state, Path(out_dir) / "model.safetensors", metadata={"format": "pt"})


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, layout: str = PUBLISHED) -> Path:
    """Write config, safetensors weights, tokenizer and processor of a tiny Kimi-K2.5 to ``out_dir``.

    ``layout``: :data:`PUBLISHED` (the real checkpoint's tensor names and fused vision q/k/v,
    which export converts as transformers does) or :data:`TRANSFORMERS`.
    """
    import torch
    from transformers import (
        DeepseekV3Config,
        Kimi_K25Config,
        Kimi_K25ForConditionalGeneration,
        Kimi_K25ImageProcessor,
        Kimi_K25Processor,
        Kimi_K25VideoProcessor,
        Kimi_K25VisionConfig,
    )

    from qeff_vision.tiny import build_byte_tokenizer

    out_dir = Path(out_dir)
    tokenizer = build_byte_tokenizer(
        SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="[PAD]",
        extra_attributes={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    )
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    config = Kimi_K25Config(
        text_config=DeepseekV3Config(
            **TEXT,
            vocab_size=len(tokenizer),
            bos_token_id=ids["[BOS]"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["[PAD]"],
        ),
        vision_config=Kimi_K25VisionConfig(**VISION),
        projection_hidden_size=VISION["hidden_size"],
        image_token_id=ids[IMAGE_TOKEN],
        video_token_id=ids[VIDEO_TOKEN],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    finish_random_weights(model)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["[PAD]"]
    model.save_pretrained(out_dir, safe_serialization=True)
    save_weights(model, out_dir, layout)
    image_options = dict(
        size={"max_height": MAX_PATCHES_PER_SIDE, "max_width": MAX_PATCHES_PER_SIDE},
        max_patches=MAX_PATCHES,
        patch_size=VISION["patch_size"],
        merge_size=2,
    )
    processor = Kimi_K25Processor(
        image_processor=Kimi_K25ImageProcessor(**image_options),
        video_processor=Kimi_K25VideoProcessor(),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out_dir)
    return out_dir
