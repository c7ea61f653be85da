"""InternVL export: tiles -> InternViT -> pixel shuffle -> projector, one graph for every tile count.

transformers' tower interpolates its position table to the input size whenever it is traced (ref:
transformers v5 models/internvl/modeling_internvl.py, ``InternVLVisionEmbeddings.
interpolate_pos_encoding``: "always interpolate when tracing"), which would put a bicubic resize
into the graph. Every InternVL tile is the tower's own image size, so the table is added as it is
(what eager transformers does for such tiles). The pixel shuffle follows
``InternVLModel.pixel_shuffle``; the tiles of one image are concatenated in processor order
(canvas tiles row-major, then the thumbnail), as transformers' masked scatter does.

The decoder is the generic one (Qwen2 text model with per-layer-type masks).
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.errors import UserError
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked
from qeff_vision.families.base import ModelDescription

# Most tiles of one image the blocks are sized for: the processor's max_patches (12) and the
# thumbnail, rounded up (ref: transformers v5 models/internvl/processing_internvl.py defaults).
TILES = 16


class VisionEncoder(nn.Module):
    """pixel_values [tiles, 3, S, S] of one image -> vision_embeds [1, tiles * tokens_per_tile, hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.feature_layer = config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise UserError("InternVL export supports one vision_feature_layer (an integer)")
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.ratio = config.downsample_ratio
        vision = config.vision_config
        size = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        patch = vision.patch_size[0] if isinstance(vision.patch_size, (list, tuple)) else vision.patch_size
        self.side = size // patch  # patches per tile side: every tile is the tower's image size

    def _features(self, pixels: torch.Tensor) -> torch.Tensor:
        embeddings = self.tower.embeddings
        hidden = embeddings.patch_embeddings(pixels)
        cls = embeddings.cls_token.expand(hidden.shape[0], -1, -1)
        hidden = torch.cat([cls, hidden], dim=1)
        if embeddings.position_embeddings is not None:
            hidden = hidden + embeddings.position_embeddings
        states = [hidden]
        for layer in self.tower.encoder.layer:
            hidden = layer(hidden)
            states.append(hidden)
        if self.feature_layer == -1:
            return self.tower.layernorm(hidden)
        return states[self.feature_layer]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode one image's tiles."""
        tiles = pixel_values.shape[0]
        # Up to 12 tiles and a thumbnail attend side by side (1,025 rows each at 448 px; 437 MiB
        # of fp16 scores at 16 heads): in query blocks sized for TILES tiles.
        with query_blocked(self.tower.config, rows=self.side * self.side + 1, batch=TILES):
            features = self._features(pixel_values)
        if self.drop_cls:
            features = features[:, 1:]
        count, channels = features.shape[0], features.shape[-1]
        side = self.side
        grid = features.reshape(count, side, side, channels)
        # transformers' pixel_shuffle, step by step (its axis names are swapped; the data flow is this).
        out = int(side * self.ratio)
        grid = grid.reshape(count, side, out, int(channels / self.ratio))
        grid = grid.permute(0, 2, 1, 3).reshape(count, out, out, int(channels / self.ratio**2))
        grid = grid.permute(0, 2, 1, 3).reshape(count, out * out, -1)
        embeds = self.projector(grid)
        return embeds.reshape(1, tiles * out * out, embeds.shape[-1])


class Adapter(ExportAdapter):
    """Torch side of the InternVL family."""

    # A 1:1 image (one tile), a 3:2 one (2x1 canvas + thumbnail), a tall one, a panorama.
    test_image_sizes = ((100, 100), (100, 150), (300, 120), (60, 250))

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """Tower, pixel shuffle and projector over every tile of a batch of images."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One image of two tiles: the tile axis is exercised, memory does not grow with the image."""
        vision = model.config.vision_config
        side = vision.image_size[0] if isinstance(vision.image_size, (list, tuple)) else vision.image_size
        generator = torch.Generator().manual_seed(0)
        return {symbols.PIXEL_VALUES: torch.randn(2, vision.num_channels, side, side, generator=generator)}

    def hf_image_features(self, model, processed):
        """Transformers' ``get_image_features`` per tile, joined per image [tiles * tokens, hidden]."""
        with torch.no_grad():
            features = model.model.get_image_features(
                torch.as_tensor(processed["pixel_values"])
            ).pooler_output
        host = self.family.host(ModelDescription(model.config.to_dict()))
        tiles = host.tiles_per_image(processed)
        return [part.reshape(-1, part.shape[-1]) for part in host.split_tiles(features, tiles)]
