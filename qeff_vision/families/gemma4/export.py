"""Gemma 4 export: the patch-list tower with a traceable pooler; the text model over per-layer caches.

Vision program (ref: transformers v5.23 models/gemma4/modeling_gemma4.py, ``Gemma4VisionModel``,
``Gemma4VisionPooler``, ``Gemma4Model.get_image_features``): transformers' patch embedder, 2-D
RoPE and encoder layers as they are, over the processor's patch list padded to the
``max_soft_tokens`` budget (what vLLM sends too). Padded patches ((-1, -1) positions) are masked as
transformers masks them: no position embedding, never attended to as keys, zeroed before pooling.
The pooler averages each k x k block of real patches found from the positions (transformers'
``one_hot`` over a Python length becomes a comparison with ``arange``, so one graph serves every
patch count) and scales by sqrt(hidden) in float32: that product leaves fp16's range, and
transformers computes it in float32 too. The output keeps the budget's ``patches / k**2`` rows,
the image's own first (cells are numbered row-major over the image's grid) and zeros after them;
transformers strips those (``pooler_mask``), here a reader keeps the leading rows it counts (the
host's ``own_rows``, vLLM's placeholder count). The projector's unit-weight pre-norm also reads the
float32 rows; only its output takes the graph dtype.

Language program: the generic decoder with Gemma 4's pieces:
  * token embedding with image, video and audio ids replaced by the pad id, as transformers
    embeds them (``Gemma4Model.forward``); image rows are merged after it, unscaled;
  * per-layer embeddings (``get_per_layer_inputs``) looked up from the same padded ids inside the
    graph (``DecoderParts.token_kwargs``); the text model projects them with the merged rows;
  * final-logit soft-capping ``tanh(logits / c) * c`` (``Gemma4ForConditionalGeneration.forward``);
  * with ``use_bidirectional_attention == "vision"`` an image's placeholders see each other both
    ways on sliding layers only (``create_masks_for_vision_model``: full layers stay causal);
  * shared-KV layers call no cache update: their producer's attention keys/values reach them
    through transformers' own ``shared_kv_states``, and the IO table gives them no rows;
  * MoE experts in Qwen3-VL-MoE's routed form (min(tokens x top_k, experts) expert slices read
    per call: the chosen ones at decode, each once in a prefill chunk), in the exporter's own
    model only; the router (per-expert scale included) is traced as transformers writes it.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked
from qeff_vision.export.decoder import SLIDING_ATTENTION, DecoderParts
from qeff_vision.families.gemma4 import IMAGE_POSITION_IDS


def pool_by_positions(
    hidden: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, kernel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average every ``kernel`` x ``kernel`` block of real patches.

    Cell of a patch at (x, y): ``x // k + (width // k) * (y // k)``, width the patch columns
    (ref: ``Gemma4VisionPooler._avg_pool_by_positions``). ``padding`` [batch, patches] marks the
    padded patches: they weigh nothing, so the cells past the image's own pool nothing.

    Returns:
        (pooled [batch, patches // kernel**2, hidden] in fp32, [batch, cells] True where a cell
        holds real patches: the image's own rows, which come first; transformers' ``pooler_mask``).
    """
    clamped = positions.clamp(min=0)  # padding's (-1, -1), as transformers clamps it
    x, y = clamped[..., 0], clamped[..., 1]
    width = x.max(dim=-1, keepdim=True)[0] + 1
    cell = torch.div(x, kernel, rounding_mode="floor") + torch.div(
        width, kernel, rounding_mode="floor"
    ) * torch.div(y, kernel, rounding_mode="floor")
    cells = torch.arange(hidden.shape[1] // (kernel * kernel), device=hidden.device)
    member = (cell.unsqueeze(-1) == cells) & ~padding.unsqueeze(-1)  # [batch, patches, cells]
    weights = member.to(torch.float32) / (kernel * kernel)
    return weights.transpose(1, 2) @ hidden.to(torch.float32), member.any(dim=1)


def padding_mask(padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [batch, 1, 1, patches] mask: no patch attends to a padded one.

    transformers' ``create_bidirectional_mask`` over ``~padding_positions``.
    """
    return torch.where(padding, torch.finfo(dtype).min, 0.0).to(dtype)[:, None, None, :]


class VisionEncoder(nn.Module):
    """(pixel_values, image_position_ids) of a padded patch list -> vision_embeds [1, cells, text]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tower = model.model.vision_tower
        self.embedder = model.model.embed_vision
        self.kernel = self.tower.config.pooling_kernel_size

    def forward(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        """Embed, encode with padded patches masked, pool the real ones in fp32, standardize, project."""
        # The patch list (up to the processor's budget) attends to itself: in query blocks.
        with query_blocked(self.tower.config):
            return self._encode(pixel_values, image_position_ids)

    def _encode(self, pixel_values: torch.Tensor, image_position_ids: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        padding = (image_position_ids == -1).all(dim=-1)  # the processor pads with (-1, -1)
        hidden = tower.patch_embedder(pixel_values, image_position_ids, padding)
        mask = padding_mask(padding, hidden.dtype)
        rotary = tower.encoder.rotary_emb(hidden, image_position_ids)
        for layer in tower.encoder.layers:
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=rotary, position_ids=image_position_ids
            )
        hidden = hidden.masked_fill(padding.unsqueeze(-1), 0.0)
        pooled, own = pool_by_positions(hidden, image_position_ids, padding, self.kernel)
        pooled = pooled * tower.pooler.root_hidden_size
        if tower.config.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        normed = self.embedder.embedding_pre_projection_norm(pooled).to(hidden.dtype)
        embeds = self.embedder.embedding_projection(normed)
        # Rows past the image's own are zeros, as a fixed-length output pads (the host's own_rows).
        return torch.where(own.unsqueeze(-1), embeds, torch.zeros_like(embeds))


class PaddedEmbedding(nn.Module):
    """The scaled token embedding of ``ids`` with every multimodal placeholder id replaced by ``pad``."""

    def __init__(self, embed: nn.Module, placeholders: tuple[int, ...], pad: int):
        super().__init__()
        self.embed, self.placeholders, self.pad = embed, placeholders, pad

    def padded(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with placeholders replaced by the pad id."""
        is_placeholder = torch.zeros_like(ids, dtype=torch.bool)
        for placeholder in self.placeholders:
            is_placeholder = is_placeholder | (ids == placeholder)
        return torch.where(is_placeholder, torch.full_like(ids, self.pad), ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows of the padded ids."""
        return self.embed(self.padded(ids))


class SoftCappedHead(nn.Module):
    """``lm_head`` followed by Gemma's final-logit soft-capping (none when ``cap`` is None)."""

    def __init__(self, head: nn.Module, cap: float | None):
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits, soft-capped."""
        logits = self.head(hidden)
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap


class Adapter(ExportAdapter):
    """Torch side of the Gemma 4 family."""

    # Gemma4RMSNorm scales by its weight (not 1 + weight); unit-weight ones have none.
    rms_norm_weight_offsets = {}

    # The exporter's own model runs these experts in the routed form (ExportAdapter.empty_model).
    sparse_experts = "experts"

    # ---- vision program ----

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The patch-list tower, pooler and projector."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A 2 x 3 grid of pooled cells (6 x 9 patches at kernel 3), then one cell of padding.

        Row-major as the processor lists them, padded with (-1, -1) patches as it pads to its budget.
        """
        config = model.config.vision_config
        kernel, patch = config.pooling_kernel_size, config.patch_size
        rows, cols = 2 * kernel, 3 * kernel
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        real = torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)
        positions = torch.cat([real, torch.full((kernel * kernel, 2), -1)]).unsqueeze(0)
        patches = positions.shape[1]
        pixels = torch.rand(1, patches, 3 * patch * patch, generator=torch.Generator().manual_seed(0))
        pixels[:, rows * cols :] = 0.0  # the processor's padding is zeros
        return {symbols.PIXEL_VALUES: pixels, IMAGE_POSITION_IDS: positions}

    def hf_image_features(self, model, processed):
        """The reference: transformers' ``get_image_features``, one [tokens, hidden] tensor per image."""
        pixels = torch.as_tensor(processed[symbols.PIXEL_VALUES])
        positions = torch.as_tensor(processed[IMAGE_POSITION_IDS])
        with torch.no_grad():
            return list(model.model.get_image_features(pixels, positions).pooler_output)

    # ---- language program ----

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The generic parts plus Gemma 4's embedding, PLE, soft-capping and image attention."""
        parts = super().decoder_parts(model)
        config, text = model.config, model.config.text_config
        placeholders = tuple(
            int(i)
            for i in (config.image_token_id, config.video_token_id, config.audio_token_id)
            if i is not None
        )
        language = model.model.language_model
        embed = PaddedEmbedding(language.embed_tokens, placeholders, text.pad_token_id)
        parts.embed_tokens = embed
        parts.lm_head = SoftCappedHead(model.lm_head, text.final_logit_softcapping)
        parts.bidirectional_images = text.use_bidirectional_attention == "vision"
        parts.bidirectional_layer_types = (SLIDING_ATTENTION,)
        if text.hidden_size_per_layer_input:
            parts.token_kwargs = lambda ids: {
                "per_layer_inputs": language.get_per_layer_inputs(embed.padded(ids))
            }
        return parts
