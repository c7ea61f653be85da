"""LLaVA-NeXT export: a vision program that picks the pinpoint, unpads and appends newlines in the graph.

transformers packs the tile features with Python on ``image_sizes.tolist()`` (ref: transformers
v5 models/llava_next/modeling_llava_next.py, ``pack_image_features`` / ``unpad_image``), which
tracing would freeze into constants of the example image (QEfficient's graph is fixed to 1109x1610
that way). Here the graph takes ``image_sizes`` as the processor returns it and computes the
pinpoint, the tile grid and the unpadded feature grid from its values (:func:`image_geometry`), so
one graph serves every grid pinpoint and image size, and the vision program's inputs are what the
Cloud AI vLLM plugin sends: ``pixel_values`` and ``image_sizes``.

The decoder is the generic one: Granite's embedding, attention and residual multipliers live
inside its text model, and transformers' LlavaNext applies its own ``lm_head`` with no
``logits_scaling`` division (that happens only in GraniteForCausalLM), so no extra parts are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.families.llava_next import IMAGE_SIZES, best_resolution


@dataclass(frozen=True)
class Geometry:
    """An image's grids as int64 tensors shaped as its height (traced as graph values, not constants).

    Attributes:
        tile_rows: Tiles down of the chosen pinpoint.
        tile_cols: Tiles across.
        top: Feature rows cropped above the kept window.
        left: Feature columns cropped left of it.
        feature_height: Feature rows kept.
        feature_width: Feature columns kept.
    """

    tile_rows: torch.Tensor
    tile_cols: torch.Tensor
    top: torch.Tensor
    left: torch.Tensor
    feature_height: torch.Tensor
    feature_width: torch.Tensor


def image_geometry(
    height: torch.Tensor, width: torch.Tensor, pinpoints: torch.Tensor, tile: int, side: int, tiles_given
) -> Geometry:
    """The processor's pinpoint for a ``height`` x ``width`` image and the model's unpadding, in integers.

    Pinpoint (ref: transformers image_processing_utils.select_best_resolution): the most pixels
    kept at the aspect-preserving scale, then the least area wasted, the first pinpoint on a tie.
    transformers scales in floating point (``int(height * (pin_width / width))`` can come out one
    pixel short: 2500x3753 keeps 767 rows of the 768x1536 pinpoint, tying it with 768x1152); the
    graph keeps to integers, which the device runs exactly and no precision plan touches. Where
    the two disagree, the integer winner is a pinpoint with more tiles than the processor cut, so
    pinpoints needing more tiles than ``pixel_values`` holds (``tiles_given``) are left out, which
    restores transformers' choice for unpadded inputs (``tests/test_llava_next_vllm_inputs.py``
    compares with transformers over a grid of sizes up to 5000 px).
    Unpadding (ref: modeling_llava_next.unpad_image) crops the side the image did not fill by the
    same count at both ends; its ``int(round(x, 7))`` is the integer floor for any size below 10^7.

    Args:
        height: int64 original height: 0-d in the graph, [N] to check N sizes at once.
        width: int64 original width, shaped as ``height``.
        pinpoints: [K, 2] int64 (height, width) of the model's grid pinpoints.
        tile: Tile side in pixels.
        side: Features per tile side.
        tiles_given: Tiles (base tile excluded) the pixel input holds, padding included: an int
            or a tensor shaped as ``height``.
    """
    pin_height, pin_width = pinpoints[:, 0], pinpoints[:, 1]
    height, width = height[..., None], width[..., None]  # against every pinpoint (a batch of sizes too)
    if torch.is_tensor(tiles_given):
        tiles_given = tiles_given[..., None]
    width_bound = pin_width * height <= pin_height * width  # the width limits the scale
    kept_width = torch.where(width_bound, pin_width, width * pin_height // height)
    kept_height = torch.where(width_bound, height * pin_width // width, pin_height)
    effective = torch.minimum(kept_width * kept_height, width * height)
    tiles = (pin_height // tile) * (pin_width // tile)
    effective = torch.where(tiles <= tiles_given, effective, torch.full_like(effective, -1))
    wasted = pin_height * pin_width - effective
    best = effective == effective.max(-1, keepdim=True).values
    # argmin returns the first of equal minima: the first pinpoint wins a tie, as in the loop.
    choice = torch.where(best, wasted, wasted.max(-1, keepdim=True).values + 1).argmin(-1)
    rows, cols = pin_height[choice] // tile, pin_width[choice] // tile
    height, width = height[..., 0], width[..., 0]
    grid_height, grid_width = rows * side, cols * side
    wider = width * grid_height > grid_width * height  # the image is wider than its grid: crop rows
    crop_rows = (grid_height - height * grid_width // width) // 2
    crop_cols = (grid_width - width * grid_height // height) // 2
    top = torch.where(wider, crop_rows, torch.zeros_like(crop_rows))
    left = torch.where(wider, torch.zeros_like(crop_cols), crop_cols)
    return Geometry(rows, cols, top, left, grid_height - 2 * top, grid_width - 2 * left)


def row_sources(geometry: Geometry, rows: torch.Tensor, side: int, tiles) -> torch.Tensor:
    """Per image and output row, the row of the feature table it copies: [B, rows] int64.

    The table is every tile's P x P features in tile order (base tile first), then one
    ``image_newline`` row (index ``tiles * P*P``), then one zero row (``tiles * P*P + 1``).
    Output row k < P*P is the base tile's k-th feature; after it, the unpadded grid row by row,
    each row of ``feature_width`` features ended by a newline; rows past the image's own
    ``P*P + feature_height * (feature_width + 1)`` copy the zero row. Only values come from
    ``image_sizes``: every shape is ``rows`` (a function of the tile count) and the batch.
    """
    per_tile = side * side
    k = torch.arange(rows)[None, :]
    height, width = geometry.feature_height[:, None], geometry.feature_width[:, None]
    j = k - per_tile
    grid_row, column = j // (width + 1), j % (width + 1)
    y, x = grid_row + geometry.top[:, None], column + geometry.left[:, None]
    tile = 1 + (y // side) * geometry.tile_cols[:, None] + x // side
    source = tile * per_tile + (y % side) * side + x % side
    newline, zero = tiles * per_tile, tiles * per_tile + 1
    source = torch.where(column == width, torch.full_like(source, newline), source)
    source = torch.where(grid_row >= height, torch.full_like(source, zero), source)
    return torch.where(k < per_tile, k.expand_as(source), source)


def most_rows(pinpoints: torch.Tensor, tile: int, side: int, tiles) -> torch.Tensor:
    """The output rows of a call with ``tiles`` tiles per image (base tile included), as a graph value.

    The most rows any image those tiles can hold produces: the base tile plus the largest
    pinpoint grid of at most ``tiles - 1`` tiles, uncropped, with its newlines (the graph form of
    ``LlavaNext.vision_rows``). It depends on the tile count (a shape) only, so a specialization
    fixes it.
    """
    rows, cols = pinpoints[:, 0] // tile, pinpoints[:, 1] // tile
    grid = (rows * side) * (cols * side + 1)
    fits = rows * cols <= tiles - 1
    return side * side + torch.where(fits, grid, torch.zeros_like(grid)).max()


class VisionEncoder(nn.Module):
    """Tiles to packed image features, the grids computed from ``image_sizes``, every shape static.

    Inputs: pixel_values [B, tiles, 3, S, S] (the tile axis may be padded, as the processor pads
    it across a batch), image_sizes [B, 2] int64 (each image's original height, width).
    Output: [B, vision_size, hidden]: per image the base tile, then the unpadded grid row by row,
    each row ended by ``image_newline``, then zero rows. ``vision_size`` is the most rows an image
    of ``tiles`` tiles can produce (:func:`most_rows`), so each specialization's output is one
    fixed shape whatever the image sizes' values: the SDK compiler needs static shapes per
    specialization. Each image's own rows are the first ``image_tokens`` (the processor's count);
    the host and the vLLM plugin read only those.
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
        self.tile = config.vision_config.image_size
        self.side = self.tile // config.vision_config.patch_size
        self.register_buffer(
            "pinpoints", torch.tensor(config.image_grid_pinpoints, dtype=torch.int64), persistent=False
        )

    def forward(self, pixel_values, image_sizes) -> torch.Tensor:
        """Encode a batch of images with the same tile count (any sizes)."""
        batch, tiles, side = pixel_values.shape[0], pixel_values.shape[1], self.side
        geometry = image_geometry(
            image_sizes[:, 0], image_sizes[:, 1], self.pinpoints, self.tile, side, tiles - 1
        )
        # Every tile reaches the tower (padding too): a static shape; the gather reads only the
        # image's own tiles.
        output = self.tower(pixel_values.flatten(0, 1), output_hidden_states=True)
        selected = torch.cat([output.hidden_states[layer] for layer in self.feature_layers], dim=-1)
        if self.drop_cls:
            selected = selected[:, 1:]
        features = self.projector(selected)  # [B*tiles, P*P, hidden]
        hidden = features.shape[-1]
        features = features.reshape(batch, tiles * side * side, hidden)
        newline = self.image_newline.to(features.dtype).reshape(1, 1, hidden).expand(batch, 1, hidden)
        table = torch.cat([features, newline, torch.zeros_like(newline)], dim=1)
        rows = most_rows(self.pinpoints, self.tile, side, tiles)
        sources = row_sources(geometry, rows, side, tiles)
        return table.gather(1, sources[..., None].expand(-1, -1, hidden))


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
        """An image one and a half tiles wide: a 1x2 grid whose feature grid loses columns at both ends.

        The graph reads the grids from the ``image_sizes`` values, so any size traces the same graph;
        this one makes every step (tile selection, layout, both crops' index arithmetic) non-trivial.
        """
        config, vision = model.config, model.config.vision_config
        tile = vision.image_size
        height, width = tile, tile + tile // 2
        pin_height, pin_width = best_resolution(height, width, config.image_grid_pinpoints)
        tiles = (pin_height // tile) * (pin_width // tile) + 1
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, tiles, vision.num_channels, tile, tile, generator=generator)
        return {
            symbols.PIXEL_VALUES: pixels,
            IMAGE_SIZES: torch.tensor([[height, width]], dtype=torch.int64),
        }

    def vision_parity_pairs(self, outputs, features, model):
        """The image's own rows against transformers', and the padding after them against zeros."""
        ours, reference = outputs[symbols.VISION_EMBEDS][0], features[0].numpy()
        pairs = [(ours[: len(reference)], reference)]
        if len(ours) > len(reference):
            pairs.append((ours[len(reference) :], np.zeros_like(ours[len(reference) :])))
        return pairs

    def hf_image_features(self, model, processed):
        """Transformers' packed features per image [tokens, hidden]."""
        with torch.no_grad():
            output = model.model.get_image_features(
                torch.as_tensor(processed["pixel_values"]), torch.as_tensor(processed["image_sizes"])
            )
        return list(output.pooler_output)
