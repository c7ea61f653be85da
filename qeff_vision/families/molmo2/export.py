"""Molmo2 export: crops -> ViT -> two layers' features -> attention pooling -> projector; the text model.

Vision program (ref: transformers v5.23 models/molmo2/modeling_molmo2.py, ``Molmo2Model.
get_image_features``, ``Molmo2Adapter.forward``): transformers' patch embedding, position table and
encoder layers as they are (every crop is the tower's own size, so the table is added unchanged);
the features of ``vision_feature_layer`` concatenated; each pooled token's patches gathered by
``image_token_pooling`` (-1 slots read patch 0 and are zeroed and masked, as transformers does),
their mean the query of the pooling attention, then the projector. One image per call.

Language program: the generic decoder over transformers' text model (one 4-D mask, Llama-style),
wrapped for two things Molmo2 does around it (``Molmo2Model.forward``):
  * image features are *added* to the ``<im_patch>`` embeddings: the generic merge puts the
    features in place of the embedding, and the wrapper adds that embedding row back (x + 0 = x
    elsewhere, and the sum is the same float either way round);
  * every image token of the chunk (``mm_token_type_ids``: patches, columns, starts, ends) attends
    to every other one both ways (``block_sequence_ids`` all 0): the wrapper rebuilds the position
    mask with those links (:func:`~qeff_vision.export.decoder.attention_masks`).
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked
from qeff_vision.export.decoder import FULL_ATTENTION, DecoderParts, attention_masks
from qeff_vision.families.base import ModelDescription
from qeff_vision.families.molmo2 import IMAGE_TOKEN_POOLING

# Most crops (or video frames) of one call the tower's blocks are sized for.
CROPS = 16


class VisionEncoder(nn.Module):
    """One image: pixel_values [crops, patches, dim] and pooling [tokens, window] -> [1, tokens, hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.tower = model.model.vision_tower
        self.adapter = model.model.multi_modal_projector
        # transformers indexes hidden_states (embeddings first): layer + 1, or a negative index.
        self.feature_states = [
            layer + 1 if layer >= 0 else layer for layer in model.config.adapter_config.vision_feature_layer
        ]

    def forward(self, pixel_values: torch.Tensor, image_token_pooling: torch.Tensor) -> torch.Tensor:
        """Encode one image's crops and pool them into its tokens."""
        tower = self.tower
        hidden = tower.patch_embedding(pixel_values) + tower.positional_embedding[None, :, :]
        states = [hidden]
        # Every crop (or video frame: up to 16) attends over its 729 patches side by side: in
        # query blocks sized for CROPS of them (qeff_vision/export/blocked_attention.py).
        with query_blocked(tower.config, rows=int(tower.positional_embedding.shape[0]), batch=CROPS):
            for layer in tower.layers:
                hidden = layer(hidden, None)
                states.append(hidden)
        features = torch.cat([states[index] for index in self.feature_states], dim=-1)
        flat = features.reshape(-1, features.shape[-1])
        valid = image_token_pooling >= 0
        patches = flat[torch.clamp(image_token_pooling, min=0)] * valid.to(flat.dtype).unsqueeze(-1)
        count = valid.to(torch.float32).sum(-1)
        count = torch.where(count == 0, torch.ones_like(count), count)
        query = patches.sum(-2, keepdim=True) / count[:, None, None].to(patches.dtype)
        minimum = torch.finfo(patches.dtype).min
        mask = torch.where(valid, 0.0, minimum).to(patches.dtype)[:, None, None, :]
        pooled, _ = self.adapter.image_pooling_2d(query, patches, attention_mask=mask)
        pooled = self.adapter.image_projector(pooled.squeeze(1))
        return pooled.unsqueeze(0)


class TextModel(nn.Module):
    """transformers' text model with Molmo2's additive merge and its image-token attention block."""

    def __init__(self, text_model: nn.Module, embed_tokens: nn.Module, patch_id: int):
        super().__init__()
        self.text_model = text_model
        self.embed_tokens = embed_tokens
        self.patch_id = patch_id

    @property
    def config(self):
        """The text config (the exporter sets the attention implementation on it)."""
        return self.text_model.config

    def forward(self, inputs_embeds, attention_mask, position_ids, image_block, patch_tokens, **kwargs):
        """Add the ``<im_patch>`` embedding to the merged rows, link the image block, run the layers."""
        row = self.embed_tokens.weight[self.patch_id].to(inputs_embeds.dtype)
        inputs_embeds = torch.where(patch_tokens.unsqueeze(-1), inputs_embeds + row, inputs_embeds)
        links = image_block.unsqueeze(-1) & image_block.unsqueeze(-2)
        mask = attention_masks(
            position_ids, attention_mask.shape[-1], (FULL_ATTENTION,), None, links, attention_mask.dtype
        )[FULL_ATTENTION]
        return self.text_model(
            inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=position_ids, **kwargs
        )


class Adapter(ExportAdapter):
    """Torch side of the Molmo2 family."""

    # One crop window, a 2x2 canvas, a tall and a wide image: 2, 5, 4 and 4 crops on the tiny.
    test_image_sizes = ((60, 60), (100, 150), (300, 120), (60, 250))
    single_mask = True  # Molmo2TextModel passes a 4-D mask through create_causal_mask unchanged

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """ViT, feature concat, attention pooling and projector over one image's crops."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Two crops and five pooled tokens (one with a padded slot): both axes are exercised."""
        vision = model.config.vision_config
        patches = vision.num_position_embeddings
        dim = vision.patch_size * vision.patch_size * vision.num_channels
        generator = torch.Generator().manual_seed(0)
        window = 4
        pooling = torch.randint(0, 2 * patches, (5, window), generator=generator)
        pooling[0, -1] = -1
        return {
            symbols.PIXEL_VALUES: torch.randn(2, patches, dim, generator=generator),
            IMAGE_TOKEN_POOLING: pooling,
        }

    def hf_image_features(self, model, processed):
        """Transformers' pooled features per image [tokens, hidden] (``get_image_features``)."""
        with torch.no_grad():
            features = model.model.get_image_features(
                torch.as_tensor(processed["pixel_values"]),
                torch.as_tensor(processed[IMAGE_TOKEN_POOLING]),
                torch.as_tensor(processed["image_grids"]),
            ).pooler_output
        return [part.reshape(-1, part.shape[-1]) for part in features]

    def decoder_parts(self, model: nn.Module) -> DecoderParts:
        """The default parts with the text model wrapped (additive merge, image-token block)."""
        parts = super().decoder_parts(model)
        config = model.config
        description = ModelDescription(config.to_dict())
        block_ids = torch.tensor(self.family.vision(description).image_token_ids, dtype=torch.int64)
        patch_id = config.image_patch_id
        parts.text_model = TextModel(parts.text_model, parts.embed_tokens, patch_id)
        parts.bidirectional_images = False  # the wrapper links the whole block, not one run of patches

        def token_kwargs(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
            prefill = torch.ones_like(input_ids).sum(dim=1, keepdim=True) > 1  # decode merges nothing
            block = (input_ids.unsqueeze(-1) == block_ids).any(-1)
            return {"image_block": block & prefill, "patch_tokens": (input_ids == patch_id) & prefill}

        parts.token_kwargs = token_kwargs
        return parts
