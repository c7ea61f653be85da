"""Mistral 3 export: a Pixtral tower whose patch grid, 2-D rotary positions and merge follow the input.

transformers builds the rotary positions, the per-image attention blocks and the patch merge with
Python loops over ``image_sizes`` (ref: transformers v5 models/pixtral/modeling_pixtral.py,
``PixtralVisionModel.forward``; models/mistral3/modeling_mistral3.py, ``Mistral3PatchMerger``),
which tracing would freeze. Here each image of the batch is its own sequence: the patch grid is
the shape of the convolution output, the (row, column) positions come from ``arange`` over it, and
the merge is a reshape (channel-major within each 2x2 block, the order ``unfold`` produces).
An odd row or column of patches is dropped by the merge as ``unfold`` drops it.

The decoder is the generic one; Mistral's text model takes one 4-D mask (no sliding window in
Mistral 3 checkpoints). ``[IMG_BREAK]``/``[IMG_END]`` are ordinary tokens: the merge rule only
counts ``[IMG]`` placeholders, so the rows land in order across the breaks.
"""

from __future__ import annotations

import torch
from torch import nn

from qeff_vision import symbols
from qeff_vision.export.adapter import ExportAdapter
from qeff_vision.export.blocked_attention import query_blocked
from qeff_vision.families.mistral3.host import IMAGE_SIZES


class VisionEncoder(nn.Module):
    """pixel_values [B, 3, H, W] -> vision_embeds [B, (H/28) * (W/28), text hidden]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        config = model.config
        self.tower = model.model.vision_tower
        self.projector = model.model.multi_modal_projector
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.merge = config.spatial_merge_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Encode a batch of same-size images."""
        # One image's patches attend to each other (12,100 at Pixtral's 1540 px limit): in query
        # blocks, one block's scores under the bound (qeff_vision/export/blocked_attention.py).
        with query_blocked(self.tower.config):
            return self._encode(pixel_values)

    def _encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tower, projector, merge = self.tower, self.projector, self.merge
        patches = tower.patch_conv(pixel_values)  # [B, D, h, w]
        batch, dim, height, width = patches.shape
        hidden = tower.ln_pre(patches.flatten(2).transpose(1, 2))  # [B, h*w, D], row-major
        rows = torch.arange(height).view(-1, 1).expand(height, width).reshape(-1)
        cols = torch.arange(width).view(1, -1).expand(height, width).reshape(-1)
        rotary = tower.patch_positional_embedding(hidden, torch.stack([rows, cols], dim=-1))
        states = [hidden]
        for layer in tower.transformer.layers:
            hidden = layer(hidden, None, position_embeddings=rotary)
            states.append(hidden)
        selected = torch.cat([states[index] for index in self.feature_layers], dim=-1)
        features = projector.norm(selected)
        channels = features.shape[-1]
        merged_h, merged_w = height // merge, width // merge
        grid = features.reshape(batch, height, width, channels)[:, : merged_h * merge, : merged_w * merge]
        grid = grid.reshape(batch, merged_h, merge, merged_w, merge, channels)
        grid = grid.permute(0, 1, 3, 5, 2, 4).reshape(batch, merged_h * merged_w, channels * merge * merge)
        merged = projector.patch_merger.merging_layer(grid)
        return projector.linear_2(projector.act(projector.linear_1(merged)))


class Adapter(ExportAdapter):
    """Torch side of the Mistral 3 family."""

    single_mask = True  # MistralModel passes a 4-D mask through create_causal_mask unchanged
    # Square, wide, tall, and one shrunk from beyond longest_edge.
    test_image_sizes = ((100, 100), (100, 150), (300, 120), (60, 400))

    def vision_encoder(self, model: nn.Module) -> nn.Module:
        """The shape-driven Pixtral tower and projector."""
        return VisionEncoder(model).eval()

    def vision_example_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """A 3x4-token image (6x8 patches): non-square, so rows and columns cannot be confused."""
        side = model.config.vision_config.patch_size * model.config.spatial_merge_size
        generator = torch.Generator().manual_seed(0)
        return {symbols.PIXEL_VALUES: torch.randn(1, 3, 3 * side, 4 * side, generator=generator)}

    def hf_image_features(self, model, processed):
        """Transformers' ``get_image_features``: one [tokens, hidden] tensor per image."""
        with torch.no_grad():
            output = model.model.get_image_features(
                torch.as_tensor(processed[symbols.PIXEL_VALUES]), torch.as_tensor(processed[IMAGE_SIZES])
            )
        return list(output.pooler_output)
