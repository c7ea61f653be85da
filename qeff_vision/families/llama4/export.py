"""Llama 4 export: complex RoPE rewritten as real cos/sin, temperature from positions, tiles per call.

transformers applies RoPE as complex multiplication (``torch.polar``, ``view_as_complex``) in the
text model and the vision tower (ref: transformers v5.23 models/llama4/modeling_llama4.py,
``Llama4TextRotaryEmbedding``, ``apply_rotary_emb``, ``Llama4VisionRotaryEmbedding``,
``vision_apply_rotary_emb``), which the ONNX exporter cannot trace. Each (even, odd) pair of a head
is one complex number ``a + bi``; times ``cos + i sin`` it is ``(a cos - b sin) + i (a sin + b cos)``:
:func:`rotate_pairs` computes that in float32 on real tensors, the same products transformers'
complex multiply forms.

The NoPE layers scale queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``;
transformers takes ``p`` from the cache length (``past_key_values.get_seq_length``), which a
chunked prefill with padding or a device cache cannot give: here ``p`` is the token's position id
(``Llama4TextAttention.forward``, "temperature tuning").

Our modules reuse transformers' layers and weights without changing the model, so the reference
stays transformers' own. The MoE block (:func:`routed_moe`) keeps transformers' router (sigmoid of
the top-k logits, zero elsewhere) and shared expert, but reads min(tokens x top_k, experts) expert
slices (:mod:`qeff_vision.export.experts`): the routed ones at a decode step, every expert once in a
prefill chunk. transformers runs every expert on every token (``Llama4TextMoe.forward``), and so
does QEfficient's ``QEffLlama4TextMoe``: a Maverick decode step would read 128 experts for one.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.attention import grouped_attention
from qeff_vision.export.decoder import DecoderParts
from qeff_vision.export.experts import expert_slices, routed_sum, slice_weights
from qeff_vision.export.rms_norm import CustomRMSNormFunction
from qeff_vision.export.rotary_tables import angle_cos_sin
from qeff_vision.families.base import ModelDescription
from qeff_vision.families.llama4.host import ASPECT_RATIOS


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., D] read as D/2 complex pairs, times ``cos + i sin`` [..., D/2] (broadcast), in float32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def qk_norm(norm: nn.Module, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's L2 QK-norm (``Llama4TextL2Norm``: an RMSNorm without weight) as one ``CustomRMSNorm``.

    Queries and keys [batch, seq, heads, head_dim] are normalized per head row, so both go through
    one call on their concatenation: the compiler's own kernel (fp32 inside) instead of a decomposed
    ``x ** 2`` that fp16 overflows, one call per norm module as for every other RMSNorm.
    """
    heads = query.shape[2]
    joined = torch.cat([query, key.to(query.dtype)], dim=2)
    ones = torch.ones(joined.shape[-1], dtype=joined.dtype)
    normed = CustomRMSNormFunction.apply(joined, ones, float(norm.eps))
    return normed[:, :, :heads], normed[:, :, heads:].to(key.dtype)


