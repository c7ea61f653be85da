"""What a Kimi-K2.5 checkpoint needs to compile, counted from its config (torch-free).

Parameters are counted per module as transformers builds them (ref: transformers v5.23
models/deepseek_v3/modeling_deepseek_v3.py and models/kimi_k25/modeling_kimi_k25.py). On the device
the compiler's ``-mxfp6-matmul`` stores every matmul weight as MXFP6 (6-bit elements with one
8-bit scale per 32: 6.25 bits a weight); gathered tables (token embeddings, position grids) and
norms stay fp16. The device count is a lower bound for the weights alone, before KV, activations
and the compiler's own reserve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qeff_vision.families.config_view import ConfigReader

#: Bits per matmul weight under MXFP6 (6-bit elements, an 8-bit scale per block of 32).
MXFP6_BITS = 6 + 8 / 32
FP16_BYTES = 2
#: DRAM of one Cloud AI 100 device: an AI 100 Ultra card is four devices with 128 GB in all.
DEVICE_BYTES = 32 * 10**9
DEVICES_PER_CARD = 4
LONG_CONTEXT = 128 * 1024

# Kimi_K25VisionConfig's defaults (the published tower's values: its config.json spells them
# ``vt_*``, which transformers' native config does not read).
VISION_SOURCE = "Kimi_K25VisionConfig default"
DEEPSEEK_DEFAULTS = "DeepseekV3Config default"
VISION_DEFAULTS = dict(
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    patch_size=14,
    pos_emb_height=64,
    pos_emb_width=64,
)


@dataclass(frozen=True)
class Sizing:
    """Parameter counts of a checkpoint.

    Attributes:
        matmul: Parameters of matmul weights (compressed by MXFP6).
        other: Gathered tables, norms, biases and router biases (kept fp16).
        active: Parameters one token reads (top-k plus shared experts in each MoE layer).
    """

    matmul: int
    other: int
    active: int

    @property
    def total(self) -> int:
        """Every parameter."""
        return self.matmul + self.other

    @property
    def device_bytes(self) -> int:
        """Weight bytes on the device with MXFP6 matmuls and fp16 for the rest."""
        return math.ceil(self.matmul * MXFP6_BITS / 8) + self.other * FP16_BYTES


def count_parameters(config: Mapping[str, Any], source: str = "<memory>") -> Sizing:
    """Parameters of a Kimi-K2.5 ``config.json`` (DeepSeek-V3 text model, MoonViT, projector)."""
    reader = ConfigReader(source)
    text = reader.section(config).sub("text_config")
    hidden, vocab, heads = (
        text.required(key) for key in ("hidden_size", "vocab_size", "num_attention_heads")
    )
    q_rank, kv_rank = text.optional("q_lora_rank", int), text.required("kv_lora_rank")
    nope, rope, value = (text.required(key) for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    query = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
    attention = query + hidden * (kv_rank + rope) + kv_rank * heads * (nope + value) + heads * value * hidden
    norms = 2 * hidden + kv_rank + (q_rank or 0)
    layers = text.required("num_hidden_layers")
    dense_layers = text.default("first_k_dense_replace", 0, int, DEEPSEEK_DEFAULTS)
    experts, expert = text.required("n_routed_experts"), 3 * hidden * text.required("moe_intermediate_size")
    shared = text.default("n_shared_experts", 0, int, DEEPSEEK_DEFAULTS) * expert
    sparse, dense_mlp = layers - dense_layers, 3 * hidden * text.required("intermediate_size")
    routed = sparse * (experts * expert + shared + experts * hidden)  # experts, shared, router
    matmul = layers * attention + dense_layers * dense_mlp + routed + vocab * hidden  # + lm_head (untied)
    other = (
        layers * norms + sparse * experts + hidden + vocab * hidden
    )  # router biases, final norm, embeddings
    active = layers * attention + dense_layers * dense_mlp + vocab * hidden
    active += sparse * (text.required("num_experts_per_tok") * expert + shared)
    vision = reader.section(config).sub("vision_config")
    tower = {key: vision.default(key, value, int, VISION_SOURCE) for key, value in VISION_DEFAULTS.items()}
    width, inner = tower["hidden_size"], tower["intermediate_size"]
    merged = 4 * width  # a 2x2 merge kernel: the projector's input width
    matmul += tower["num_hidden_layers"] * (4 * width * width + 2 * width * inner)
    matmul += 3 * tower["patch_size"] ** 2 * width + merged * merged + merged * hidden
    other += tower["num_hidden_layers"] * (9 * width + inner)  # biases and layer norms
    other += tower["pos_emb_height"] * tower["pos_emb_width"] * width
    # patch-embedding bias, final and projector layer norms, projector biases
    other += width + 2 * width + 2 * width + merged + hidden
    return Sizing(matmul, other, active)


def sizing_note(config: Mapping[str, Any], latent_width: int, source: str = "<memory>") -> str:
    """One line: parameters, MXFP6 bytes, the fewest devices, latent KV bytes per position and at 128k."""
    sizing = count_parameters(config, source)
    weights = sizing.device_bytes
    devices = math.ceil(weights / DEVICE_BYTES)
    layers = ConfigReader(source).section(config).sub("text_config").required("num_hidden_layers")
    per_position = layers * latent_width * FP16_BYTES
    return (
        f"compile sizing: {sizing.total / 1e12:.2f}T parameters ({sizing.active / 1e9:.1f}B active per "
        f"token); with -mxfp6-matmul the weights take {weights / 1e9:.0f} GB, so at least {devices} "
        f"devices of {DEVICE_BYTES // 10**9} GB ({math.ceil(devices / DEVICES_PER_CARD)} AI 100 Ultra "
        f"cards) before KV; the MLA latent cache is {per_position / 1000:.1f} KB per position in fp16 "
        f"({per_position * LONG_CONTEXT / 1e9:.1f} GB per 128k-token sequence)"
    )
