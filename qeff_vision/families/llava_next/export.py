"""LLaVA-NeXT export: a vision program that tiles, unpads and appends newlines by shape arithmetic.

transformers packs the tile features with Python on ``image_sizes.tolist()`` (ref: transformers
v5 models/llava_next/modeling_llava_next.py, ``pack_image_features`` / ``unpad_image``), which
tracing would freeze into constants of the example image. Here the tile grid and the unpadded
feature grid are the shapes of ``tile_grid`` [batch, tile_rows, tile_cols] and ``feature_grid``
[batch, feature_height, feature_width], so one graph serves every grid pinpoint and image size.

The decoder is the generic one: Granite's embedding, attention and residual multipliers live
inside its text model, and transformers' LlavaNext applies its own ``lm_head`` with no
``logits_scaling`` division (that happens only in GraniteForCausalLM), so no extra parts are needed.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.families.llava_next import (
    FEATURE_GRID,
    TILE_GRID,
)


class VisionEncoder(nn.Module):
    """Tiles to packed image features, every size taken from an input shape.

    Inputs: pixel_values [B, tiles, 3, S, S], tile_grid [B, rows, cols], feature_grid [B, fh, fw].
    Output: [B, P*P + fh * (fw + 1), hidden]: the base tile, then the unpadded grid row by row,
    each row ended by ``image_newline``.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        self.image_newline = model.model.image_newline
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.side = config.vision_config.image_size // config.vision_config.patch_size

    def forward(self, pixel_values, tile_grid, feature_grid) -> torch.Tensor:
        """Encode a batch of images with the same tile grid and unpadded feature grid."""
        batch, tiles = pixel_values.shape[0], pixel_values.shape[1]
        rows, cols = tile_grid.shape[1], tile_grid.shape[2]
        height, width = feature_grid.shape[1], feature_grid.shape[2]
        side = self.side
        output = self.tower(pixel_values.flatten(0, 1), output_hidden_states=True)
        selected = torch.cat([output.hidden_states[layer] for layer in self.feature_layers], dim=-1)
        if self.drop_cls:
            selected = selected[:, 1:]
        features = self.projector(selected)  # [B*tiles, P*P, hidden]
        hidden = features.shape[-1]
        features = features.reshape(batch, tiles, side * side, hidden)
        base = features[:, 0]
        # Tiles in row-major order, each P x P: lay them out as one (rows*P) x (cols*P) grid.
        grid = features[:, 1:].reshape(batch, rows, cols, side, side, hidden)
        grid = grid.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows * side, cols * side, hidden)
        # Unpad: keep the centred fh x fw window (the cropped side loses as much at both ends).
        top, left = (rows * side - height) // 2, (cols * side - width) // 2
        grid = grid.index_select(1, torch.arange(height) + top).index_select(2, torch.arange(width) + left)
        newline = self.image_newline.to(grid.dtype).reshape(1, 1, 1, hidden).expand(batch, height, 1, hidden)
        grid = torch.cat([grid, newline], dim=2).reshape(batch, height * (width + 1), hidden)
        return torch.cat([base, grid], dim=1)


class Adapter(ExportAdapter):
    """Torch side of the LLaVA-NeXT family."""

    single_mask = True  # Granite and Llama take one 4-D mask through create_causal_mask
    # Each lands on a different pinpoint of the tiny checkpoint (112x112, 168x56, 56x168, 56x56),
    # cropping rows, columns, or nothing.
    test_image_sizes = ((100, 150), (300, 120), (60, 200), (40, 40))

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The shape-driven tiling tower."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A 1x2 tile grid whose feature grid loses a column at each end: small, every step non-trivial."""
        vision = model.config.vision_config
        side = vision.image_size // vision.patch_size
        generator = torch.Generator().manual_seed(0)
        tile = (vision.num_channels, vision.image_size, vision.image_size)
        pixels = torch.randn(1, 3, *tile, generator=generator)
        return {
            symbols.PIXEL_VALUES: pixels,
            TILE_GRID: torch.zeros(1, 1, 2, dtype=torch.int64),
            FEATURE_GRID: torch.zeros(1, side, 2 * side - 2, dtype=torch.int64),
        }

    def hf_image_features(self, model, processed):
        """Transformers' packed features per image [tokens, hidden]."""
        with torch.no_grad():
            output = model.model.get_image_features(
                torch.as_tensor(processed["pixel_values"]), torch.as_tensor(processed["image_sizes"])
            )
        return list(output.pooler_output)