def routed_moe(moe: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``Llama4TextMoe`` on ``hidden`` [..., H] reading only min(tokens x top_k, experts) expert slices.

    The router is transformers' (``Llama4Router.forward``): top-k of the logits, sigmoid in float32
    of those, ``sigmoid(-inf) = 0`` elsewhere; each routed input is scaled by its score before the
    expert (``routed_in = hidden * score``), the shared expert's output added to the experts' sum.
    The expert weights are stored [E, in, out] (``bmm`` layout).
    """
    flat = hidden.reshape(-1, moe.hidden_dim)
    router, experts = moe.router, moe.experts
    logits = nn.Linear.forward(router, flat)  # the router is an nn.Linear; its own forward also scores
    top_value, top_index = torch.topk(logits, router.top_k, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
    scores = torch.sigmoid(scores.float()).to(scores.dtype)
    ids, owners = expert_slices(top_index, experts.num_experts)
    weights = slice_weights(scores, ids, owners)
    routed = routed_sum(
        flat,
        experts.gate_up_proj,
        experts.down_proj,
        experts.act_fn,
        ids,
        weights,
        top_k=router.top_k,
        scale_inputs=True,
        stored_out_in=False,
    )
    return moe.shared_expert(flat) + routed


class TextModel(nn.Module):
    """transformers' ``Llama4TextModel`` layers over our cache, with real RoPE and positional temperature."""

    def __init__(self, text_model: nn.Module):
        super().__init__()
        self.inner = text_model
        self.config = text_model.config  # the exporter selects its attention on this config

    def forward(self, inputs_embeds, attention_mask, position_ids, past_key_values, use_cache=True, **kwargs):
        """Run every decoder layer on ``inputs_embeds``; ``attention_mask`` is ``{layer_type: mask}``."""
        inner, config = self.inner, self.config
        rotary = inner.rotary_emb
        cos, sin = (part.unsqueeze(2) for part in angle_cos_sin(rotary, position_ids))  # [b, s, 1, D/2]
        floor = torch.floor((position_ids.float() + 1.0) / config.floor_scale)
        temperature = (torch.log1p(floor) * config.attn_scale + 1.0)[..., None, None]  # [batch, seq, 1, 1]
        hidden = inputs_embeds
        for index, layer in enumerate(inner.layers[: config.num_hidden_layers]):
            residual = hidden
            attended = self._attention(
                layer.self_attn,
                layer.input_layernorm(hidden),
                cos,
                sin,
                temperature,
                attention_mask[config.layer_types[index]],
                past_key_values,
            )
            hidden = residual + attended
            residual = hidden
            normed = layer.post_attention_layernorm(hidden)
            fed = routed_moe(layer.feed_forward, normed) if layer.is_moe_layer else layer.feed_forward(normed)
            hidden = residual + fed.view(residual.shape)
        return SimpleNamespace(last_hidden_state=inner.norm(hidden))

    def _attention(self, attn, hidden, cos, sin, temperature, mask, cache):
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        query = attn.q_proj(hidden).view(shape)
        key = attn.k_proj(hidden).view(shape)
        value = attn.v_proj(hidden).view(shape).transpose(1, 2)
        if attn.use_rope:
            query, key = rotate_pairs(query, cos, sin), rotate_pairs(key, cos, sin)
        if hasattr(attn, "qk_norm"):  # L2 norm of RoPE layers (use_qk_norm)
            query, key = qk_norm(attn.qk_norm, query, key)
        if attn.attn_temperature_tuning and not attn.use_rope:
            query = (query * temperature).to(query.dtype)
        key, value = cache.update(key.transpose(1, 2), value, attn.layer_idx)
        output, _ = grouped_attention(attn, query.transpose(1, 2), key, value, mask, scaling=attn.scaling)
        return attn.o_proj(output.reshape(*hidden.shape[:-1], -1))


class VisionEncoder(nn.Module):
    """pixel_values [tiles, 3, tile, tile] of one image -> vision_embeds [1, tiles * tokens, text hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tower = model.vision_model
        self.projector = model.multi_modal_projector
        freqs = self.tower.rotary_embedding.freqs_ci  # complex [patches + 1, 1, D/2]
        # Broadcast over [tiles, patches + 1, heads, D/2] as ``reshape_for_broadcast`` does.
        shape = (1, freqs.shape[0], 1, freqs.shape[-1])
        self.register_buffer("cos", freqs.real.reshape(shape).float().clone(), persistent=False)
        self.register_buffer("sin", freqs.imag.reshape(shape).float().clone(), persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode one image's tiles (global tile last) into its rows in prompt order."""
        tower = self.tower
        tiles, channels, height, width = pixel_values.shape
        patch = tower.patch_size
        # Unfold as a reshape: features ordered (channel, row in patch, column in patch), patches row-major.
        grid = pixel_values.reshape(tiles, channels, height // patch, patch, width // patch, patch)
        grid = grid.permute(0, 2, 4, 1, 3, 5).reshape(tiles, (height // patch) * (width // patch), -1)
        hidden = tower.patch_embedding.linear(grid)
        cls = tower.class_embedding.expand(tiles, 1, hidden.shape[-1])
        hidden = torch.cat([hidden, cls], dim=1) + tower.positional_embedding_vlm.to(hidden.dtype)
        hidden = tower.layernorm_pre(hidden)
        for layer in tower.model.layers:
            residual = hidden
            hidden = residual + self._attention(layer.self_attn, layer.input_layernorm(hidden))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = tower.layernorm_post(hidden)[:, :-1, :]
        features = tower.vision_adapter(hidden)  # pixel shuffle + MLP: [tiles, tokens, vision_output_dim]
        return self.projector(features).reshape(1, -1, self.projector.linear_1.out_features)

    def _attention(self, attn, hidden):
        shape = (*hidden.shape[:-1], -1, attn.head_dim)
        query = rotate_pairs(attn.q_proj(hidden).view(shape), self.cos, self.sin).transpose(1, 2)
        key = rotate_pairs(attn.k_proj(hidden).view(shape), self.cos, self.sin).transpose(1, 2)
        value = attn.v_proj(hidden).view(shape).transpose(1, 2)
        weights = torch.softmax(torch.matmul(query, key.transpose(2, 3)) * attn.head_dim**-0.5, dim=-1)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(*hidden.shape[:-1], -1)
        return attn.o_proj(output)


class Adapter(ExportAdapter):
    """Torch side of the Llama 4 family."""

    # One tile, a wide image (1x2 + global), a tall one and a 2x2 one (+ global) on the tiny's 84 px tiles.
    test_image_sizes = ((80, 80), (100, 150), (200, 90), (170, 170))

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The tower with real RoPE and a reshaped unfold, then the projector."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Two tiles (the tile count is the dynamic axis)."""
        config = model.config.vision_config
        generator = torch.Generator().manual_seed(0)
        shape = (2, config.num_channels, config.image_size, config.image_size)
        return {symbols.PIXEL_VALUES: torch.randn(*shape, generator=generator)}

    def hf_image_features(self, model, processed):
        """Transformers' tower and projector (``Llama4ForConditionalGeneration.forward``), per image."""
        pixels = torch.as_tensor(processed[symbols.PIXEL_VALUES]).float()
        with torch.no_grad():
            features = model.get_image_features(pixel_values=pixels, return_dict=True).last_hidden_state
            rows = model.multi_modal_projector(features)
        host = self.family.host(ModelDescription(model.config.to_dict()))
        # The tile counts come from aspect_ratios (image processor) or the prompt's ids (processor).
        keys = [key for key in (ASPECT_RATIOS, "input_ids") if key in processed]
        counts = host.tile_counts({key: torch.as_tensor(processed[key]).numpy() for key in keys})
        return [tiles.reshape(-1, tiles.shape[-1]) for tiles in torch.split(rows, counts)]

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """``language_model.model`` / ``language_model.lm_head`` (unlike the other families' layout)."""
        text_config = model.config.text_config
        language = model.language_model
        return DecoderParts(
            embed_tokens=language.model.embed_tokens,
            text_model=TextModel(language.model),
            lm_head=language.lm_head,
            image_token_id=model.config.image_token_id,
            layer_types=list(text_config.layer_types),
            attention_chunk_size=text_config.attention_chunk_size,
        )
