"""Kimi-K2.5 export: a MoonViT tower on a symbolic patch grid, absorbed latent attention, routed experts.

Vision (ref: transformers v5.23 models/kimi_k25/modeling_kimi_k25.py, ``Kimi_K25VisionModel``):
transformers derives the position table, the rotary positions, the per-image attention segments
and the 2x2 merge from ``grid_thw.tolist()``, which tracing freezes into the example image. Here
the grid is the lengths of ``h_shape`` and ``w_shape`` and every index is tensor arithmetic on it:

* the learned position grid is resampled bicubically (align_corners False) with the 4-tap weights
  of transformers' own helper per axis (ref: vision_utils.py ``_interpolation_axis_taps_weights``),
  as two matmuls over the grid instead of ``embedding_bag`` over 16 taps per patch;
* attention runs per image: a block mask over the call's images instead of ``cu_seqlens`` splits;
* the merge is a reshape of the raster patches into 2x2 blocks (one frame: the temporal mean is
  the identity).

Language (ref: models/deepseek_v3/modeling_deepseek_v3.py, ``DeepseekV3Attention``): transformers
caches the latents (normed compressed KV and the rotated key part) and expands them into per-head
keys and values with ``kv_b_proj`` on every call, which reads ``ctx_len x heads x (nope + v)``
expanded elements. The exported attention absorbs ``kv_b_proj`` instead (DeepSeek-V2's absorbed
form, QEfficient's ``mla_absorption``): the query's no-rope part is multiplied by W_UK into the
latent space, scores are taken against the cached latents and rotary keys, and the weighted latent
sum goes through W_UV, so a call reads only ``ctx_len x (kv_lora_rank + qk_rope_head_dim)``.
Experts read min(tokens x top_k, experts) slices (:mod:`qeff_vision.export.experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export import blocked_attention
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked_attention
from qeff_vision.export.decoder import DecoderParts
from qeff_vision.families.kimi_k25 import H_SHAPE, W_SHAPE

BICUBIC = "bicubic"


class VisionEncoder(nn.Module):
    """pixel_values [N, 3, P, P], h_shape [h], w_shape [w] -> vision_embeds [N / (h w), h w / 4, hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tower = model.model.vision_tower
        self.projector = model.model.mm_projector
        config = self.tower.config
        self.side = config.pos_emb_height  # transformers resamples the grid as a square of this side
        self.merge = tuple(config.merge_kernel_size)

    def _axis_weights(self, size) -> torch.Tensor:
        """[size, side]: how much each row of the learned grid adds to each of ``size`` output rows."""
        from transformers.vision_utils import _interpolation_axis_taps_weights

        index = torch.arange(size)
        taps, weights = _interpolation_axis_taps_weights(
            index, torch.ones_like(index) * size, self.side, BICUBIC, False
        )
        # Taps clamped to the border repeat an index: their weights add up, as in the gather form.
        onehot = taps.unsqueeze(-1) == torch.arange(self.side).view(1, 1, -1)
        return (onehot.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1)

    def _positions(self, within: torch.Tensor, rows, columns) -> torch.Tensor:
        """The learned position grid resampled to (rows, columns), read at each patch's raster index.

        Separable: the grid is resampled along rows, then columns (two matmuls, [rows, columns,
        width] at most), instead of 16 gathered taps per patch ([patches, 16, width]).
        """
        embedding = self.tower.patch_embed.pos_emb
        table = embedding.position_embeddings  # [side, side, width]
        side, width = table.shape[0], table.shape[-1]
        by_rows = torch.matmul(self._axis_weights(rows).to(table.dtype), table.reshape(side, -1))
        by_rows = by_rows.reshape(-1, side, width).transpose(0, 1).reshape(side, -1)  # [side, rows x width]
        grid = torch.matmul(self._axis_weights(columns).to(table.dtype), by_rows)  # [columns, rows x width]
        # Back to raster order: [rows x columns, width].
        grid = grid.reshape(-1, rows, width).transpose(0, 1).reshape(-1, width)
        # Row 0 of the time table is the zero row every still image (one frame) adds.
        return grid[within] + embedding.time_position_embeddings[0].to(table.dtype)

    def forward(self, pixel_values: torch.Tensor, h_shape: torch.Tensor, w_shape: torch.Tensor):
        """Encode a call's images, all of the grid (len(h_shape), len(w_shape))."""
        tower = self.tower
        rows, columns = h_shape.shape[0], w_shape.shape[0]
        patches = pixel_values.shape[0]
        index = torch.arange(patches)
        within = index % (rows * columns)
        image, row, column = index // (rows * columns), within // columns, within % columns
        proj = tower.patch_embed.proj
        hidden = proj(pixel_values.to(proj.weight.dtype)).reshape(patches, -1)
        hidden = hidden + self._positions(within, rows, columns).to(hidden.dtype)
        cos, sin = tower.rotary_emb(hidden, torch.stack([row, column], dim=-1))
        for layer in tower.layers:  # a patch attends the patches of its image
            hidden = hidden + self._attention(layer.attn, layer.norm1(hidden), cos, sin, image)
            hidden = hidden + layer.mlp(layer.norm2(hidden))
        hidden = tower.final_layernorm(hidden)
        merge_rows, merge_columns = self.merge
        width = hidden.shape[-1]
        blocks = hidden.reshape(
            -1, rows // merge_rows, merge_rows, columns // merge_columns, merge_columns, width
        )
        blocks = blocks.permute(0, 1, 3, 2, 4, 5).reshape(-1, merge_rows * merge_columns, width)
        embeds = self.projector(blocks)
        return embeds.reshape(patches // (rows * columns), -1, embeds.shape[-1])

    @staticmethod
    def _attention(attn: nn.Module, hidden, cos, sin, segment) -> torch.Tensor:
        """Attention among patches of the same ``segment`` [N], in query blocks (scores bounded)."""
        from transformers.models.kimi_k25.modeling_kimi_k25 import apply_rotary_pos_emb_vision

        length = hidden.shape[0]
        query = attn.q_proj(hidden).reshape(length, attn.num_heads, attn.head_dim)
        key = attn.k_proj(hidden).reshape(length, attn.num_heads, attn.head_dim)
        value = attn.v_proj(hidden).reshape(length, attn.num_heads, attn.head_dim).transpose(0, 1)
        query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
        query, key = query.transpose(0, 1), key.transpose(0, 1)  # [heads, N, head_dim]
        output = query_blocked_attention(query, key, value, attn.scaling, segments=segment)
        return attn.proj(output.transpose(0, 1).reshape(length, -1))


def absorbed_attention(attention: nn.Module):
    """A forward for ``attention`` (``DeepseekV3Attention``) that reads only the latent cache.

    Same call and result as transformers' forward; with transformers' own cache (its ``generate``
    on a model shared with a test) it runs transformers' forward unchanged.
    """
    from transformers.cache_utils import Cache
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    original = attention.forward
    config = attention.config

    def forward(hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        if past_key_values is None or isinstance(past_key_values, Cache):
            return original(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        batch, length = hidden_states.shape[:-1]
        heads, nope, value = attention.num_heads, attention.qk_nope_head_dim, attention.v_head_dim
        if attention.q_lora_rank is None:
            query = attention.q_proj(hidden_states)
        else:
            query = attention.q_b_proj(attention.q_a_layernorm(attention.q_a_proj(hidden_states)))
        query = query.reshape(batch, length, heads, attention.qk_head_dim).transpose(1, 2)
        query_nope, query_rope = torch.split(query, [nope, attention.qk_rope_head_dim], dim=-1)
        compressed, rotary = torch.split(
            attention.kv_a_proj_with_mqa(hidden_states),
            [attention.kv_lora_rank, attention.qk_rope_head_dim],
            dim=-1,
        )
        compressed = attention.kv_a_layernorm(compressed).reshape(batch, 1, length, -1)
        rotary = rotary.reshape(batch, 1, length, -1)
        cos, sin = position_embeddings
        rotate = (
            deepseek.apply_rotary_pos_emb_interleave
            if config.rope_interleave
            else deepseek.apply_rotary_pos_emb
        )
        query_rope, rotary = rotate(query_rope, rotary, cos, sin)
        # The layer's LatentKV (qeff_vision/export/latent_cache.py): writes the call's latents and
        # returns both caches at the slots attention reads.
        compressed, rotary = past_key_values.layer_state(attention.layer_idx).update(compressed, rotary)
        # kv_b_proj [heads x (nope + v), rank]: W_UK, the keys' no-rope part, and W_UV, the values.
        up = attention.kv_b_proj.weight.reshape(heads, nope + value, -1)
        keys_up, values_up = up[:, :nope], up[:, nope:]
        query_latent = torch.matmul(query_nope, keys_up.to(query_nope.dtype))  # [batch, heads, seq, rank]
        compressed, rotary = compressed.to(query_latent.dtype), rotary.to(query_rope.dtype)
        blocks = blocked_attention.active().language_count(heads)
        if blocks > 1:  # the scores [batch, heads, seq, K] in key blocks (export/blocked_attention.py)

            def scores_of(start, stop):
                scores = torch.matmul(query_latent, compressed[:, :, start:stop].transpose(2, 3))
                scores = scores + torch.matmul(query_rope, rotary[:, :, start:stop].transpose(2, 3))
                mask = blocked_attention.key_rows(attention_mask, start, stop)
                return (scores * attention.scaling + mask).float()

            context = blocked_attention.key_blocked_attention(
                query_latent, compressed, compressed, scores_of, blocks
            ).to(query_latent.dtype)
        else:
            scores = torch.matmul(query_latent, compressed.transpose(2, 3))
            scores = scores + torch.matmul(query_rope, rotary.transpose(2, 3))
            scores = scores * attention.scaling + attention_mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query_latent.dtype)
            context = torch.matmul(weights, compressed)  # [batch, heads, seq, rank]
        output = torch.matmul(context, values_up.transpose(1, 2).to(context.dtype))
        output = output.transpose(1, 2).reshape(batch, length, heads * value)
        return attention.o_proj(output), None

    return forward


class PlaceholdersAsTokenZero(nn.Module):
    """Token embedding that embeds image and video placeholder ids as token 0, as transformers does.

    ``Kimi_K25Model.forward`` zeroes every placeholder id before the embedding lookup; a prompt's
    placeholders are replaced by vision rows anyway, but a placeholder id the model generates is
    fed back as an ordinary token, and must then embed as token 0 too.
    """

    def __init__(self, embed: nn.Module, placeholder_ids: tuple[int, ...]):
        super().__init__()
        self.embed = embed
        self.placeholder_ids = placeholder_ids

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [batch, seq, hidden] of ``input_ids``, placeholders read as token 0."""
        is_placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
        for placeholder in self.placeholder_ids:
            is_placeholder = is_placeholder | (input_ids == placeholder)
        return self.embed(torch.where(is_placeholder, torch.zeros_like(input_ids), input_ids))


class Adapter(ExportAdapter):
    """Torch side of the Kimi-K2.5 family."""

    # DeepseekV3Model passes a 4-D mask through ``create_causal_mask`` unchanged.
    single_mask = True
    test_image_sizes = ((100, 150), (224, 224), (300, 120))

    # The exporter's own model runs these experts in the routed form (ExportAdapter.empty_model).
    sparse_experts = "mlp.experts"

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The symbolic-grid MoonViT tower and the patch-merging projector."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One 4x6-patch image: not square, smaller than the position grid on both axes."""
        patch = model.config.vision_config.patch_size
        rows, columns = (
            2 * model.config.vision_config.merge_kernel_size[0],
            3 * model.config.vision_config.merge_kernel_size[1],
        )
        generator = torch.Generator().manual_seed(0)
        return {
            symbols.PIXEL_VALUES: torch.randn(rows * columns, 3, patch, patch, generator=generator),
            H_SHAPE: torch.ones(rows, dtype=torch.int64),
            W_SHAPE: torch.ones(columns, dtype=torch.int64),
        }

    def hf_image_features(self, model, processed):
        """Transformers' image features on the processor outputs, one [tokens, hidden] per image."""
        with torch.no_grad():
            output = model.model.get_image_features(
                torch.as_tensor(processed["pixel_values"]), torch.as_tensor(processed["image_grid_thw"])
            )
        return list(output.pooler_output)

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The shared layout, every attention layer in the absorbed form over our retained latents."""
        parts = super().decoder_parts(model)
        config = model.config
        parts.embed_tokens = PlaceholdersAsTokenZero(
            parts.embed_tokens, (config.image_token_id, config.video_token_id)
        )
        for layer in parts.text_model.layers:
            if not getattr(layer.self_attn, "absorbed", False):
                layer.self_attn.forward = absorbed_attention(layer.self_attn)
                layer.self_attn.absorbed = True
        return parts
